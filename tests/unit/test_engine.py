"""The engine boundary: build, smoke and push talk to an Engine only, and DockerEngine is one.

No Docker engine runs in the fast suite (the real one is driven by test_docker_e2e.py, with
the same code). Here:
- build.py, smoke.py and publish.py run against an in-memory engine (FakeEngine, below) that
  records every call, so their policy is tested: tags only after success, smoke records keyed
  by image ID, untag after a failed push, pull-back by digest compared with the tested image;
- DockerEngine's build runs a stand-in `docker` CLI script that speaks BuildKit's plain
  progress (the lines of a real build log) and writes the iidfile, as `docker build` does;
- DockerEngine's SDK calls run against a stand-in client with the docker SDK's method names.
A killed envbuild cancelling its build is tests/process/test_engine_killed.py.
"""

from __future__ import annotations

import contextlib
import io
import socket
import os
import json
import sys
from pathlib import Path

import docker.errors
import pytest

from envbuild.builds import build

from envbuild.supply import publish
from envbuild.render.output import write_build_dir
from envbuild.builds import verdict as smoke
from envbuild.engine import (BuildFailed, BuildOutcome, BuildSecrets, Engine, ImageConfig, ImageInfo, RegistryError, RunResult,
                             get_engine, registry_of)
from envbuild.engine.docker import DockerEngine
from envbuild.base.errors import EnvbuildError
from envbuild.image import paths

IMAGE_ID = "sha256:" + "1f" * 32


class FakeEngine:
    """An in-memory engine: images by ref, scripted results, every call recorded."""

    name = "fake"

    def __init__(self, images=None, run_result=None, push_digests=None, build_error=None, pulled_id=IMAGE_ID):
        self.images = dict(images or {})           # ref -> ImageInfo
        self.run_result = run_result
        self.push_digests = push_digests or {}     # ref -> digest or RegistryError
        self.build_error = build_error
        self.pulled_id = pulled_id
        self.calls: list[tuple] = []

    def check_usable(self):
        pass  # always usable: the images live in this object

    def build(self, context, tags, secrets, log_path, on_step=None, extra_args=()):
        self.calls.append(("build", str(context), list(tags)))
        Path(log_path).write_text("log\n")
        if self.build_error:
            raise self.build_error
        self.calls.extend(("tag", IMAGE_ID, t) for t in tags)
        return BuildOutcome(IMAGE_ID, [("[builder 1/2] RUN x", 1.5)])

    def inspect(self, ref):
        self.calls.append(("inspect", ref))
        if ref not in self.images:
            raise EnvbuildError(f"image '{ref}' does not exist locally")
        return self.images[ref]

    def run(self, image, argv, *, timeout, gpus=None, network="none", env=None, entrypoint=None, mounts=None,
            rdma=False, platform=None):
        self.calls.append(("run", image, list(argv), dict(timeout=timeout, gpus=gpus, network=network,
                                                           entrypoint=list(entrypoint or []), env=dict(env or {}),
                                                           **({"mounts": dict(mounts)} if mounts else {}),
                                                           **({"rdma": True} if rdma else {}))))
        self.mounted = {host: sorted(p.name for p in __import__("pathlib").Path(host).rglob("*"))
                        for host in (mounts or {})}
        return self.run_result

    def tag(self, image, ref):
        self.calls.append(("tag", image, ref))

    def untag(self, ref):
        self.calls.append(("untag", ref))

    def push(self, ref):
        self.calls.append(("push", ref))
        result = self.push_digests[ref]
        if isinstance(result, Exception):
            raise result
        return result

    def pull(self, ref):
        self.calls.append(("pull", ref))
        return self.pulled_id

    def config(self, ref):
        self.calls.append(("config", ref))
        return ImageConfig(self.inspect(ref).id, (), (), (), (), "", "", ())

    def export(self, ref):
        self.calls.append(("export", ref))
        return contextlib.nullcontext(io.BytesIO())

    def read_file(self, ref, path, limit):
        self.calls.append(("read_file", ref, path))
        return None

    def names(self):
        return [c[0] for c in self.calls]


def test_both_engines_satisfy_the_interface():
    assert isinstance(FakeEngine(), Engine) and isinstance(DockerEngine(client=object()), Engine)
    assert isinstance(get_engine("docker"), DockerEngine)


