"""Match the signatures against a log in one streaming pass, rank by rank.

The log comes as blocks of whole lines (bytes). The screen (screen.py) finds, in each block at once,
every guard word of every signature: the lines holding none are only counted (`bytes.count`), with
no Python work of their own; a line holding some is decoded and fed to the trackers (trackers.py)
of the signatures whose words it holds. Rank labels of all lines are collected by one
regular expression per block. Only while a `wait` signature has a wait open (a JIT load that
has not finished yet) are lines walked one by one, since every line of that rank counts then.

A message a terminal wrapped over two lines still matches: a line holding a word of a
signature's guard but not a match is joined with the line before and after it (the same rank's,
or an unprefixed continuation) and matched again; a match must span the join. A paste that
lost its newlines is cut before each `[rankN]:` it holds.
"""

from __future__ import annotations

from typing import Iterable, Optional

from envbuild.doctor.finding import MAX_LABELS, Finding
from envbuild.doctor.ranks import SNIFF_LINES, RankStyle, split_flattened
from envbuild.doctor.reading import MAX_LINE
from envbuild.doctor.screen import SAID, Screen, screen_of
from envbuild.doctor.signatures import KnownIssue, applicable
from envbuild.doctor.trackers import WRAP_MIN, MatchTracker, WaitTracker

MAX_SAID = 64  # distinct catalogued messages one log reports
WRAP_SPAN = 4  # lines before and after a line that a wrapped message may take


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
        tracker.hit(line_no, body, found[1], rank)  # matched already; a catalogue entry has no context or unless

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
            covered = tracker.feed_join(lines, (current - first, current - first + 1), self.joined.get(index, 0), rank)
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


def diagnose_blocks(blocks: Iterable[bytes], issues: list[KnownIssue], screen: Optional[Screen] = None,
                    default_rank: Optional[str] = None) -> tuple[list[Finding], Scan]:
    """Every known issue found in one log given as blocks of whole lines, and the scan (lines, ranks)."""
    scan = Scan(issues, screen or screen_of(issues), default_rank)
    for block in blocks:
        scan.feed_block(block)
    scan.finish()
    return sorted(scan.findings(), key=lambda f: f.line_no), scan
