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
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections import Counter

from . import node, paths
from .nccl import loaded_version
from .collectives import bus_bandwidth, run_collectives, size_words
from .manifest import UsageError, load_manifest, manifest_path
from .report import build_report, render_text
from .sandbox import sha256_file
from .versions import normalize_version

TORCH_DEFAULT_PORT = 29500  # torchrun's --master-port default
SLURM_PORT_BASE = 15000  # PyTorch Lightning's SLURM convention: 15000 + the job id's last 4 digits
STORE_PREFIX = "envbuild-multinode"
FINISH_WAIT_S = 10.0  # how long rank 0 keeps the store up for the others to read the verdict
BACKSTOP_GRACE_S = 10.0  # faulthandler's hard exit, should a hang hold the interpreter lock
ITERATIONS = 5
NCCL_TESTS_DOC = "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md"

USAGE = ("smoke.py --multinode: no rendezvous variables are set, so this process cannot know its rank "
         "or where rank 0 is. Start one process per rank the way the job starts, e.g. "
         "`torchrun --nnodes 2 --nproc-per-node 8 --node-rank I --master-addr HOST --master-port 29500 "
         "/opt/envbuild/smoke.py --multinode` on each node, or `srun --ntasks-per-node 8 python "
         "/opt/envbuild/smoke.py --multinode` in an allocation (rank 0's host is the first of "
         "SLURM_JOB_NODELIST), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (LOCAL_RANK picks the "
         "GPU) yourself. Without them, run the single-node smoke test: drop --multinode.")


# ----------------------------------------------------------------------------- rendezvous
def _slurm_range(text: str, whole: str) -> list[str]:
    """One bracket entry ('01-03' or '7'), zero-padded to its lower bound's width as Slurm does."""
    low, _, high = text.partition("-")
    if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
        raise UsageError(f"SLURM nodelist {whole!r}: bad range {text!r} (expected N or N-M with N <= M)")
    return [str(i).zfill(len(low)) for i in range(int(low), int(high or low) + 1)]


def _expand_one(pattern: str, whole: str) -> list[str]:
    """Expand one host pattern; several bracket groups expand left to right (a cartesian product)."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise UsageError(f"SLURM nodelist {whole!r}: unbalanced ']'")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise UsageError(f"SLURM nodelist {whole!r}: unbalanced '['")
    head, ranges, tail = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    numbers = [n for part in ranges.split(",") for n in _slurm_range(part.strip(), whole)]
    return [head + n + rest for n in numbers for rest in _expand_one(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact hostlist as hosts, in order (what `scontrol show hostnames` prints).

    >>> expand_hostlist("node[01-03,7],login1")
    ['node01', 'node02', 'node03', 'node7', 'login1']
    >>> expand_hostlist("rack[1-2]-gpu[3,5]")
    ['rack1-gpu3', 'rack1-gpu5', 'rack2-gpu3', 'rack2-gpu5']
    """
    hosts, depth, start = [], 0, 0
    for at, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1) or (at == len(text) and depth):
            raise UsageError(f"SLURM nodelist {text!r}: unbalanced {'[' if depth > 0 else ']'!r}")
        if char == "," and depth == 0:
            item = text[start:at].strip()
            if item:
                hosts.extend(_expand_one(item, text))
            start = at + 1
    return hosts


def slurm_port(job_id: str) -> int:
    """A port every rank of a Slurm job derives alike: 15000 + the job id's last four digits.

    PyTorch Lightning's convention (src/lightning/fabric/plugins/environments/slurm.py), so two
    jobs sharing a node rarely collide.
    >>> slurm_port("7099018")
    24018
    """
    return SLURM_PORT_BASE + int(job_id.strip()[-4:])


class Rendezvous:
    """Where this rank stands: rank, world size, local rank, rank 0's address, and who said so."""

    def __init__(self, rank, world_size, local_rank, master_addr, master_port, launcher, notes=()):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.launcher, self.notes = launcher, list(notes)

    def as_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "master": f"{self.master_addr}:{self.master_port}", "launcher": self.launcher, "notes": self.notes}


def _int_var(environ, name: str, minimum: int = 0) -> int:
    value = environ.get(name, "").strip()
    if not value.isdigit() or int(value) < minimum:
        raise UsageError(f"smoke.py --multinode: {name}={value!r} is not a whole number >= {minimum}")
    return int(value)


def _first(environ, *names):
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None, None