def test_unknown_engine_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ENVBUILD_ENGINE", "dokcer")
    with pytest.raises(EnvbuildError, match=r"unknown container engine 'dokcer' \(from ENVBUILD_ENGINE\); "
                                            r"did you mean docker\? envbuild knows: docker"):
        get_engine()


@pytest.mark.parametrize("ref, registry", [("127.0.0.1:5000/envbuild:t", "127.0.0.1:5000"),
                                           ("reg.example.org/team/envbuild@sha256:ab", "reg.example.org"),
                                           ("localhost/x:y", "localhost"), ("envbuild:t", "docker.io"),
                                           ("team/envbuild:t", "docker.io")])
def test_registry_of(ref, registry):
    assert registry_of(ref) == registry


# --------------------------------------------------------------------------- build.py over an engine
def test_build_tags_readable_and_content_tag_after_success(tmp_path):
    write_build_dir({"Dockerfile": b"FROM scratch\n"}, tmp_path)  # a rendered dir: with its record
    engine = FakeEngine()
    res = build.build_image(tmp_path, "t1", "repo", BuildSecrets(), engine=engine)
    content = build.content_tag("t1", tmp_path)
    assert res.tags == ["repo:t1", f"repo:{content}"] and res.image_id == IMAGE_ID
    assert engine.calls[0] == ("build", str(tmp_path), ["repo:t1", f"repo:{content}"])
    assert res.log == tmp_path / build.LOG_NAME and res.steps == [("[builder 1/2] RUN x", 1.5)]


def test_build_failure_is_worded_by_build_py_and_tags_nothing(tmp_path):
    engine = FakeEngine(build_error=BuildFailed("[builder 4/7] RUN setup.sh deepspeed", ["g++ failed", "exit 1"],
                                                " Is dockerd running?"))
    write_build_dir({"Dockerfile": b"FROM scratch\n"}, tmp_path)
    with pytest.raises(EnvbuildError) as info:
        build.build_image(tmp_path, "t1", "repo", BuildSecrets(), engine=engine)
    assert info.value.exit_code == 1
    assert info.value.message == ("image build failed at step [builder 4/7] RUN setup.sh deepspeed. Is dockerd "
                                  "running? Last lines:\n    g++ failed\n    exit 1\n"
                                  f"Full log: {tmp_path / build.LOG_NAME}. No tag was applied.")
    assert "tag" not in engine.names()


# --------------------------------------------------------------------------- smoke.py over an engine
REPORT = {"ok": True, "mode": "gpu", "checks": [
    {"name": "versions", "ok": True, "detail": "torch 2.11.0", "seconds": 1.0},
    {"name": "driver", "ok": True, "detail": "driver 580.82.07 >= 580.65.06 (CUDA 13.0)", "seconds": 0.0,
     "data": {"driver": "580.82.07"}},
    {"name": "p2p", "ok": True, "skipped": True, "detail": "skipped: P2P needs two or more GPUs", "seconds": 0.0}]}


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVBUILD_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def smoke_engine(stdout, code=0, stderr="", timed_out=False):
    return FakeEngine(images={"img:t": ImageInfo(IMAGE_ID, ["img:t"])},
                      run_result=RunResult(None if timed_out else code, stdout, stderr, timed_out))


def test_smoke_runs_the_tested_id_and_records_the_verdict(state):
    engine = smoke_engine("Setting ds_accelerator to cuda\n" + json.dumps(REPORT, indent=2) + "\n")
    rep = smoke.run_smoke("img:t", gpus="all", timeout=99, engine=engine)
    assert rep.ok and rep.mode == "gpu" and rep.image_id == IMAGE_ID and [c["name"] for c in rep.checks] == \
        ["versions", "driver", "p2p"]
    (_, image, argv, opts), = [c for c in engine.calls if c[0] == "run"]
    assert image == IMAGE_ID and argv == [paths.VENV_PYTHON, paths.SMOKE, "--json"]
    assert opts == {"timeout": 99, "gpus": "all", "network": "none", "entrypoint": [paths.ENTRYPOINT],
                    "env": {}}
    record = json.loads(smoke.record_path(IMAGE_ID).read_text())
    assert record["ok"] and record["image_id"] == IMAGE_ID and record["checks"][1]["data"] == {"driver": "580.82.07"}
    assert smoke.require_passed(IMAGE_ID, "img:t")["ok"]


