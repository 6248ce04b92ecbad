"""Match known signatures against a log in one streaming pass, rank by rank."""

from __future__ import annotations

import itertools
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .ranks import SNIFF_LINES, RankStyle
from .reading import clean_line, printable
from .signatures import REGEX_FIELDS, KnownIssue, literal_guard

MAX_LABELS = 4096
EXCERPT = 240


def rank_order(label: str):
    """Natural order: rank 2 before rank 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label)]


def sorted_ranks(labels: Iterable[Optional[str]]) -> list[str]:
    return sorted({label for label in labels if label}, key=rank_order)


def excerpt_of(line: str, start: int) -> str:
    """The carriage-return segment of `line` holding position `start`, shortened and made printable."""
    begin = line.rfind("\r", 0, start) + 1
    end = line.find("\r", start)
    segment = line[begin:end if end >= 0 else len(line)].strip()
    start = max(0, min(start - begin, len(segment)))
    if len(segment) > EXCERPT:
        left = max(0, start - EXCERPT // 3)
        segment = ("…" if left else "") + segment[left:left + EXCERPT] + "…"
    return printable(segment)


@dataclass
class Finding:
    """One known issue found in the log, where first, how often and on which ranks."""
    issue: KnownIssue
    line_no: int
    excerpt: str
    count: int
    ranks: list[str] = field(default_factory=list)
    other_ranks: list[str] = field(default_factory=list)
    detail: str = ""

    def as_dict(self) -> dict:
        return {"id": self.issue.id, "title": self.issue.title, "line": self.line_no, "count": self.count,
                "rank": self.ranks, "other_ranks": self.other_ranks, "detail": self.detail,
                "excerpt": self.excerpt, "cause": self.issue.cause, "fix": self.issue.fix,
                "source": self.issue.source}


class MatchTracker:
    """A `match` signature: hits, optionally confirmed by context or excused by what came just
    before them, cancelled by a later `unless`.

    Context and excuses are remembered as the line number where they last appeared, so a hit
    costs no look-back over earlier lines (every line that can match them reaches `feed`: their
    guard words are in the engine's pre-check).
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
        self.first: Optional[tuple[int, str]] = None
        self.ranks: set[str] = set()
        self.cancelled = False
        self.waiting: deque = deque()  # hits whose context may still come: (deadline, line_no, excerpt, rank)

    def feed(self, line_no: int, line: str, rank: Optional[str]):
        if self.unless and self.count and self.unless.search(line):
            self.cancelled = True
        if self.excused_by and self.excused_by.search(line):
            self.last_excuse = line_no
        if self.context:
            self._settle(line_no, line)
        match = self.pattern.search(line)
        if not match:
            return
        if self.last_excuse is not None and line_no - self.last_excuse <= self.reach:
            return
        hit = (line_no + self.reach, line_no, excerpt_of(line, match.start()), rank)
        if self.context and (self.last_context is None or line_no - self.last_context > self.reach):
            self.waiting.append(hit)
            return
        self._record(*hit[1:])

    def _settle(self, line_no: int, line: str):
        """Forget waiting hits out of reach; if this line is context, note it and confirm the rest."""
        while self.waiting and self.waiting[0][0] < line_no:
            self.waiting.popleft()
        if self.context.search(line):
            self.last_context = line_no
            while self.waiting:
                self._record(*self.waiting.popleft()[1:])

    def _record(self, line_no: int, excerpt: str, rank: Optional[str]):
        self.count += 1
        self.cancelled = False
        if self.first is None or line_no < self.first[0]:
            self.first = (line_no, excerpt)
        if rank and len(self.ranks) < MAX_LABELS:
            self.ranks.add(rank)

    def finding(self, all_ranks: set[str]) -> Optional[Finding]:
        if not self.count or self.cancelled:
            return None
        # Which ranks lack the signature is only known when the lines that carry it name their rank.
        others = sorted_ranks(all_ranks - self.ranks) if self.ranks else []
        return Finding(self.issue, self.first[0], self.first[1], self.count, sorted_ranks(self.ranks), others)


@dataclass
class _Stream:
    """One rank's open waits."""
    pending: int = 0
    opened: int = 0
    since: Optional[tuple[int, str]] = None  # first still-open wait: (line_no, excerpt)
    lines_after: int = 0
    moved_on: bool = False


class WaitTracker:
    """A `wait` signature: waits opened and closed per rank; the ones left open at the end hang."""

    def __init__(self, issue: KnownIssue):
        self.issue = issue
        self.pattern = issue.regex("pattern")
        self.resolved_by = issue.regex("resolved_by")
        self.evidence = issue.regex("evidence")
        self.moved_on = issue.regex("moved_on")
        self.streams: dict[Optional[str], _Stream] = {}
        self.open = 0  # waits open over all ranks
        self.evidence_first: Optional[tuple[int, str]] = None  # (line_no, excerpt)
        self.evidence_count = 0
        self.evidence_ranks: set[str] = set()

    def waiting(self) -> bool:
        return self.open > 0

    def idle(self, rank: Optional[str]):
        """A line that matches none of this signature's expressions: it only counts as a line after a wait."""
        stream = self.streams.get(rank)
        if stream is not None and stream.pending:
            stream.lines_after += 1

    def feed(self, line_no: int, line: str, rank: Optional[str]):
        stream = self.streams.get(rank)
        opened = list(self.pattern.finditer(line))
        resolved = self.resolved_by.count(line)
        if stream is not None and stream.pending and not opened and not resolved:
            stream.lines_after += 1
        if self.moved_on and self.moved_on.search(line):
            for waiting in self.streams.values():
                if waiting.pending:
                    waiting.moved_on = True
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
            stream.pending += 1
            stream.opened += 1
            self.open += 1
        for _ in range(resolved):
            self._resolve(rank)

    def _resolve(self, rank: Optional[str]):
        """Close one open wait: this rank's, else the oldest one open (prefixes are not always on every line)."""
        stream = self.streams.get(rank)
        if stream is None or not stream.pending:
            open_streams = [s for s in self.streams.values() if s.pending]
            if not open_streams:
                return
            stream = min(open_streams, key=lambda s: s.since[0])
        stream.pending -= 1
        self.open -= 1
        if not stream.pending:
            stream.since = None

    def finding(self, all_ranks: set[str]) -> Optional[Finding]:
        hung = {rank: s for rank, s in self.streams.items()
                if s.pending and not s.moved_on and s.lines_after < self.issue.quiet_lines}
        if not hung and not self.evidence_count:
            return None
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
        return Finding(self.issue, line_no, excerpt, stuck or self.evidence_count, sorted_ranks(ranks),
                       sorted_ranks(loaded), "; ".join(details))


def trie_pattern(words) -> str:
    """One regular expression for many literal words, shaped as a trie so that it tests each
    character once instead of trying every word in turn; where words share a start, the longest
    is matched.

    >>> trie_pattern(["ab", "abc", "b"])
    '(?:ab(?:c)?|b)'
    >>> import re; [m.group() for m in re.finditer(trie_pattern(["ab", "abc", "b"]), "abcab b")]
    ['abc', 'ab', 'b']
    """
    trie: dict = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def branch(node: dict) -> str:
        ends = "" in node
        options = [re.escape(char) + branch(child) for char, child in sorted(node.items()) if char]
        if not options:
            return ""
        body = options[0] if len(options) == 1 and not ends else "(?:" + "|".join(options) + ")"
        if len(options) == 1 and not ends:
            return body
        return body + ("?" if ends else "")

    return branch(trie)


class Dispatch:
    """Which trackers a line concerns, from the guard words of their expressions it contains.

    Most lines of a log contain none and are only counted; a line with some is fed to the
    trackers whose words it holds, not to all of them. Training-progress words (`moved_on`) are
    looked for only while a wait is open, since they are on most lines.

    >>> from envbuild.doctor.signatures import KnownIssue
    >>> a = KnownIssue(id="a", title="t", pattern="Bus error", cause="c", fix="f", source="s")
    >>> b = KnownIssue(id="b", title="t", pattern="error: x|Killed", cause="c", fix="f", source="s")
    >>> d = Dispatch([a, b], ["pattern"])
    >>> sorted(d.targets("Bus error: x")), d.targets("fine"), sorted(d.targets("Killed"))
    ([0, 1], set(), [1])
    """

    def __init__(self, issues: list[KnownIssue], fields):
        owners: dict[str, set[int]] = {}
        self.everything = False
        for index, issue in enumerate(issues):
            for name in fields:
                expression = getattr(issue, name)
                if not expression:
                    continue
                guard = literal_guard(expression)
                if guard is None:  # an expression without a guard word: every line concerns everyone
                    self.everything = True
                    return
                for word in guard:
                    owners.setdefault(word, set()).add(index)
        # A word found in the line also holds every shorter word inside it.
        self.owners = {word: set().union(*(owners[inner] for inner in owners if inner in word)) for word in owners}
        words = sorted(owners, key=len, reverse=True)
        self.screen = re.compile(trie_pattern(words)) if words else None

    def targets(self, line: str) -> set[int]:
        """Indexes of the issues whose words are in `line` (every word found, overlapping or not)."""
        found: set[int] = set()
        if self.screen is None:
            return found
        match = self.screen.search(line)
        while match:
            found |= self.owners[match.group()]
            match = self.screen.search(line, match.start() + 1)
        return found


def diagnose(lines: Iterable[str], issues: list[KnownIssue]) -> list[Finding]:
    """Every known issue found in `lines` (an iterable of log lines), first occurrence first."""
    lines = iter(lines)
    head = list(itertools.islice(lines, SNIFF_LINES))
    style = RankStyle.sniff(head)
    trackers = [WaitTracker(i) if i.kind == "wait" else MatchTracker(i) for i in issues]
    always = Dispatch(issues, [n for n in REGEX_FIELDS if n != "moved_on"])
    while_waiting = Dispatch(issues, REGEX_FIELDS)
    waits = [(index, t) for index, t in enumerate(trackers) if isinstance(t, WaitTracker)]
    all_ranks: set[str] = set()
    for line_no, raw in enumerate(itertools.chain(head, lines), 1):
        rank, line = style.label(raw)
        if rank and len(all_ranks) < MAX_LABELS:
            all_ranks.add(rank)
        dispatch = while_waiting if any(t.waiting() for _, t in waits) else always
        if dispatch.everything:
            for tracker in trackers:
                tracker.feed(line_no, line, rank)
            continue
        targets = dispatch.targets(line)
        for index in targets:
            trackers[index].feed(line_no, line, rank)
        for index, tracker in waits:  # a match tracker has nothing to do with a line that is not its
            if index not in targets:
                tracker.idle(rank)
    findings = [f for f in (t.finding(all_ranks) for t in trackers) if f]
    found = {f.issue.id for f in findings}
    findings = [f for f in findings if not set(f.issue.superseded_by) & found]
    return sorted(findings, key=lambda f: f.line_no)


def diagnose_text(text: str, issues: list[KnownIssue]) -> list[Finding]:
    """`diagnose` for a log already in memory (tests, small inputs), cleaned as LogReader cleans lines."""
    return diagnose((clean_line(line) for line in text.split("\n")), issues)
