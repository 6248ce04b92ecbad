"""The matrix data: complete, sourced, and a malformed file fails with file + field path."""

import re

import pytest

from envbuild.errors import EnvbuildError
from envbuild.matrix import load_matrix

# domain-facts.md section 4: every GPU must have a profile.
DOMAIN_FACTS_GPUS = {"v100": "7.0", "t4": "7.5", "a10": "8.6", "a100": "8.0", "a800": "8.0", "l4": "8.9",
                     "l40": "8.9", "l40s": "8.9", "l20": "8.9", "rtx3090": "8.6", "rtx4090": "8.9",
                     "h100": "9.0", "h200": "9.0", "gh200": "9.0", "h800": "9.0", "h20": "9.0",
                     "b200": "10.0", "gb200": "10.0", "b300": "10.3", "gb300": "10.3", "rtx5090": "12.0",
                     "gb10": "12.1"}


def test_every_gpu_of_the_domain_facts_has_its_compute_capability(matrix):
    assert {p.name: p.cc for p in matrix.gpus} == DOMAIN_FACTS_GPUS


@pytest.mark.parametrize("spelling", ["h20", "H20", "nvidia-h20", "NVIDIA-H20", "h20-96gb", "nvidia_h20"])
def test_gpu_aliases(matrix, spelling):
    assert matrix.gpu(spelling).name == "h20"


def test_h20_disables_nccl_p2p_with_reason_and_source(matrix):
    env = {e.name: e for e in matrix.gpu("h20").env}
    assert env["NCCL_P2P_DISABLE"].value == "1"
    assert "field report 5" in env["NCCL_P2P_DISABLE"].source
    assert env["NCCL_P2P_DISABLE"].reason


def test_every_env_default_has_reason_and_source(matrix):
    for e in [*matrix.gpus_file.common_env, *(e for p in matrix.gpus for e in p.env)]:
        assert len(e.reason) > 20 and e.source, e.name


def test_common_env_turns_hangs_into_errors(matrix):
    names = {e.name for e in matrix.gpus_file.common_env}
    assert {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"} <= names


def test_stacks_cover_the_required_ranges(matrix):
    torches = {".".join(s.torch.split(".")[:2]) for s in matrix.stacks}
    assert {"2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.11"} <= torches
    assert {"12.1", "12.4", "12.6", "12.8", "13.0"} <= {s.cuda for s in matrix.stacks}
    assert {"3.10", "3.11", "3.12"} <= {s.python for s in matrix.stacks}
    ds = {".".join(s.deepspeed.split(".")[:2]) for s in matrix.stacks}
    assert {"0.15", "0.19"} <= ds and "0.19.8" in {s.deepspeed for s in matrix.stacks}


def test_a_pypi_cuda13_stack_exists_on_plain_debian(matrix):
    pypi = [s for s in matrix.stacks if s.toolchain == "pypi"]
    assert pypi and pypi[0].cuda == "13.0" and pypi[0].deepspeed == "0.19.8"
    assert not pypi[0].base_images.builder.startswith("nvidia/")
    assert pypi[0].cuda_toolkit.startswith("13.0")


def test_every_stack_pins_base_images_by_full_tag(matrix):
    for s in matrix.stacks:
        for ref in (s.base_images.builder, s.base_images.runtime):
            assert re.match(r"^[\w./-]+:[\w.-]+$", ref), ref
            if ref.startswith("nvidia/cuda:"):
                assert re.match(r"^nvidia/cuda:\d+\.\d+\.\d+-(base|devel)-ubuntu\d\d\.04$", ref), ref


def _break(matrix_copy, name, old, new):
    p = matrix_copy / name
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("name, old, new, expected", [
    ("stacks.yaml", 'torch: "2.5.1"', 'torch: "two.five"', r"stacks\[1\] \(torch2.5-cu124-py3.10\)\.torch: expected a version"),
    ("stacks.yaml", "    toolchain: pypi\n", "    toolchain: pypi\n    colour: blue\n", r"stacks\[9\].*colour: Extra inputs are not permitted"),
    ("gpus.yaml", 'cc: "9.0", cc_inferred: true, family: Hopper, interconnect: "HGX', 'cc: "nine", cc_inferred: true, family: Hopper, interconnect: "HGX', r"profiles\[15\] \(h20\)\.cc: expected a compute capability"),
    ("torch.yaml", 'python: ">=3.9,<3.14", torchvision: "0.20.1"', 'python: "~=>3.9", torchvision: "0.20.1"', r"releases\[1\]\.python: expected a PEP 440 specifier"),
    ("deepspeed.yaml", "kind: cpu, since", "kind: gpu, since", r"ops\.cpu_adam\.kind: Input should be 'cpu' or 'cuda'"),
    ("bases.yaml", "  debian12:\n", "  debian12:\n  - oops\n", r"bases.yaml is not valid YAML at line"),
])
def test_malformed_matrix_names_file_and_field(matrix_copy, name, old, new, expected):
    _break(matrix_copy, name, old, new)
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert name in e.value.message
    assert re.search(expected, e.value.message), e.value.message


def test_a_stack_that_breaks_a_rule_is_a_matrix_error(matrix_copy):
    # torch 2.4 has no wheels for Python 3.13: the rule, not the schema, catches it.
    _break(matrix_copy, "stacks.yaml", 'python: "3.10"\n    cuda: "12.1"', 'python: "3.13"\n    cuda: "12.1"')
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "torch-python" in e.value.message and "torch2.4-cu121-py3.10" in e.value.message


def test_unknown_reference_is_a_matrix_error(matrix_copy):
    _break(matrix_copy, "stacks.yaml", 'deepspeed: "0.15.4"', 'deepspeed: "0.15.9"')
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "0.15.9 is not a release in deepspeed.yaml" in e.value.message