def test_smoke_table_marks_skipped_checks():
    rep = smoke.SmokeReport("img:t", IMAGE_ID, True, "gpu", REPORT["checks"], 1.0, REPORT)
    assert smoke.table_rows(rep) == [("versions", "ok", "1.0s", "torch 2.11.0"),
                                     ("driver", "ok", "0.0s", "driver 580.82.07 >= 580.65.06 (CUDA 13.0)"),
                                     ("p2p", "skip", "0.0s", "skipped: P2P needs two or more GPUs")]


def test_smoke_nonzero_exit_is_a_failure_even_with_an_ok_report(state):
    rep = smoke.run_smoke("img:t", engine=smoke_engine(json.dumps(REPORT), code=1))
    assert not rep.ok and not json.loads(smoke.record_path(IMAGE_ID).read_text())["ok"]


def test_smoke_timeout_and_missing_report_are_clear_errors(state):
    with pytest.raises(EnvbuildError, match="did not finish in 5 s; the container was killed"):
        smoke.run_smoke("img:t", timeout=5, engine=smoke_engine("", timed_out=True))
    with pytest.raises(EnvbuildError, match=r"printed no result \(exit 127\); is /opt/envbuild/smoke.py in the "
                                            r"image\? Last output: exec: python: not found"):
        smoke.run_smoke("img:t", engine=smoke_engine("", code=127, stderr="exec: python: not found"))
    assert not smoke.record_path(IMAGE_ID).exists()
    with pytest.raises(EnvbuildError, match="does not exist locally"):
        smoke.run_smoke("other:t", engine=smoke_engine("{}"))


def test_cli_smoke_table_shows_the_new_checks(state, monkeypatch):
    from click.testing import CliRunner

    from envbuild.cli import main

    monkeypatch.setattr(smoke, "get_engine", lambda: smoke_engine(json.dumps(REPORT)))
    result = CliRunner().invoke(main, ["smoke", "img:t"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("driver" in ln and "580.82.07 >= 580.65.06" in ln for ln in lines)
    assert any("p2p" in ln and " skip " in ln for ln in lines)
    assert "PASSED" in result.output


# --------------------------------------------------------------------------- publish.py over an engine
REG = "127.0.0.1:5000"
DIGEST = "sha256:" + "d1" * 32


@pytest.fixture
def passed(state):
    p = smoke.record_path(IMAGE_ID)
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"ok": True, "checks": []}))


def push_engine(**kw):
    tags = ["envbuild:t1", "envbuild:t1-0123456789ab", "other:x"]
    digests = {f"{REG}/envbuild:t1": DIGEST, f"{REG}/envbuild:t1-0123456789ab": DIGEST}
    return FakeEngine(images={"envbuild:t1": ImageInfo(IMAGE_ID, tags)}, push_digests={**digests, **kw})


@pytest.fixture
def registry(monkeypatch):
    """The registry's HTTP API (not the engine): reachable, serving the tested image's config."""
    served = {"config": IMAGE_ID}
    monkeypatch.setattr(publish, "check_reachable", lambda registry: None)
    monkeypatch.setattr(publish, "remote_manifest",
                        lambda registry, name, ref: None if ref.endswith("0123456789ab") and not ref.startswith("sha")
                        else (DIGEST, {"config": {"digest": served["config"]}}))
    return served


def test_push_both_tags_then_pull_back_by_digest(passed, registry):
    engine = push_engine()
    res = publish.push("envbuild:t1", REG, engine=engine)
    assert res.refs == [f"{REG}/envbuild:t1", f"{REG}/envbuild:t1-0123456789ab"] and res.digest == DIGEST
    assert [c for c in engine.calls if c[0] in ("tag", "push", "pull")] == [
        ("tag", IMAGE_ID, f"{REG}/envbuild:t1"), ("push", f"{REG}/envbuild:t1"),
        ("tag", IMAGE_ID, f"{REG}/envbuild:t1-0123456789ab"), ("push", f"{REG}/envbuild:t1-0123456789ab"),
        ("pull", f"{REG}/envbuild@{DIGEST}")]
    assert res.attempts == 3


