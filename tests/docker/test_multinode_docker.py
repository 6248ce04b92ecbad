"""The multi-node smoke test for real: containers as nodes, each in its own network namespace
on a user-defined Docker bridge (`docker network create`; traffic stays on this machine),
started from the CI image the way jobs start (torchrun on each node; srun-style variables;
plain RANK/WORLD_SIZE), over gloo (no GPU here).

- two nodes x two ranks under torchrun pass, with bandwidth per size and the slowest rank;
- three srun-style nodes, one started from a DIFFERENT image (the CI image with its manifest
  rebuilt under the same tag): rank 0 names that host and all ranks exit 1;
- a rank that never starts: rank 0 names it and every started rank exits 1 within the
  deadline (--timeout 8) plus start-up, never a hang; a rank whose rank 0 never starts says
  it could not reach the rendezvous.

Time: 32-55 s on this 2-core machine (9 + 6 + 14 s for the three tests when it is idle) once
the CI image is built: the module fixture builds it (conftest.run_build, as every real build),
which BuildKit's cache makes a few seconds after the first build (the module alone from an
empty cache: 8 min here, 2026-11-26, PyPI through a TLS proxy). Containers, the network and the images are this run's own (conftest.unique)
and removed in finally blocks, on failure too.
"""

from __future__ import annotations

import functools
import json
import secrets
import subprocess
import time

import pytest

import conftest
from conftest import ci_stack_id, remove_images, run_build, unique

REPO = unique("envbuild-multinode")
OPS = "cpu_adam,fused_adam"
SMOKE = ["python", "/opt/envbuild/smoke.py", "--multinode"]
TIMEOUT = 8  # --timeout of the runs that must fail on a missing rank
RUN_LIMIT = 120  # the most any one run here may take before the test calls it a hang


docker = functools.partial(conftest.docker, timeout=300)


@pytest.fixture(scope="module")
def ci_image(docker_engine, tmp_path_factory):
    """The CI image (h20, the CI stack, CPU and fused Adam ops)."""
    out = tmp_path_factory.mktemp("multinode") / "h20"
    r = run_build("--gpu", "h20", "--stack", ci_stack_id(), "--ds-ops", OPS, "--image-repo", REPO, "-o", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    image = f"{REPO}:{json.loads((out / 'manifest.json').read_text())['tag']}"
    yield image
    remove_images(REPO)


@pytest.fixture(scope="module")
def odd_image(ci_image):
    """The CI image rebuilt with one change to its manifest, under a tag of its own: what a node
    runs when it pulled another build of the 'same' image."""
    tag = f"{REPO}-odd:{secrets.token_hex(4)}"
    dockerfile = (f"FROM {ci_image}\nRUN /opt/venv/bin/python -c \"import json; p = '/opt/envbuild/manifest.json'; "
                  "m = json.load(open(p)); m['rebuilt_by'] = 'test_multinode_docker'; "
                  "json.dump(m, open(p, 'w'), indent=2)\"\n")
    docker("build", "-q", "-t", tag, "-", input=dockerfile)
    try:
        yield tag
    finally:
        docker("rmi", "-f", tag, check=False)


class Cluster:
    """Containers on one user-defined bridge network; everything it made goes in `close`."""

    def __init__(self):
        self.prefix = f"envbuild-mn-{secrets.token_hex(3)}"
        self.network = self.prefix
        self.names: list[str] = []
        docker("network", "create", "--driver", "bridge", self.network)

    def start(self, node: str, image: str, command: list[str], env: dict | None = None) -> str:
        name = f"{self.prefix}-{node}"
        flags = [f for key, value in (env or {}).items() for f in ("-e", f"{key}={value}")]
        return self.run(["run", "-d", "--name", name, "--hostname", name, "--network", self.network, *flags, image,
                         *command])

    def run(self, args: list[str]) -> str:
        """`docker run -d ARGS` (its --name among them), removed in `close`: the container's name."""
        self.names.append(args[args.index("--name") + 1])
        docker(*args)
        return self.names[-1]

    def address(self, name: str) -> str:
        return docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name).stdout.strip()

    def netns(self, name: str) -> str:
        return docker("inspect", "-f", "{{.NetworkSettings.SandboxKey}}", name).stdout.strip()

    def wait(self, names: list[str], limit: float = RUN_LIMIT) -> dict:
        """Each container's exit code, stdout, stderr and when it ended (seconds from now)."""
        start, done = time.monotonic(), {}
        for name in names:
            left = max(1.0, limit - (time.monotonic() - start))
            try:
                code = int(docker("wait", name, timeout=left).stdout.strip())
            except subprocess.TimeoutExpired:
                logs = docker("logs", name, check=False)
                raise AssertionError(f"{name} still runs after {limit:g}s (a hang): "
                                     f"{logs.stdout[-1500:]} {logs.stderr[-1500:]}") from None
            logs = docker("logs", name, check=False)
            done[name] = {"rc": code, "out": logs.stdout, "err": logs.stderr, "s": time.monotonic() - start}
        return done

    def close(self) -> None:
        if self.names:
            docker("rm", "-f", *self.names, check=False)
        docker("network", "rm", self.network, check=False)


