"""What one signature has seen of a log so far, fed line by line by the scan: a `match`
signature's hits and records, a `wait` signature's waits per rank. Each turns into Findings at the
end; neither knows how lines reach it (the screen, the block scan and the joins are the engine's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from envbuild.doctor.finding import MAX_LABELS, MAX_VALUES, Finding, excerpt_of
from envbuild.doctor.ranks import sorted_ranks, timestamp
from envbuild.doctor.reading import printable
from envbuild.doctor.signatures import KnownIssue

MAX_KEYS = 16  # findings one signature can make with different titles (libraries, hosts, ...)
MAX_RESOLVED = 256  # distinct sets of parts whose resolved texts a signature remembers
WRAP_MIN = 40  # a line shorter than this was not wrapped by a terminal
WORDY = re.compile(r"[A-Za-z0-9]")


def _parts(match: re.Match) -> dict[str, str]:
    parts: dict[str, str] = {}
    for name, value in match.groupdict().items():
        if value is not None:
            parts.setdefault(re.sub(r"__\d+$", "", name), printable(value))
    return parts


@dataclass
class _Record:
    line_no: int
    excerpt: str
    time: Optional[tuple]
    parts: dict
    resolved: dict
    count: int = 0
    ranks: set = field(default_factory=set)
    firsts: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)  # part -> every distinct value seen (at most MAX_VALUES)


class MatchTracker:
    """A `match` signature: hits, optionally confirmed by context or excused by what came just
    before them, cancelled by a later `unless`; one record per title its parts make.

    Context and excuses are remembered as the line number where they last appeared, so a hit
    costs no look-back over earlier lines (every line that can match them reaches `feed`: their
    guard words are in the engine's screen).
    """

    def __init__(self, issue: KnownIssue):
        self.issue = issue
        self.pattern = issue.regex("pattern")
        self.unless = issue.regex("unless")
        self.context = issue.regex("context")
        self.excused_by = issue.regex("excused_by")
        self.reach = issue.context_lines
        self.last_context: Optional[int] = None
        self.last_excuse: Optional[int] = None
        self.count = 0
        self.records: dict[str, _Record] = {}
        self._resolved: dict[tuple, tuple[dict, dict]] = {}  # captures -> (parts, resolved texts)
        self.cancelled = False
        self.waiting: list = []  # hits whose context may still come: (deadline, line_no, line, match, rank)
        self.has_parts = bool(issue.parts())  # only a match with parts can lose some to a wrapped line

    def feed(self, line_no: int, line: str, rank: Optional[str], may_wrap: bool = True) -> Optional[bool]:
        """Take one line; True if the pattern matched it (whether or not the hit counts), None if it
        matched up to the end of a line long enough to have been wrapped (the join takes it)."""
        if self.unless and self.count and self.unless.search(line):
            self.cancelled = True
        if self.excused_by and self.excused_by.search(line):
            self.last_excuse = line_no
        if self.context:
            self._settle(line_no, line)
        match = self.pattern.search(line)
        if match is None:
            return False
        if may_wrap and self.has_parts and (not line[:match.start()].strip()
                         or len(line) >= WRAP_MIN and not WORDY.search(line, match.end())):
            return None  # the message may have begun on the line before or go on in the next: the join decides
        self.hit(line_no, line, match, rank)
        return True

    def feed_join(self, lines: list[tuple[int, str]], within: tuple[int, int], after: int,
                  rank: Optional[str]) -> int:
        """Lines of `rank` a terminal may have wrapped one message over, each (line_no, text): a match
        that touches lines[within[0]:within[1]], spans a join (or lies in that line) and starts after
        line `after` counts.
        Returns the number of the last line the match covered (0: none)."""
        for separator in ("", " "):
            bounds, text = [], ""
            for _, line in lines:
                bounds.append(len(text))
                text += line + separator
            bounds.append(len(text))
            if not self.pattern.possible(text):
                continue
            for match in self.pattern.regex.finditer(text):
                first = max(i for i, b in enumerate(bounds[:-1]) if b <= match.start())
                last = max(i for i, b in enumerate(bounds[:-1]) if b < match.end())
                if last < within[0] or first >= within[1] or lines[first][0] <= after:
                    continue
                if first == last and first != within[0]:
                    continue  # another line's own match: that line's feed took it
                self.hit(lines[first][0], text, match, rank)
                return lines[last][0]
        return 0

    def hit(self, line_no: int, line: str, match: re.Match, rank: Optional[str]):
        """A match of the pattern (made here, or by the catalogue for what a component said): excused,
        waiting for its context, or recorded."""
        if self.last_excuse is not None and line_no - self.last_excuse <= self.reach:
            return
        hit = (line_no + self.reach, line_no, line, match, rank)
        if self.context and (self.last_context is None or line_no - self.last_context > self.reach):
            self.waiting.append(hit)
            return
        self._record(*hit[1:])

    def _settle(self, line_no: int, line: str):
        """Forget waiting hits out of reach; if this line is context, note it and confirm the rest."""
        self.waiting = [hit for hit in self.waiting if hit[0] >= line_no]
        if self.context.search(line):
            self.last_context = line_no
            for hit in self.waiting:
                self._record(*hit[1:])
            self.waiting = []

    def _record(self, line_no: int, line: str, match: re.Match, rank: Optional[str]):
        self.count += 1
        self.cancelled = False
        captured = tuple(match.groupdict().items())
        known = self._resolved.get(captured)
        if known is None:  # a log repeats its lines: make and resolve each distinct set of captures' parts once
            parts = _parts(match)
            known = (parts, self.issue.resolve(parts))
            if len(self._resolved) < MAX_RESOLVED:
                self._resolved[captured] = known
        parts, resolved = known
        key = resolved["title"]
        record = self.records.get(key)
        if record is None:
            if len(self.records) >= MAX_KEYS:
                record = next(iter(self.records.values()))
            else:
                record = self.records[key] = _Record(line_no, excerpt_of(line, match.start()), timestamp(line),
                                                     parts, resolved)
        if line_no < record.line_no:
            record.line_no, record.excerpt, record.time = line_no, excerpt_of(line, match.start()), timestamp(line)
        record.count += 1
        for name, value in parts.items():
            seen = record.values.setdefault(name, [])
            if value not in seen and len(seen) < MAX_VALUES:
                seen.append(value)
        if rank and len(record.ranks) < MAX_LABELS:
            record.ranks.add(rank)
            record.firsts.setdefault(rank, (line_no, timestamp(line)))

    def findings(self, all_ranks: set[str]) -> list[Finding]:
        if not self.count or self.cancelled:
            return []
        found = []
        for record in self.records.values():
            # Which ranks lack the signature is only known when the lines that carry it name their rank.
            others = sorted_ranks(all_ranks - record.ranks) if record.ranks else []
            found.append(Finding(self.issue, record.line_no, record.excerpt, record.count, sorted_ranks(record.ranks),
                                 others, self.issue.fill_detail(record.values), parts=record.values,
                                 resolved=record.resolved, time=record.time, firsts=record.firsts))
        return found


@dataclass
class _Stream:
    """One rank's open waits."""
    pending: int = 0
    opened: int = 0
    since: Optional[tuple[int, str]] = None  # first still-open wait: (line_no, excerpt)
    lines_after: int = 0
    moved_on: bool = False


class WaitTracker:
    """A `wait` signature: waits opened and closed per rank; the ones left open at the end hang.

    `live` holds the streams that could still end as a hang (open, no progress after them, and
    fewer than `quiet_lines` lines of their rank since); while it is empty no line needs to be
    counted, so the engine goes back to skipping the lines no signature concerns.
    """

    def __init__(self, issue: KnownIssue):
        self.issue = issue
        self.pattern = issue.regex("pattern")
        self.resolved_by = issue.regex("resolved_by")
        self.evidence = issue.regex("evidence")
        self.moved_on = issue.regex("moved_on")
        self.streams: dict[Optional[str], _Stream] = {}
        self.live: set = set()
        self.evidence_first: Optional[tuple[int, str]] = None  # (line_no, excerpt)
        self.evidence_count = 0
        self.evidence_ranks: set[str] = set()

    def waiting(self) -> bool:
        return bool(self.live)

    def idle(self, rank: Optional[str]):
        """A line that matches none of this signature's expressions: it only counts as a line after a wait."""
        stream = self.streams.get(rank)
        if stream is not None and stream.pending:
            self._count_line(rank, stream)

    def _count_line(self, rank: Optional[str], stream: _Stream):
        stream.lines_after += 1
        if stream.lines_after >= self.issue.quiet_lines:
            self.live.discard(rank)

    def feed(self, line_no: int, line: str, rank: Optional[str]) -> bool:
        stream = self.streams.get(rank)
        opened = list(self.pattern.finditer(line))
        resolved = self.resolved_by.count(line)
        if stream is not None and stream.pending and not opened and not resolved:
            self._count_line(rank, stream)
        if self.moved_on and self.moved_on.search(line):
            for waiting in self.streams.values():
                if waiting.pending:
                    waiting.moved_on = True
            self.live.clear()
        if self.evidence:
            match = self.evidence.search(line)
            if match:
                self.evidence_count += 1
                self.evidence_first = self.evidence_first or (line_no, excerpt_of(line, match.start()))
                if rank and len(self.evidence_ranks) < MAX_LABELS:
                    self.evidence_ranks.add(rank)
        for match in opened:
            if stream is None:
                if len(self.streams) >= MAX_LABELS:
                    rank = None
                stream = self.streams.setdefault(rank, _Stream())
            if not stream.pending:
                stream.since, stream.lines_after, stream.moved_on = (line_no, excerpt_of(line, match.start())), 0, False
                self.live.add(rank)
            stream.pending += 1
            stream.opened += 1
        for _ in range(resolved):
            self._resolve(rank)
        return bool(opened)

    def _resolve(self, rank: Optional[str]):
        """Close one open wait: this rank's, else the oldest one open (prefixes are not always on every line)."""
        stream = self.streams.get(rank)
        if stream is None or not stream.pending:
            open_streams = [(key, s) for key, s in self.streams.items() if s.pending]
            if not open_streams:
                return
            rank, stream = min(open_streams, key=lambda item: item[1].since[0])
        stream.pending -= 1
        if not stream.pending:
            stream.since = None
            self.live.discard(rank)

    def findings(self, all_ranks: set[str]) -> list[Finding]:
        hung = {rank: s for rank, s in self.streams.items()
                if s.pending and not s.moved_on and s.lines_after < self.issue.quiet_lines}
        if not hung and not self.evidence_count:
            return []
        starts = [s.since for s in hung.values()] + ([self.evidence_first] if self.evidence_first else [])
        line_no, excerpt = min(starts)
        stuck = sum(s.pending for s in hung.values())
        opened = sum(s.opened for s in self.streams.values())
        ranks = set(hung) | self.evidence_ranks
        loaded = {rank for rank, s in self.streams.items() if rank not in ranks and s.opened and not s.pending}
        details = []
        if stuck:
            details.append(f"{stuck} of {opened} extension loads never finished")
        if self.evidence_count:
            details.append(f"a stack waits in the lock's wait loop (line {self.evidence_first[0]})")
        firsts = {rank: (s.since[0], None) for rank, s in hung.items() if rank}
        return [Finding(self.issue, line_no, excerpt, stuck or self.evidence_count, sorted_ranks(ranks),
                        sorted_ranks(loaded), "; ".join(details), firsts=firsts)]