def test_push_refuses_an_image_without_a_passing_record(state, registry):
    engine = push_engine()
    with pytest.raises(EnvbuildError, match="no smoke test has been recorded"):
        publish.push("envbuild:t1", REG, engine=engine)
    assert engine.names() == ["inspect"]


def test_failed_push_leaves_no_tag(passed, registry):
    engine = push_engine(**{f"{REG}/envbuild:t1": RegistryError("manifest invalid", REG)})
    with pytest.raises(EnvbuildError, match="push of 127.0.0.1:5000/envbuild:t1 failed after 1 attempt"):
        publish.push("envbuild:t1", REG, engine=engine)
    assert engine.calls[-1] == ("untag", f"{REG}/envbuild:t1") and "pull" not in engine.names()


def test_refused_authentication_names_the_registry(passed, registry):
    engine = push_engine(**{f"{REG}/envbuild:t1": RegistryError("unauthorized: authentication required", REG)})
    with pytest.raises(EnvbuildError, match=r"docker login 127\.0\.0\.1:5000"):
        publish.push("envbuild:t1", REG, engine=engine)


def test_pulled_back_bits_must_be_the_tested_ones(passed, registry):
    engine = push_engine()
    engine.pulled_id = "sha256:" + "ee" * 32
    with pytest.raises(EnvbuildError, match="not the tested sha256:1f1f1f1f1f1f"):
        publish.push("envbuild:t1", REG, engine=engine)
    registry["config"] = "sha256:" + "ee" * 32
    with pytest.raises(EnvbuildError, match="registry serves image sha256:eeeeeeeeeeee"):
        publish.push("envbuild:t1", REG, engine=push_engine())


def test_two_tags_with_different_digests_are_refused(passed, registry):
    engine = push_engine(**{f"{REG}/envbuild:t1-0123456789ab": "sha256:" + "99" * 32})
    with pytest.raises(EnvbuildError, match="got different digests"):
        publish.push("envbuild:t1", REG, engine=engine)


def test_content_tag_is_never_moved(passed, monkeypatch):
    monkeypatch.setattr(publish, "check_reachable", lambda registry: None)
    monkeypatch.setattr(publish, "remote_manifest", lambda *a: (DIGEST, {"config": {"digest": "sha256:" + "ab" * 32}}))
    engine = push_engine()
    with pytest.raises(EnvbuildError, match="content tags are immutable"):
        publish.push("envbuild:t1", REG, engine=engine)
    assert ("tag", IMAGE_ID, f"{REG}/envbuild:t1-0123456789ab") not in engine.calls


# --------------------------------------------------------------------------- DockerEngine: the build CLI
SUCCESS_LOG = """#1 [internal] load build definition from Dockerfile
#1 transferring dockerfile: 3.21kB done
#1 DONE 0.0s
#5 [builder 3/7] RUN bash /opt/envbuild-setup/setup.sh venv /usr/bin/python3.11
#5 DONE 4.2s
#6 [runtime 5/6] COPY envbuild/env.sh envbuild/entrypoint.sh envbuild/smoke.py /opt/envbuild/
#6 CACHED
#9 exporting to image
#9 writing image sha256:1f1f done
#9 DONE 0.1s
"""
FAIL_LOG = """#6 [builder 4/7] RUN bash /opt/envbuild-setup/setup.sh deepspeed deepspeed==0.19.8 cpu_adam
#6 1.0 Collecting deepspeed==0.19.8
#6 55.2 error: command '/usr/bin/g++' failed with exit code 1
#6 ERROR: executor failed running [/bin/bash -o pipefail -c bash /opt/envbuild-setup/setup.sh deepspeed]
"""
FAKE_DOCKER = r'''#!{python}
"""Stand-in docker CLI: records each call, answers `build` like BuildKit's plain progress."""
import json, os, sys
args = sys.argv[1:]
call = {{"argv": args, "DOCKER_BUILDKIT": os.environ.get("DOCKER_BUILDKIT")}}
if args[0] == "build":
    call["secret_files"] = {{s.split(",")[0][3:]: open(s.split("src=")[1]).read()
                            for s in args[args.index("build"):] if s.startswith("id=")}}
with open(os.environ["FAKE_DOCKER_CALLS"], "a") as f:
    f.write(json.dumps(call) + "\n")
mode = os.environ.get("FAKE_DOCKER_MODE", "ok")
if args[0] == "build" and mode == "hang":  # a long RUN step; SIGINT cancels it, as the real CLI does
    import signal, time
    def cancelled(signum, frame):  # written, then renamed: the marker appears whole, never empty
        marker = os.environ["FAKE_DOCKER_CALLS"] + ".cancelled"
        with open(marker + ".tmp", "w") as f:
            f.write(str(signum))
        os.rename(marker + ".tmp", marker)
        sys.exit(130)
    signal.signal(signal.SIGINT, cancelled)
    print("#5 [builder 16/20] RUN bash /opt/envbuild-setup/setup.sh extensions", flush=True)
    time.sleep(120)
    sys.exit(0)
if args[0] == "build":
    if mode == "daemon-down":
        print("ERROR: Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?")
        sys.exit(1)
    sys.stdout.write({fail!r} if mode == "fail" else {success!r})
    if mode == "fail":
        sys.exit(1)
    open(args[args.index("--iidfile") + 1], "w").write("{iid}\n")
elif args[0] == "tag" and mode == "tag-fails":
    print("Error response from daemon: invalid reference format", file=sys.stderr)
    sys.exit(1)
'''


