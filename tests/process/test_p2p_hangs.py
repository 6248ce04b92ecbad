"""The smoke test's P2P measurement with real ranks (stand-in bodies, no NCCL) that hang or die: a
hang is killed at the deadline without leaking the image's baked NCCL_P2P_DISABLE, and a dead
rank ends the group at once. The decision on its inputs is tests/unit/test_p2p.py."""

from __future__ import annotations

import os
import re
import time

from conftest import kill_processes_mentioning
from envbuild.image import collectives
from test_p2p import args_ns, fake_ranks, seen
from test_p2p import guard  # noqa: F401  (fixtures)


def test_p2p_hang_is_killed_and_the_baked_value_does_not_leak(tmp_path, guard):  # noqa: F811
    environ = {**os.environ, "NCCL_P2P_DISABLE": "1"}  # baked into the image, as for H20
    start = time.monotonic()
    try:
        ok, detail, _, data = collectives.check_p2p(2, args_ns(timeout=2.0), str(tmp_path), environ,
                                                    fake_ranks("hang", 0.02))
    finally:
        left = kill_processes_mentioning(str(tmp_path))
    assert left == []
    assert 2.0 <= time.monotonic() - start < 25
    assert ok and "nccl x2: P2P hangs (killed after 2s)" in detail and data["workaround_needed"] is True
    for rank in (0, 1):
        assert seen(tmp_path, "p2p-on", rank)["NCCL_P2P_DISABLE"] == "0"   # not the baked 1
        assert seen(tmp_path, "p2p-off", rank)["NCCL_P2P_DISABLE"] == "1"
    assert seen(tmp_path, "p2p-on", 1)["RANK"] == "1" and seen(tmp_path, "p2p-on", 1)["WORLD_SIZE"] == "2"


def test_p2p_failure_fails_fast_when_the_image_does_not_disable_it(tmp_path, guard):  # noqa: F811
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_P2P")}
    start = time.monotonic()
    ok, detail, _, data = collectives.check_p2p(4, args_ns(timeout=30.0), str(tmp_path), environ,
                                                fake_ranks("fail", 0.02))
    assert time.monotonic() - start < 20  # a dead rank ends the group; no waiting for the deadline
    assert not ok and re.search(r"P2P fails: rank \d exited 1", detail) and "peer access is not supported" in detail
    assert "set it (docker run -e NCCL_P2P_DISABLE=1" in detail
    assert data["busbw_p2p_off_gbps"] > 0
