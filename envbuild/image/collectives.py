"""Collectives under a hard timeout, and the P2P measurement.

`collectives` runs all_reduce + all_gather across every local GPU (NCCL) or two CPU ranks
(gloo) with the image's own environment. `p2p` (two or more GPUs) runs all_reduce twice more,
with the P2P transport on and with NCCL_P2P_DISABLE=1, and says whether P2P hangs or fails on
this node (then the workaround is needed), the bus bandwidth of each, and what the workaround
costs.
"""

from __future__ import annotations

import os
import time

from . import sandbox
from .report import Skipped

P2P_VARIABLES = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL")


def bus_bandwidth(op: str, size_bytes: float, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s as nccl-tests defines it (size = the all_gather output size)."""
    if seconds <= 0 or nranks < 1:
        return 0.0
    factor = {"all_reduce": 2.0 * (nranks - 1) / nranks, "all_gather": (nranks - 1) / nranks}[op]
    return size_bytes * factor / seconds / 1e9


def size_words(size: int) -> str:
    """A byte count as people write it, to 4 digits (the report's data keeps the exact bytes).

    >>> size_words(1048576), size_words(16380), size_words(12)
    ('1 MiB', '16 KiB', '12 B')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} B"


def run_collectives(rank: int, world: int, backend: str, device, sizes: list[int], iterations: int) -> dict:
    """all_reduce(sum) and all_gather for each size: an untimed first round checks the values,
    then `iterations` timed rounds (mean seconds per round, this rank's clock). The one timed
    loop: the single-node child (children.py) and the multi-node ranks (multinode.py) both run it."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", device) if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    token = torch.zeros(1, device=dev)
    times: dict = {"all_reduce": {}, "all_gather": {}}
    gather = getattr(dist, "all_gather_into_tensor", None)
    for size in sizes:
        numel = size // 4
        buf = torch.full((numel,), float(rank + 1), device=dev)
        chunk = torch.full((numel // world,), float(rank), device=dev)
        out = torch.empty(numel, device=dev)
        for op in ("all_reduce", "all_gather"):
            for i in range(iterations + 1):
                if i == 1:
                    dist.all_reduce(token)  # line the ranks up before the clock starts
                    sync()
                    start = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(buf)
                elif gather is not None:
                    gather(out, chunk)
                else:
                    dist.all_gather(list(out.chunk(world)), chunk)
                if i == 0:
                    sync()
                    if op == "all_reduce" and not bool((buf == world * (world + 1) / 2).all()):
                        return {"ok": False, "detail": f"all_reduce of {size_words(size)}: wrong sum "
                                f"{buf[0].item()} (want {world * (world + 1) / 2:g})", "times": times}
                    if op == "all_gather" and not bool((out.view(world, -1) == torch.arange(
                            world, device=dev, dtype=out.dtype).view(world, 1)).all()):
                        return {"ok": False, "detail": f"all_gather of {size_words(size)}: wrong contents",
                                "times": times}
            sync()
            times[op][str(size)] = (time.perf_counter() - start) / iterations
    return {"ok": True, "detail": "", "times": times}


def hang_hint(backend: str, timeout: float) -> str:
    """Name the usual culprits, so a hung collective points at a fix, not at the user's code."""
    msg = (f"timed out after {timeout:g}s: the {backend} collective hung. Likely causes: NCCL P2P transport "
           "(try NCCL_P2P_DISABLE=1, as on H20); /dev/shm too small (docker --shm-size=16g or --ipc=host); "
           "NVLS (NCCL_NVLS_ENABLE=0); driver / fabric-manager version mismatch. Re-run with NCCL_DEBUG=INFO.")
    if backend == "gloo":
        msg += " For gloo on 127.0.0.1: loopback blocked or hostname unresolvable (try GLOO_SOCKET_IFNAME=lo)."
    return msg


class CollectiveRun:
    """One group of ranks: ``ok``, ``hang`` (killed at the deadline) or ``fail``, with rank 0's timings."""

    def __init__(self, state: str, detail: str = "", result: dict | None = None, nranks: int = 0):
        self.state = state
        self.detail = detail
        self.result = result or {}
        self.nranks = nranks

    def busbw(self, op: str = "all_reduce") -> float:
        if self.state != "ok":
            return 0.0
        return bus_bandwidth(op, self.result["size_bytes"], self.result[op + "_s"], self.nranks)


def run_collective(name: str, backend: str, nproc: int, args, work: str, env: dict, command=None) -> CollectiveRun:
    """Run `nproc` ranks of the collective child with `env`; `command(rank, result_path)` replaces
    the child (tests use a stand-in where no GPU or torch exists)."""
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sandbox.free_port()), WORLD_SIZE=str(nproc))
    if backend == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")

    def result_path(rank):
        return os.path.join(work, f"{name}-rank{rank}.json")

    def argv(rank):
        if command is not None:
            return command(rank, result_path(rank))
        return sandbox.self_command("--child", "collective", "--backend", backend, "--size-mb", str(args.size_mb),
                                    "--timeout", str(args.timeout), "--result", result_path(rank))

    outcome = sandbox.run_ranks(argv, nproc, env, args.timeout,
                                lambda rank: os.path.join(work, f"{name}-rank{rank}.log"))
    if outcome.state == "timeout":
        return CollectiveRun("hang", hang_hint(backend, args.timeout), nranks=nproc)
    if outcome.state == "failed":
        return CollectiveRun("fail", f"rank {outcome.failed_rank} exited {outcome.returncode}: {outcome.log_tail}",
                             nranks=nproc)
    results = [sandbox.read_json(result_path(rank)) for rank in range(nproc)]
    bad = [rank for rank, res in enumerate(results) if not res or not res.get("ok")]
    if bad:
        rank = bad[0]
        why = (results[rank] or {}).get("detail") or sandbox.tail(os.path.join(work, f"{name}-rank{rank}.log"))
        return CollectiveRun("fail", f"rank {rank}: {why}", nranks=nproc)
    return CollectiveRun("ok", "", results[0], nranks=nproc)