@pytest.fixture
def fake_cli(tmp_path, monkeypatch):
    cli = tmp_path / "docker"
    cli.write_text(FAKE_DOCKER.format(python=sys.executable, success=SUCCESS_LOG, fail=FAIL_LOG, iid=IMAGE_ID))
    cli.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_DOCKER_CALLS", str(calls))
    monkeypatch.delenv("ENVBUILD_DOCKER_BUILD_ARGS", raising=False)

    def read():
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return cli, read


def test_docker_build_then_tags_with_secrets_as_files(tmp_path, fake_cli, monkeypatch):
    cli, calls = fake_cli
    monkeypatch.setenv("ENVBUILD_DOCKER_BUILD_ARGS", "--no-cache --pull")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    events = []
    secrets = BuildSecrets(pip_index_url="https://u:tok123@mirror/simple", ca_cert=None)
    outcome = DockerEngine(cli=str(cli)).build(ctx, ["r:a", "r:b"], secrets, tmp_path / "build.log",
                                               on_step=lambda e, n: events.append((e, n)), extra_args=("--label", "x=1"))
    assert outcome == BuildOutcome(IMAGE_ID, [("[internal] load build definition from Dockerfile", 0.0),
                                              ("[builder 3/7] RUN bash /opt/envbuild-setup/setup.sh venv "
                                               "/usr/bin/python3.11", 4.2)])
    build_call, tag_a, tag_b = calls()
    argv = build_call["argv"]
    assert argv[:5] == ["build", "--network", "host", "--progress", "plain"] and argv[-1] == str(ctx)
    assert argv[-5:-1] == ["--no-cache", "--pull", "--label", "x=1"] and build_call["DOCKER_BUILDKIT"] == "1"
    assert "tok123" not in " ".join(argv)
    assert build_call["secret_files"] == {"pip_index_url": "https://u:tok123@mirror/simple\n"}
    assert [tag_a["argv"], tag_b["argv"]] == [["tag", IMAGE_ID, "r:a"], ["tag", IMAGE_ID, "r:b"]]
    log = (tmp_path / "build.log").read_text()
    assert log.startswith(f"$ {cli} build") and "#5 DONE 4.2s" in log
    assert ("start", "[runtime 5/6] COPY envbuild/env.sh envbuild/entrypoint.sh envbuild/smoke.py /opt/envbuild/") \
        in events and events.count(("done", "[builder 3/7] RUN bash /opt/envbuild-setup/setup.sh venv "
                                            "/usr/bin/python3.11")) == 1
    assert ("cached", "[runtime 5/6] COPY envbuild/env.sh envbuild/entrypoint.sh envbuild/smoke.py /opt/envbuild/") \
        in events


