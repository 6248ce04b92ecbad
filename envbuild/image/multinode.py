"""The multi-node smoke test: every rank of a job proves it runs the same image on a sane node,
then the whole world runs collectives under a hard deadline.

    torchrun --nnodes N --nproc-per-node G ... /opt/envbuild/smoke.py --multinode [--json]
    srun --ntasks-per-node G python /opt/envbuild/smoke.py --multinode [--json]

A job across nodes fails in ways one node cannot show: a node pulled another image (or an
older build under the same tag), has another driver, or never starts, and then the job hangs
in its first collective. So each rank publishes a fingerprint (image content, lock, stack,
fabric, driver, GPU) in the rendezvous store *before* any collective; rank 0 names every host
that differs from the majority, and names the ranks that never joined when its deadline
passes. Only then do all ranks run all_reduce and all_gather (NCCL on GPUs, else gloo) for a
few sizes, reporting bus bandwidth as nccl-tests defines it and the slowest rank. Every wait
has a deadline; a watchdog turns any wait past it into a clear error and a non-zero exit.
Exit 0 iff every rank passed, 1 otherwise, 2 on usage errors (no rendezvous variables).

This module runs one rank through those phases under the watchdog and prints its word; each
phase's own work lives in its module: rendezvous.py, fingerprints.py, bandwidth.py.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time

from .bandwidth import message_sizes, op_detail, summarize
from .collectives import run_collectives, size_words
from .fingerprints import (compare_fingerprints, describe_mismatches, describe_same, fingerprint, fp_key,
                           missing_message, read_fingerprints, show, wait_for_ranks)
from .manifest import UsageError, load_manifest, manifest_path
from .rendezvous import Rendezvous, connect_store, rendezvous_from_env
from .report import build_report, render_text, short_error

FINISH_WAIT_S = 10.0  # how long rank 0 keeps the store up for the others to read the verdict
BACKSTOP_GRACE_S = 10.0  # faulthandler's hard exit, should a hang hold the interpreter lock
ITERATIONS = 5
NCCL_TESTS_DOC = "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md"


# ----------------------------------------------------------------------------- deadlines
class Watchdog:
    """A deadline per phase; past it the rank reports what it waited for and exits 1. A faulthandler
    timer backs it up, for a hang that holds the interpreter lock."""

    def __init__(self, expire):
        self.expire = expire
        self.lock = threading.Lock()
        self.deadline = None
        self.what = ""
        self.stopped = threading.Event()
        threading.Thread(target=self._run, name="envbuild-watchdog", daemon=True).start()

    def phase(self, what: str, seconds: float) -> None:
        with self.lock:
            self.what, self.deadline = what, time.monotonic() + seconds
        faulthandler.dump_traceback_later(seconds + BACKSTOP_GRACE_S, exit=True)

    def stop(self) -> None:
        self.stopped.set()
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        while not self.stopped.wait(0.2):
            with self.lock:
                late = self.deadline is not None and time.monotonic() > self.deadline
                what = self.what
            if late:
                self.expire(what)
                return


# ----------------------------------------------------------------------------- one rank
class Run:
    """One rank's run: the rendezvous, the fingerprints, the collectives, and what it prints."""

    def __init__(self, args, manifest: dict, path: str, rdzv: Rendezvous, out):
        self.args, self.manifest, self.path, self.rdzv, self.out = args, manifest, path, rdzv, out
        self.fp: dict = {"rank": rdzv.rank, "host": socket.gethostname()}
        self.fps: list[dict] = []
        self.checks: list[dict] = []
        self.rows: list[dict] = []
        self.printed = threading.Lock()

    # -- output
    def check(self, name: str, ok: bool, detail: str, started: float, data=None, seconds=None) -> None:
        seconds = time.monotonic() - started if seconds is None else seconds
        entry = {"name": name, "ok": bool(ok), "detail": detail, "seconds": round(seconds, 3)}
        if data:
            entry["data"] = data
        self.checks.append(entry)

    def report(self) -> dict:
        rep = build_report(self.manifest, "multinode", self.checks, self.path)
        rep.update(rank=self.rdzv.rank, world=dict(self.rdzv.as_dict(), backend=self.fp.get("backend")),
                   ranks=self.fps or [self.fp], bandwidth=self.rows, bandwidth_definition=NCCL_TESTS_DOC)
        return rep

    def rank_line(self, ok: bool, error: str = "") -> str:
        fp = self.fp
        what = (f"image {show(fp.get('tag'))} manifest {show(fp.get('manifest_sha256'))} torch {show(fp.get('torch'))} "
                f"NCCL {show(fp.get('nccl'))} DeepSpeed {show(fp.get('deepspeed'))} fabric {show(fp.get('fabric'))} "
                f"driver {show(fp.get('driver'))} GPU {show(fp.get('gpu'))} backend {show(fp.get('backend'))}")
        head = f"multinode rank {self.rdzv.rank}/{self.rdzv.world_size} on {fp.get('host')}"
        return f"{head}: {'ok' if ok else 'FAILED: ' + error} | {what}"

    def finish(self, ok: bool, error: str = "") -> int:
        """Print this rank's line (rank 0: the verdict) exactly once; the exit code."""
        if not self.printed.acquire(blocking=False):
            return 1
        if self.rdzv.rank == 0:
            if error and not any(not c["ok"] for c in self.checks):
                self.checks.append({"name": "multinode", "ok": False, "detail": error, "seconds": 0.0})
            rep = self.report()
            ok = ok and bool(rep["ok"])
            if self.args.json:
                print(json.dumps(rep), file=self.out)
            else:
                print(self.rank_line(ok, error or "see the verdict") + "\n" + render_text(rep), file=self.out)
        elif self.args.json:
            print(json.dumps({"rank": self.rdzv.rank, "world_size": self.rdzv.world_size, "host": self.fp.get("host"),
                              "ok": ok, "error": error or None, "fingerprint": self.fp}), file=self.out)
        else:
            print(self.rank_line(ok, error), file=self.out)
        self.out.flush()
        return 0 if ok else 1

    def expired(self, what: str) -> None:
        """The watchdog's end: say what never finished, then exit without waiting on anything."""
        if self.printed.locked():
            return  # the rank already said its word and is exiting
        code = self.finish(False, f"{what} did not finish within its deadline (--timeout {self.args.timeout:g}s)")
        sys.stderr.flush()
        os._exit(code or 1)

    # -- phases
    def run(self) -> int:
        timeout = self.args.timeout
        # c10d logs each expected timeout with a C++ backtrace on stderr; this rank's line says it
        # better. TORCH_CPP_LOG_LEVEL=INFO (set by the user) brings them back.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        dog = Watchdog(self.expired)
        try:
            return self._run(dog, timeout)
        finally:
            dog.stop()

    def _run(self, dog: Watchdog, timeout: float) -> int:
        rdzv, started = self.rdzv, time.monotonic()
        self.fp = fingerprint(self.manifest, self.path, rdzv)
        where = f"{rdzv.master_addr}:{rdzv.master_port}"
        dog.phase(f"connecting to the rendezvous at {where}", timeout + 15)
        try:
            store = connect_store(rdzv, timeout)
        except ImportError as error:  # no torch: nothing to join with, so say it here
            return self.finish(False, f"{self.fp.get('error') or type(error).__name__ + ': ' + short_error(error)}")
        except Exception as error:  # noqa: BLE001
            if rdzv.rank == 0:
                return self.finish(False, f"rank 0 could not serve the rendezvous at {where} within {timeout:g}s "
                                   f"({short_error(error)}): another process may hold the port (pick another "
                                   "MASTER_PORT), or MASTER_ADDR is not an address of this host, or name lookups "
                                   "here are slow (a DNS server that does not answer)")
            return self.finish(False, f"could not reach rank 0's rendezvous at {where} within {timeout:g}s "
                               f"({short_error(error)}): rank 0 has not started, or MASTER_ADDR/MASTER_PORT are wrong, "
                               "or a firewall blocks the port")
        try:
            return self._with_store(store, dog, timeout, started)
        except Exception as error:  # noqa: BLE001 - the store or process group failed: one clear line
            return self.finish(False, f"{type(error).__name__}: {short_error(error)}")

    def _with_store(self, store, dog: Watchdog, timeout: float, started: float) -> int:
        rdzv = self.rdzv
        store.set(fp_key(rdzv.rank), json.dumps(self.fp))
        if rdzv.rank == 0:
            dog.phase(f"waiting for all {rdzv.world_size} ranks to join", timeout + 15)
            verdict = self._judge(store, timeout, started)
            store.set("verdict", json.dumps(verdict))
        else:
            from datetime import timedelta

            dog.phase("waiting for rank 0's verdict on the fingerprints", 2 * timeout + 25)
            try:
                store.wait(["verdict"], timedelta(seconds=2 * timeout + 10))
            except Exception as error:  # noqa: BLE001
                return self.finish(False, f"no verdict from rank 0 at {rdzv.master_addr}:{rdzv.master_port}: "
                                   f"{short_error(error)} (rank 0 exited or its node is unreachable)")
            verdict = json.loads(store.get("verdict"))
        if verdict.get("abort"):
            self._done(store, dog, verdict.get("joined", rdzv.world_size))
            return self.finish(False, verdict["abort"] if rdzv.rank == 0 else f"rank 0 stopped the run: "
                               f"{verdict['abort']}")
        mine = (verdict.get("deviants") or {}).get(str(rdzv.rank))
        differs = (self.fp["error"] if self.fp.get("error") else
                   f"this rank differs from the majority: {', '.join(mine)} (see rank 0)" if mine else
                   "" if verdict.get("ok") else "other ranks' fingerprints differ (see rank 0)")
        if not verdict.get("collectives"):
            self._done(store, dog, rdzv.world_size)
            return self.finish(False, differs + "; collectives not run: not every rank can run them alike")
        ok, error = self._collectives(store, dog, timeout)
        self._done(store, dog, rdzv.world_size)
        return self.finish(ok and verdict.get("ok", False), "; ".join(filter(None, [differs, error])))

    def _judge(self, store, timeout: float, started: float) -> dict:
        """Rank 0: wait for every rank, compare the fingerprints, decide whether to go on."""
        world = self.rdzv.world_size
        missing = wait_for_ranks(store, world, timeout)
        if missing:
            joined = [json.loads(store.get(fp_key(r))) for r in range(world) if r not in missing]
            message = missing_message(missing, joined, world, timeout)
            self.fps = joined
            self.check("rendezvous", False, message, started, {"missing_ranks": missing})
            return {"abort": message, "joined": world - len(missing)}
        self.fps = read_fingerprints(store, world)
        hosts = sorted({fp.get("host") for fp in self.fps})
        self.check("rendezvous", True, f"{world} ranks joined from {len(hosts)} host{'s' * (len(hosts) != 1)} "
                   f"({', '.join(hosts[:8])}{' ...' if len(hosts) > 8 else ''}) via {self.rdzv.launcher}, "
                   f"master {self.rdzv.master_addr}:{self.rdzv.master_port}", started)
        now = time.monotonic()
        broken = [fp for fp in self.fps if fp.get("error")]
        if broken:
            self.check("ranks", False, "; ".join(f"rank {fp['rank']} on {fp.get('host')}: {fp['error']}"
                                                 for fp in broken[:8]), now, {"ranks": [fp["rank"] for fp in broken]})
        healthy = [fp for fp in self.fps if not fp.get("error")]
        diffs = compare_fingerprints(healthy)
        if diffs:
            self.check("fingerprints", False, describe_mismatches(diffs, len(healthy)), now, {"mismatches": diffs})
        elif healthy:
            self.check("fingerprints", True, describe_same(healthy), now)
        blocking = bool(broken) or any(d["blocking"] for d in diffs)
        for fp in broken:
            diffs.append({"rank": fp["rank"], "words": f"its stack could not be read ({fp['error']})"})
        deviants: dict = {}
        for diff in diffs:
            deviants.setdefault(str(diff["rank"]), []).append(diff["words"])
        return {"ok": not diffs and not broken, "collectives": not blocking, "deviants": deviants}

    def _collectives(self, store, dog: Watchdog, timeout: float) -> tuple[bool, str]:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        rdzv, backend, device = self.rdzv, self.fp["backend"], self.fp.get("device")
        if backend == "nccl":
            torch.cuda.set_device(device)
        started = time.monotonic()
        dog.phase(f"init_process_group({backend}) over {rdzv.world_size} ranks", timeout + 15)
        try:
            dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=rdzv.rank,
                                    world_size=rdzv.world_size, timeout=timedelta(seconds=timeout))
        except Exception as error:  # noqa: BLE001
            iface = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
            return False, (f"init_process_group({backend}) failed: {short_error(error)}. Every rank joined the "
                           "rendezvous, so a rank died since, or the ranks cannot reach each other's own addresses "
                           f"(rank-to-rank traffic, not only to rank 0: set {iface} to the interface they share)")
        try:
            sizes = message_sizes(self.args.size_mb, rdzv.world_size)
            dog.phase(f"all_reduce/all_gather of up to {size_words(sizes[-1])} over {rdzv.world_size} ranks "
                      "(a rank died, or the network between the nodes drops traffic; re-run with NCCL_DEBUG=INFO)",
                      timeout)
            try:
                mine = run_collectives(rdzv.rank, rdzv.world_size, backend, device, sizes, ITERATIONS)
            except Exception as error:  # noqa: BLE001 - still share it, so rank 0 can name this rank
                mine = {"ok": False, "detail": f"{type(error).__name__}: {short_error(error)}", "times": {}}
            dog.phase("gathering the collective results", timeout)
            results: list = [None] * rdzv.world_size
            dist.all_gather_object(results, dict(mine, rank=rdzv.rank))
        finally:
            dist.destroy_process_group()
        bad = [res for res in results if not res.get("ok")]
        hosts = [fp.get("host") for fp in self.fps] or [None] * rdzv.world_size
        if rdzv.rank == 0:
            if bad:
                detail = "; ".join(f"rank {res['rank']}: {res['detail']}" for res in bad[:8])
                self.check("collectives", False, detail, started)
            else:
                self.rows = summarize(results, hosts, rdzv.world_size)
                for op in ("all_reduce", "all_gather"):
                    rows = [r for r in self.rows if r["op"] == op]
                    self.check(op, True, op_detail(self.rows, op, backend, rdzv.world_size), started,
                               {"sizes": rows}, seconds=sum(r["seconds"] for r in rows) * (ITERATIONS + 1))
        if bad:
            return False, "collectives failed (" + "; ".join(f"rank {r['rank']}: {r['detail']}" for r in bad[:3]) + ")"
        return True, ""

    def _done(self, store, dog: Watchdog, present: int) -> None:
        """Everyone says it is done; rank 0 keeps serving the store until they have (bounded)."""
        dog.phase("finishing", FINISH_WAIT_S + 15)
        try:
            store.add("done", 1)
            if self.rdzv.rank == 0:
                deadline = time.monotonic() + FINISH_WAIT_S
                while store.add("done", 0) < present and time.monotonic() < deadline:
                    time.sleep(0.1)
        except Exception:  # noqa: BLE001 - rank 0 already gone: nothing left to tell it
            pass


def main(args, reserve) -> int:
    """`smoke.py --multinode`: usage errors (exit 2) before anything waits; then one rank's run.
    `reserve(enabled)` is cli.stdout_reserved (with --json, fd 1 carries only our JSON)."""
    try:
        rdzv = rendezvous_from_env()
        path = manifest_path(args.manifest)
        manifest = load_manifest(path)
    except UsageError as error:
        print(str(error) if str(error).startswith("smoke.py") else f"smoke.py: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(error), "checks": []}))
        return 2
    with reserve(args.json) as out:
        return Run(args, manifest, path, rdzv, out).run()