def check_collectives(backend: str, nproc: int, args, work: str, env: dict | None = None, command=None):
    """all_reduce + all_gather with the image's environment; any hang is killed at the deadline."""
    run = run_collective("collectives", backend, nproc, args, work, dict(os.environ if env is None else env),
                         command)
    if run.state != "ok":
        return False, run.detail
    size = run.result["size_bytes"]
    if nproc == 1:  # nothing crosses a bus: a busbw of 0 would read as a broken link
        parts = [f"{op} {run.result[op + '_s'] * 1e3:.2f} ms" for op in ("all_reduce", "all_gather")]
        return True, (f"{backend} x1, {size / 2**20:g} MiB: " + "; ".join(parts) + "; values ok (one rank: no "
                      "traffic between GPUs, so no bus bandwidth; it needs two or more ranks)")
    parts = [f"{op} {run.result[op + '_s'] * 1e3:.2f} ms busbw {run.busbw(op):.2f} GB/s"
             for op in ("all_reduce", "all_gather")]
    return True, f"{backend} x{nproc}, {size / 2**20:g} MiB: " + "; ".join(parts) + "; values ok"


# ----------------------------------------------------------------------------- P2P on / off
def p2p_env(environ: dict, enabled: bool) -> dict:
    """The environment of one P2P measurement. 'On' drops every P2P setting the image or the
    user made (a baked NCCL_P2P_DISABLE=1 must not leak into it); 'off' is NCCL_P2P_DISABLE=1."""
    env = {key: value for key, value in environ.items() if key not in P2P_VARIABLES}
    env["NCCL_P2P_DISABLE"] = "0" if enabled else "1"
    return env


