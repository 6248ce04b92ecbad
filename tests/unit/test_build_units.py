"""Logic of build/smoke/push that needs no engine: tags, progress parsing, retries,
smoke records. The registry and engine paths run for real in test_docker_e2e.py; the engine
boundary itself is in test_engine.py."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from envbuild import buildsteps
from envbuild.builds import build
from envbuild.supply import publish
from envbuild.builds import verdict as smoke
from envbuild.engine import docker as docker_engine
from envbuild.base.errors import EnvbuildError
from envbuild.render.builddir import render_files, write_build_dir
from envbuild.oci.registry import READABLE_TAG_MAX, TAG_RE
from envbuild.resolve.resolver import Request, resolve


def test_content_tag_follows_rendered_inputs(matrix, tmp_path):
    a = write_build_dir(render_files(resolve(matrix, Request(gpu="h20"))), tmp_path / "a")
    b = write_build_dir(render_files(resolve(matrix, Request(gpu="h20"))), tmp_path / "b")
    c = write_build_dir(render_files(resolve(matrix, Request(gpu="h20", env=(("X", "1"),)))), tmp_path / "c")
    (b / build.LOG_NAME).write_text("a log does not change the content")
    (b / "train.py").write_text("nor does the user's own file beside the rendered ones")
    (b / "image.sif").write_bytes(b"nor an image built there")
    ta, tb, tc = (build.content_tag("t", d) for d in (a, b, c))
    assert ta == tb != tc and ta.startswith("t-") and len(ta) == 2 + 12
    (b / "Dockerfile").write_text((b / "Dockerfile").read_text() + "# edited\n")
    assert build.content_tag("t", b) != ta  # an edited rendered file does


def test_every_tag_is_a_valid_docker_tag(matrix):
    for s in matrix.stacks:
        for g in matrix.gpus:
            try:
                r = resolve(matrix, Request(gpu=g.name, stack=s.id, ds_ops="cpu_adam", cpu_target="x86-64-v4",
                                            keep_toolchain=True))
            except EnvbuildError:
                continue
            assert TAG_RE.match(r.tag) and len(r.tag) <= READABLE_TAG_MAX == 128 - 13, r.tag


LOG = """#5 [builder 3/7] RUN bash /opt/envbuild-setup/setup.sh venv /usr/bin/python3.11
#5 DONE 4.2s
#6 [builder 4/7] RUN bash /opt/envbuild-setup/setup.sh deepspeed deepspeed==0.19.8 cpu_adam
#6 1.0 Collecting deepspeed==0.19.8
#6 55.2 error: command '/usr/bin/g++' failed with exit code 1
#6 ERROR: executor failed running [/bin/bash -o pipefail -c bash /opt/envbuild-setup/setup.sh deepspeed]
"""


def test_progress_names_the_failing_step_and_its_last_lines():
    events = []
    p = docker_engine.BuildkitProgress(lambda e, n: events.append((e, n)))
    for line in LOG.splitlines():
        p.feed(line)
    step, lines = p.failure([])
    assert "setup.sh deepspeed" in step and "[builder 4/7]" in step
    assert any("g++' failed" in ln for ln in lines)
    assert p.steps == [("[builder 3/7] RUN bash /opt/envbuild-setup/setup.sh venv /usr/bin/python3.11", 4.2)]
    assert ("error", step) in events


# A COPY --from that fails prints no output of its own: its reason is on the ERROR line and in
# BuildKit's summary. Docker 20.10's own words (this machine, a COPY of a path the stage lacks):
COPY_NOT_FOUND = """#6 [stage-1 2/2] COPY --from=builder /opt/venv /opt/venv
#6 sha256:bab1e7bd585387d29c7a79e0f1427de9ec74fa47ae75d4e0bd533de1a8a74fbb
#6 ERROR: "/opt/venv" not found: not found
------
 > [stage-1 2/2] COPY --from=builder /opt/venv /opt/venv:
------
failed to compute cache key: "/opt/venv" not found: not found
"""
# A full disk in the same step, as a public CI log shows it (omec-project/upf#49,
# https://github.com/omec-project/upf/pull/49, its first log):
COPY_NO_SPACE = """#29 [cpiface 3/5] COPY --from=cpiface-build /opt/grpc/libs/opt /opt/grpc/libs/opt
#29 ERROR: failed to copy files: userspace copy failed: write /var/lib/docker/overlay2/c6480ij2vovmd28msmoo9b747/merged/opt/grpc/libs/opt/libgrpc_cronet.a: no space left on device
------
 > [cpiface 3/5] COPY --from=cpiface-build /opt/grpc/libs/opt /opt/grpc/libs/opt:
