"""The multi-node collectives' numbers: the message sizes, and per op and size the slowest
rank's time with the bandwidths from it as nccl-tests defines them. The last phase of
``smoke.py --multinode`` (multinode.py): what rank 0 reports once the collectives ran.
"""

from __future__ import annotations

from .collectives import bus_bandwidth, size_words


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