def test_docker_build_failure_names_the_step_and_tags_nothing(tmp_path, fake_cli, monkeypatch):
    cli, calls = fake_cli
    monkeypatch.setenv("FAKE_DOCKER_MODE", "fail")
    with pytest.raises(BuildFailed) as info:
        DockerEngine(cli=str(cli)).build(tmp_path, ["r:a"], BuildSecrets(), tmp_path / "build.log")
    assert "setup.sh deepspeed" in info.value.step and info.value.hint == ""
    assert any("g++' failed" in line for line in info.value.lines)
    assert [c["argv"][0] for c in calls()] == ["build"]


BUILD_RUNNER = """
import signal, sys
from pathlib import Path
from envbuild.console import _terminated
from envbuild.engine import BuildSecrets
from envbuild.engine.docker import DockerEngine
signal.signal(signal.SIGTERM, _terminated)  # as the envbuild command does
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job inherits it
DockerEngine(cli=sys.argv[1]).build(Path(sys.argv[2]), [], BuildSecrets(), Path(sys.argv[2]) / "build.log")
"""


def test_docker_build_with_no_daemon_says_so(tmp_path, fake_cli, monkeypatch):
    cli, calls = fake_cli
    monkeypatch.setenv("FAKE_DOCKER_MODE", "daemon-down")
    with pytest.raises(BuildFailed) as info:
        DockerEngine(cli=str(cli)).build(tmp_path, ["r:a"], BuildSecrets(), tmp_path / "build.log")
    assert info.value.step == "(unknown step)" and "Is dockerd running?" in info.value.hint


def test_docker_tag_failure_after_build_is_a_clear_error(tmp_path, fake_cli, monkeypatch):
    cli, _ = fake_cli
    monkeypatch.setenv("FAKE_DOCKER_MODE", "tag-fails")
    with pytest.raises(EnvbuildError, match=f"built {IMAGE_ID} but could not tag it r:a: Error response"):
        DockerEngine(cli=str(cli)).build(tmp_path, ["r:a"], BuildSecrets(), tmp_path / "build.log")


def test_docker_cli_override_and_missing_cli(tmp_path, monkeypatch):
    from envbuild.engine import docker as docker_engine

    monkeypatch.setenv("ENVBUILD_DOCKER_CLI", str(tmp_path / "nope"))
    monkeypatch.setattr(docker_engine, "DOCKER_CLI_CANDIDATES", ())
    with pytest.raises(EnvbuildError, match="no docker CLI found"):
        docker_engine.docker_cli()
    exe = tmp_path / "mydocker"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("ENVBUILD_DOCKER_CLI", str(exe))
    assert docker_engine.docker_cli() == str(exe)


# --------------------------------------------------------------------------- DockerEngine: the SDK calls
class FakeContainer:
    def __init__(self, code=0, hang=False):
        self.code, self.hang, self.events = code, hang, []

    def wait(self, timeout):
        self.events.append(("wait", timeout))
        if self.hang:
            import requests

            raise requests.exceptions.ReadTimeout("read timed out")
        return {"StatusCode": self.code}

    def logs(self, stdout, stderr):
        return b'{"ok": true}\n' if stdout else b"warning: chatter\n"

    def kill(self):
        self.events.append(("kill",))

    def remove(self, force):
        self.events.append(("remove", force))


class FakeImage:
    def __init__(self, image_id=IMAGE_ID, tags=("envbuild:t1",)):
        self.id, self.tags, self.tagged = image_id, list(tags), []

    def tag(self, repo, tag):
        self.tagged.append((repo, tag))


class FakeClient:
    """The docker SDK's names (client.images / client.containers), scripted."""

    def __init__(self, container=None, push_events=(), pull_error=None):
        self.image = FakeImage()
        self.container = container or FakeContainer()
        self.push_events, self.pull_error = list(push_events), pull_error
        self.run_kwargs, self.removed, self.pushed = None, [], []
        client = self

        class Images:
            def get(self, ref):
                if ref not in (IMAGE_ID, "envbuild:t1"):
                    raise docker.errors.ImageNotFound(f"No such image: {ref}")
                return client.image

            def remove(self, ref, noprune):
                client.removed.append((ref, noprune))

            def push(self, repo, tag, stream, decode):
                client.pushed.append((repo, tag, stream, decode))
                return iter(client.push_events)

            def pull(self, ref):
                if client.pull_error:
                    raise client.pull_error
                return FakeImage()

        class Containers:
            def list(self, **kwargs):  # no orphaned envbuild containers
                return []

            def run(self, image, argv, **kwargs):
                client.run_kwargs = dict(kwargs, image=image, argv=argv)
                return client.container

        self.images, self.containers = Images(), Containers()


