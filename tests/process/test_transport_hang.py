"""The `transport` check's child hung in NCCL's init (a stand-in that starts a grandchild and
sleeps): killed at the hard timeout with its whole process group, and reported with what NCCL
said. The parser and the verdict are tests/unit/test_transport.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from test_transport import IB, MLX, run
from test_transport import stub  # noqa: F401  (fixtures)


def test_a_hung_init_is_killed_with_its_whole_process_group(stub, tmp_path):  # noqa: F811
    """Stand-in child (no GPU here) that writes a log, starts a grandchild and sleeps."""
    start = time.monotonic()
    ok, detail, _, data = run({"fabric": IB}, stub("nccl-451-socket-device-open.log", "hang"), tmp_path,
                              {"rdma": MLX, "memlock": -1, "dev_infiniband": True}, timeout=3.0)
    assert time.monotonic() - start < 20
    assert not ok and data["child"] == "timeout"
    assert "hung: killed after 3s (pinned: NCCL_NET=IB)" in detail and "Unable to open device mlx5_bond_0" in detail
    grandchild = int(Path(str(stub.seen) + ".pid").read_text())
    for _ in range(50):  # reaped by init once killed; gone either way
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, signal.SIGKILL)
        pytest.fail("the grandchild survived the timeout")
