"""The compatibility rules, one behaviour each."""

from types import SimpleNamespace

import pytest
from packaging.version import Version

from envbuild.knowledge import rules
from envbuild.base.errors import EnvbuildError
from envbuild.resolve.resolver import Request, explain_rows, resolve


@pytest.mark.parametrize("cc, arches, ok", [
    ("9.0", "7.5;8.0;8.6;9.0;10.0;12.0", True),
    ("8.9", "7.0;7.5;8.0;8.6;9.0", True),          # sm_86 cubin runs on 8.9
    ("7.0", "7.5;8.0;8.6;9.0;10.0;12.0", False),   # V100 dropped from cu13 wheels
    ("10.3", "7.5;8.0;9.0;10.0", True),
    ("12.0", "5.0;6.0;7.0;7.5;8.0;8.6;9.0", False),
    ("12.1", "9.0;10.0;12.0+PTX", True),
    ("10.0", "8.0;9.0+PTX", True),                 # PTX is JIT-compiled by the driver
    ("8.0", "9.0+PTX", False),
])
def test_arch_runs_on(cc, arches, ok):
    assert rules.arch_runs_on(cc, arches) is ok


@pytest.mark.parametrize("text, version, ok", [
    ("2.5", "2.5.1", True), ("2.5", "2.6.0", False), ("2.5.1", "2.5.1", True),
    (">=2.5,<2.8", "2.7.1", True), (">=2.5,<2.8", "2.8.0", False), ("13", "13.0", True),
])
def test_user_specifier(text, version, ok):
    assert rules.user_specifier("--torch", text).contains(version) is ok


@pytest.mark.parametrize("bad", ["2.x", ">>2", "", "latest"])
def test_user_specifier_rejects_garbage(bad):
    with pytest.raises(EnvbuildError, match="--torch"):
        rules.user_specifier("--torch", bad)


def test_v100_gets_the_cu126_stack_not_the_default_cu130(matrix):
    r = resolve(matrix, Request(gpu="v100"))
    assert r.stack.cuda == "12.6" and r.stack.torch == "2.11.0"
    assert r.torch_index == "https://download.pytorch.org/whl/cu126"


def test_blackwell_needs_torch_27_and_cuda_128(matrix):
    r = resolve(matrix, Request(gpu="b200", torch="<2.8"))
    assert (r.stack.torch, r.stack.cuda) == ("2.7.1", "12.8")
    with pytest.raises(EnvbuildError, match="b200 needs torch >=2.7"):
        resolve(matrix, Request(gpu="b200", torch="2.5"))


def _stack(matrix, sid):
    return matrix.stack(sid)


def test_sparse_attn_never_with_torch2(matrix):
    why = rules.op_rejection(matrix, _stack(matrix, "torch2.4-cu121-py3.10"), "sparse_attn", "9.0")
    assert why and "torch < 2.0" in why.message


def test_sparse_attn_gone_after_0197(matrix):
    why = rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu130-py3.12"), "sparse_attn", "9.0")
    assert "removed in DeepSpeed 0.19.7" in why.message


@pytest.mark.parametrize("op", ["cutlass_ops", "ragged_device_ops"])
def test_dskernels_ops_are_off(matrix, op):
    why = rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu130-py3.12"), op, "9.0")
    assert "deepspeed-kernels" in why.message


def test_fp_quantizer_triton_limit(matrix):
    # DeepSpeed 0.18.9 pins triton < 3.3; torch 2.8 brings triton 3.4.
    why = rules.op_rejection(matrix, _stack(matrix, "torch2.8-cu128-py3.12"), "fp_quantizer", "9.0")
    assert why and "triton" in why.message
    # 0.19.8 dropped the check; CC must still be >= 8.0.
    assert rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu130-py3.12"), "fp_quantizer", "9.0") is None
    assert "8.0" in rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu126-py3.12"), "fp_quantizer", "7.0").message


def test_async_io_brings_libaio_and_evoformer_needs_cutlass(matrix):
    s = _stack(matrix, "torch2.11-cu130-py3.12")
    assert rules.op_rejection(matrix, s, "async_io", "9.0") is None
    assert "CUTLASS" in rules.op_rejection(matrix, s, "evoformer_attn", "9.0").message
    r = resolve(matrix, Request(gpu="h100", stack=s.id, ds_ops="async_io"))
    from envbuild.plan import stack_plan
    plan = stack_plan(r)
    assert "libaio-dev" in plan.builder.steps[0].args and "libaio1t64" in plan.runtime.steps[0].args


def test_utils_op_only_from_0171(matrix):
    old = resolve(matrix, Request(gpu="h100", stack="torch2.5-cu124-py3.10"))
    assert "utils" not in old.ops and ("utils", "utils first appears in DeepSpeed 0.17.1") in old.dropped_ops
    assert "utils" in resolve(matrix, Request(gpu="h100")).ops


