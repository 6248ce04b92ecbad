"""The multi-node smoke test's logic, without torch (fast): Slurm hostlists and rendezvous
variables, the fingerprint comparison, bandwidth maths, the report, the watchdog, the usage
error. The torch side (TCPStore, gloo, torchrun) runs for real across containers in
tests/docker/test_multinode_docker.py.

Real inputs, each with its source: hostlists and their expansions pasted in public threads,
a real srun task environment, and nccl-tests output lines whose algbw / busbw we must
reproduce from size and time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from conftest import ROOT
from envbuild.image import bandwidth, fingerprints, rendezvous
from envbuild.image import multinode as mn
from envbuild.image.manifest import UsageError

# ----------------------------------------------------------------------------- hostlists
# `scontrol show hostnames` output pasted in https://github.com/skypilot-org/skypilot/pull/8891
SKYPILOT_NODELIST = "ml-16-node-[001-002,004],ml-17-node-[001-003]"
SKYPILOT_HOSTNAMES = """\
ml-16-node-001
ml-16-node-002
ml-16-node-004
ml-17-node-001
ml-17-node-002
ml-17-node-003
"""
# python-hostlist's examples (the LLNL hostlist syntax Slurm uses), quoted in
# https://gitlab.liu.se/NSC/puppetmodules/nscutils/-/commit/14645e7643103a0ce9eccbc3a44773e76b4674a9
NSC_EXAMPLES = {
    "foo[8-11]": "foo8, foo9, foo10, foo11",
    "rack[01-3]-node[01-2,5]": "rack01-node01, rack01-node02, rack01-node5, rack02-node01, rack02-node02, "
                               "rack02-node5, rack03-node01, rack03-node02, rack03-node5",
    "d[1-5],n[01-05]": "d1, d2, d3, d4, d5, n01, n02, n03, n04, n05",
}


def test_hostlist_expands_like_scontrol_show_hostnames():
    assert rendezvous.expand_hostlist(SKYPILOT_NODELIST) == SKYPILOT_HOSTNAMES.split()


@pytest.mark.parametrize("hostlist,meaning", NSC_EXAMPLES.items())
def test_hostlist_matches_python_hostlist(hostlist, meaning):
    """Each range is padded to its own lower bound's width (Slurm's hostlist.c: width =
    strlen(lo)): '01-3' gives 01 02 03, but the '5' after '01-2' stays 'node5'."""
    assert rendezvous.expand_hostlist(hostlist) == meaning.split(", ")


def test_hostlist_plain_names_and_whitespace():
    assert rendezvous.expand_hostlist("eu-g4-015") == ["eu-g4-015"]
    assert rendezvous.expand_hostlist(" a1, b[2-3] ") == ["a1", "b2", "b3"]
    assert rendezvous.expand_hostlist("") == []


@pytest.mark.parametrize("bad,words", [("node[3-1]", "bad range '3-1'"), ("node[1-2", "unbalanced '['"),
                                       ("node1-2]", "unbalanced ']'"), ("node[a-b]", "bad range 'a-b'")])
def test_hostlist_errors_name_the_input(bad, words):
    with pytest.raises(UsageError) as err:
        rendezvous.expand_hostlist(bad)
    assert repr(bad) in str(err.value) and words in str(err.value)


# ----------------------------------------------------------------------------- rendezvous
# A real srun task's environment (a subset), from
# https://github.com/Lightning-AI/pytorch-lightning/issues/16236
LIGHTNING_SRUN_ENV = {
    "SLURM_GTIDS": "0", "SLURM_JOBID": "7099018", "SLURM_JOB_ID": "7099018", "SLURM_JOB_NAME": "train.job",
    "SLURM_JOB_NODELIST": "eu-g4-015", "SLURM_JOB_NUM_NODES": "1", "SLURM_LOCALID": "0", "SLURM_NNODES": "1",
    "SLURM_NODEID": "0", "SLURM_NODELIST": "eu-g4-015", "SLURM_NPROCS": "1", "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "eu-g4-015", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_SUBMIT_HOST": "eu-login-41",
}


def test_srun_environment_from_a_real_job():
    rdzv = rendezvous.rendezvous_from_env(LIGHTNING_SRUN_ENV)
    assert (rdzv.rank, rdzv.world_size, rdzv.local_rank, rdzv.launcher) == (0, 1, 0, "srun")
    assert rdzv.master_addr == "eu-g4-015"
    # Lightning's convention, as its SLURMEnvironment computes it: 15000 + "9018"
    assert rdzv.master_port == 24018
    assert any("SLURM_JOB_ID=7099018" in note for note in rdzv.notes)


def test_srun_across_nodes_takes_rank_0s_host_from_the_nodelist():
    """2 nodes x 4 GPUs, the first GPU of the second node (the layout explained in
    https://github.com/rstrudel/segmenter/issues/22): SLURM_PROCID 4, SLURM_LOCALID 0."""
    env = {"SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "ml-16-node-[001-002]"}
    rdzv = rendezvous.rendezvous_from_env(env)
    assert (rdzv.rank, rdzv.world_size, rdzv.local_rank) == (4, 8, 0)
    assert (rdzv.master_addr, rdzv.master_port) == ("ml-16-node-001", 18456)
    # the step's own list and task count win over the allocation's (srun -w / -n on part of it)
    rdzv = rendezvous.rendezvous_from_env(dict(env, SLURM_STEP_NODELIST="ml-16-node-002", SLURM_STEP_NUM_TASKS="4",
                                       SLURM_PROCID="3"))
    assert (rdzv.master_addr, rdzv.world_size) == ("ml-16-node-002", 4)
    # what the user exports wins over what Slurm implies
    rdzv = rendezvous.rendezvous_from_env(dict(env, MASTER_ADDR="10.0.0.7", MASTER_PORT="29999"))
    assert (rdzv.master_addr, rdzv.master_port, rdzv.notes) == ("10.0.0.7", 29999, [])


def test_torchrun_variables_win_over_slurm():
    """torchrun under srun (one torchrun per node): torchrun's RANK is the rank of the process."""
    env = dict(LIGHTNING_SRUN_ENV, RANK="5", WORLD_SIZE="16", LOCAL_RANK="5", MASTER_ADDR="node-a",
               MASTER_PORT="29400", TORCHELASTIC_RUN_ID="none")
    rdzv = rendezvous.rendezvous_from_env(env)
    assert (rdzv.rank, rdzv.world_size, rdzv.local_rank, rdzv.launcher) == (5, 16, 5, "torchrun")
    assert (rdzv.master_addr, rdzv.master_port) == ("node-a", 29400)
    plain = rendezvous.rendezvous_from_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0"})
    assert (plain.launcher, plain.master_port, plain.local_rank) == ("env", 29500, 0)
    assert "torchrun's default" in plain.notes[0]


@pytest.mark.parametrize("env,words", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "rank 2 is outside a world of 2 ranks (0..1)"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "h"}, "WORLD_SIZE='0'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "not a TCP port"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS is not"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "set MASTER_ADDR"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[2-1]"}, "bad range"),
])
def test_bad_rendezvous_variables_are_usage_errors(env, words):
    with pytest.raises(UsageError) as err:
        rendezvous.rendezvous_from_env(env)
    assert words in str(err.value)