def rendezvous_from_env(environ=None) -> Rendezvous:
    """torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) win; else srun's (SLURM_PROCID,
    SLURM_NTASKS, the first host of the step's or job's nodelist, a port from SLURM_JOB_ID);
    else a UsageError. MASTER_ADDR / MASTER_PORT set by the user override what Slurm implies."""
    env = os.environ if environ is None else environ
    notes = []
    if env.get("RANK") or env.get("WORLD_SIZE"):
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if not env.get(name, "").strip()]
        if missing:
            raise UsageError(f"smoke.py --multinode: RANK/WORLD_SIZE are set but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not: set {missing[0]} (rank 0's host for "
                             "MASTER_ADDR), as torchrun does")
        rank, world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE", 1)
        _, local = _first(env, "LOCAL_RANK", "SLURM_LOCALID")
        addr = env["MASTER_ADDR"].strip()
        launcher = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "env"
    elif env.get("SLURM_PROCID"):
        rank = _int_var(env, "SLURM_PROCID")
        count_var, _ = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        if not count_var:
            raise UsageError("smoke.py --multinode: SLURM_PROCID is set but SLURM_NTASKS is not: run it under "
                             "srun (one task per rank), not in the batch script itself")
        world = _int_var(env, count_var, 1)
        local = env.get("SLURM_LOCALID")
        list_var, nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if env.get("MASTER_ADDR", "").strip():
            addr = env["MASTER_ADDR"].strip()
        elif nodelist:
            hosts = expand_hostlist(nodelist)
            if not hosts:
                raise UsageError(f"smoke.py --multinode: {list_var}={nodelist!r} names no host")
            addr = hosts[0]
            notes.append(f"MASTER_ADDR {addr}: the first host of {list_var}={nodelist}")
        else:
            raise UsageError("smoke.py --multinode: under Slurm but neither SLURM_JOB_NODELIST nor MASTER_ADDR "
                             "is set: set MASTER_ADDR to rank 0's host")
        launcher = "srun"
    else:
        raise UsageError(USAGE)
    if rank >= world:
        raise UsageError(f"smoke.py --multinode: rank {rank} is outside a world of {world} ranks (0..{world - 1})")
    if env.get("MASTER_PORT", "").strip():
        port = _int_var(env, "MASTER_PORT", 1)
    elif launcher == "srun" and env.get("SLURM_JOB_ID", "").strip()[-4:].isdigit():
        port = slurm_port(env["SLURM_JOB_ID"])
        notes.append(f"MASTER_PORT {port}: derived from SLURM_JOB_ID={env['SLURM_JOB_ID'].strip()}")
    else:
        port = TORCH_DEFAULT_PORT
        notes.append(f"MASTER_PORT {port}: torchrun's default (MASTER_PORT unset)")
    if port > 65535:
        raise UsageError(f"smoke.py --multinode: MASTER_PORT={port} is not a TCP port (1..65535)")
    local_rank = int(local) if local and local.strip().isdigit() else 0
    return Rendezvous(rank, world, local_rank, addr, port, launcher, notes)


# ----------------------------------------------------------------------------- fingerprints
def image_fingerprint(manifest: dict, path: str) -> dict:
    """What the image is: its manifest's and lock's bytes (a rebuild under the same tag differs
    here), its tag, and the fabric it was built for. The lock lies beside the manifest."""
    fabric = manifest.get("fabric") or {}
    home = os.path.dirname(os.path.abspath(path))
    return {"tag": manifest.get("tag"), "manifest_sha256": sha256_file(path),
            "lock_sha256": sha256_file(os.path.join(home, os.path.basename(paths.LOCK))),
            "extend_lock_sha256": sha256_file(os.path.join(home, os.path.basename(paths.EXTEND_LOCK))),
            "fabric": fabric.get("name"), "transport": fabric.get("transport")}


def pick_device(local_rank: int, gpus: int) -> int | None:
    """The GPU index of this rank: LOCAL_RANK, or 0 where the launcher gave each task one GPU.

    >>> pick_device(3, 8), pick_device(3, 1), pick_device(0, 0)
    (3, 0, None)
    """
    if gpus <= 0:
        return None
    if local_rank < gpus:
        return local_rank
    if gpus == 1:
        return 0
    raise RuntimeError(f"LOCAL_RANK {local_rank} but only {gpus} GPUs are visible to this process: start at "
                       f"most {gpus} ranks per node, or give each rank its own GPU (srun --gpus-per-task=1)")


