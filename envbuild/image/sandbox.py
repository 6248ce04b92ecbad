"""Child processes under hard timeouts, and the no-JIT sandbox they load ops in.

Every check that can hang (an op load waiting on a stale lock, a collective) runs in its own
session, so a timeout kills the whole process group, grandchildren included. Children run
this package's CLI (``--child ...``) by import, so the package works under either name
(``envbuild.image`` on the host, ``envbuild_image`` inside the image).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

HANG_ENV = "ENVBUILD_SMOKE_TEST_HANG"  # test hook: =no_jit or =collective makes those children sleep


def package_command(module: str, function: str, *args: str, isolated: bool = False) -> list[str]:
    """argv that runs `function(argv)` of this package's `module` in a new Python process
    (``-I`` with `isolated`: no user site, no PYTHON* variables); it exits with its result."""
    package = __package__ or "envbuild_image"
    root = os.path.dirname(os.path.abspath(__file__))
    for _ in package.split("."):
        root = os.path.dirname(root)
    boot = (f"import sys; sys.path.insert(0, {root!r}); from {package}.{module} import {function}; "
            f"sys.exit({function}(sys.argv[1:]))")
    return [sys.executable, *(["-I"] if isolated else []), "-u", "-c", boot, *args]


def self_command(*args: str) -> list[str]:
    """argv that runs this package's smoke CLI with `args` in a new Python process."""
    return package_command("cli", "main", *args)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session (it started one), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def run_child(cmd: list[str], env: dict, timeout: float, log_path: str) -> tuple[str, int | None]:
    """Run cmd in its own session, output to log_path; ('done', rc) or ('timeout', None) after a kill."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return "done", proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return "timeout", None


class RanksOutcome:
    """How a group of ranks ended: ``done`` (all exited 0), ``failed`` (one exited non-zero,
    the rest were killed) or ``timeout`` (the deadline passed; all were killed)."""

    def __init__(self, state: str, failed_rank: int | None = None, returncode: int | None = None,
                 log_tail: str = "", seconds: float = 0.0):
        self.state = state
        self.failed_rank = failed_rank
        self.returncode = returncode
        self.log_tail = log_tail
        self.seconds = seconds


def run_ranks(argv_for_rank: Callable[[int], list[str]], nproc: int, env: dict, timeout: float,
              log_for_rank: Callable[[int], str], poll: float = 0.2) -> RanksOutcome:
    """Start `nproc` ranks (RANK/LOCAL_RANK set), each in its own session; wait until all exit,
    one fails, or `timeout` passes. Nothing is left running when this returns."""
    procs = []
    start = time.monotonic()
    try:
        for rank in range(nproc):
            with open(log_for_rank(rank), "wb") as log:
                procs.append(subprocess.Popen(argv_for_rank(rank), stdout=log, stderr=subprocess.STDOUT,
                                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                              start_new_session=True))
        deadline = start + timeout
        while True:
            failed = [rank for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)]
            if failed:
                rank = failed[0]
                return RanksOutcome("failed", rank, procs[rank].returncode, tail(log_for_rank(rank)),
                                    time.monotonic() - start)
            if all(proc.poll() is not None for proc in procs):
                return RanksOutcome("done", seconds=time.monotonic() - start)
            if time.monotonic() > deadline:
                return RanksOutcome("timeout", seconds=time.monotonic() - start)
            time.sleep(poll)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)


LDD_TIMEOUT = 30.0


def unresolved_libraries(path: str, environ=None) -> tuple[list[str], int]:
    """(the shared libraries `path` needs that the loader cannot find here, in ldd's order; ldd's
    exit status). Raises OSError or subprocess.SubprocessError when ldd cannot run."""
    done = subprocess.run(["ldd", path], capture_output=True, text=True, errors="replace", timeout=LDD_TIMEOUT,
                          env=None if environ is None else dict(environ))
    return [line.split("=>")[0].strip() for line in done.stdout.splitlines() if "=> not found" in line], done.returncode


def tail(path: str, limit: int = 600) -> str:
    """The end of a log, on one line."""
    try:
        with open(path, "rb") as handle:
            return handle.read().decode("utf-8", "replace")[-limit:].strip().replace("\n", " | ")
    except OSError:
        return ""


def read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def write_json(path: str, data: dict) -> None:
    """Replace `path` atomically: a killed child leaves the last complete result, never half of one."""
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    os.replace(path + ".tmp", path)


def sha256_of(path: str) -> str:
    """sha256 of a whole file's bytes, read in blocks (OSError when it cannot be read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: str) -> str | None:
    """sha256 of a file's bytes, or None when it cannot be read."""
    try:
        return sha256_of(path)
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def plant_stale_locks(root: str, ops: list[str]) -> set[str]:
    """Recreate field reports 1/2: a stale <op>/lock per op, then the tree made read-only."""
    planted = set()
    for op in ops:
        os.makedirs(os.path.join(root, op), exist_ok=True)
        open(os.path.join(root, op, "lock"), "w").close()
        planted |= {op, os.path.join(op, "lock")}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chmod(os.path.join(dirpath, name), 0o555)
    os.chmod(root, 0o555)
    return planted


def tree_entries(root: str) -> set[str]:
    """Every path under root; root ignores modes, so this is how a write is caught."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        out |= {os.path.relpath(os.path.join(dirpath, name), root) for name in dirnames + filenames}
    return out


def make_writable(root: str) -> None:
    """Undo plant_stale_locks' modes so the temporary directory can be removed without root."""
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)
