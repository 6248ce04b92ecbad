"""Rendering: golden files, byte-identical output, layer order, atomic writes."""

import json
import os
import re

import pytest

from conftest import ROOT, tree
from envbuild import buildsteps
from envbuild.base.errors import EnvbuildError
from envbuild.resolve.extend import EXTEND_LOCK_SOURCE, Layer
from envbuild.knowledge.lock import parse_lock
from envbuild.plan import layer_plan
from envbuild.oci.registry import READABLE_TAG_MAX
from envbuild.render.builddir import render, render_files, write_build_dir
from envbuild.resolve.resolver import Request, resolve

GOLDEN = ROOT / "tests" / "golden"
CASES = {
    "h20-default": Request(gpu="h20"),
    "h20-pypi-ci": Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam,fused_adam",
                           base_image="local/debian:bookworm"),
    "v100-cu126": Request(gpu="v100"),
    "rtx4090-torch2.5-devel": Request(gpu="rtx4090", torch="2.5", keep_toolchain=True, ds_ops="cpu_adam,async_io"),
    # ARM64 (Grace): the Debian 12 PyPI-toolchain stack (GCC 12.2: armv9-a) and the newest Ubuntu
    # 24.04 stack (GCC 13: neoverse-v2).
    "gh200-arm64-pypi": Request(gpu="gh200", stack="torch2.11-cu130-py3.11-pypi",
                                ds_ops="cpu_adam,cpu_adagrad,cpu_lion,utils"),
    "gb200-arm64-default": Request(gpu="gb200"),
    # CUDA extensions compiled in the builder (extensions.yaml), with the devel image's nvcc and cuobjdump.
    "h100-ext": Request(gpu="h100", stack="torch2.11-cu130-py3.12", ds_ops="cpu_adam,fused_adam",
                        extensions=("causal-conv1d", "flash-attn")),
}
VERBATIM = "envbuild/"  # files copied unchanged from templates/files; compared there, not in golden/
GENERATED = ("envbuild/extensions.json", "envbuild/deepspeed.json")  # written from the plan under envbuild/: golden like the rest
# The manifest's digests of the whole fixture matrix and of every other rendered file change with
# any data or in-image file: kept out of the golden files (a new extension touches its data, its
# module and its tests, not every golden manifest); what they digest is compared file by file,
# and tests/behaviour/test_reproduce.py checks the digests themselves.
_DIGESTS = re.compile(rb'("(?:matrix|render)": \{\n\s*"sha256": ")[0-9a-f]{64}(")')