def stack_fingerprint(local_rank: int) -> dict:
    """What the Python stack is and which backend and GPU this rank will use (imports torch)."""
    import platform
    from importlib import metadata

    import torch

    try:
        deepspeed = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        deepspeed = None
    nccl = None
    try:
        if torch.distributed.is_nccl_available():  # the library loaded, not the header torch was built with
            nccl = loaded_version()
    except Exception:  # noqa: BLE001 - a torch without NCCL: None says so
        nccl = None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = pick_device(local_rank, gpus)
    return {"python": platform.python_version(), "torch": normalize_version(torch.__version__), "nccl": nccl,
            "deepspeed": deepspeed, "backend": "nccl" if device is not None else "gloo", "device": device,
            "gpu": torch.cuda.get_device_name(device) if device is not None else None, "gpus": gpus}


def fingerprint(manifest: dict, path: str, rdzv: Rendezvous, environ=None, facts=None) -> dict:
    """This rank's whole fingerprint: image, stack, node (driver), fabric environment, place.
    A stack that cannot be read (no GPU for this LOCAL_RANK, a broken torch) is an ``error``
    entry, so rank 0 can still name the rank and its host."""
    env = os.environ if environ is None else environ
    facts = node.probe() if facts is None else facts
    fp = {"rank": rdzv.rank, "world_size": rdzv.world_size, "local_rank": rdzv.local_rank,
          "host": socket.gethostname(), "driver": facts.driver, "nccl_net": env.get("NCCL_NET") or None,
          "error": None}
    fp.update(image_fingerprint(manifest, path))
    try:
        fp.update(stack_fingerprint(rdzv.local_rank))
    except Exception as error:  # noqa: BLE001
        fp["error"] = f"{type(error).__name__}: {_short(error)}"
    return fp


# What ranks must agree on: (key, words, blocks_collectives). A different stack, backend or
# world size can hang the collectives, so those are not run; the rest is named, then measured.
COMPARED = (
    ("manifest_sha256", "image content (sha256 of manifest.json)", False),
    ("lock_sha256", "lock (sha256 of lock.txt)", False),
    ("extend_lock_sha256", "layer lock (sha256 of extend-lock.txt)", False),
    ("tag", "image tag", False),
    ("python", "Python", True),
    ("torch", "torch", True),
    ("nccl", "NCCL", True),
    ("deepspeed", "DeepSpeed", True),
    ("fabric", "fabric", False),
    ("transport", "fabric transport", False),
    ("nccl_net", "NCCL_NET", False),
    ("driver", "NVIDIA driver", False),
    ("gpu", "GPU", False),
    ("backend", "backend (GPU visible or not)", True),
    ("world_size", "world size", True),
)


def show(value) -> str:
    """A fingerprint value as a short word: sha256 digests to 12 hex digits, None to 'none'.

    >>> show("a" * 64), show(None), show("2.15.0")
    ('aaaaaaaaaaaa', 'none', '2.15.0')
    """
    if value is None:
        return "none"
    text = str(value)
    return text[:12] if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def majority(values: list):
    """The most common value; on a tie, the one the lowest rank holds (rank 0 is the reference).

    >>> majority(["a", "b", "b"]), majority(["a", "b"])
    ('b', 'a')
    """
    return Counter(values).most_common(1)[0][0]  # most_common keeps first-seen order among equal counts


def compare_fingerprints(fps: list[dict]) -> list[dict]:
    """Every (rank, field) that differs from the majority of ranks, in rank order."""
    diffs = []
    for key, words, blocking in COMPARED:
        values = [fp.get(key) for fp in fps]
        want = majority(values)
        for fp, value in zip(fps, values):
            if value != want:
                diffs.append({"rank": fp.get("rank"), "host": fp.get("host"), "field": key, "words": words,
                              "value": value, "majority": want, "blocking": blocking,
                              "majority_ranks": values.count(want)})
    return sorted(diffs, key=lambda d: d["rank"])


def rank_words(ranks: list[int], limit: int = 8) -> str:
    """'rank 3', 'ranks 0-3, 8', with a count past `limit` runs.

    >>> rank_words([3]), rank_words([0, 1, 2, 3, 8]), rank_words(list(range(0, 40, 2)), limit=2)
    ('rank 3', 'ranks 0-3, 8', 'ranks 0, 2 and 18 more')
    """
    ranks = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    words = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    more = f" and {len(words) - limit} more" if len(words) > limit else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(words[:limit]) + more