def test_all_preset_is_every_buildable_op(matrix):
    r = resolve(matrix, Request(gpu="h100", ds_ops="all"))
    assert {"cpu_adam", "fused_adam", "fp_quantizer", "async_io", "dc", "pin_memory"} <= set(r.ops)
    assert not {"sparse_attn", "cutlass_ops", "ragged_device_ops", "evoformer_attn", "gds"} & set(r.ops)


def test_nvcc_rule(matrix):
    new = _stack(matrix, "torch2.11-cu130-py3.11-pypi")
    old = _stack(matrix, "torch2.10-cu128-py3.12")
    assert rules.nvcc_required(matrix, new, ["cpu_adam"]) is None
    assert "fused_adam" in rules.nvcc_required(matrix, new, ["cpu_adam", "fused_adam"])
    old_ds = old.model_copy(update={"deepspeed": "0.18.9"})
    assert "nvcc -V" in rules.nvcc_required(matrix, old_ds, ["cpu_adam"])


def test_a_fitting_wheel_needs_no_nvcc_and_a_compiled_extension_does(matrix, matrix_copy):
    """FA4's pure-Python wheel compiles nothing: no nvcc step (it rendered one, "compiled with
    nvcc"); a compiled extension keeps it; a wheel with device code keeps the toolchain for the
    audit's cuobjdump only. The PyPI stack's toolkit (13.0) is given cuobjdump, as 13.2 has it, so
    that causal-conv1d's SASS audit can run there."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.plan import stack_plan

    bases = matrix_copy / "bases.yaml"
    bases.write_text(bases.read_text().replace('audit_since: "13.2"', 'audit_since: "13.0"'))
    copy = load_matrix(matrix_copy)

    def toolchain_steps(*extensions):
        r = resolve(copy, Request(gpu="h100", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam", extensions=extensions))
        return r.nvcc_reason, [s.comment for s in stack_plan(r).builder.steps if s.name == "cuda-toolkit"]

    assert toolchain_steps("flash-attn-4") == (None, [])
    assert toolchain_steps("causal-conv1d") == ("CUDA extensions causal-conv1d are compiled with nvcc", [
        "nvcc 13.0.2 from PyPI, outside the venv (CUDA extensions causal-conv1d are compiled with nvcc)"])
    s = matrix.stack("torch2.11-cu130-py3.11-pypi")
    ext = SimpleNamespace  # a resolved ExtensionBuild: the extension and the wheel that fits (None: compiled)
    fa4, xf = matrix.extension("flash-attn-4"), matrix.extension("xformers")
    assert rules.nvcc_required(matrix, s, ["cpu_adam"], None, (ext(ext=fa4, wheel=fa4.wheels[0]),)) is None
    assert rules.nvcc_required(matrix, s, ["cpu_adam"], None, (ext(ext=xf, wheel=xf.wheels[0]),)) == \
        "its cuobjdump audits the SASS of the PyPI wheels of xformers; nothing is compiled"
    assert rules.nvcc_required(matrix, s, ["cpu_adam"], None, (ext(ext=fa4, wheel=fa4.wheels[0]), ext(ext=xf, wheel=None))) == \
        "CUDA extensions xformers are compiled with nvcc"


def test_pypi_stack_without_cuda_ops_skips_the_toolkit(matrix):
    from envbuild.plan import stack_plan
    r = resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam"))
    assert [s.name for s in stack_plan(r).builder.steps] == ["os", "venv", "uv", "torch", "deepspeed", "finish", "layers"]
    r = resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam,fused_adam"))
    assert [s.name for s in stack_plan(r).builder.steps] == ["os", "venv", "uv", "torch", "cuda-toolkit", "deepspeed",
                                                             "finish", "layers"]


@pytest.mark.parametrize("gpu", ["gh200", "gb200", "gb300", "gb10"])
def test_grace_gpus_get_an_aarch64_image_or_the_reason(matrix, gpu):
    """Grace (and DGX Spark's GB10) hosts are aarch64: only stacks with aarch64 CUDA wheels on
    PyPI (torch >= 2.11, its default CUDA) serve them; every other stack says why."""
    rows = explain_rows(matrix, Request(gpu=gpu))
    for stack_id, verdict, why in rows:
        s = _stack(matrix, stack_id)
        if Version(s.torch) < Version("2.11"):
            assert verdict == "rejected" and "[gpu-host-arch]" in why and "CPU-only" in why, (stack_id, why)
        elif s.cuda != matrix.torch_release(s.torch).default_cuda:
            assert "[gpu-host-arch]" in why and "default CUDA" in why, (stack_id, why)
    assert resolve(matrix, Request(gpu=gpu)).arch == "aarch64"


def test_the_documented_rules_are_the_rules_that_exist():
    """The rules package's index lists every rule, and every rule a user can meet is made in one of
    its family modules: no Rejection anywhere else, no "(rule NAME" message outside it."""
    import re

    from conftest import ROOT
    from envbuild.knowledge import rules
    package = ROOT / "envbuild" / "knowledge" / "rules"
    documented = set(re.findall(r"``([a-z][a-z-]+)``", rules.__doc__))
    source = "\n".join(path.read_text() for path in sorted(package.glob("*.py")))
    made = set(re.findall(r'Rejection\(\s*"([a-z-]+)"', source)) | set(re.findall(r"\(rule ([a-z][a-z-]+)", source))
    assert made == documented, (made - documented, documented - made)
    for path in sorted((ROOT / "envbuild").rglob("*.py")):
        if package not in path.parents and "image" not in path.parts:
            text = path.read_text()
            assert not re.search(r'Rejection\(\s*"', text) and not re.search(r"\(rule [a-z]", text), path


def test_the_index_names_every_rule_of_every_family():
    """`rules.X` is the family module's own object for each public name a family defines: a rule
    added to a family without its line in the index fails here, not in a caller. (Patch a rule
    where its family calls it: envbuild.knowledge.rules.<family>.X, not the index's name.)"""
    import ast
    import importlib

    from conftest import ROOT
    from envbuild.knowledge import rules
    assert len(rules.__all__) == len(set(rules.__all__))
    defined = {}
    for path in sorted((ROOT / "envbuild" / "knowledge" / "rules").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"envbuild.knowledge.rules.{path.stem}")
        for node in ast.parse(path.read_text()).body:
            targets = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                       [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [])
            for name in targets:
                if not name.startswith("_"):
                    assert name not in defined, (name, defined.get(name), path.stem)
                    defined[name] = module
    indexed = set(defined) | {"arch_runs_on"}  # the gpu-arch rule, defined once in envbuild/image/arch.py
    assert indexed == set(rules.__all__), indexed ^ set(rules.__all__)
    for name, module in defined.items():
        assert getattr(rules, name) is getattr(module, name), name


CURAND_OPS = ("transformer", "stochastic_transformer", "transformer_inference", "random_ltd", "fp_quantizer")
# What `envbuild lock` writes for torch 2.15, whose wheels no longer bring nvidia-curand: the
# production lock's section (nvidia-curand 10.4.2.66, https://pypi.org/project/nvidia-curand/10.4.2.66/).
CURAND_SECTION = ("# [curand]\nnvidia-curand==10.4.2.66 \\\n"
                  "    --hash=sha256:9bb3796a2f6223454b2e326e3d7572c1500cfa4d629de827676b4eeecd30ab0c\n"
                  "    # via cuda-toolkit\n")
PYPI_LOCK = "locks/torch2.11-cu130-py3.11-pypi.x86_64.txt"


def with_curand_section(matrix_dir):
    """The fixture's PyPI-toolchain lock as torch 2.15's is: no nvidia-curand in the venv (torch
    2.11's wheels bring it, 2.15's do not) and the toolchain extra's wheel in the [curand] section."""
    from envbuild.knowledge.lock import parse_lock

    path = matrix_dir / PYPI_LOCK
    text = path.read_text()
    block = next(p.block for p in parse_lock(text).sections["venv"] if p.key == "nvidia-curand")
    assert text.endswith("\n# [curand]\n")  # torch 2.11: the extra adds nothing its wheels lack
    path.write_text(text.replace(block, "").removesuffix("# [curand]\n") + CURAND_SECTION)
    return matrix_dir


def without_curand_section(matrix_dir):
    """The fixture's PyPI-toolchain lock as `envbuild lock` wrote it before the toolchain's curand
    extra: no `toolchain-adds` header, no [curand] section."""
    path = matrix_dir / PYPI_LOCK
    lines = path.read_text().removesuffix("\n# [curand]\n").splitlines(keepends=True)
    path.write_text("".join(line for line in lines if not line.startswith("# toolchain-adds: ")))
    return matrix_dir


@pytest.mark.parametrize("op", CURAND_OPS)
def test_ops_that_link_curand_need_the_lock_section_the_toolchain_adds_it_from(matrix, op):
    """They link -lcurand (their op_builder's extra_ldflags, derived by `matrix refresh`): the PyPI
    toolchain's extras have no cuRAND and its `curand` extra adds it, hash-locked in a section of
    the stack's lock. A lock without that section: refused before the build, naming the command
    that writes it; the NVIDIA devel image has cuRAND."""
    assert "curand" in matrix.ops[op].needs
    why = rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu130-py3.11-pypi"), op, "9.0")
    assert why and why.rule == "ds-op" and f"{op}: needs curand" in why.message
    assert ("the pypi toolchain adds curand from cuda-toolkit[curand], hash-locked in the stack's lock, and the lock "
            "of torch2.11-cu130-py3.11-pypi has no [curand] section: `envbuild lock --stack "
            "torch2.11-cu130-py3.11-pypi` writes it") in why.message
    assert rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu130-py3.11-pypi"), op, "9.0",
                              sections=frozenset({"venv", "toolchain", "curand"})) is None
    devel = rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu130-py3.12"), op, "9.0")
    assert devel is None or "curand" not in devel.message


def test_all_selects_the_curand_ops_where_the_lock_has_the_section(matrix_copy):
    from envbuild.knowledge.matrix import load_matrix

    m = load_matrix(with_curand_section(matrix_copy))
    r = resolve(m, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="all"))
    assert set(CURAND_OPS) <= set(r.ops) and r.toolchain_adds == ("curand",)
    assert not set(CURAND_OPS) & {name for name, _ in r.dropped_ops}
    plain = resolve(m, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam"))
    assert plain.toolchain_adds == ()  # an image without those ops takes no cuRAND


def test_a_lock_without_the_section_leaves_the_curand_ops_out_and_names_the_command(matrix_copy):
    from envbuild.knowledge.matrix import load_matrix

    m = load_matrix(without_curand_section(matrix_copy))
    r = resolve(m, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="all"))
    dropped = dict(r.dropped_ops)
    assert set(CURAND_OPS) <= set(dropped) and not set(CURAND_OPS) & set(r.ops)
    assert "`envbuild lock --stack torch2.11-cu130-py3.11-pypi` writes it" in dropped["transformer"]
    with pytest.raises(EnvbuildError, match=r"--ds-ops: op 'random_ltd' cannot be pre-built .* no \[curand\] section"):
        resolve(m, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="random_ltd"))


