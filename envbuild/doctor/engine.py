"""Match the signatures against a log in one streaming pass, rank by rank.

The log comes as blocks of whole lines (bytes). One Aho-Corasick automaton (ahocorasick_rs)
finds, in each block at once, every guard word of every signature: the lines holding none are
only counted (`bytes.count`), with no Python work of their own; a line holding some is decoded
and fed to the signatures whose words it holds. Rank labels of all lines are collected by one
regular expression per block. Only while a `wait` signature has a wait open (a JIT load that
has not finished yet) are lines walked one by one, since every line of that rank counts then.

A message a terminal wrapped over two lines still matches: a line holding a word of a
signature's guard but not a match is joined with the line before and after it (the same rank's,
or an unprefixed continuation) and matched again; a match must span the join. A paste that
lost its newlines is cut before each `[rankN]:` it holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Iterable, Optional

import ahocorasick_rs

from envbuild.doctor.ranks import SNIFF_LINES, RankStyle, split_flattened, timestamp
from envbuild.doctor.reading import MAX_LINE, printable
from envbuild.doctor.said import UNEXPLAINED, Said, load_said
from envbuild.doctor.signatures import MIN_GUARD, REGEX_FIELDS, KnownIssue, applicable, literal_guard

MAX_LABELS = 4096
MAX_KEYS = 16  # findings one signature can make with different titles (libraries, hosts, ...)
MAX_VALUES = 8  # values of one part a finding lists
MAX_SAID = 64  # distinct catalogued messages one log reports
MAX_RESOLVED = 256  # distinct sets of parts whose resolved texts a signature remembers
EXCERPT = 240
WRAP_MIN = 40  # a line shorter than this was not wrapped by a terminal
WRAP_SPAN = 4  # lines before and after a line that a wrapped message may take
WORDY = re.compile(r"[A-Za-z0-9]")
SAID = -1  # the screen's owner index of the catalogue's words (what a component said)


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
    """One known issue found in the logs: where first, how often, on which ranks, with which parts."""
    issue: KnownIssue
    line_no: int
    excerpt: str
    count: int
    ranks: list[str] = field(default_factory=list)
    other_ranks: list[str] = field(default_factory=list)
    detail: str = ""
    parts: dict = field(default_factory=dict)
    resolved: dict = field(default_factory=dict)  # title, cause, fix, certainty for these parts
    file: Optional[str] = None
    time: Optional[tuple] = None
    firsts: dict = field(default_factory=dict)  # rank -> (file, line_no, time) of its first hit

    def text(self, name: str) -> str:
        return self.resolved.get(name) or getattr(self.issue, name)

    @property
    def title(self) -> str:
        return self.text("title")

    @property
    def explained(self) -> bool:
        """False for what a component said that only its catalogue knows (family `unexplained`)."""
        return self.issue.family != UNEXPLAINED

    @property
    def certainty(self) -> str:
        return self.resolved.get("certainty") or self.issue.certainty

    def as_dict(self) -> dict:
        return {"id": self.issue.id, "family": self.issue.family, "title": self.title, "certainty": self.certainty,
                "parts": self.parts, "file": self.file, "line": self.line_no, "count": self.count,
                "rank": self.ranks, "other_ranks": self.other_ranks, "detail": self.detail,
                "excerpt": self.excerpt, "cause": self.text("cause"), "fix": self.text("fix"),
                "source": self.issue.source}


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
        self._resolved: dict[tuple, dict] = {}
        self.cancelled = False
        self.waiting: list = []  # hits whose context may still come: (deadline, line_no, line, match, rank)
        self._rank: Optional[str] = None  # the rank of the lines being joined (feed_join)
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
        self._hit(line_no, line, match, rank)
        return True

    def feed_join(self, lines: list[tuple[int, str]], within: tuple[int, int], after: int) -> int:
        """Lines a terminal may have wrapped one message over, each (line_no, text): a match that
        touches lines[within[0]:within[1]], spans a join (or lies in that line) and starts after
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
                self._hit(lines[first][0], text, match, self._rank)
                return lines[last][0]
        return 0

    def _hit(self, line_no: int, line: str, match: re.Match, rank: Optional[str]):
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
        parts = _parts(match)
        memo = tuple(parts.items())
        resolved = self._resolved.get(memo)
        if resolved is None:  # a log repeats its lines: resolve each distinct set of parts once
            resolved = self.issue.resolve(parts)
            if len(self._resolved) < MAX_RESOLVED:
                self._resolved[memo] = resolved
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