def describe_mismatches(diffs: list[dict], world: int) -> str:
    """Name each host that differs (its ranks, each field: its value and the majority's)."""
    by_host: dict[str, dict] = {}
    for diff in diffs:
        entry = by_host.setdefault(diff["host"], {"ranks": set(), "fields": {}})
        entry["ranks"].add(diff["rank"])
        entry["fields"].setdefault(diff["field"], diff)
    parts = []
    for host, entry in by_host.items():
        fields = "; ".join(f"{d['words']} {show(d['value'])} where {d['majority_ranks']} of {world} ranks have "
                           f"{show(d['majority'])}" for d in entry["fields"].values())
        parts.append(f"host {host} ({rank_words(sorted(entry['ranks']))}): {fields}")
    return "differs from the majority: " + ". ".join(parts)


def describe_same(fps: list[dict]) -> str:
    """What every rank agreed on, in one line."""
    fp = fps[0]
    hosts = len({f.get("host") for f in fps})
    gpu = f", GPU {fp['gpu']}" if fp.get("gpu") else ""
    return (f"all {len(fps)} ranks on {hosts} host{'s' if hosts != 1 else ''} run image {show(fp.get('tag'))} "
            f"(manifest {show(fp.get('manifest_sha256'))}, lock {show(fp.get('lock_sha256'))}), torch "
            f"{show(fp.get('torch'))}, NCCL {show(fp.get('nccl'))}, DeepSpeed {show(fp.get('deepspeed'))}, fabric "
            f"{show(fp.get('fabric'))} ({show(fp.get('transport'))}), driver {show(fp.get('driver'))}{gpu}")