def test_no_variables_is_the_usage_paragraph():
    with pytest.raises(UsageError) as err:
        rendezvous.rendezvous_from_env({"PATH": "/usr/bin", "HOME": "/root"})
    assert str(err.value) == rendezvous.USAGE
    assert "torchrun" in rendezvous.USAGE and "srun" in rendezvous.USAGE and "\n" not in rendezvous.USAGE


def _cli(*args, env=None, timeout=60):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
             ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    clean["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", "import sys; from envbuild.image.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", *args], env=dict(clean, **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def test_cli_without_rendezvous_exits_2_with_one_paragraph(tmp_path):
    r = _cli("--multinode")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == rendezvous.USAGE and "Traceback" not in r.stderr
    r = _cli("--multinode", "--json")
    assert r.returncode == 2 and json.loads(r.stdout) == {"ok": False, "error": rendezvous.USAGE, "checks": []}


def test_cli_checks_the_manifest_before_waiting_on_anyone(tmp_path):
    """Rendezvous variables set, manifest missing: a usage error at once, not a rendezvous wait."""
    start = time.monotonic()
    r = _cli("--multinode", "--manifest", str(tmp_path / "nope.json"),
             env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert r.returncode == 2 and "manifest not found" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - start < 30


# ----------------------------------------------------------------------------- fingerprints
def _fp(rank, host, **over):
    fp = {"rank": rank, "host": host, "world_size": 3, "tag": "torch2.15.0-h20", "manifest_sha256": "a" * 64,
          "lock_sha256": "b" * 64, "extend_lock_sha256": None, "python": "3.11.14", "torch": "2.15.0",
          "nccl": "2.30.7", "deepspeed": "0.19.8", "fabric": "ib", "transport": "IB", "nccl_net": "IB",
          "driver": "580.65.06", "gpu": "NVIDIA H20", "backend": "nccl"}
    fp.update(over)
    return fp


def test_same_fingerprints_pass_and_say_what_they_agree_on():
    fps = [_fp(0, "n1"), _fp(1, "n2"), _fp(2, "n3")]
    assert fingerprints.compare_fingerprints(fps) == []
    words = fingerprints.describe_same(fps)
    assert "all 3 ranks on 3 hosts" in words and "manifest aaaaaaaaaaaa" in words and "driver 580.65.06" in words


def test_a_rebuilt_image_under_the_same_tag_is_named_by_host():
    fps = [_fp(0, "n1"), _fp(1, "n2", manifest_sha256="c" * 64), _fp(2, "n3")]
    diffs = fingerprints.compare_fingerprints(fps)
    assert [(d["rank"], d["field"], d["blocking"]) for d in diffs] == [(1, "manifest_sha256", False)]
    words = fingerprints.describe_mismatches(diffs, 3)
    assert "host n2 (rank 1)" in words and "cccccccccccc where 2 of 3 ranks have aaaaaaaaaaaa" in words
    assert "n1" not in words and "n3" not in words


def test_the_odd_one_out_is_named_even_when_it_is_rank_0():
    fps = [_fp(0, "n1", driver="550.54.15"), _fp(1, "n2"), _fp(2, "n3")]
    assert [(d["rank"], d["host"], d["value"], d["majority"]) for d in fingerprints.compare_fingerprints(fps)] == \
        [(0, "n1", "550.54.15", "580.65.06")]


def test_two_ranks_that_disagree_are_compared_against_rank_0():
    """No majority with two nodes: rank 0 is the reference, so the other one is named."""
    fps = [_fp(0, "n1"), _fp(1, "n2", torch="2.14.1", nccl="2.29.3")]
    diffs = fingerprints.compare_fingerprints(fps)
    assert {(d["rank"], d["field"]) for d in diffs} == {(1, "torch"), (1, "nccl")}
    assert all(d["blocking"] for d in diffs)


def test_a_whole_node_of_ranks_is_named_once_with_its_rank_range():
    fps = [_fp(r, f"n{r // 8}", world_size=24) for r in range(24)]
    for r in range(8, 16):
        fps[r].update(gpu="NVIDIA H100 80GB HBM3", driver="570.86.15")
    diffs = fingerprints.compare_fingerprints(fps)
    words = fingerprints.describe_mismatches(diffs, 24)
    assert words.count("host n1") == 1 and "(ranks 8-15)" in words
    assert "NVIDIA driver 570.86.15 where 16 of 24 ranks have 580.65.06" in words
    assert "GPU NVIDIA H100 80GB HBM3 where 16 of 24 ranks have NVIDIA H20" in words
    assert not any(d["blocking"] for d in diffs)  # measured anyway: the bandwidth still says something


def test_older_images_without_a_fabric_section_compare_as_none(tmp_path):
    man = tmp_path / "manifest.json"
    man.write_text(json.dumps({"tag": "old"}))
    fp = fingerprints.image_fingerprint({"tag": "old"}, str(man))
    assert fp["fabric"] is None and fp["transport"] is None and fp["lock_sha256"] is None


def test_image_fingerprint_hashes_the_manifest_and_the_lock_beside_it(matrix, tmp_path):
    """On a real rendered manifest (with its fabric section) and lock: one changed byte shows."""
    from envbuild.render.builddir import render_files
    from envbuild.resolve.resolver import Request, resolve

    files = render_files(resolve(matrix, Request(gpu="h20")))
    (tmp_path / "manifest.json").write_bytes(files["manifest.json"].encode() if isinstance(files["manifest.json"], str)
                                             else files["manifest.json"])
    (tmp_path / "lock.txt").write_bytes(files["envbuild/lock.txt"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    first = fingerprints.image_fingerprint(manifest, str(tmp_path / "manifest.json"))
    assert first["tag"] == manifest["tag"] and first["fabric"] == manifest["fabric"]["name"]
    assert first["transport"] == manifest["fabric"]["transport"]
    assert first["lock_sha256"] == hashlib.sha256(files["envbuild/lock.txt"]).hexdigest()
    (tmp_path / "lock.txt").write_bytes(files["envbuild/lock.txt"] + b"\n")
    second = fingerprints.image_fingerprint(manifest, str(tmp_path / "manifest.json"))
    assert second["lock_sha256"] != first["lock_sha256"] and second["manifest_sha256"] == first["manifest_sha256"]


def test_local_rank_picks_the_gpu_or_fails_clearly():
    assert fingerprints.pick_device(0, 8) == 0 and fingerprints.pick_device(7, 8) == 7
    assert fingerprints.pick_device(5, 1) == 0  # srun --gpus-per-task=1: each task sees its one GPU as 0
    assert fingerprints.pick_device(2, 0) is None
    with pytest.raises(RuntimeError, match="LOCAL_RANK 4 but only 2 GPUs"):
        fingerprints.pick_device(4, 2)


# ----------------------------------------------------------------------------- bandwidth
# nccl-tests output lines with their rank count and the column of the (out-of-place) time in us,
# followed by algbw and busbw, as pasted in public threads.
NCCL_TESTS_LINES = [
    # all_gather_perf -g 2 (2 ranks): https://github.com/NVIDIA/nccl/issues/1435
    ("all_gather", 2, 5, "    16777216       4194304  bfloat16    none      -1    108.8  154.20   77.10      0"),
    ("all_gather", 2, 5, "    67108864      16777216  bfloat16    none      -1    292.3  229.59  114.79      0"),
    # all_reduce_perf, 2 ranks on 2 DGX Spark nodes: https://github.com/NVIDIA/dgx-spark-playbooks/pull/103
    ("all_reduce", 2, 5, "       65536         16384     float     sum      -1    67.93    0.96    0.96       0"),
    # all_reduce, 8 ranks (mscclpp-test, nccl-tests' definitions): https://github.com/microsoft/mscclpp/pull/83
    ("all_reduce", 8, 2, "  1073741824     268435456    17018   63.09  110.41      0"),
]


@pytest.mark.parametrize("op,nranks,column,line", NCCL_TESTS_LINES)
def test_bandwidth_reproduces_nccl_tests(op, nranks, column, line):
    words = line.split()
    micros, algbw, busbw = (float(w) for w in words[column:column + 3])
    got_alg, got_bus = bandwidth.bandwidth(op, int(words[0]), micros * 1e-6, nranks)
    assert got_alg == pytest.approx(algbw, abs=0.006) and got_bus == pytest.approx(busbw, abs=0.006)


def test_bandwidth_of_nothing_is_zero():
    assert bandwidth.bandwidth("all_reduce", 1024, 0.0, 2) == (0.0, 0.0)


def test_message_sizes_are_whole_float32_per_rank():
    for world in (1, 2, 3, 7, 16):
        sizes = bandwidth.message_sizes(4, world)
        assert sizes == sorted(set(sizes)) and sizes[-1] <= 4 * 2**20
        assert all(size % (4 * world) == 0 and size > 0 for size in sizes)
    assert bandwidth.message_sizes(64, 2) == [2**20, 2**23, 2**26]


def test_summary_uses_the_slowest_rank_and_names_it():
    results = [{"ok": True, "times": {"all_reduce": {"1048576": 0.010}, "all_gather": {"1048576": 0.004}}},
               {"ok": True, "times": {"all_reduce": {"1048576": 0.020}, "all_gather": {"1048576": 0.003}}},
               {"ok": True, "times": {"all_reduce": {"1048576": 0.012}, "all_gather": {"1048576": 0.002}}}]
    rows = bandwidth.summarize(results, ["a", "b", "c"], 3)
    ar = next(r for r in rows if r["op"] == "all_reduce")
    ag = next(r for r in rows if r["op"] == "all_gather")
    assert (ar["slowest_rank"], ar["slowest_host"], ar["seconds"], ar["fastest_seconds"]) == (1, "b", 0.020, 0.010)
    assert ar["algbw_gbps"] == pytest.approx(2**20 / 0.020 / 1e9, abs=1e-3)
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * 4 / 3, abs=1e-3)
    assert (ag["slowest_rank"], ag["busbw_gbps"]) == (0, pytest.approx(2**20 / 0.004 / 1e9 * 2 / 3, abs=1e-3))
    text = bandwidth.op_detail(rows, "all_reduce", "gloo", 3)
    assert text.startswith("gloo x3: 1 MiB 20.00 ms") and "slowest rank 1 on b" in text


def test_rank_words_fold_runs():
    assert fingerprints.rank_words([5, 1, 2, 3]) == "ranks 1-3, 5"


# ----------------------------------------------------------------------------- joining
class DictStore:
    """The few calls of torch's Store the join uses, on a dict (torch's TCPStore runs in the docker test)."""

    def __init__(self, data=None):
        self.data = dict(data or {})

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def wait(self, keys, timeout):
        assert isinstance(timeout, timedelta)
        if not self.check(keys):
            raise RuntimeError("Wait timeout")


def test_missing_ranks_are_named_with_the_hosts_that_did_join():
    store = DictStore({f"fp/{r}": json.dumps(_fp(r, f"node{r}")).encode() for r in (0, 1, 3)})
    missing = fingerprints.wait_for_ranks(store, 5, 0.1)
    assert missing == [2, 4]
    joined = fingerprints.read_fingerprints(DictStore({f"fp/{r}": store.get(f"fp/{r}") for r in range(2)}), 2)
    text = fingerprints.missing_message(missing, joined, 5, 30)
    assert text.startswith("ranks 2, 4 of 5 never joined within 30s (2 joined, from node0, node1)")
    full = DictStore({f"fp/{r}": b"{}" for r in range(3)})
    assert fingerprints.wait_for_ranks(full, 3, 0.1) == []


def test_wait_for_port_keeps_its_own_deadline():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert rendezvous.wait_for_port("127.0.0.1", server.getsockname()[1], 2) == ""
        port = server.getsockname()[1]
    start = time.monotonic()
    why = rendezvous.wait_for_port("127.0.0.1", port, 1.0)
    assert why == f"nothing accepts connections at 127.0.0.1:{port} (refused)"
    assert 0.9 < time.monotonic() - start < 3


def _judged(fps, world):
    store = DictStore({f"fp/{fp['rank']}": json.dumps(fp).encode() for fp in fps})
    run, _ = _run(0, world)
    verdict = run._judge(store, 0.1, time.monotonic())
    return verdict, {c["name"]: c for c in run.checks}


def test_rank_0_judges_the_joined_fingerprints():
    verdict, checks = _judged([_fp(r, f"n{r}") for r in range(3)], 3)
    assert verdict == {"ok": True, "collectives": True, "deviants": {}}
    assert checks["rendezvous"]["ok"] and checks["fingerprints"]["ok"]
    verdict, checks = _judged([_fp(0, "n0"), _fp(1, "n1", torch="2.14.0"), _fp(2, "n2")], 3)
    assert verdict == {"ok": False, "collectives": False, "deviants": {"1": ["torch"]}}
    verdict, checks = _judged([_fp(0, "n0"), _fp(2, "n2")], 3)
    assert verdict["abort"].startswith("rank 1 of 3 never joined") and checks["rendezvous"]["data"] == \
        {"missing_ranks": [1]}


def test_a_rank_that_could_not_read_its_stack_is_named_and_stops_the_collectives():
    broken = {"rank": 1, "host": "n1", "world_size": 3, "error": "RuntimeError: LOCAL_RANK 4 but only 2 GPUs"}
    verdict, checks = _judged([_fp(0, "n0"), broken, _fp(2, "n2")], 3)
    assert not verdict["ok"] and not verdict["collectives"]
    assert verdict["deviants"] == {"1": ["its stack could not be read (RuntimeError: LOCAL_RANK 4 but only 2 GPUs)"]}
    assert checks["ranks"]["detail"] == "rank 1 on n1: RuntimeError: LOCAL_RANK 4 but only 2 GPUs"
    assert checks["fingerprints"]["ok"]  # the two that could be read agree


# ----------------------------------------------------------------------------- output
def _run(rank, world, json_out=False):
    args = SimpleNamespace(json=json_out, timeout=30.0, size_mb=4.0)
    rdzv = rendezvous.Rendezvous(rank, world, 0, "10.0.0.1", 29500, "env")
    out = io.StringIO()
    run = mn.Run(args, {"tag": "t-h20", "gpu": "h20"}, "/opt/envbuild/manifest.json", rdzv, out)
    run.fp = _fp(rank, f"n{rank}", backend="gloo", gpu=None)
    return run, out


def test_a_rank_prints_one_line_and_rank_0_the_verdict():
    run, out = _run(1, 2)
    assert run.finish(True) == 0
    line = out.getvalue()
    assert line.count("\n") == 1 and line.startswith("multinode rank 1/2 on n1: ok | image t")
    assert "backend gloo" in line
    run, out = _run(1, 2, json_out=True)
    assert run.finish(False, "rank 0 stopped the run: x") == 1
    data = json.loads(out.getvalue())
    assert data["rank"] == 1 and data["ok"] is False and data["error"].startswith("rank 0 stopped")
    run, out = _run(0, 2)
    run.checks.append({"name": "rendezvous", "ok": True, "detail": "2 ranks joined", "seconds": 1.0})
    assert run.finish(True) == 0
    text = out.getvalue()
    assert text.splitlines()[0].startswith("multinode rank 0/2 on n0: ok") and text.rstrip().endswith("RESULT: ok")


def test_rank_0_json_is_one_line_and_a_failure_without_a_check_becomes_one():
    run, out = _run(0, 3, json_out=True)
    assert run.finish(True, "fingerprint: ModuleNotFoundError: No module named 'torch'") == 1
    assert out.getvalue().count("\n") == 1
    rep = json.loads(out.getvalue())
    assert rep["ok"] is False and rep["mode"] == "multinode" and rep["rank"] == 0
    assert rep["checks"][-1]["name"] == "multinode" and "No module named 'torch'" in rep["checks"][-1]["detail"]
    assert rep["world"]["master"] == "10.0.0.1:29500" and rep["bandwidth_definition"] == mn.NCCL_TESTS_DOC
    assert run.finish(True) == 1 and out.getvalue().count("\n") == 1  # printed once, whatever comes later


def test_the_watchdog_fires_after_the_phase_deadline_and_not_before():
    fired = []
    done = threading.Event()
    dog = mn.Watchdog(lambda what: (fired.append((what, time.monotonic())), done.set()))
    try:
        start = time.monotonic()
        dog.phase("waiting for nothing", 0.5)
        assert done.wait(5)
        assert fired[0][0] == "waiting for nothing" and fired[0][1] - start >= 0.5
    finally:
        dog.stop()  # also cancels faulthandler's hard exit, which would end this pytest process
    quiet = mn.Watchdog(lambda what: fired.append(what))
    try:
        quiet.phase("long", 60)
        time.sleep(0.5)
    finally:
        quiet.stop()
    assert len(fired) == 1


def test_expiry_prints_the_phase_and_exits_1(tmp_path):
    """The watchdog's end in a real process: the rank's line names what it waited for, exit 1."""
    code = ("import io, sys, time; from types import SimpleNamespace; from envbuild.image import multinode as mn\n"
            "from envbuild.image.rendezvous import Rendezvous\n"
            "rdzv = Rendezvous(1, 2, 0, 'h', 1, 'env')\n"
            "run = mn.Run(SimpleNamespace(json=False, timeout=0.5), {'tag': 't'}, 'm', rdzv, sys.stdout)\n"
            "dog = mn.Watchdog(run.expired); dog.phase('waiting for rank 0', 0.5); time.sleep(30)\n")
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and time.monotonic() - start < 20
    assert r.stdout.startswith("multinode rank 1/2 on ") and \
        "FAILED: waiting for rank 0 did not finish within its deadline (--timeout 0.5s)" in r.stdout