class Screen:
    """Every guard word of every signature's expressions in one Aho-Corasick automaton, with the
    signatures each word concerns; `moved_on` words (training progress, on most lines) are looked
    for only while a wait is open, by a second automaton.

    For wrapped messages the automaton also holds each pattern guard word cut at a line end:
    its beginnings followed by a newline and its ends after one (`: cannot op` + `\\n`,
    `\\n` + `en shared object file`). A hit means the line's end may cut the message, so the
    line is joined with the next one.
    """

    def __init__(self, issues: list[KnownIssue], said: Optional[Said] = None):
        issues = applicable(issues)
        always = [name for name in REGEX_FIELDS if name != "moved_on"]
        self.everything = False
        self.said = said
        self.words, self.owners, self.pattern_owners, self.wraps = self._index(issues, always, wraps=True)
        self.wait_words, self.wait_owners, _, _ = self._index(issues, REGEX_FIELDS, wraps=False)
        self.automaton = ahocorasick_rs.BytesAhoCorasick(self.words) if self.words else None
        self.wait_automaton = ahocorasick_rs.BytesAhoCorasick(self.wait_words) if self.wait_words else None

    def _index(self, issues, fields, wraps: bool):
        owners: dict[bytes, set[int]] = {}
        pattern_owners: dict[bytes, set[int]] = {}
        cut: dict[bytes, set[int]] = {}
        for index, issue in enumerate(issues):
            for name in fields:
                expression = getattr(issue, name)
                if not expression:
                    continue
                guard = literal_guard(expression)
                if guard is None:  # an expression without a guard word: every line concerns it
                    self.everything = True
                    continue
                for word in guard:
                    owners.setdefault(word.encode(), set()).add(index)
                if not (wraps and name == "pattern" and issue.kind == "match"):
                    continue
                for word in guard:
                    data = word.encode()
                    pattern_owners.setdefault(data, set()).add(index)
                    for at in range(1, len(data)):  # the longer side of the cut, at least half the word
                        if at >= max(MIN_GUARD, len(data) - at):
                            cut.setdefault(data[:at] + b"\n", set()).add(index)
                        elif len(data) - at >= MIN_GUARD:
                            cut.setdefault(b"\n" + data[at:], set()).add(index)
        for word in self.said.words if self.said else ():
            owners.setdefault(word.encode(), set()).add(SAID)  # a line a catalogued message may be on
        words = sorted(set(owners) | set(cut))
        return (words, [frozenset(owners.get(w, ())) for w in words],
                [frozenset(pattern_owners.get(w, ())) for w in words], [frozenset(cut.get(w, ())) for w in words])

    def hits(self, block: bytes, waiting: bool = False) -> list[tuple[int, int, int]]:
        """(word index, start, end) of every word in `block`, overlapping ones included, by start."""
        automaton = self.wait_automaton if waiting else self.automaton
        if automaton is None:
            return []
        hits = automaton.find_matches_as_indexes(block, overlapping=True)
        hits.sort(key=itemgetter(1))
        return hits