def golden_view(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: _DIGESTS.sub(rb"\1<not compared>\2", v) if k == "manifest.json" else v for k, v in files.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(matrix, case):
    files = render_files(resolve(matrix, CASES[case]))
    golden_dir = GOLDEN / case
    rendered = golden_view({k: v for k, v in files.items() if not k.startswith(VERBATIM) or k in GENERATED})
    if os.environ.get("ENVBUILD_UPDATE_GOLDEN"):  # plain writes: golden dirs carry no .envbuild-files record
        for rel, data in rendered.items():
            (golden_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (golden_dir / rel).write_bytes(data)
    assert tree(golden_dir) == rendered, f"re-render with ENVBUILD_UPDATE_GOLDEN=1 and review the diff of {golden_dir}"
    for k, v in files.items():
        if k.startswith(VERBATIM + "lib/"):  # the in-image package, copied from envbuild/image/
            assert v == (ROOT / "envbuild" / "image" / k.rsplit("/", 1)[1]).read_bytes()
        elif k == VERBATIM + "lock.txt":  # the stack's lock, from the matrix
            resolution = resolve(matrix, CASES[case])
            assert v == (matrix.directory / "locks" / f"{resolution.stack.id}.{resolution.arch}.txt").read_bytes()
        elif k.startswith(VERBATIM + "lock/"):  # its parts: every block of the lock, each in one part
            continue
        elif k == VERBATIM + "os-lock.txt":  # the stack's OS lock, from the matrix
            resolution = resolve(matrix, CASES[case])
            assert v == (matrix.directory / "locks" / "os" / f"{resolution.stack.id}.{resolution.arch}.txt").read_bytes()
        elif k.startswith(VERBATIM + "steps/os-lock-"):  # a stage's part of it (tests/unit/test_oslock.py)
            continue
        elif k.startswith(VERBATIM) and k not in GENERATED:
            assert v == _source(k).read_bytes()


def _source(build_path: str):
    """What a verbatim file of the build directory is a copy of: a bash step or other file of
    templates/files, or a build-stage script of envbuild/buildsteps."""
    name = build_path.rsplit("/", 1)[1]
    if build_path.startswith(VERBATIM + "steps/") and name in buildsteps.SCRIPTS:
        return buildsteps.path(name)
    return ROOT / "templates" / "files" / build_path[len(VERBATIM):]


# A layer image (`envbuild extend`) is a plan like any other: one stage on the stack image, rendered by the same
# render(). Its lock is what `envbuild extend` resolved for einops and safetensors on the CI stack
# (tests/fixtures/layer, uv against PyPI as of 2026-11-22), so no network is needed here.
LAYER_BASE = "envbuild:torch2.11.0-cu130-py3.11-ds0.19.8-h20@sha256:" + "ab" * 32


def _layer(name="demo") -> Layer:
    text = (ROOT / "tests" / "fixtures" / "layer" / "extend-lock.txt").read_text()
    return Layer(requirements=("einops", "safetensors"), source="requirements.txt",
                     lock=parse_lock(text, EXTEND_LOCK_SOURCE), exclude_newer="2026-11-22T00:00:00Z", name=name)


def test_golden_layer(matrix):
    r = resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi"))
    files = render(layer_plan(r, _layer(), LAYER_BASE))
    golden_dir = GOLDEN / "h20-layer"
    rendered = golden_view({k: v for k, v in files.items() if not k.startswith(VERBATIM) or k.endswith("extend-lock.txt")})
    if os.environ.get("ENVBUILD_UPDATE_GOLDEN"):
        for rel, data in rendered.items():
            (golden_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (golden_dir / rel).write_bytes(data)
    assert tree(golden_dir) == rendered, f"re-render with ENVBUILD_UPDATE_GOLDEN=1 and review the diff of {golden_dir}"
    steps = {k for k in files if k.startswith(VERBATIM + "steps/")}
    assert steps == {f"envbuild/steps/{n}" for n in ("lib.sh", "extend.sh", "import_check.py", "pip_check.py")}
    for k in steps:
        assert files[k] == _source(k).read_bytes()


def test_a_layer_tag_obeys_the_one_tag_rule(matrix):
    """The layer's tag is checked by the rule every tag is: a name that would make it too
    long for Docker (with its content tag) is refused with the numbers, not rendered."""
    r = resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam,cpu_adagrad",
                                cpu_target="x86-64-v4", keep_toolchain=True, env=(("A", "1"),)))
    room = READABLE_TAG_MAX - len(r.tag) - len("-ext-")
    plan = layer_plan(r, _layer("x" * room), LAYER_BASE)
    assert len(plan.tag) == READABLE_TAG_MAX and plan.tag.endswith("-ext-" + "x" * room)
    with pytest.raises(EnvbuildError, match=rf"--name '{'x' * 32}' makes the layer's tag 131 characters .*at most "
                                            rf"115 .*Docker's limit is 128.*nearest valid choice: --name {'x' * room}\."):
        layer_plan(r, _layer("x" * 32), LAYER_BASE)


def test_render_twice_is_byte_identical(cli, tmp_path):
    for d in ("a", "b"):
        r = cli("render", "--gpu", "h20", "-o", str(tmp_path / d))
        assert r.returncode == 0, r.stderr
    a, b = tree(tmp_path / "a"), tree(tmp_path / "b")
    assert a == b and len(a) >= 9
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "a").rglob("*") if p.is_file()}
    assert modes["entrypoint.sh"] == modes["cc-wrapper.sh"] == modes["deepspeed.sh"] == 0o755
    assert modes["Dockerfile"] == modes["env.sh"] == modes["lib.sh"] == 0o644  # sourced, not run