# ----------------------------------------------------------------------------- bandwidth
def message_sizes(size_mb: float, world: int) -> list[int]:
    """A 64th, an 8th and all of --size-mb, in bytes, each a whole number of float32 per rank.

    >>> message_sizes(64, 2)
    [1048576, 8388608, 67108864]
    >>> message_sizes(0, 3)
    [12]
    """
    unit = 4 * world
    sizes = {max(unit, int(size_mb * 2**20 / div) // unit * unit) for div in (64, 8, 1)}
    return sorted(sizes)


def bandwidth(op: str, size_bytes: float, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s as nccl-tests' PERFORMANCE.md defines them: algbw = S/t; busbw =
    algbw * 2(n-1)/n for all_reduce, (n-1)/n for all_gather (S = the gathered output's size).

    >>> bandwidth("all_reduce", 1e9, 1.0, 4)
    (1.0, 1.5)
    """
    if seconds <= 0:
        return 0.0, 0.0
    return size_bytes / seconds / 1e9, bus_bandwidth(op, size_bytes, seconds, nranks)


def summarize(results: list[dict], hosts: list[str], world: int) -> list[dict]:
    """Per op and size: the slowest rank's time (a collective is done when every rank is), the
    bandwidths from it, and which rank / host that was."""
    rows = []
    for op in ("all_reduce", "all_gather"):
        sizes = sorted({int(size) for res in results for size in (res.get("times") or {}).get(op, {})})
        for size in sizes:
            times = [(res["times"][op].get(str(size)), rank) for rank, res in enumerate(results)
                     if res.get("times") and str(size) in res["times"].get(op, {})]
            slowest_s, slowest = max(times)
            fastest_s = min(t for t, _ in times)
            algbw, busbw = bandwidth(op, size, slowest_s, world)
            rows.append({"op": op, "size_bytes": size, "seconds": slowest_s, "fastest_seconds": fastest_s,
                         "algbw_gbps": round(algbw, 3), "busbw_gbps": round(busbw, 3), "slowest_rank": slowest,
                         "slowest_host": hosts[slowest] if slowest < len(hosts) else None})
    return rows


def op_detail(rows: list[dict], op: str, backend: str, world: int) -> str:
    """One line per op: each size's time, algbw and busbw, and the slowest rank."""
    mine = [r for r in rows if r["op"] == op]
    parts = [f"{size_words(r['size_bytes'])} {r['seconds'] * 1e3:.2f} ms algbw {r['algbw_gbps']:.2f} GB/s busbw "
             f"{r['busbw_gbps']:.2f} GB/s (slowest rank {r['slowest_rank']} on {r['slowest_host']})" for r in mine]
    return f"{backend} x{world}: " + "; ".join(parts) + "; values ok"


# ----------------------------------------------------------------------------- torch side
def wait_for_port(addr: str, port: int, seconds: float, poll: float = 0.5) -> str:
    """Wait until something accepts TCP connections at addr:port; '' then, else why not.

    torch's TCPStore client retries past its own timeout (20 s for 8 here), so the deadline is
    kept here, with the stdlib, and the reason is told apart: no such host, nothing listening,
    or no answer at all.
    >>> wait_for_port("127.0.0.1", 1, 0.3).startswith("nothing accepts connections at 127.0.0.1:1")
    True
    """
    deadline = time.monotonic() + seconds
    why = ""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.2, min(2.0, left))):
                return ""
        except socket.gaierror as error:
            why = f"{addr!r} does not resolve ({error.strerror or error})"
        except ConnectionRefusedError:
            why = f"nothing accepts connections at {addr}:{port} (refused)"
        except OSError as error:
            why = f"{addr}:{port} does not answer ({error.strerror or type(error).__name__})"
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        time.sleep(min(poll, left))


def connect_store(rdzv: Rendezvous, timeout: float, environ=None):
    """The rendezvous store: rank 0 serves it at MASTER_ADDR:MASTER_PORT, unless torchrun's agent
    already does (TORCHELASTIC_USE_AGENT_STORE, the check torch's env:// rendezvous makes)."""
    from datetime import timedelta

    import torch.distributed as dist

    env = os.environ if environ is None else environ
    agent = (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR") == rdzv.master_addr
             and env.get("MASTER_PORT") == str(rdzv.master_port))
    if rdzv.rank != 0 or agent:
        why = wait_for_port(rdzv.master_addr, rdzv.master_port, timeout)
        if why:
            raise ConnectionError(why)
    store = dist.TCPStore(host_name=rdzv.master_addr, port=rdzv.master_port, world_size=rdzv.world_size,
                          is_master=rdzv.rank == 0 and not agent, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False, multi_tenant=True)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{STORE_PREFIX}/{attempt}/", store)


def _fp_key(rank: int) -> str:
    return f"fp/{rank}"


def wait_for_ranks(store, world: int, timeout: float) -> list[int]:
    """Wait until every rank published its fingerprint; the ranks still missing at the deadline."""
    from datetime import timedelta

    keys = [_fp_key(rank) for rank in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
        return []
    except Exception:  # noqa: BLE001 - a store timeout: find out who is missing
        return [rank for rank, key in enumerate(keys) if not store.check([key])]


def read_fingerprints(store, world: int) -> list[dict]:
    keys = [_fp_key(rank) for rank in range(world)]
    raw = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(key) for key in keys]
    return [json.loads(value) for value in raw]


def missing_message(missing: list[int], joined: list[dict], world: int, timeout: float) -> str:
    """Name the ranks that never joined, and where the others came from."""
    hosts = sorted({fp.get("host") or "?" for fp in joined})
    return (f"{rank_words(missing)} of {world} never joined within {timeout:g}s ({len(joined)} joined, from "
            f"{', '.join(hosts) or 'no host'}): the process never started, died before the rendezvous, or cannot "
            "reach MASTER_ADDR:MASTER_PORT (wrong address, or a firewall). Check that job step's output; no "
            "collective was run")


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
            return self.finish(False, f"{self.fp.get('error') or type(error).__name__ + ': ' + _short(error)}")
        except Exception as error:  # noqa: BLE001
            if rdzv.rank == 0:
                return self.finish(False, f"rank 0 could not serve the rendezvous at {where} within {timeout:g}s "
                                   f"({_short(error)}): another process may hold the port (pick another "
                                   "MASTER_PORT), or MASTER_ADDR is not an address of this host, or name lookups "
                                   "here are slow (a DNS server that does not answer)")
            return self.finish(False, f"could not reach rank 0's rendezvous at {where} within {timeout:g}s "
                               f"({_short(error)}): rank 0 has not started, or MASTER_ADDR/MASTER_PORT are wrong, "
                               "or a firewall blocks the port")
        try:
            return self._with_store(store, dog, timeout, started)
        except Exception as error:  # noqa: BLE001 - the store or process group failed: one clear line
            return self.finish(False, f"{type(error).__name__}: {_short(error)}")

    def _with_store(self, store, dog: Watchdog, timeout: float, started: float) -> int:
        rdzv = self.rdzv
        store.set(_fp_key(rdzv.rank), json.dumps(self.fp))
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
                                   f"{_short(error)} (rank 0 exited or its node is unreachable)")
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
            joined = [json.loads(store.get(_fp_key(r))) for r in range(world) if r not in missing]
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
            return False, (f"init_process_group({backend}) failed: {_short(error)}. Every rank joined the "
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
                mine = {"ok": False, "detail": f"{type(error).__name__}: {_short(error)}", "times": {}}
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


def _short(error: BaseException, limit: int = 300) -> str:
    """An exception's first line, bounded (torch's store errors carry C++ backtraces)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:limit]


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