class Scan:
    """One log's pass: its trackers, fed block by block."""

    def __init__(self, issues: list[KnownIssue], screen: Screen, default_rank: Optional[str] = None):
        issues = applicable(issues)
        self.issues = issues
        self.screen = screen
        self.default_rank = default_rank
        self.trackers = [WaitTracker(i) if i.kind == "wait" else MatchTracker(i) for i in issues]
        self.waits = [(index, t) for index, t in enumerate(self.trackers) if isinstance(t, WaitTracker)]
        self.style: Optional[RankStyle] = None
        self.lines = 0  # lines before the current block
        self.all_ranks: set[str] = set()
        self.previous: Optional[tuple[int, bytes]] = None  # the last line seen: (line_no, bytes)
        self.forward: list = []  # windows of lines at a block's end, waiting for the next block's first lines
        self.joined: dict[int, int] = {}  # tracker -> the last line a joined match covered
        self.said_trackers: dict[int, MatchTracker] = {}  # catalogued message -> its tracker

    def waiting(self) -> bool:
        return self.screen.everything or any(t.waiting() for _, t in self.waits)

    def feed_block(self, block: bytes):
        if self.style is None:
            head = block[:SNIFF_LINES * 400].split(b"\n")[:SNIFF_LINES]
            self.style = RankStyle.sniff(line.decode("utf-8", "replace") for line in head)
        if len(self.all_ranks) < MAX_LABELS:
            count = bool(self.default_rank) and self.default_rank not in self.all_ranks
            labels, labelled = self.style.labels_in(block, self.all_ranks, count)
            self.all_ranks |= labels
            if self.default_rank and labelled < block.count(b"\n") + (not block.endswith(b"\n")):
                self.all_ranks.add(self.default_rank)
        if self.forward:
            self._join_forward(block)
        pos, hits, index = 0, self.screen.hits(block), 0
        line_no = self.lines  # the number of the line before `pos`
        while pos < len(block):
            if self.waiting():
                pos, line_no = self._walk(block, pos, line_no)
                index = 0
                continue
            while index < len(hits) and hits[index][1] < pos:
                index += 1
            if index == len(hits):
                break
            start = block.rfind(b"\n", 0, hits[index][1]) + 1
            end = block.find(b"\n", start)
            end = len(block) if end < 0 else end
            owners, whole, cut = set(), set(), set()
            while index < len(hits) and hits[index][1] <= end:
                word, hit_start, _ = hits[index]
                if hit_start - start < MAX_LINE:
                    owners |= self.screen.owners[word]
                    whole |= self.screen.pattern_owners[word]
                    cut |= self.screen.wraps[word]
                index += 1
            line_no += block.count(b"\n", pos, start) + 1
            if owners or cut:
                self._line(block, start, end, line_no, owners, whole, cut)
            pos = end + 1
        self.lines += block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
        last = block.rstrip(b"\n").rsplit(b"\n", 1)[-1]
        self.previous = (self.lines, last)

    def _walk(self, block: bytes, pos: int, line_no: int) -> tuple[int, int]:
        """Lines one by one from `pos`, while a wait is open: every line of its rank counts."""
        base = pos
        hits = self.screen.hits(block[base:], waiting=True)
        index = 0
        while pos < len(block) and self.waiting():
            end = block.find(b"\n", pos)
            end = len(block) if end < 0 else end
            owners: set[int] = set()
            while index < len(hits) and hits[index][1] + base < end:
                if hits[index][1] + base - pos < MAX_LINE:
                    owners |= self.screen.wait_owners[hits[index][0]]
                index += 1
            line_no += 1
            if self.screen.everything:
                owners = set(range(len(self.trackers))) | {SAID}
            self._line(block, pos, end, line_no, owners, set(), set(), walking=True)
            pos = end + 1
        return pos, line_no

    def _label(self, text: str) -> tuple[Optional[str], str]:
        rank, body = self.style.label(text)
        return rank or self.default_rank, body

    def _line(self, block: bytes, start: int, end: int, line_no: int, owners: set[int], whole: set[int],
              cut: set[int], walking: bool = False):
        raw = block[start:min(end, start + MAX_LINE)]
        text = raw.decode("utf-8", "replace")
        segments = split_flattened(text) if "[rank" in text else [text]
        matched: set[int] = set()
        deferred: set[int] = set()
        said = SAID in owners and self.screen.said is not None
        owners = owners - {SAID}
        for segment in segments:
            rank, body = self._label(segment)
            explained = False
            for index in sorted(owners):
                tracker = self.trackers[index]
                fed = tracker.feed(line_no, body, rank, len(segments) == 1) if isinstance(tracker, MatchTracker) \
                    else tracker.feed(line_no, body, rank)
                if fed:
                    matched.add(index)
                elif fed is None:
                    deferred.add(index)
                explained = explained or fed is not False and isinstance(tracker, MatchTracker)
            if said and not explained:
                self._said(line_no, body, rank)
            if walking:
                for index, tracker in self.waits:  # a match tracker has nothing to do with a line that is not its
                    if index not in owners:
                        tracker.idle(rank)
        # A guard word on this line yet no match: the rest of the message may be on the lines before
        # or after. A guard word cut by the line's end: the rest is on the next line.
        if len(segments) > 1:
            return  # a paste cut at each rank prefix: its pieces were not wrapped
        whole, cut = (whole | deferred) - matched, (cut | whole | deferred) - matched
        if not cut:
            return
        before = self._lines_before(block, start, line_no)
        after = self._lines_after(block, end, line_no) if len(raw) >= WRAP_MIN else []
        window = before + [(line_no, raw)] + after
        if len(after) < WRAP_SPAN and len(raw) >= WRAP_MIN and (not after or len(after[-1][1]) >= WRAP_MIN) \
                and end + sum(len(line) + 1 for _, line in after) >= len(block) - 1 and end < len(block):
            self.forward.append((window, len(before), cut))  # the rest may be in the next block
            return
        self._join(window, len(before), cut)

    def _said(self, line_no: int, body: str, rank: Optional[str]):
        """A line no curated signature took: the catalogued message it holds, if any, is what was said."""
        found = self.screen.said.match(body)
        if found is None:
            return
        tracker = self.said_trackers.get(found[0])
        if tracker is None:
            if len(self.said_trackers) >= MAX_SAID:
                return
            tracker = self.said_trackers[found[0]] = MatchTracker(self.screen.said.issue(found[0]))
        tracker._hit(line_no, body, found[1], rank)  # matched already; a catalogue entry has no context or unless

    def _lines_before(self, block: bytes, start: int, line_no: int) -> list[tuple[int, bytes]]:
        """Up to WRAP_SPAN lines before line `line_no` (starting at `start`) that end where a terminal
        would wrap (long enough)."""
        lines, line_no = [], line_no - 1
        while start and len(lines) < WRAP_SPAN:
            begin = block.rfind(b"\n", 0, start - 1) + 1
            line = block[begin:start - 1]
            if len(line) < WRAP_MIN:
                break
            lines.insert(0, (line_no, line))
            line_no, start = line_no - 1, begin
        if not start and len(lines) < WRAP_SPAN and self.previous and len(self.previous[1]) >= WRAP_MIN:
            lines.insert(0, self.previous)
        return lines

    def _lines_after(self, block: bytes, end: int, line_no: int) -> list[tuple[int, bytes]]:
        """Up to WRAP_SPAN lines after line `line_no` (ending at `end`), while the line before each was long enough."""
        lines = []
        previous_length = WRAP_MIN
        while end < len(block) - 1 and len(lines) < WRAP_SPAN and previous_length >= WRAP_MIN:
            after = block.find(b"\n", end + 1)
            after = len(block) if after < 0 else after
            line = block[end + 1:after]
            lines.append((line_no + 1, line))
            line_no, end, previous_length = line_no + 1, after, len(line)
        return lines

    def _join_forward(self, block: bytes):
        """The windows that reached the end of the last block, completed from this one's first lines."""
        pending, self.forward = self.forward, []
        for window, current, trackers in pending:
            end = -1
            while len(window) - current - 1 < WRAP_SPAN and len(window[-1][1]) >= WRAP_MIN and end < len(block) - 1:
                after = block.find(b"\n", end + 1)
                after = len(block) if after < 0 else after
                window.append((window[-1][0] + 1, block[end + 1:after]))
                end = after
            self._join(window, current, trackers)

    def _join(self, window: list[tuple[int, bytes]], current: int, trackers: set[int]):
        """Match the lines of `window` joined (a message a terminal wrapped), for the signatures in
        `trackers`; the window stops at a line another rank printed (interleaved output)."""
        labelled = [(line_no, self._label(line[:MAX_LINE].decode("utf-8", "replace"))) for line_no, line in window]
        rank = labelled[current][1][0]
        if rank == self.default_rank:  # a continuation has no prefix: it belongs to the line it continues
            rank = next((label for _, (label, _) in reversed(labelled[:current]) if label != self.default_rank), rank)
        first, last = current, current
        while first > 0 and labelled[first - 1][1][0] in (rank, self.default_rank):
            first -= 1
        while last + 1 < len(labelled) and labelled[last + 1][1][0] in (rank, self.default_rank) \
                and labelled[last + 1][1][1].strip():
            last += 1
        lines = [(line_no, body.rstrip("\r")) for line_no, (_, body) in labelled[first:last + 1]]
        for index in sorted(trackers):
            tracker = self.trackers[index]
            tracker._rank = rank
            covered = tracker.feed_join(lines, (current - first, current - first + 1), self.joined.get(index, 0))
            if covered:
                self.joined[index] = covered

    def finish(self):
        """The end of the log: a window still waiting for the next block is matched as it is."""
        pending, self.forward = self.forward, []
        for window, current, trackers in pending:
            self._join(window, current, trackers)

    def findings(self) -> list[Finding]:
        findings = [f for t in [*self.trackers, *self.said_trackers.values()] for f in t.findings(self.all_ranks)]
        found = {f.issue.id for f in findings}
        return [f for f in findings if not set(f.issue.superseded_by) & found]


_SCREENS: list[tuple[tuple[KnownIssue, ...], Screen]] = []  # the last few, newest last


def screen_of(issues: list[KnownIssue]) -> Screen:
    """The Screen of these very issue objects, built once: building one (two automata over every
    guard word and its cuts) takes longer than diagnosing a typical log. The issues are frozen, and
    each entry holds them, so an object's id cannot be reused while its entry is here."""
    key = tuple(issues)
    for held, screen in _SCREENS:
        if len(held) == len(key) and all(a is b for a, b in zip(held, key)):
            return screen
    screen = Screen(issues, load_said())
    _SCREENS[:] = [*_SCREENS[-3:], (key, screen)]
    return screen


def diagnose_blocks(blocks: Iterable[bytes], issues: list[KnownIssue], screen: Optional[Screen] = None,
                    default_rank: Optional[str] = None) -> tuple[list[Finding], Scan]:
    """Every known issue found in one log given as blocks of whole lines, and the scan (lines, ranks)."""
    scan = Scan(issues, screen or screen_of(issues), default_rank)
    for block in blocks:
        scan.feed_block(block)
    scan.finish()
    return sorted(scan.findings(), key=lambda f: f.line_no), scan