def p2p_disabled(environ: dict) -> bool:
    """Does the environment training will run with turn P2P off?"""
    return environ.get("NCCL_P2P_DISABLE", "").strip() == "1" or \
        environ.get("NCCL_P2P_LEVEL", "").strip().upper() in ("LOC", "0")


def _outcome(run: CollectiveRun, timeout: float) -> str:
    return {"hang": f"hangs (killed after {timeout:g}s)", "fail": "fails"}[run.state] + \
        (f": {run.detail}" if run.state == "fail" else "")


def p2p_verdict(on: CollectiveRun, off: CollectiveRun, disabled_here: bool, timeout: float):
    """Decide from the two measurements; ok means training with this environment works here.

    Returns (ok, detail, data) with data = {p2p, busbw_p2p_on, busbw_p2p_off, workaround_cost_pct,
    workaround_needed}.
    """
    bw_on, bw_off = on.busbw(), off.busbw()
    data = {"p2p": on.state, "p2p_disabled": off.state, "busbw_p2p_on_gbps": round(bw_on, 2),
            "busbw_p2p_off_gbps": round(bw_off, 2), "workaround_cost_pct": None, "workaround_needed": None,
            "p2p_disabled_here": disabled_here}
    here = "NCCL_P2P_DISABLE=1 is set here" if disabled_here else "NCCL_P2P_DISABLE=1 is not set here"
    if on.state == "ok" and off.state == "ok":
        cost = (bw_on - bw_off) / bw_on * 100 if bw_on > 0 else 0.0
        data.update(workaround_cost_pct=round(cost, 1), workaround_needed=False)
        detail = (f"P2P works on this node: all_reduce busbw {bw_on:.2f} GB/s with P2P, {bw_off:.2f} GB/s with "
                  f"NCCL_P2P_DISABLE=1; the workaround costs {cost:.0f}% of the bandwidth")
        if disabled_here:
            detail += (f". {here} (baked or yours) but not needed on this node: "
                       "run with NCCL_P2P_DISABLE=0 to get the bandwidth back")
        return True, detail, data
    if on.state != "ok" and off.state == "ok":
        data["workaround_needed"] = True
        detail = (f"P2P {_outcome(on, timeout)} on this node: the workaround NCCL_P2P_DISABLE=1 is needed "
                  f"(all_reduce busbw with it {bw_off:.2f} GB/s). {here}")
        if not disabled_here:
            detail += ": set it (docker run -e NCCL_P2P_DISABLE=1, apptainer --env, or envbuild render --env)"
        return disabled_here, detail, data
    if on.state == "ok":
        data["workaround_needed"] = False
        detail = (f"P2P works ({bw_on:.2f} GB/s) but all_reduce with NCCL_P2P_DISABLE=1 "
                  f"{_outcome(off, timeout)}. {here}")
        if disabled_here:
            detail += ": unset it on this node (NCCL_P2P_DISABLE=0)"
        return not disabled_here, detail, data
    detail = (f"all_reduce {_outcome(on, timeout)} with P2P and {_outcome(off, timeout)} with "
              "NCCL_P2P_DISABLE=1: not a P2P problem (see the collectives check)")
    return False, detail, data


def check_p2p(gpus: int, args, work: str, environ: dict | None = None, command=None):
    """Measure all_reduce with P2P on and off, each in its own ranks under the hard timeout."""
    environ = dict(os.environ if environ is None else environ)
    if gpus < 2:
        return Skipped("P2P needs two or more GPUs" if gpus else "CPU mode: no GPU")
    nproc = min(args.nproc or gpus, gpus)
    if nproc < 2:
        return Skipped(f"--nproc {nproc}: P2P needs two or more ranks")
    on = run_collective("p2p-on", "nccl", nproc, args, work, p2p_env(environ, True), command)
    off = run_collective("p2p-off", "nccl", nproc, args, work, p2p_env(environ, False), command)
    ok, detail, data = p2p_verdict(on, off, p2p_disabled(environ), args.timeout)
    return ok, f"nccl x{nproc}: {detail}", None, data
