"""The resolver: newest valid stack, deterministic, explained."""

import pytest

from envbuild.plan import stack_plan
from envbuild.resolve.resolver import Request, explain_rows, resolve


def test_h20_default_is_newest_valid_stack(matrix):
    r = resolve(matrix, Request(gpu="h20"))
    assert r.stack.torch == "2.11.0" and r.stack.deepspeed == "0.19.8"
    assert r.arch_list == "9.0"
    assert r.tag == "torch2.11.0-cu130-py3.12-ds0.19.8-h20"


def test_specifiers_narrow_the_choice(matrix):
    r = resolve(matrix, Request(gpu="a100", torch=">=2.5,<2.8"))
    assert r.stack.torch == "2.7.1"
    r = resolve(matrix, Request(gpu="a100", python="3.11"))
    assert r.stack.id == "torch2.11-cu130-py3.11-pypi"
    r = resolve(matrix, Request(gpu="a100", cuda="12.4"))
    assert r.stack.id == "torch2.5-cu124-py3.10"


def test_resolution_does_not_depend_on_row_order(matrix, matrix_copy):
    """The choice is by version order, not by where a row sits in stacks.yaml."""
    import yaml

    from envbuild.knowledge.matrix import load_matrix
    p = matrix_copy / "stacks.yaml"
    data = yaml.safe_load(p.read_text())
    data["stacks"].reverse()
    p.write_text(yaml.safe_dump(data))
    shuffled = load_matrix(matrix_copy)
    assert [s.id for s in shuffled.stacks] != [s.id for s in matrix.stacks]
    for g in matrix.gpus:
        for req in (Request(gpu=g.name), Request(gpu=g.name, torch="<2.9")):
            try:
                want = resolve(matrix, req).stack.id
            except Exception as e:  # the same error both ways
                want = type(e).__name__
            try:
                got = resolve(shuffled, req).stack.id
            except Exception as e:
                got = type(e).__name__
            assert got == want, (g.name, req)


def test_explain_lists_every_candidate_with_rules(matrix):
    rows = explain_rows(matrix, Request(gpu="b200"))
    assert len(rows) == len(matrix.stacks)
    verdicts = {sid: (v, why) for sid, v, why in rows}
    assert [v for _, v, _ in rows].count("CHOSEN") == 1
    assert verdicts["torch2.6-cu126-py3.12"][0] == "rejected"
    assert "[gpu-floor]" in verdicts["torch2.6-cu126-py3.12"][1]
    assert "[gpu-jit-arch]" in verdicts["torch2.4-cu121-py3.10"][1]


def test_env_override_replaces_a_default(matrix):
    r = resolve(matrix, Request(gpu="h20", env=(("NCCL_P2P_DISABLE", "0"), ("MY_VAR", "x"))))
    env = {e.name: e for e in r.env}
    assert env["NCCL_P2P_DISABLE"].value == "0" and env["NCCL_P2P_DISABLE"].source == "user"
    assert env["MY_VAR"].value == "x"


@pytest.mark.parametrize("torch, buffer_var", [
    ("2.4", None),                              # no flight recorder yet
    ("2.5", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    ("2.7", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    ("2.8", "TORCH_FR_BUFFER_SIZE"),            # the old name is deprecated from 2.8
    ("2.10", "TORCH_FR_BUFFER_SIZE"),
    ("2.11", None),                             # 2000 is torch's own default from 2.11
])
def test_flight_recorder_variables_follow_the_torch_version(matrix, torch, buffer_var):
    env = {e.name: e.value for e in resolve(matrix, Request(gpu="h100", torch=torch)).env}
    buffers = {n for n in env if n in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")}
    assert buffers == ({buffer_var} if buffer_var else set())
    # dump-on-timeout is torch's own default from 2.7 (the torch-2.7.1 wheel): baked only before
    assert ("TORCH_NCCL_DUMP_ON_TIMEOUT" in env) == (torch in ("2.5", "2.6"))
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env  # torch's default (3) is the right one


def test_node_dependent_defaults_are_not_baked(matrix):
    """RTX 4090's P2P/IB workaround depends on the node's driver: it reaches the node as a
    condition, never as a baked ENV."""
    r = resolve(matrix, Request(gpu="rtx4090"))
    assert not {"NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"} & {e.name for e in r.env}
    node = {(d.name, d.value): d.node for d in r.node_env}
    assert node["NCCL_P2P_DISABLE", "1"].driver_below == "550.40.07"
    # accelerate wants the name set: 1 where the node has no InfiniBand, 0 (IB kept) where it has
    assert node["NCCL_IB_DISABLE", "1"].infiniband == "absent" and node["NCCL_IB_DISABLE", "0"].infiniband == "present"
    # A user's --env bakes their value and drops the node condition for that variable.
    r = resolve(matrix, Request(gpu="rtx4090", env=(("NCCL_IB_DISABLE", "0"),)))
    assert "NCCL_IB_DISABLE" not in {d.name for d in r.node_env}


def test_driver_floor_follows_the_cuda_major(matrix):
    assert resolve(matrix, Request(gpu="h100", cuda="12.8")).driver.min_driver == "525.60.13"
    r = resolve(matrix, Request(gpu="h100", cuda="13.0"))
    assert r.driver.min_driver == "580.65.06"
    assert {e.name: e.value for e in stack_plan(r).image_env}["ENVBUILD_MIN_DRIVER"] == "580.65.06"


def test_driver_floor_is_the_larger_of_the_stacks_and_the_gpu_generations(matrix):
    """Blackwell on a CUDA 12.8 stack needs R570 (12.x alone would say R525); on CUDA 13 the
    stack's R580 is already higher; a Hopper GPU keeps the stack's floor."""
    r = resolve(matrix, Request(gpu="b200", cuda="12.8"))
    assert (r.driver.min_driver, r.driver.branch) == ("570.26", "R570") and "Blackwell" in r.driver.source
    plan = stack_plan(r)
    assert {e.name: e.value for e in plan.image_env}["ENVBUILD_MIN_DRIVER"] == "570.26"
    assert dict(plan.labels.pairs)["io.envbuild.min-driver"] == "570.26"
    assert resolve(matrix, Request(gpu="b200", cuda="13.0")).driver.min_driver == "580.65.06"
    assert resolve(matrix, Request(gpu="h100", cuda="12.8")).driver.min_driver == "525.60.13"


def test_non_default_choices_change_the_tag(matrix):
    base = resolve(matrix, Request(gpu="h20")).tag
    assert resolve(matrix, Request(gpu="h20", ds_ops="cpu_adam")).tag == base + "-ops-cpu_adam"
    assert resolve(matrix, Request(gpu="h20", ds_ops="all")).tag.startswith(base + "-ops-")
    assert resolve(matrix, Request(gpu="h20", cpu_target="x86-64-v4")).tag == base + "-x86_64-v4"
    assert resolve(matrix, Request(gpu="h20", keep_toolchain=True)).tag == base + "-devel"


def test_custom_env_tag_does_not_depend_on_option_order(matrix):
    a = resolve(matrix, Request(gpu="h20", env=(("A", "2"), ("B", "1")))).tag
    b = resolve(matrix, Request(gpu="h20", env=(("B", "1"), ("A", "2")))).tag
    assert a == b and "-custom-" in a