------
failed to solve with frontend dockerfile.v0: failed to build LLB: failed to copy files: userspace copy failed: write /var/lib/docker/overlay2/c6480ij2vovmd28msmoo9b747/merged/opt/grpc/libs/opt/libgrpc_cronet.a: no space left on device
"""


@pytest.mark.parametrize("log, reason, hint", [
    (COPY_NOT_FOUND, '"/opt/venv" not found', ""),
    (COPY_NO_SPACE, "no space left on device", "disk is full"),
    (LOG, "executor failed running", ""),
], ids=["copy-not-found", "copy-no-space", "run-failed"])
def test_a_failed_step_says_the_engines_reason_not_only_its_last_output(log, reason, hint):
    """CI once said only `#36 sha256:...` for a failed COPY of the venv: the reason on the ERROR
    line was dropped. The failing step's lines end with it, and a full disk says so."""
    p = docker_engine.BuildkitProgress(None)
    tail = log.splitlines()
    for line in tail:
        p.feed(line)
    step, lines = p.failure(tail)
    assert "COPY --from" in step or "deepspeed" in step
    assert any(reason in ln for ln in lines), lines
    assert (hint in docker_engine.failure_hint(tail)) if hint else docker_engine.failure_hint(tail) == ""


def test_secrets_go_to_private_files_not_the_command_line(tmp_path):
    s = build.BuildSecrets(pip_index_url="https://u:tok@mirror/simple", apt_mirror="http://m")
    args = docker_engine.secret_args(s, tmp_path)
    assert "tok" not in " ".join(args)
    assert (tmp_path / "pip_index_url").read_text().strip() == "https://u:tok@mirror/simple"
    assert (tmp_path / "pip_index_url").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("msg, kind", [
    ("received unexpected HTTP status: 503 Service Unavailable", "transient"),
    ("read tcp 127.0.0.1:5000: connection reset by peer", "transient"),
    ("unauthorized: authentication required", "auth"),
    ("no basic auth credentials", "auth"),
    ("manifest invalid", "fatal"),
    ("blob unknown: sha256:401abc403def", "fatal"),  # status codes inside a digest are not statuses
])
def test_classify(msg, kind):
    assert publish.classify(msg) == kind


def test_retries_transient_then_succeeds():
    # A fake push (no registry): fails twice with a transient error, then succeeds.
    calls, sleeps = [], []

    def action():
        calls.append(1)
        if len(calls) < 3:
            raise publish.RegistryError("502 Bad Gateway", "r:5000")
        return "sha256:abc"

    assert publish.with_retries(action, "push", sleep=sleeps.append) == ("sha256:abc", 3)
    assert sleeps == [2.0, 4.0]


def test_auth_error_is_not_retried():
    calls = []

    def action():
        calls.append(1)
        raise publish.RegistryError("unauthorized: authentication required", "r:5000")

    with pytest.raises(EnvbuildError, match="docker login r:5000"):
        publish.with_retries(action, "push", sleep=lambda s: None)
    assert len(calls) == 1


def test_repo_of():
    assert publish.repo_of("localhost:5000/envbuild:t1") == "localhost:5000/envbuild"
    assert publish.repo_of("envbuild:t1") == "envbuild"
    assert publish.repo_of("a/b@sha256:00") == "a/b"


def test_push_needs_a_passing_smoke_record(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVBUILD_STATE_DIR", str(tmp_path))
    with pytest.raises(EnvbuildError, match="no smoke test has been recorded"):
        smoke.require_passed("sha256:" + "a" * 64, "img")
    p = smoke.record_path("sha256:" + "a" * 64)
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"ok": False, "checks": [{"name": "no_jit", "ok": False}]}))
    with pytest.raises(EnvbuildError, match=r"smoke test failed \(no_jit"):
        smoke.require_passed("sha256:" + "a" * 64, "img")
    p.write_text(json.dumps({"ok": True, "checks": []}))
    assert smoke.require_passed("sha256:" + "a" * 64, "img")["ok"]


def test_last_json_reads_an_indented_report_after_other_output():
    text = 'Setting ds_accelerator to cuda\n{\n  "ok": true,\n  "checks": [{"name": "x"}]\n}\n'
    assert smoke._last_json(text) == {"ok": True, "checks": [{"name": "x"}]}
    with pytest.raises(ValueError):
        smoke._last_json("no json here")