def test_an_op_missing_two_needs_names_both_each_with_its_own_reason(matrix):
    """evoformer_attn needs cuRAND (the toolchain says how it adds it) and CUTLASS (the op's own
    reason): the message names both, and does not give the cuRAND reason as CUTLASS's."""
    why = rules.op_rejection(matrix, _stack(matrix, "torch2.11-cu130-py3.11-pypi"), "evoformer_attn", "9.0")
    assert why and why.message.startswith("evoformer_attn: needs curand, cutlass, which "), why.message
    own, adds = why.message.split(": ", 2)[2].split("; ", 1)
    assert "CUTLASS" in own and "curand" not in own and "[curand] section" in adds


def test_all_leaves_out_every_op_the_ci_stack_cannot_build_with_its_reason(matrix):
    ops, dropped = rules.select_ops(matrix, _stack(matrix, "torch2.11-cu130-py3.11-pypi"), "9.0", "all")
    left_out = dict(dropped)  # no lock sections given: nothing the toolchain adds
    assert set(CURAND_OPS) <= set(left_out)
    assert not {"transformer", "random_ltd"} & set(ops) and {"cpu_adam", "fused_adam"} <= set(ops)


def test_async_io_links_the_drivers_stub_which_the_pypi_toolchain_makes(production_matrix, tmp_path):
    """async_io links -lcuda (its op_builder's extra_ldflags, derived by `matrix refresh`). Building
    `--ds-ops all` of the CI stack stopped there once: `ld: cannot find -lcuda`, as no PyPI CUDA
    wheel holds the driver's stub. The PyPI toolchain now makes one (cuda-toolkit.sh), so the rule
    allows async_io there; a toolchain that provides no stub gets it refused before the build,
    naming the newest stacks that can pre-build it."""
    import shutil

    from envbuild.knowledge.matrix import load_matrix

    m = production_matrix
    assert m.ops["async_io"].needs == ["libaio", "libcuda"] and "libcuda" in m.bases.toolchains["pypi"].provides
    for stack in ("torch2.15-cu132-py3.11-pypi", "torch2.15-cu132-py3.12", "torch2.14-cu126-py3.12"):
        assert rules.op_rejection(m, _stack(m, stack), "async_io", "9.0") is None, stack
    shutil.copytree(m.directory, tmp_path / "m")
    bases = tmp_path / "m" / "bases.yaml"
    bases.write_text(bases.read_text().replace("    provides: [libcuda]\n", ""))
    without = load_matrix(tmp_path / "m")
    why = rules.op_rejection(without, _stack(without, "torch2.15-cu132-py3.12"), "async_io", "9.0")
    assert why and why.message == ("async_io: needs libcuda, which envbuild's ubuntu24.04 base and its pypi "
                                   "toolchain do not provide: " + without.ops["async_io"].reason)
    with pytest.raises(EnvbuildError) as named:
        rules.select_ops(without, _stack(without, "torch2.15-cu132-py3.12"), "9.0", "async_io")
    assert "Stacks that can pre-build async_io: torch2.14-cu130-py3.12, " in str(named.value)  # the newest first
