"""The issue-42 corrections to the extension rules, on the fixture matrix: pairs that cannot share
an image (rule ext-conflict), Blackwell source builds with an nvcc too old to emit their code
(rule ext-nvcc), FA4's requirements per CUDA major, and the build variables and patches of
mamba-ssm and Transformer Engine's binding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_here
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge import rules
from envbuild.resolve.resolver import Request, resolve


def _spec(matrix, gpu, exts, **kw) -> dict:
    from envbuild.plan.components import extensions as ext_plan

    return {e["name"]: e for e in ext_plan.spec(resolve(matrix, Request(gpu=gpu, extensions=exts, **kw)), "/usr/local/cuda")["extensions"]}


@pytest.mark.parametrize("asked, why, choices", [
    (("causal-conv1d", "mamba-ssm", "flash-attn-4"), "apache-tvm-ffi<=0.1.9",
     "--ext causal-conv1d,flash-attn-4, or --ext causal-conv1d,mamba-ssm (one image each)"),
    (("flash-attn", "fa4"), "flash_attn/cute/", "--ext flash-attn, or --ext flash-attn-4 (one image each)"),
])
def test_extensions_that_cannot_share_an_image_are_refused_naming_each_set_that_works(matrix, asked, why, choices):
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="h100", extensions=asked))
    msg = str(e.value)
    assert "rule ext-conflict" in msg and why in msg and msg.endswith(f"Nearest valid choices: {choices}."), msg
    for choice in choices.replace(" (one image each)", "").split(", or "):  # each choice renders
        resolve(matrix, Request(gpu="h100", extensions=tuple(choice.removeprefix("--ext ").split(","))))


def test_the_conflict_is_refused_by_the_cli_with_exit_2_and_nothing_written(tmp_path):
    r = run_here("render", "--gpu", "h100", "--ext", "flash-attn-4,mamba-ssm,causal-conv1d", "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "rule ext-conflict" in r.stderr and not (tmp_path / "o").exists(), r.stderr


@pytest.mark.parametrize("ext", ["flash-attn", "mamba-ssm"])
@pytest.mark.parametrize("gpu", ["b200", "rtx5090"])
def test_a_blackwell_source_build_with_an_nvcc_older_than_12_8_is_refused_naming_stack_and_gpu(matrix, ext, gpu):
    """The GPU rules accept the stack (its torch is cu130); its nvcc (a PyPI toolkit 12.6) would
    compile no sm_100/sm_120 code, so the extension refuses the pair; nvcc 12.8 is accepted."""
    s = matrix.stack("torch2.11-cu130-py3.12")
    g = matrix.gpu(gpu)
    old = s.model_copy(update={"cuda_toolkit": "12.6.3"})
    why = [r for r in rules.extension_rejections(matrix, old, matrix.extension(ext), "x86_64", None, g) if r.rule == "ext-nvcc"]
    assert len(why) == 1 and f"compiled for {gpu} ({g.sm}) needs nvcc >=12.8 and stack {s.id} compiles with nvcc 12.6.3" \
        in why[0].message and "setup.py" in why[0].message, why
    for fits in (s.model_copy(update={"cuda_toolkit": "12.8.1"}), s):
        assert not [r for r in rules.extension_rejections(matrix, fits, matrix.extension(ext), "x86_64", None, g)
                    if r.rule == "ext-nvcc"]
    assert not [r for r in rules.extension_rejections(matrix, old, matrix.extension(ext), "x86_64", None, matrix.gpu("h100"))
                if r.rule == "ext-nvcc"]  # Hopper's sm_90 comes from nvcc 11.8


def test_fa4_gets_the_cutlass_dsl_and_cuda_bindings_of_the_stacks_cuda_major(matrix):
    cu13 = _spec(matrix, "h100", ("fa4",), stack="torch2.11-cu126-py3.12")["flash-attn-4"]["requires"]
    assert "cuda-bindings>=12.8,<13" in cu13 and not [r for r in cu13 if "cu13" in r or ">=13" in r], cu13
    s = matrix.stack("torch2.11-cu130-py3.12")
    assert rules.extension_requirements(matrix.extension("fa4"), s)[-2:] == ["nvidia-cutlass-dsl[cu13]>=4.6.2",
                                                                            "cuda-bindings>=13,<14"]
    locked = {rules.requirement_name(r) for r in rules.extension_requirements(matrix.extension("fa4"), s)} - {"quack-kernels"}
    why = [r.message for r in rules.extension_rejections(matrix, s, matrix.extension("fa4"), "x86_64", locked) if r.rule == "ext-deps"]
    assert why == ["flash-attn-4 needs quack-kernels, which stack torch2.11-cu130-py3.12's lock does not hold "
                   "(the image installs nothing unlocked)"], why


def test_quack_kernels_undeclared_triton_comes_with_every_cuda_torch_stack_lock(production_matrix):
    """quack-kernels imports triton without requiring it: FA4 fits only stacks whose torch (a CUDA
    build) brings triton, which each shipped lock shows."""
    from envbuild.knowledge.lock import load_lock

    assert "triton" in production_matrix.extension("fa4").sources["triton"]
    for s in production_matrix.stacks:
        for arch in ("x86_64", "aarch64"):
            lock = load_lock(Path(production_matrix.directory), s.id, arch)
            if lock is not None:
                assert "triton" in lock.pins(), (s.id, arch)


def test_mamba_ssm_keeps_its_cuda_build_and_gets_the_cxx20_patch_from_torch_2_13(production_matrix):
    new = _spec(production_matrix, "h100", ("causal-conv1d", "mamba-ssm"), stack="torch2.13-cu132-py3.12")["mamba-ssm"]
    assert new["build_env"]["MAMBA_KEEP_CUDA_BUILD"] == "TRUE" and new["build_env"]["MAMBA_FORCE_BUILD"] == "TRUE"
    assert len(new["patches"]) == 1 and new["patches"][0]["new"].count("-std=c++20") == 2
    assert new["determines"]["patches"] == new["patches"]


def test_transformer_engine_binding_builds_from_source_and_finds_cudnn_and_nccl_headers(production_matrix):
    te = _spec(production_matrix, "h100", ("transformer-engine-cu13", "te"), stack="torch2.13-cu132-py3.12")
    entry = te["transformer-engine-torch"]
    assert entry["build_env"]["NVTE_PYTORCH_FORCE_BUILD"] == "TRUE" and entry["build_headers"] == ["cudnn.h", "nccl.h"]
    assert json.dumps(entry["determines"]["build_env"], sort_keys=True).count("NVTE_PYTORCH_FORCE_BUILD") == 1


# ---------------------------------------------------------------- an extension's own lock (matrices/locks/ext)


def test_fa4_renders_on_the_newest_locked_stack_with_its_closure_installed_by_hash(production_matrix):
    """FA4's Requires-Dist are in no stack lock: its own lock (resolved by uv against the stack's
    lock as constraints) holds them, so rule ext-deps passes on a locked stack and the image
    installs the CuTe DSL's binary wheels of the stack's CUDA major by hash."""
    r = resolve(production_matrix, Request(gpu="h100", extensions=("fa4",)))
    assert r.lock is not None and r.stack.id == "torch2.15-cu132-py3.12"
    entry = _spec(production_matrix, "h100", ("fa4",))["flash-attn-4"]
    pins = [line.split(" ")[0] for line in entry["requires_lock"].splitlines() if line[:1].isalnum()]
    assert "nvidia-cutlass-dsl-libs-cu13==4.8.1" in pins and "quack-kernels==0.6.5" in pins, pins
    assert entry["requires_lock"].count("--hash=sha256:") >= len(pins) and not any(p.startswith("torch==") for p in pins)


def test_each_extension_lock_agrees_with_its_stack_lock_and_every_one_needed_exists(production_matrix):
    """Offline: an extension's lock names the stack lock it was resolved against (the sha256 of
    its [venv]); a stack lock refreshed without it leaves the extension refused, never installed
    against other pins. CUDA 12 stacks get cuda-bindings 12.x, never 13 (driver 580+)."""
    from envbuild.knowledge.lock import ext_lock, ext_lock_path, stack_lock
    from envbuild.resolve.locking import locked_extensions

    m = production_matrix
    wanted = set()
    for s in m.stacks:
        for arch in m.stack_arches(s):
            lock = stack_lock(m, s, arch)
            for ext in locked_extensions(m, s, arch, lock) if lock else ():
                wanted.add(ext_lock_path(m.directory, ext.name, s.id, arch))
                own = ext_lock(m, ext, s, arch, lock)
                assert own is not None, (ext.name, s.id, arch)
                bindings = {**lock.pins(), **own.pins()}.get("cuda-bindings")
                assert bindings is None or bindings.split(".")[0] == s.cuda.split(".")[0], (s.id, bindings)
    assert wanted == set((Path(m.directory) / "locks" / "ext").glob("*.txt")) and len(wanted) == 65


def test_an_extension_lock_made_against_another_stack_lock_is_not_used(tmp_path):
    import shutil

    from conftest import ROOT
    from envbuild.knowledge.matrix import load_matrix

    d = tmp_path / "m"
    shutil.copytree(ROOT / "matrices", d)
    path = d / "locks" / "ext" / "flash-attn-4.torch2.15-cu132-py3.12.x86_64.txt"
    text = path.read_text()
    path.write_text(text.replace(text.split("# stack-venv: ")[1][:64], "0" * 64))
    m = load_matrix(d)
    with pytest.raises(EnvbuildError, match=r"flash-attn-4 needs .*quack-kernels.*which stack torch2\.15-cu132-py3\.12's lock"):
        resolve(m, Request(gpu="h100", extensions=("fa4",), stack="torch2.15-cu132-py3.12"))


def test_lock_check_finds_a_missing_extension_lock_stale_and_writes_it_with_the_stack(tmp_path, monkeypatch):
    """`envbuild lock` makes an extension's lock with its stack's, and `--check` calls a missing
    one stale (uv stubbed here: what it would resolve is the stack's pins plus the closure)."""
    import shutil

    from conftest import ROOT
    from envbuild.knowledge.lock import load_lock
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.resolve import locking

    d = tmp_path / "m"
    shutil.copytree(ROOT / "matrices", d)
    path = d / "locks" / "ext" / "flash-attn-4.torch2.15-cu132-py3.12.x86_64.txt"
    want = path.read_text()
    path.unlink()
    m = load_matrix(d)
    s = m.stack("torch2.15-cu132-py3.12")
    lock = load_lock(d, s.id, "x86_64")
    closure = want.split("# [venv]\n")[1]
    seen = []
    monkeypatch.setattr(locking, "compile_requirements", lambda reqs, *a, **k: seen.append(reqs) or lock.text.split("# [venv]\n")[1].split("\n# [")[0] + closure)
    monkeypatch.setattr(locking, "uv_version", lambda: want.split("# resolver: ")[1].split("\n")[0])
    inputs = locking.lock_inputs(m, s, ([], "n/a"), "x86_64")
    kw = dict(date=lock.header["exclude-newer"])
    checked = [o for o in locking.lock_extensions(m, s, "x86_64", inputs, lock.text, check=True, **kw) if "flash-attn-4" in o.detail]
    assert [(o.state, o.detail) for o in checked] == [("stale", "--ext flash-attn-4: no lock yet")]
    assert not path.exists()
    locking.lock_extensions(m, s, "x86_64", inputs, lock.text, check=False, **kw)
    assert path.read_text() == want and ("flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]>=4.6.2", "cuda-bindings>=13,<14") in seen


# ---------------------------------------------------------------- sdist extensions' own locks, glibc, the audit rule


def test_ext_audit_refuses_only_an_extension_with_device_code_to_audit(matrix):
    """The PyPI toolchain of CUDA 13.0.2 has no cuobjdump: an extension with SASS of its own
    (flash-attn, TE's core) is refused for it, FA4's pure-Python wheel and TE's host-only binding
    (device_code: false; their link check needs no cuobjdump) are not."""
    s = matrix.stack("torch2.11-cu130-py3.11-pypi")
    audit = {name: [r.message for r in rules.extension_rejections(matrix, s, matrix.extension(name), "x86_64", None)
                    if r.rule == "ext-audit"] for name in ("flash-attn", "transformer-engine-cu13", "fa4", "te")}
    assert audit["flash-attn"] and "no cuobjdump before CUDA 13.2" in audit["flash-attn"][0], audit
    assert audit["transformer-engine-cu13"] and not audit["fa4"] and not audit["te"], audit


def test_the_build_step_looks_for_cuobjdump_only_where_there_is_device_code(monkeypatch, tmp_path):
    """What rule ext-audit lets through builds: a spec whose extensions have no device code of
    their own does not fail for want of cuobjdump; one with device code still does."""
    from conftest import build_step

    step = build_step("extensions.py")
    asked = []
    monkeypatch.setattr(step.sass_audit, "find_cuobjdump", lambda home: asked.append("required") or "/x/cuobjdump")
    monkeypatch.setattr(step.sass_audit, "which_cuobjdump", lambda home: asked.append("optional") or "")
    for device_code in (False, True):
        spec = {"cache": str(tmp_path / "cache"), "locked": True, "cuda_home": "", "arch_list": "9.0",
                "record": str(tmp_path / "r.json"), "lock": str(tmp_path / "l.txt"),
                "extensions": [{"name": "x", "device_code": device_code}]}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        monkeypatch.setattr(step, "install_requires_lock", lambda *a: (_ for _ in ()).throw(SystemExit("stop")))
        with pytest.raises(SystemExit):
            step.main(str(tmp_path / "spec.json"))
    assert asked == ["optional", "required"], asked


def test_mamba_ssm_on_aarch64_needs_the_glibc_of_tilelangs_only_wheel(production_matrix, monkeypatch):
    """tilelang 0.1.8 (mamba-ssm's pin) has one aarch64 wheel, manylinux_2_34: a base image with
    an older glibc is refused naming both glibcs and the wheel (rule ext-glibc), and gets no
    extension lock (uv would pick tilelang's sdist, a TVM compile in the image); x86_64 is not."""
    from envbuild.knowledge.lock import stack_lock
    from envbuild.resolve.locking import locked_extensions

    m, mamba = production_matrix, production_matrix.extension("mamba-ssm")
    s = m.stack("torch2.15-cu132-py3.12")
    lock = stack_lock(m, s, "aarch64")
    assert mamba in locked_extensions(m, s, "aarch64", lock)
    assert rules.glibc_rejection(m, s, mamba, "aarch64") is None
    monkeypatch.setitem(m.bases.families, s.os, m.bases.families[s.os].model_copy(update={"glibc": "2.31"}))
    why = [r.message for r in rules.extension_rejections(m, s, mamba, "aarch64", None) if r.rule == "ext-glibc"]
    assert len(why) == 1 and "on aarch64 needs glibc >= 2.34" in why[0] and "has glibc 2.31" in why[0] \
        and "manylinux_2_34_aarch64" in why[0], why
    assert not [r for r in rules.extension_rejections(m, s, mamba, "x86_64", None) if r.rule == "ext-glibc"]
    assert mamba not in locked_extensions(m, s, "aarch64", lock)


@pytest.mark.parametrize("asked, fits", [(("causal-conv1d", "mamba-ssm"), "tilelang==0.1.8"),
                                         (("transformer-engine-cu13", "te"), "onnxscript==")])
def test_sdist_extensions_render_on_the_newest_locked_stack_with_their_requirements_by_hash(production_matrix, asked, fits):
    """mamba-ssm's and TE's binding's install_requires (from their setup.py, as data) are in their
    own locks: rule ext-deps passes on a locked stack, and a package two extension locks hold (the
    core's and the binding's) is installed once."""
    r = resolve(production_matrix, Request(gpu="h100", extensions=asked))
    assert r.lock is not None and r.stack.id == "torch2.15-cu132-py3.12", r.stack.id
    entries = list(_spec(production_matrix, "h100", asked).values())
    assert fits in entries[-1]["requires_lock"] and entries[-1]["requires_lock"].count("--hash=sha256:") > 1
    pins = [line.split(" ")[0].split("==")[0] for e in entries for line in e["requires_lock"].splitlines() if line[:1].isalnum()]
    assert len(pins) == len(set(pins)), pins


def test_an_sdist_extension_lock_gives_uv_its_setup_py_requirements_and_wants_wheels_for_the_rest(tmp_path, monkeypatch):
    """uv cannot build mamba-ssm's sdist (its setup.py imports torch): its install_requires go
    to uv as static metadata, every other package must be a wheel, and the lock says both."""
    from envbuild.knowledge.lock import load_lock
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.resolve import locking

    m = load_matrix()
    s, mamba = m.stack("torch2.15-cu132-py3.12"), m.extension("mamba-ssm")
    lock = load_lock(m.directory, s.id, "aarch64")
    seen = {}
    monkeypatch.setattr(locking, "compile_requirements", lambda reqs, *a, **k: seen.update(k, reqs=reqs) or "")
    monkeypatch.setattr(locking, "uv_version", lambda: "uv (stub)")
    inputs = locking.lock_inputs(m, s, ([], "n/a"), "aarch64")
    text = locking.write_ext_lock(mamba, s, inputs, lock.text, "2026-11-22T00:00:00Z", (("causal-conv1d", "1.7.0", ""),))
    assert seen["metadata"] == (("mamba-ssm", "2.3.2.post1", tuple(mamba.requires_dist.requirements)),)
    assert seen["wheels_only_but"] == "mamba-ssm" and seen["reqs"][0] == "mamba-ssm==2.3.2.post1"
    assert "# requires-dist: torch packaging ninja einops triton>=3.5.0 transformers tilelang==0.1.8" in text
    assert "setup.py lines 395-406" in text and "wheels only but mamba-ssm itself" in text


def test_requires_dist_must_name_what_requires_names(production_matrix):
    from pydantic import ValidationError

    from envbuild.knowledge.matrix.files.extensions_yaml import CudaExtension

    data = production_matrix.extension("mamba-ssm").model_dump(exclude_defaults=True)
    data["requires_dist"]["requirements"] = [r for r in data["requires_dist"]["requirements"] if r != "transformers"]
    with pytest.raises(ValidationError, match=r"requires_dist names .* they must agree"):
        CudaExtension.model_validate(data)


@pytest.mark.parametrize("gpu, ext, why", [("a100", "flash-attn-3", "needs compute capability >= 9.0 and a100 is sm_80"),
                                           ("v100", "flash-attn-4", "needs compute capability >= 9.0 and v100 is sm_70")])
def test_an_extension_below_its_compute_capability_is_refused_by_the_cli_with_nothing_written(tmp_path, gpu, ext, why):
    r = run_here("render", "--gpu", gpu, "--ext", ext, "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and why in r.stderr and "rule ext-gpu" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_the_listing_counts_an_extensions_own_lock_as_a_render_does():
    """`envbuild extensions` says an extension fits a locked stack where its own lock holds what
    the stack's does not (as render decides), and names the glibc and torch floors elsewhere."""
    r = run_here("extensions", "--json", production=True)
    assert r.returncode == 0, r.stderr
    data = {e["name"]: e for e in json.loads(r.stdout)}
    for name in ("flash-attn-4", "mamba-ssm", "transformer-engine-torch"):
        assert "torch2.15-cu132-py3.12 (x86_64, aarch64)" in data[name]["stacks"], (name, data[name]["stacks"])
    assert data["mamba-ssm"]["min_glibc"] == {"aarch64": "2.34"} and "x86_64" in data["mamba-ssm"]["cpu_arch"]
    assert "triton>=3.5.0" in data["mamba-ssm"]["refused"]["torch2.8-cu128-py3.12"]


def test_transformer_engines_core_gets_the_curand_its_import_loads(tmp_path):
    """TE's core loads libcurand at import (transformer_engine/common/__init__.py line 496), which
    torch 2.15's CUDA 13 wheels do not bring: the venv installs the lock's [curand] section for it,
    and an image without it does not (the opt-in TE cell failed 'curand shared object not found')."""
    from conftest import ROOT

    said = {}
    for name, exts in (("te", ["--ext", "transformer-engine-cu13"]), ("plain", [])):
        out = tmp_path / name
        r = run_here("render", "--gpu", "h20", "--stack", "torch2.15-cu132-py3.11-pypi", *exts, "-o", str(out),
                     env={"ENVBUILD_MATRIX_DIR": str(ROOT / "matrices")})
        assert r.returncode == 0, r.stderr
        said[name] = (out / "Dockerfile").read_text(), (out / "envbuild" / "lock" / "venv.txt").read_text()
    assert "with its [curand] section (extensions load it)" in said["te"][0] and "nvidia-curand==" in said["te"][1]
    assert "[curand]" not in said["plain"][0] and "nvidia-curand" not in said["plain"][1]