def test_docker_run_options_and_gpus():
    client = FakeClient()
    res = DockerEngine(client=client).run(IMAGE_ID, ["python", "x"], timeout=30, env={"A": "1"},
                                          entrypoint=["/opt/envbuild/entrypoint.sh"])
    assert res == RunResult(0, '{"ok": true}\n', "warning: chatter\n")
    assert client.run_kwargs == {"image": IMAGE_ID, "argv": ["python", "x"], "network_mode": "none", "shm_size": "1g",
                                 "detach": True, "environment": {"A": "1"},
                                 "entrypoint": ["/opt/envbuild/entrypoint.sh"],
                                 # who owns it: the next run removes it if this process was killed
                                 "labels": {"io.envbuild.owner": f"{socket.gethostname()}:{os.getpid()}"}}
    assert client.container.events == [("wait", 30), ("remove", True)]
    for gpus, count in (("all", -1), ("2", 2)):
        DockerEngine(client=client).run(IMAGE_ID, ["x"], timeout=1, gpus=gpus)
        (request,) = client.run_kwargs["device_requests"]
        assert request["Count"] == count and request["Capabilities"] == [["gpu"]]


def test_docker_run_mounts_are_read_only_binds():
    client = FakeClient()
    DockerEngine(client=client).run(IMAGE_ID, ["x"], timeout=1, mounts={"/tmp/stub": "/sys/devices/system/cpu"})
    assert client.run_kwargs["volumes"] == {"/tmp/stub": {"bind": "/sys/devices/system/cpu", "mode": "ro"}}


def test_smoke_under_qemu_binds_the_stub_cpu_sysfs_and_says_so(state):
    engine = smoke_engine(json.dumps(REPORT))
    smoke.run_smoke("img:t", timeout=9, engine=engine, qemu=True)
    (_, _, argv, opts), = [c for c in engine.calls if c[0] == "run"]
    assert argv[-2:] == ["--timeout", str(smoke.QEMU_CHECK_TIMEOUT)]  # emulation is 10-20x slower
    (host, target), = opts["mounts"].items()
    assert target == "/sys/devices/system/cpu" and "midr_el1" in engine.mounted[host]
    assert opts["env"]["QEMU_CPU"] == smoke.QEMU_CPU  # Grace's SVE vector length (tests/behaviour/test_arm64.py)
    record = json.loads(smoke.record_path(IMAGE_ID).read_text())
    assert (record["emulated"], record["qemu_cpu"]) == ("qemu-user", smoke.QEMU_CPU)


def test_docker_run_timeout_kills_and_removes():
    client = FakeClient(container=FakeContainer(hang=True))
    res = DockerEngine(client=client).run(IMAGE_ID, ["x"], timeout=3)
    assert res.timed_out and res.exit_code is None
    assert client.container.events == [("wait", 3), ("kill",), ("remove", True)]


def test_docker_inspect_tag_untag():
    client = FakeClient()
    engine = DockerEngine(client=client)
    assert engine.inspect("envbuild:t1") == ImageInfo(IMAGE_ID, ["envbuild:t1"])
    with pytest.raises(EnvbuildError, match="image 'nope:1' does not exist locally; build it with `envbuild build`"):
        engine.inspect("nope:1")
    engine.tag(IMAGE_ID, "127.0.0.1:5000/envbuild:t1")
    engine.tag(IMAGE_ID, "127.0.0.1:5000/envbuild")
    assert client.image.tagged == [("127.0.0.1:5000/envbuild", "t1"), ("127.0.0.1:5000/envbuild", "latest")]
    engine.untag("127.0.0.1:5000/envbuild:t1")
    assert client.removed == [("127.0.0.1:5000/envbuild:t1", True)]


