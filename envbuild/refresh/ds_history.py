"""DeepSpeed across releases: the per-release facts of the releases deepspeed.yaml tracks, and
the ops table (`since`/`until`/`cuda_extension_until`) found by bisecting PyPI's release list,
reading as few sdists as the bisection needs (each one cached on disk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.refresh.deepspeed_facts import OpFacts, SdistFacts, analyse
from envbuild.refresh.pypi import DistFile, Index

MIN_OPS = 20  # 0.19.8 has 23; fewer means the op_builder layout changed under us


@dataclass
class OpHistory:
    facts: OpFacts  # as of the newest release that has the op
    since: str
    until: Optional[str] = None
    cuda_extension_until: Optional[str] = None


@dataclass
class DeepSpeedHistory:
    releases: dict[str, SdistFacts] = field(default_factory=dict)
    sdists: dict[str, str] = field(default_factory=dict)  # version -> sdist filename
    ops: dict[str, OpHistory] = field(default_factory=dict)
    read: list[str] = field(default_factory=list)  # every sdist read, for the report


class _Releases:
    """PyPI's final DeepSpeed releases that have an sdist, oldest first, analysed lazily."""

    def __init__(self, index: Index):
        self.index = index
        sdists: dict[Version, DistFile] = {}
        for f in index.files("deepspeed"):
            v = f.version
            if not f.is_wheel and not v.is_prerelease and not v.is_devrelease:
                sdists[v] = f
        if not sdists:
            raise EnvbuildError("PyPI lists no DeepSpeed sdist; the index changed shape.")
        self.versions = sorted(sdists)
        self.files = sdists
        self._ops: dict[Version, dict[str, OpFacts]] = {}
        self.read: list[str] = []

    def position(self, version: str) -> int:
        v = Version(version)
        if v not in self.files:
            raise EnvbuildError(f"deepspeed {version} (in deepspeed.yaml) has no sdist on PyPI; the nearest are "
                                f"{', '.join(str(x) for x in self.versions[-5:])}.")
        return self.versions.index(v)

    def facts(self, version: Version, full: bool) -> SdistFacts:
        dist = self.files[version]
        files = self.index.sdist_files(dist)
        self.read.append(dist.filename)
        facts = analyse(files, str(version), full=full)
        self._ops[version] = facts.ops
        return facts

    def ops(self, position: int) -> dict[str, OpFacts]:
        v = self.versions[position]
        if v not in self._ops:
            self.facts(v, full=False)
        return self._ops[v]


def _first(lo: int, hi: int, holds: Callable[[int], bool]) -> int:
    """Smallest position in (lo, hi] where `holds` is true, given holds(hi) and a monotone
    predicate (false ... false true ... true)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    return hi


def op_bounds(scanned: list[int], newest: int, has: Callable[[int], bool]) -> tuple[int, Optional[int]]:
    """(since, until) positions of an op present in some `scanned` release: the start of the
    run of releases that has it, and the first release after the last scanned one with it
    that lacks it (None when the newest release still has it). Bisects between scanned
    releases, so only O(log n) more releases are read."""
    present = [p for p in scanned if has(p)]
    first, last = present[0], present[-1]
    # From the last scanned release without the op (ops come and go: utils existed in
    # 0.3-0.9 and came back in 0.17.1), else from the first release on PyPI.
    absent = [p for p in scanned if p < first]
    if absent:
        since = _first(absent[-1], first, has)
    else:
        since = 0 if has(0) else _first(0, first, has)
    if last == newest:
        return since, None
    gone = next(p for p in scanned if p > last)
    return since, _first(last, gone, lambda p: not has(p))


def derive(index: Index, tracked: list[str]) -> DeepSpeedHistory:
    """Facts of the tracked releases plus the ops table over all of PyPI's releases."""
    rel = _Releases(index)
    history = DeepSpeedHistory()
    positions = sorted({rel.position(v) for v in tracked})
    for p in positions:
        v = rel.versions[p]
        history.releases[str(v)] = rel.facts(v, full=True)
        history.sdists[str(v)] = rel.files[v].filename
    newest = len(rel.versions) - 1
    scanned = sorted(set(positions) | {newest})
    universe = sorted({name for p in scanned for name in rel.ops(p)})
    if len(universe) < MIN_OPS or len(rel.ops(positions[-1])) < MIN_OPS:
        raise EnvbuildError(f"deepspeed {rel.versions[positions[-1]]}: only {len(rel.ops(positions[-1]))} ops found "
                            f"in op_builder (at least {MIN_OPS} expected); the sdist layout changed.")
    for name in universe:
        since, until = op_bounds(scanned, newest, lambda p: name in rel.ops(p))
        last = max(p for p in scanned if name in rel.ops(p))
        entry = OpHistory(facts=rel.ops(last)[name], since=str(rel.versions[since]),
                          until=None if until is None else str(rel.versions[until]))
        if entry.facts.kind == "cpu" and not entry.facts.cuda_extension:
            has = [p for p in scanned if name in rel.ops(p)]
            was_cuda = [p for p in has if rel.ops(p)[name].cuda_extension]
            if was_cuda:
                after = next(p for p in has if p > was_cuda[-1])
                entry.cuda_extension_until = str(rel.versions[_first(
                    was_cuda[-1], after, lambda p: name in rel.ops(p) and not rel.ops(p)[name].cuda_extension)])
        history.ops[name] = entry
    history.read = rel.read
    return history