@pytest.fixture
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _verdict(result: dict) -> dict:
    (report,) = [obj for obj in _json_lines(result["out"]) if "checks" in obj]
    return report


def _checks(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_two_nodes_under_torchrun_pass_with_bandwidth(ci_image, cluster):
    def torchrun(rank, addr):
        return ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(rank), "--master-addr",
                addr, "--master-port", "29500", *SMOKE[1:], "--json", "--timeout", "60", "--size-mb", "4"]

    node0 = cluster.start("node0", ci_image, torchrun(0, f"{cluster.prefix}-node0"))  # its own name
    addr = cluster.address(node0)  # known once it runs: the other node is given this address
    node1 = cluster.start("node1", ci_image, torchrun(1, addr))
    assert cluster.netns(node0) != cluster.netns(node1), "the two nodes share a network namespace"
    done = cluster.wait([node0, node1])
    assert [done[n]["rc"] for n in (node0, node1)] == [0, 0], done
    report = _verdict(done[node0])
    checks = _checks(report)
    assert report["ok"] and report["mode"] == "multinode" and report["world"]["world_size"] == 4
    assert report["world"]["launcher"] == "torchrun" and report["world"]["backend"] == "gloo"
    assert "4 ranks joined from 2 hosts" in checks["rendezvous"]["detail"]
    assert {r["host"] for r in report["ranks"]} == {node0, node1}
    assert checks["fingerprints"]["ok"] and "all 4 ranks on 2 hosts run image" in checks["fingerprints"]["detail"]
    rows = report["bandwidth"]
    assert {(r["op"], r["size_bytes"]) for r in rows} == {(op, s) for op in ("all_reduce", "all_gather")
                                                           for s in (65536, 524288, 4194304)}
    assert all(r["busbw_gbps"] > 0 and r["slowest_host"] in (node0, node1) for r in rows)
    for op in ("all_reduce", "all_gather"):
        assert checks[op]["ok"] and checks[op]["detail"].startswith("gloo x4: 64 KiB")
    others = [obj for n in (node0, node1) for obj in _json_lines(done[n]["out"]) if "checks" not in obj]
    assert sorted(o["rank"] for o in others) == [1, 2, 3] and all(o["ok"] for o in others)
    print(f"\ntwo nodes x 2 ranks under torchrun: {max(d['s'] for d in done.values()):.1f}s; "
          + "; ".join(f"{r['op']} {r['size_bytes']} B busbw {r['busbw_gbps']} GB/s" for r in rows))