def test_verify_ops_reads_the_record_without_importing_deepspeed(tmp_path):
    """A stand-in deepspeed package (DeepSpeed is not installed on the host; the real one is
    checked inside the image by test_docker_e2e): its __init__ raises, as DeepSpeed < 0.17.5
    does with DS_ACCELERATOR=cuda and no GPU driver, so only a file read can pass."""
    import subprocess
    import sys

    pkg = tmp_path / "deepspeed"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('no driver')\n")
    (pkg / "git_version_info_installed.py").write_text(
        "installed_ops = {'cpu_adam': 1, 'fused_adam': 0}\naccelerator_name = 'cuda'\n")
    script = buildsteps.path("verify_ops.py")
    run = lambda *ops: subprocess.run([sys.executable, str(script), *ops], capture_output=True, text=True,  # noqa: E731
                                      env={"PYTHONPATH": str(tmp_path)})
    assert run("cpu_adam").returncode == 0
    r = run("cpu_adam", "fused_adam")
    assert r.returncode == 1 and "ops not pre-built: fused_adam" in r.stderr
    (pkg / "git_version_info_installed.py").write_text("installed_ops = {'cpu_adam': 1}\naccelerator_name = 'cpu'\n")
    r = run("cpu_adam")
    assert r.returncode == 1 and "recorded as 'cpu'" in r.stderr


def test_registry_api_calls_go_to_the_host_root_when_registry_has_a_namespace():
    """--registry ghcr.io/acme: the API is at https://ghcr.io/v2/acme/envbuild/..., not under
    /acme/v2/ (a real HTTP server on 127.0.0.1 records the paths asked for)."""
    import http.server
    import threading

    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        registry = f"127.0.0.1:{server.server_port}/acme"
        publish.check_reachable(registry, timeout=5)
        assert publish.remote_manifest(registry, "acme/envbuild", "t1") is None
    finally:
        server.shutdown()
    assert "/v2/" in asked and "/v2/acme/envbuild/manifests/t1" in asked
    assert not any(p.startswith("/acme/") for p in asked)