def test_build_dir_has_everything_the_dockerfile_copies(matrix, tmp_path):
    out = write_build_dir(render_files(resolve(matrix, Request(gpu="h20"))), tmp_path / "b")
    dockerfile = (out / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (out / src).is_file() or any((out / src).iterdir()), src


def test_manifest_has_the_required_keys(matrix):
    m = json.loads(render_files(resolve(matrix, Request(gpu="h20")))["manifest.json"])
    for key in ("tag", "python", "cuda", "torch", "deepspeed", "gpu", "torch_cuda_arch_list", "ds_ops", "env",
                "base_images"):
        assert key in m, key
    assert m["env"]["NCCL_P2P_DISABLE"] == "1" and m["env"]["DS_ACCELERATOR"] == "cuda"
    assert m["torch_cuda_arch_list"] == "9.0" and "fused_adam" in m["ds_ops"]


def _env_in_dockerfile(text):
    env = {}
    for block in re.findall(r"^ENV (.*?)(?:\n(?!    )|\Z)", text, re.S | re.M):
        for name, value in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', block):
            env[name] = json.loads(value) if value.startswith('"') else value
    return env


def test_manifest_env_is_exactly_what_the_runtime_stage_sets(matrix):
    files = render_files(resolve(matrix, Request(gpu="h20")))
    runtime = files["Dockerfile"].decode().split("AS runtime", 1)[1]
    assert _env_in_dockerfile(runtime) == json.loads(files["manifest.json"])["env"]


def test_gpu_variants_differ_only_in_the_late_layer(matrix):
    """h20 and h100 share the arch list 9.0: every line up to the per-GPU marker is equal,
    so Docker reuses every heavy layer."""
    h20 = render_files(resolve(matrix, Request(gpu="h20")))["Dockerfile"].decode()
    h100 = render_files(resolve(matrix, Request(gpu="h100")))["Dockerfile"].decode()
    marker = "# ---- "
    instructions = lambda t: [ln for ln in t.split(marker)[0].splitlines() if not ln.startswith("#")]  # noqa: E731
    assert instructions(h20) == instructions(h100)
    assert len(instructions(h20)) > 30
    assert "NCCL_P2P_DISABLE" in h20.split(marker)[1] and "NCCL_P2P_DISABLE" not in h100


def test_ds_build_flags(matrix):
    files = render_files(resolve(matrix, Request(gpu="h20", ds_ops="cpu_adam,fused_adam")))
    d = files["Dockerfile"].decode()
    assert "DS_BUILD_OPS=0" in d and "DS_ACCELERATOR=cuda" in d and "TORCH_CUDA_ARCH_LIST=9.0" in d
    assert "DS_BUILD_CPU_ADAM=1" in d and "DS_BUILD_FUSED_ADAM=1" in d and "DS_BUILD_FUSED_LAMB" not in d
    assert "--no-build-isolation" in files["envbuild/steps/deepspeed.sh"].decode()


def test_singularity_environment_computes_per_job_dir(matrix):
    files = render_files(resolve(matrix, Request(gpu="h20")))
    env_sh = files["envbuild/env.sh"].decode()
    assert "SLURM_JOB_ID" in env_sh and "TORCH_EXTENSIONS_DIR" in env_sh and "$$" in env_sh
    for name in ("Singularity.def", "Singularity.standalone.def"):
        text = files[name].decode()
        assert ". /opt/envbuild/env.sh" in text.split("%environment", 1)[1]
        assert 'NCCL_P2P_DISABLE="${NCCL_P2P_DISABLE:-1}"' in text
        assert "/opt/envbuild/smoke.py" in text.split("%test", 1)[1]
    assert "From: envbuild:torch2.11.0-cu130-py3.12-ds0.19.8-h20" in files["Singularity.def"].decode()
    standalone = files["Singularity.standalone.def"].decode()
    assert standalone.count("Bootstrap: docker") == 2 and "From: nvidia/cuda:13.0.2-devel-ubuntu24.04" in standalone


def test_failed_write_leaves_nothing(matrix, tmp_path, monkeypatch):
    files = render_files(resolve(matrix, Request(gpu="h20")))
    files["zzz/\0bad"] = b"x"  # an impossible file name, written last
    out = tmp_path / "out"
    with pytest.raises(Exception):
        write_build_dir(files, out)
    assert list(tmp_path.iterdir()) == []


def test_never_replaces_a_directory_envbuild_did_not_write(cli, tmp_path):
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    r = cli("render", "--gpu", "h20", "-o", str(precious))
    assert r.returncode == 2 and "refusing to replace it" in r.stderr
    assert [p.name for p in precious.iterdir()] == ["thesis.tex"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis"]


def _smoke_module():
    from envbuild.image import checks

    return checks


@pytest.mark.parametrize("name", ["Singularity.def", "Singularity.standalone.def"])
def test_singularity_environment_passes_the_smoke_env_check(matrix, tmp_path, name):
    """Run %environment the way Apptainer does (sh, host variables present) and feed the
    result to the smoke test's own env check."""
    import subprocess

    files = render_files(resolve(matrix, Request(gpu="h20")))
    env_sh = tmp_path / "env.sh"
    env_sh.write_bytes(files["envbuild/env.sh"])
    text = files[name].decode()
    section = text.split("%environment\n", 1)[1].split("\n%", 1)[0].replace("/opt/envbuild/env.sh", str(env_sh))
    host = {"PATH": "/usr/local/bin:/usr/bin:/bin", "SLURM_JOB_ID": "77", "NCCL_DEBUG": "INFO", "TMPDIR": "/scratch"}
    r = subprocess.run(["sh", "-c", section + "\nenv -0"], env=host, capture_output=True, check=True)
    environ = dict(kv.split("=", 1) for kv in r.stdout.decode().split("\0") if "=" in kv)
    manifest = json.loads(files["manifest.json"])
    ok, detail = _smoke_module().check_env(manifest, environ)
    assert ok, detail
    assert "overridden: NCCL_DEBUG='INFO'" in detail  # the host's value wins, and is reported
    assert environ["NCCL_P2P_DISABLE"] == "1" and environ["PATH"].startswith("/opt/venv/bin:")
    assert environ["TORCH_EXTENSIONS_DIR"] == "/scratch/torch_extensions-77"
    assert environ["TRITON_CACHE_DIR"] == "/scratch/triton-77"
