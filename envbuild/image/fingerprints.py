"""What each rank of a multi-node job is (image, lock, stack, fabric, driver, GPU), published in
the rendezvous store before any collective, and rank 0's comparison of them: who differs from
the majority, and who never joined. The second phase of ``smoke.py --multinode``
(multinode.py): a job that would hang in its first collective is named here instead.
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter

from . import nodefacts, paths
from .nccl import loaded_version
from .rendezvous import Rendezvous
from .report import short_error
from .sandbox import sha256_file
from .versions import normalize_version


# ----------------------------------------------------------------------------- what a rank is
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
    facts = nodefacts.probe() if facts is None else facts
    fp = {"rank": rdzv.rank, "world_size": rdzv.world_size, "local_rank": rdzv.local_rank,
          "host": socket.gethostname(), "driver": facts.driver, "nccl_net": env.get("NCCL_NET") or None,
          "error": None}
    fp.update(image_fingerprint(manifest, path))
    try:
        fp.update(stack_fingerprint(rdzv.local_rank))
    except Exception as error:  # noqa: BLE001
        fp["error"] = f"{type(error).__name__}: {short_error(error)}"
    return fp


# ----------------------------------------------------------------------------- how ranks differ
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


# ----------------------------------------------------------------------------- through the store
def fp_key(rank: int) -> str:
    """The store key a rank publishes its fingerprint under (rank 0 and the rank itself read it)."""
    return f"fp/{rank}"


def wait_for_ranks(store, world: int, timeout: float) -> list[int]:
    """Wait until every rank published its fingerprint; the ranks still missing at the deadline."""
    from datetime import timedelta

    keys = [fp_key(rank) for rank in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
        return []
    except Exception:  # noqa: BLE001 - a store timeout: find out who is missing
        return [rank for rank, key in enumerate(keys) if not store.check([key])]


def read_fingerprints(store, world: int) -> list[dict]:
    keys = [fp_key(rank) for rank in range(world)]
    raw = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(key) for key in keys]
    return [json.loads(value) for value in raw]


def missing_message(missing: list[int], joined: list[dict], world: int, timeout: float) -> str:
    """Name the ranks that never joined, and where the others came from."""
    hosts = sorted({fp.get("host") or "?" for fp in joined})
    return (f"{rank_words(missing)} of {world} never joined within {timeout:g}s ({len(joined)} joined, from "
            f"{', '.join(hosts) or 'no host'}): the process never started, died before the rendezvous, or cannot "
            "reach MASTER_ADDR:MASTER_PORT (wrong address, or a firewall). Check that job step's output; no "
            "collective was run")