def _stub(bin_dir, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("status, purged", [("installed", "--purge --force-hold libnccl2 libnccl-dev"),
                                            ("not-installed", None)])
def test_os_drop_purges_only_the_installed_matches(tmp_path, status, purged):
    """--keep-toolchain: the kept nvidia/cuda devel base's libnccl2 goes (a held package: the
    hold is forced), and a base without it is left alone; dpkg is a stand-in recording its argv
    (no Debian package database to purge from here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "dpkg-query", f"printf 'libnccl2\\t{status}\\nlibnccl-dev\\t{status}\\n'\n")
    _stub(bin_dir, "dpkg", f'echo "$@" > {tmp_path}/dpkg.argv\n')
    script = ROOT / "templates" / "files" / "steps" / "os-drop.sh"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(script), "libnccl2", "libnccl-dev"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    argv = tmp_path / "dpkg.argv"
    assert (argv.read_text().strip() if argv.exists() else None) == purged
    assert ("purged the base image's libnccl2 libnccl-dev" in r.stderr) is (purged is not None)


@pytest.mark.parametrize("name", ["pip_check.py", "requires.py", "sass_audit.py"])
def test_the_build_stage_scripts_examples_hold(name):
    """Their doctests, which pytest does not collect (the package holds scripts that run at import)."""
    import doctest

    from conftest import build_step

    module = build_step(name)
    assert doctest.testmod(module).attempted > 0 and doctest.testmod(module).failed == 0


def test_a_step_run_outside_a_build_restamps_nothing_of_this_machine(tmp_path):
    """lib.sh's EXIT trap stamps SOURCE_DATE_EPOCH (1980) on what a step wrote by walking / in the
    build container. Sourced anywhere else (the tests run steps on this machine) it walked the
    machine's filesystem and stamped files other processes were writing meanwhile: a concurrent
    `envbuild export` then made another .sqsh (CI's test_export_is_reproducible failed so)."""
    from envbuild.image import paths

    lib = ROOT / "templates" / "files" / "steps" / "lib.sh"
    assert f"[[ $STEPS_DIR == {paths.SETUP_DIR} ]]" in lib.read_text()  # the build's setup directory, as paths says
    witness = tmp_path / "written-meanwhile"
    r = subprocess.run(["bash", "-c", f'. "{lib}"; echo data > "{witness}"'], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert witness.stat().st_mtime > 315532800 + 86400, "a step outside a build restamped a file of this machine"


def _recording_stub(bin_dir: Path, name: str, body: str = "") -> Path:
    """A stand-in that records its argv (one word a line) and its environment, then runs `body`."""
    _stub(bin_dir, name, f'printf "%s\\n" "$@" > "$0.argv"\nenv > "$0.env"\n{body}')
    return bin_dir / name


@pytest.mark.parametrize("index", ["-", "https://download.pytorch.org/whl/cu130"])
def test_the_torch_step_installs_its_lock_part_with_uv_and_none_of_the_machines_uv_settings(tmp_path, index):
    """torch.sh with ENVBUILD_UV runs `uv pip install` into the venv: --require-hashes --no-deps
    from the lock part, no uv.toml (--no-config, UV_NO_CONFIG) and no UV_* variable of the
    machine (UV_INDEX_URL would add an index, UV_CONSTRAINT is the image's guard), the CA bundle,
    byte-compiled, copied, and PyTorch's index searched before PyPI as `envbuild lock` resolved
    it. A failure is reported as a lock failure. uv is a stand-in recording its argv."""
    bin_dir, secrets = tmp_path / "bin", tmp_path / "secrets"
    bin_dir.mkdir(), secrets.mkdir()
    (secrets / "ca_cert").write_text("-----BEGIN CERTIFICATE-----\n")
    uv = _recording_stub(bin_dir, "uv", 'exit "${FAIL:-0}"\n')
    env = {**os.environ, "ENVBUILD_UV": str(uv), "VIRTUAL_ENV": str(tmp_path / "venv"), "ENVBUILD_SECRETS_DIR": str(secrets),
           "UV_INDEX_URL": "https://evil.example/simple", "UV_CONSTRAINT": "/etc/pip/constraint.txt"}
    script = ROOT / "templates" / "files" / "steps" / "torch.sh"
    args = ["--require-hashes", "--no-deps", "-r", "/opt/envbuild-setup/lock/venv.txt"]
    r = subprocess.run(["bash", str(script), index, *args], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = (bin_dir / "uv.argv").read_text().splitlines()
    indexes = ["--index-url", "https://pypi.org/simple", *(["--extra-index-url", index] if index != "-" else [])]
    assert argv[:4] == ["pip", "install", "--no-config", "--no-cache"] and argv[-len(args):] == args
    assert argv[4] == "--cert" and argv[6:] == ["--link-mode", "copy", "--python", f"{tmp_path}/venv/bin/python",
                                                 "--compile-bytecode", *indexes, *args]
    seen = (bin_dir / "uv.env").read_text()
    assert "UV_NO_CONFIG=1" in seen and "UV_INDEX_URL" not in seen and "UV_CONSTRAINT" not in seen
    failed = subprocess.run(["bash", str(script), index, *args], env={**env, "FAIL": "1"}, capture_output=True, text=True,
                            timeout=60)
    assert failed.returncode != 0 and "the install from the stack's lock failed" in failed.stderr


def test_the_uv_step_installs_the_pinned_uv_by_hash_outside_the_venv_and_checks_its_version(tmp_path):
    """uv.sh: the venv's pip installs the matrix's uv by its hashes (--require-hashes --no-deps,
    wheels only) into the prefix, reading no pip configuration file; a uv that says another version
    fails the step. pip is a stand-in that writes the uv it was asked for."""
    venv_bin, prefix = tmp_path / "venv" / "bin", tmp_path / "uv"
    venv_bin.mkdir(parents=True)
    pip = _recording_stub(venv_bin, "pip", f'mkdir -p {prefix}/bin && printf \'#!/bin/sh\\necho "uv $VERSION (x86_64)"\\n\' '
                                          f"> {prefix}/bin/uv && chmod +x {prefix}/bin/uv\n")
    part = tmp_path / "uv.txt"
    part.write_text("uv==0.13.9 --hash=sha256:" + "a" * 64 + "\n")
    env = {**os.environ, "VIRTUAL_ENV": str(tmp_path / "venv"), "ENVBUILD_SECRETS_DIR": str(tmp_path / "none")}
    script = ROOT / "templates" / "files" / "steps" / "uv.sh"
    r = subprocess.run(["bash", str(script), str(prefix), str(part)], env={**env, "VERSION": "0.13.9"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "installer: uv 0.13.9" in r.stderr, r.stderr
    assert (venv_bin / "pip.argv").read_text().splitlines() == [
        "install", "--require-hashes", "--no-deps", "--only-binary", ":all:", "--no-compile", "--target", str(prefix),
        "-r", str(part)]
    assert "PIP_CONFIG_FILE=/dev/null" in (venv_bin / "pip.env").read_text() and pip.exists()
    r = subprocess.run(["bash", str(script), str(prefix), str(part)], env={**env, "VERSION": "0.14.0"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "the matrix pins uv 0.13.9" in r.stderr