def test_a_node_running_another_image_is_named(ci_image, odd_image, cluster):
    """srun-style variables (SLURM_JOB_NODELIST in hostlist syntax, the port from the job id);
    the middle node runs the rebuilt image, so the majority (2 of 3) names it."""
    prefix = cluster.prefix
    env = {"SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "30042",
           "SLURM_JOB_NODELIST": f"{prefix}-node[0-2]"}
    names = [cluster.start(f"node{r}", odd_image if r == 1 else ci_image,
                           [*SMOKE, "--json", "--timeout", "60", "--size-mb", "1"], dict(env, SLURM_PROCID=str(r)))
             for r in range(3)]
    done = cluster.wait(names)
    assert [done[n]["rc"] for n in names] == [1, 1, 1], done
    report = _verdict(done[names[0]])
    checks = _checks(report)
    assert report["world"]["master"] == f"{prefix}-node0:15042" and report["world"]["launcher"] == "srun"
    assert not report["ok"] and checks["rendezvous"]["ok"] and not checks["fingerprints"]["ok"]
    detail = checks["fingerprints"]["detail"]
    assert f"host {names[1]} (rank 1): image content (sha256 of manifest.json)" in detail
    assert "where 2 of 3 ranks have" in detail and names[0] not in detail and names[2] not in detail
    assert [d["rank"] for d in checks["fingerprints"]["data"]["mismatches"]] == [1]
    assert checks["all_reduce"]["ok"]  # same stack: the collectives still ran and measured
    (odd,) = _json_lines(done[names[1]]["out"])
    assert odd["error"].startswith("this rank differs from the majority: image content")
    (other,) = _json_lines(done[names[2]]["out"])
    assert other["error"] == "other ranks' fingerprints differ (see rank 0)"
    print(f"\nmismatched image named in {max(d['s'] for d in done.values()):.1f}s: {detail}")


def test_a_rank_that_never_starts_is_a_clear_timeout_not_a_hang(ci_image, cluster):
    """World of 3, rank 2 never starts; and, beside it, a rank 1 whose rank 0 never starts (its
    node is up, the process is not)."""
    args = [*SMOKE, "--json", "--timeout", str(TIMEOUT)]
    node0 = cluster.start("node0", ci_image, args, {"RANK": "0", "WORLD_SIZE": "3",
                                                     "MASTER_ADDR": f"{cluster.prefix}-node0", "MASTER_PORT": "29500"})
    addr = cluster.address(node0)
    node1 = cluster.start("node1", ci_image, args, {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": addr,
                                                     "MASTER_PORT": "29500"})
    idle = cluster.start("idle", ci_image, ["sleep", "infinity"])
    lone = cluster.start("lone", ci_image, args, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": cluster.address(idle),
                                                   "MASTER_PORT": "29500"})
    start = time.monotonic()
    done = cluster.wait([node0, node1, lone], limit=TIMEOUT + 60)
    took = time.monotonic() - start
    assert [done[n]["rc"] for n in (node0, node1, lone)] == [1, 1, 1], done
    report = _verdict(done[node0])
    rendezvous = _checks(report)["rendezvous"]
    assert not report["ok"] and rendezvous["data"]["missing_ranks"] == [2]
    assert rendezvous["detail"].startswith(f"rank 2 of 3 never joined within {TIMEOUT}s (2 joined, from ")
    assert set(report) >= {"checks", "ranks"} and "all_reduce" not in _checks(report)
    (one,) = _json_lines(done[node1]["out"])
    assert one["error"].startswith("rank 0 stopped the run: rank 2 of 3 never joined")
    (alone,) = _json_lines(done[lone]["out"])
    assert alone["error"].startswith(f"could not reach rank 0's rendezvous at {cluster.address(idle)}:29500 "
                                     f"within {TIMEOUT}s (nothing accepts connections at ")
    for result in done.values():
        assert "Traceback" not in result["err"] and "frame #" not in result["err"]
    assert took < TIMEOUT + 30, took  # container start + torch import + the deadline
    print(f"\nmissing rank named after {done[node0]['s']:.1f}s, unreachable rank 0 after {done[lone]['s']:.1f}s "
          f"(--timeout {TIMEOUT})")
