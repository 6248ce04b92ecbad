"""The smoke test's own timeouts, with real child processes: a hung collective and a hung op
loader are killed at the deadline with their likely causes, and a dead rank fails the check at
once with its output. The package's logic is tests/unit/test_smoke_script.py."""

from __future__ import annotations

import os
import sys
import time

from conftest import kill_processes_mentioning
from envbuild.image import checks, collectives, sandbox
from test_smoke_script import args_ns
from test_smoke_script import guard  # noqa: F401  (fixtures)


def test_hung_collective_is_killed_with_likely_causes(tmp_path, monkeypatch, guard):  # noqa: F811
    monkeypatch.setenv(sandbox.HANG_ENV, "collective")
    start = time.monotonic()
    try:
        ok, detail = collectives.check_collectives("nccl", 2, args_ns(timeout=3.0), str(tmp_path))
    finally:
        leftovers = kill_processes_mentioning(str(tmp_path))
    elapsed = time.monotonic() - start
    assert ok is False
    assert 3.0 <= elapsed < 20
    for hint in ("timed out after 3s", "NCCL_P2P_DISABLE=1", "H20", "--shm-size", "--ipc=host",
                 "NCCL_NVLS_ENABLE=0", "fabric-manager", "NCCL_DEBUG=INFO"):
        assert hint in detail
    assert leftovers == []


def test_dead_rank_fails_fast_with_its_output(tmp_path, guard):  # noqa: F811
    def dying(rank, result):
        return [sys.executable, "-c", "import sys; print('rank broke'); sys.exit(3)"]

    start = time.monotonic()
    ok, detail = collectives.check_collectives("gloo", 2, args_ns(timeout=60.0), str(tmp_path), command=dying)
    assert ok is False and "exited 3" in detail and "rank broke" in detail
    assert time.monotonic() - start < 30


def test_hung_op_loader_reports_jit_hang(tmp_path, monkeypatch, guard):  # noqa: F811
    monkeypatch.setenv(sandbox.HANG_ENV, "no_jit")
    try:
        res = checks.run_ops_child({"ds_ops": ["cpu_adam"]}, args_ns(timeout=2.0), str(tmp_path))
    finally:
        leftovers = kill_processes_mentioning(str(tmp_path))
    assert res["state"] == "timeout" and res["extra"] == []
    ok, detail = checks.check_no_jit(res, ["cpu_adam"], 2.0)
    assert ok is False and "field report 1" in detail
    assert leftovers == []
    # the read-only tree was made removable again
    assert os.access(tmp_path / "torch_extensions" / "cpu_adam", os.W_OK)