def test_docker_push_digest_and_registry_errors():
    # Event shapes as docker's push stream sends them.
    ok = [{"status": "The push refers to repository [127.0.0.1:5000/envbuild]"},
          {"status": "t1: digest: " + DIGEST + " size: 1234"},
          {"progressDetail": {}, "aux": {"Tag": "t1", "Digest": DIGEST, "Size": 1234}}]
    client = FakeClient(push_events=ok)
    assert DockerEngine(client=client).push(f"{REG}/envbuild:t1") == DIGEST
    assert client.pushed == [(f"{REG}/envbuild", "t1", True, True)]
    refused = [{"errorDetail": {"message": "unauthorized: authentication required"},
                "error": "unauthorized: authentication required"}]
    with pytest.raises(RegistryError) as info:
        DockerEngine(client=FakeClient(push_events=refused)).push(f"{REG}/envbuild:t1")
    assert info.value.message == "unauthorized: authentication required" and info.value.registry == REG
    with pytest.raises(RegistryError, match="without a digest"):
        DockerEngine(client=FakeClient(push_events=ok[:1])).push(f"{REG}/envbuild:t1")


def test_docker_pull_error_carries_the_registry_words():
    error = docker.errors.APIError("500 Server Error: Internal Server Error (\"received unexpected HTTP status: "
                                   "503 Service Unavailable\")")
    with pytest.raises(RegistryError) as info:
        DockerEngine(client=FakeClient(pull_error=error)).pull(f"{REG}/envbuild@{DIGEST}")
    assert "503 Service Unavailable" in info.value.message and info.value.registry == REG
    assert publish.classify(info.value.message) == "transient"
    assert DockerEngine(client=FakeClient()).pull(f"{REG}/envbuild@{DIGEST}") == IMAGE_ID


def test_unreachable_docker_engine_is_a_clear_error(tmp_path, monkeypatch):
    """A real docker SDK client pointed at a socket nobody listens on."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-dockerd.sock")
    with pytest.raises(EnvbuildError, match="cannot reach the Docker engine .*start dockerd"):
        DockerEngine().inspect("envbuild:t1")


class _RecordingClient:
    """Stands in for the Docker SDK client: records what a container run was asked for."""

    def __init__(self):
        self.kwargs = None
        outer = self

        class Container:
            def wait(self, timeout):
                return {"StatusCode": 0}

            def logs(self, stdout, stderr):
                return b""

            def remove(self, force):
                pass

        class Containers:
            def list(self, **kwargs):  # no orphaned envbuild containers
                return []

            def run(self, image, argv, **kwargs):
                outer.kwargs = kwargs
                return Container()

        self.containers = Containers()


def test_rdma_runs_get_the_devices_memlock_and_ipc_lock_a_multinode_job_needs():
    client = _RecordingClient()
    DockerEngine(client=client).run("img", ["true"], timeout=5, rdma=True)
    assert client.kwargs["devices"] == ["/dev/infiniband:/dev/infiniband:rwm"]
    assert client.kwargs["cap_add"] == ["IPC_LOCK"]
    (limit,) = client.kwargs["ulimits"]
    assert (limit["Name"], limit["Soft"], limit["Hard"]) == ("memlock", -1, -1)
    DockerEngine(client=client).run("img", ["true"], timeout=5)
    assert not {"devices", "cap_add", "ulimits"} & set(client.kwargs)


def test_smoke_hands_rdma_devices_over_only_on_a_gpu_run_where_the_node_has_them(monkeypatch, tmp_path):
    from envbuild.builds import verdict
    engine = FakeEngine(images={"img": ImageInfo(IMAGE_ID, ["img"])},
                        run_result=RunResult(0, '{"ok": true, "mode": "gpu", "checks": []}', ""))
    monkeypatch.setenv("ENVBUILD_STATE_DIR", str(tmp_path))
    real_isdir = verdict.os.path.isdir
    monkeypatch.setattr(verdict.os.path, "isdir", lambda p: p == "/dev/infiniband" or real_isdir(p))
    verdict.run_smoke("img", gpus="all", engine=engine)
    verdict.run_smoke("img", engine=engine)
    runs = [c[3] for c in engine.calls if c[0] == "run"]
    assert runs[0].get("rdma") is True and "rdma" not in runs[1]
