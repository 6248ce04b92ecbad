"""The smoke test's P2P measurement: all_reduce with the P2P transport on and with
NCCL_P2P_DISABLE=1, each in its own ranks under the hard timeout, and the verdict.

No GPU exists here (and no torch). The decision is unit-tested on its inputs, and the ranks
are real processes started by the real runner, but each rank is a stand-in script (not NCCL)
that behaves as a node would: hangs, fails with CUDA's peer-access error, or reports timings,
depending on the NCCL_P2P_DISABLE it was given, and records the environment it saw. The ranks
that hang or die are tests/process/test_p2p_hangs.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import alarm_deadline
from envbuild.image import collectives
from envbuild.image.collectives import CollectiveRun
from envbuild.image.report import Skipped

SIZE = 64 * 2**20
FAKE_RANK = r"""
import json, os, sys, time
result, behaviour = sys.argv[1], json.loads(sys.argv[2])
mode = behaviour["off" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "on"]
seen = {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "RANK", "WORLD_SIZE", "MASTER_PORT")}
with open(result + ".seen", "w") as f:
    json.dump(seen, f)
if mode == "hang":
    time.sleep(1e9)
if mode == "fail":
    print("NCCL WARN Cuda failure 'peer access is not supported between these two devices'")
    sys.exit(1)
with open(result, "w") as f:
    json.dump({"ok": True, "detail": "", "size_bytes": %d, "all_reduce_s": mode, "all_gather_s": mode}, f)
""" % SIZE


def fake_ranks(on, off):
    """`command` for run_collective: the stand-in rank with the given behaviour per P2P setting."""
    def command(rank, result):
        return [sys.executable, "-c", FAKE_RANK, result, json.dumps({"on": on, "off": off})]
    return command


def args_ns(**kw):
    return SimpleNamespace(**{**dict(timeout=2.0, nproc=0, size_mb=64.0), **kw})


def seen(work: Path, name: str, rank: int = 0) -> dict:
    return json.loads((work / f"{name}-rank{rank}.json.seen").read_text())


@pytest.fixture
def guard():
    with alarm_deadline(40, "the P2P measurement ignored its own timeout"):
        yield


# --------------------------------------------------------------------------- environments
def test_p2p_on_drops_every_p2p_setting_and_off_disables_it():
    baked = {"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "LOC", "NCCL_NVLS_ENABLE": "0", "PATH": "/x"}
    on, off = collectives.p2p_env(baked, True), collectives.p2p_env(baked, False)
    assert on == {"NCCL_P2P_DISABLE": "0", "NCCL_NVLS_ENABLE": "0", "PATH": "/x"}
    assert off == {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "PATH": "/x"}
    assert baked["NCCL_P2P_DISABLE"] == "1"  # the caller's environment is not changed


@pytest.mark.parametrize("environ, disabled", [
    ({"NCCL_P2P_DISABLE": "1"}, True), ({"NCCL_P2P_DISABLE": "0"}, False), ({}, False),
    ({"NCCL_P2P_LEVEL": "LOC"}, True), ({"NCCL_P2P_LEVEL": "NVL"}, False),
])
def test_p2p_disabled(environ, disabled):
    assert collectives.p2p_disabled(environ) is disabled


# --------------------------------------------------------------------------- the decision
def run(state, seconds=0.01, nranks=2, detail=""):
    result = {"size_bytes": SIZE, "all_reduce_s": seconds, "all_gather_s": seconds} if state == "ok" else {}
    return CollectiveRun(state, detail, result, nranks)


def test_busbw_of_a_run():
    assert run("ok", 0.01).busbw() == pytest.approx(SIZE * 2 * (2 - 1) / 2 / 0.01 / 1e9)
    assert run("hang").busbw() == 0.0


def test_both_work_reports_bandwidths_and_the_cost():
    ok, detail, data = collectives.p2p_verdict(run("ok", 0.01), run("ok", 0.04), False, 120)
    assert ok and "P2P works" in detail and "costs 75%" in detail
    assert data["workaround_cost_pct"] == 75.0 and data["workaround_needed"] is False
    assert data["busbw_p2p_on_gbps"] == pytest.approx(6.71, abs=0.01)
    assert data["busbw_p2p_off_gbps"] == pytest.approx(1.68, abs=0.01)
    ok, detail, _ = collectives.p2p_verdict(run("ok", 0.01), run("ok", 0.04), True, 120)
    assert ok and "not needed on this node" in detail and "NCCL_P2P_DISABLE=0" in detail


@pytest.mark.parametrize("disabled_here, ok", [(True, True), (False, False)])
def test_p2p_hang_means_the_workaround_is_needed(disabled_here, ok):
    got, detail, data = collectives.p2p_verdict(run("hang"), run("ok", 0.04), disabled_here, 120)
    assert got is ok and "P2P hangs (killed after 120s)" in detail and "workaround NCCL_P2P_DISABLE=1 is needed" in detail
    assert data["workaround_needed"] is True and data["p2p"] == "hang"
    assert ("set it (docker run -e NCCL_P2P_DISABLE=1" in detail) is not disabled_here


def test_p2p_failure_is_reported_with_its_words():
    ok, detail, _ = collectives.p2p_verdict(run("fail", detail="rank 1 exited 1: peer access is not supported"),
                                            run("ok"), True, 120)
    assert ok and "P2P fails: rank 1 exited 1: peer access is not supported" in detail


def test_only_p2p_off_broken_fails_where_p2p_is_disabled():
    ok, detail, _ = collectives.p2p_verdict(run("ok"), run("hang"), True, 60)
    assert not ok and "hangs (killed after 60s)" in detail and "unset it" in detail
    assert collectives.p2p_verdict(run("ok"), run("hang"), False, 60)[0] is True


def test_both_broken_is_not_a_p2p_problem():
    ok, detail, data = collectives.p2p_verdict(run("hang"), run("fail", detail="x"), True, 60)
    assert not ok and "not a P2P problem" in detail and data["workaround_needed"] is None


def test_skipped_without_two_gpus():
    assert isinstance(collectives.check_p2p(0, args_ns(), "/nonexistent"), Skipped)
    assert "two or more GPUs" in collectives.check_p2p(1, args_ns(), "/nonexistent").reason
    assert "--nproc 1" in collectives.check_p2p(4, args_ns(nproc=1), "/nonexistent").reason


# --------------------------------------------------------------------------- real ranks, stand-in bodies


def test_p2p_measured_both_ways(tmp_path, guard):
    ok, detail, _, data = collectives.check_p2p(2, args_ns(), str(tmp_path), dict(os.environ),
                                                fake_ranks(0.01, 0.02))
    assert ok and data["workaround_cost_pct"] == 50.0 and "costs 50%" in detail
    assert seen(tmp_path, "p2p-on")["MASTER_PORT"] != seen(tmp_path, "p2p-off")["MASTER_PORT"]
