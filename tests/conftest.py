"""Shared fixtures. Tests marked `docker` need the engine, registry and base image that
scripts/host-setup.sh starts; the rest run anywhere in seconds.

Behaviour tests (resolver, goldens, CLI) run against a small FROZEN matrix,
tests/fixtures/matrix, so adding a stack to matrices/ changes none of them; tests of the
production matrix itself (every row passes the rules, every combination lints, generated
files are current) use the `production_matrix` fixture."""

from __future__ import annotations

import contextlib
import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_MATRIX = ROOT / "tests" / "fixtures" / "matrix"
MATRIX_COMMANDS = {"render", "build", "matrix", "gpus", "extend", "extensions"}  # the commands that resolve stacks
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def matrix():
    """The frozen fixture matrix: what behaviour tests resolve against."""
    from envbuild.matrix import load_matrix

    return load_matrix(FIXTURE_MATRIX)


@pytest.fixture(scope="session")
def production_matrix():
    """The shipped matrix (matrices/): only for properties every matrix must have."""
    from envbuild.matrix import load_matrix

    return load_matrix()


def run_cli(*args, cwd=None, env=None, timeout=120, production=False):
    """Run the real console entry point of THIS checkout in a subprocess (exit codes,
    stderr, no traceback), against the fixture matrix unless `production`."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("ENVBUILD_DEBUG", None)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [full_env.get("PYTHONPATH")])])
    if production or (args and args[0] not in MATRIX_COMMANDS):
        full_env.pop("ENVBUILD_MATRIX_DIR", None)
    else:
        full_env.setdefault("ENVBUILD_MATRIX_DIR", str(FIXTURE_MATRIX))
    return subprocess.run([sys.executable, "-m", "envbuild", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def tree(path: Path) -> dict[str, bytes]:
    """All files under path, relative path -> bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def matrix_copy(tmp_path):
    """A writable copy of the built-in matrix, for tests that break it on purpose."""
    d = tmp_path / "matrices"
    shutil.copytree(FIXTURE_MATRIX, d)
    return d


@contextlib.contextmanager
def alarm_deadline(seconds: int, what: str):
    """Fail (not hang) when code under test ignores its own hard timeout."""
    def expired(*_):
        raise TimeoutError(what)

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def live_pids_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `text`: what a test left behind."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                status = (entry / "status").read_text()
            except OSError:
                continue
            if text in cmdline and "\nState:\tZ" not in status:
                pids.append(int(entry.name))
    return pids


def kill_processes_mentioning(text: str) -> list[int]:
    """SIGKILL what a test left running (found by `text` in its command line); their pids."""
    pids = live_pids_mentioning(text)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def cpu_target_env(name: str) -> dict[str, str]:
    """What the build plan hands cc-wrapper.sh for CPU target `name` (the production matrix's
    gpus.yaml cpu_targets): its compiler flag and its SIMD macro."""
    from envbuild.matrix import load_matrix

    target = load_matrix().gpus_file.cpu_targets[name]
    return {"ENVBUILD_CPU_TARGET": name, "ENVBUILD_CPU_FLAG": target.flag, "ENVBUILD_CPU_SIMD": target.simd}


DOCKER = "/usr/bin/docker"  # Debian's client: BuildKit builds go through it (scripts/host-setup.sh)


def docker(*args, check=True, timeout=900, **kw) -> subprocess.CompletedProcess:
    """Run the docker client; with `check`, a failure raises with the end of its stderr."""
    r = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {r.stderr[-2000:]}")
    return r


def ci_stack_id() -> str:
    """The production matrix's stack that CI builds for real (ci.real_build_stack)."""
    from envbuild.ci import real_build_stack
    from envbuild.matrix import load_matrix

    return real_build_stack(load_matrix()).id

