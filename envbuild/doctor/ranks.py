"""Which rank (process, task or host) printed a log line, and when, from what launchers add.

Strong prefixes name a rank unambiguously wherever they appear:
  `[rank3]:` (torchrun, PyTorch >= 2.2), `[default3]:` (torchrun --tee/--role: local rank),
  `(pid=1234)` / `(WorkerDict pid=1234, ip=10.0.0.1)` (Ray), and, inside a message,
  `[Rank 3]` / `[PG 1 Rank 3]` (ProcessGroupNCCL, DeepSpeed's log_dist).
Weak prefixes look like ordinary text (`0: ` from `srun --label`, `gpu1505: ` from pdsh and the
DeepSpeed multi-node launcher), so they count only when most lines of the log carry them;
`RankStyle.sniff` decides that from the first lines. A file of a per-rank directory
(`srun --output=%x-%t.out`) names its rank in its name (`file_rank`).

`RankStyle.labels_in` finds every label of a block of lines in one regular-expression pass, so
lines that no signature concerns cost no Python work of their own.
"""

from __future__ import annotations

import re
from typing import AbstractSet, Iterable, Optional

TORCHRUN_PREFIX = r"[^\n]{0,40}?\[rank(\d+)\]:"
ROLE_PREFIX = r"\[default(\d+)\]:"
RAY_ONE = r"\((?:[\w.-]+ )?pid=\d+(?:, ip=[\d.]+)?\)[ \t]*"
RAY_PREFIX = rf"(?:{RAY_ONE})*\((?:([\w.-]+) )?pid=(\d+)(?:, ip=([\d.]+))?\)"
IN_MESSAGE_ANY = r"[^\n]*?\[(?:PG [^\]\n]*?)?Rank (\d+)\]"
SRUN_PREFIX = r"[ \t]*(\d{1,5}): "
# A host name, not an exception class or a file name (`libfoo.so.1: `, `model.py: `).
HOST_PREFIX = (r"(?![A-Za-z][\w.-]*(?:Error|Exception|Warning|Interrupt|Exit|\.so[\d.]*|\.py|\.cc?|\.cpp|\.cu|\.hp?p?"
               r"|\.txt|\.log|\.json|\.ya?ml): )([A-Za-z][\w.-]*\d[\w.-]*): ")
STRONG = f"{TORCHRUN_PREFIX}|{ROLE_PREFIX}|{RAY_PREFIX}|{IN_MESSAGE_ANY}"
WEAK = {"srun": SRUN_PREFIX, "host": HOST_PREFIX}
# Each strong prefix with a marker a block must hold for it to occur, and its number of groups.
# `[Rank N]` inside a message is found by its own search (`labels_in`): scanning every line for it
# in the same expression costs more than all the rest.
BLOCK_PREFIXES = ((b"[rank", TORCHRUN_PREFIX, 1), (b"[default", ROLE_PREFIX, 1), (b"pid=", RAY_PREFIX, 3))
IN_MESSAGE_BYTES = re.compile(rb"Rank \d+\]")
TORCHRUN_BYTES = re.compile(rb"\[rank(\d+)\]:")  # anywhere in a line: a superset of the prefixes
ROLE_BYTES = re.compile(rb"\[default(\d+)\]:")

TORCHRUN = re.compile(TORCHRUN_PREFIX)
TORCHRUN_ANYWHERE = re.compile(r"\[rank(\d+)\]:")
STRONG_LINE = re.compile(STRONG)
PREFIX_LINE = re.compile(f"{TORCHRUN_PREFIX}|{ROLE_PREFIX}|{RAY_PREFIX}")
WEAK_LINE = {style: re.compile(expression) for style, expression in WEAK.items()}

SNIFF_LINES = 500
WEAK_SHARE = 0.5
WEAK_MIN = 3  # a weak prefix on fewer lines than this says nothing

# Timestamps a failure line may carry: ISO dates (Python logging, Slurm, most launchers) and
# glog's `E0429 13:55:49.384` (torch's C++ warnings and errors, which give no year).
TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?"
                  r"|\b[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{1,9})\b")


def _label(groups: tuple, style: Optional[str] = None) -> Optional[str]:
    """The label of one STRONG (or WEAK + STRONG) match's groups."""
    if style:
        weak, groups = groups[0], groups[1:]
        if weak:
            return f"task {int(weak)}" if style == "srun" else f"host {weak}"
    torchrun, role, actor, pid, ip, in_message = groups
    if torchrun:
        return f"rank {torchrun}"
    if role:
        return f"local rank {role}"
    if pid:
        return f"{actor + ' ' if actor else ''}pid {pid}{' @' + ip if ip else ''}"
    if in_message:
        return f"rank {in_message}"
    return None


def strong_rank(line: str) -> Optional[str]:
    """The rank a strong prefix names, or None."""
    match = STRONG_LINE.match(line)
    return _label(match.groups()) if match else None


class RankStyle:
    """Labels lines with the rank that printed them (None where nothing says)."""

    def __init__(self, weak_style: Optional[str] = None):
        self.weak_style = weak_style
        self._blocks: dict[tuple, re.Pattern] = {}

    @classmethod
    def sniff(cls, first_lines: Iterable[str]) -> "RankStyle":
        """Accept a weak prefix style only if it is on at least half of the non-blank first lines (and
        on WEAK_MIN of them: two lines of a tiny paste say nothing)."""
        counts: dict[str, int] = {}
        total = 0
        for line in first_lines:
            if not line.strip():
                continue
            total += 1
            for style, regex in WEAK_LINE.items():
                if regex.match(line):
                    counts[style] = counts.get(style, 0) + 1
                    break
        best = max(counts, key=lambda s: counts[s], default=None)
        if best and counts[best] >= max(WEAK_MIN, WEAK_SHARE * total):
            return cls(best)
        return cls()

    def label(self, line: str) -> tuple[Optional[str], str]:
        """(rank label, the line without the launcher's prefix)."""
        if self.weak_style:
            match = WEAK_LINE[self.weak_style].match(line)
            if match:
                return _label(match.groups() + (None,) * 6, self.weak_style), line[match.end():]
        match = TORCHRUN.match(line)
        if match:
            return f"rank {match.group(1)}", line[match.end():]
        return strong_rank(line), line

    def _block_regex(self, present: tuple[bool, ...]) -> re.Pattern:
        """One expression for the prefixes of a block's lines, leaving out those whose marker the
        block lacks (an alternative that can never match keeps its groups, so `_label` reads the
        same positions)."""
        regex = self._blocks.get(present)
        if regex is None:
            alternatives = [expression if here else "(?!)" + "()" * groups
                            for here, (_, expression, groups) in zip(present, BLOCK_PREFIXES)]
            if self.weak_style:
                alternatives.insert(0, WEAK[self.weak_style])  # the weak prefix's group first
            # A newline, not a MULTILINE `^`: re then looks for its literal first byte in C and tries
            # the prefixes at line starts only, instead of at every byte (7x faster on short lines).
            regex = self._blocks[present] = re.compile(f"\n(?:{'|'.join(alternatives)})".encode())
        return regex

    def labels_in(self, block: bytes, known: AbstractSet[str] = frozenset(), count: bool = True) -> tuple[set[str], int]:
        """The labels of the lines of a block, and how many lines carry one (when `count`): the
        prefixes in one pass over the block, `[Rank N]` lines one by one (only they cost Python
        work). Where the count is not needed and every `[rankN]:`/`[defaultN]:` anywhere in the
        block names a label already `known`, the exact pass (which must check each line's first
        40 characters) can add nothing and is skipped: 10 million short lines cost 1.2 s less."""
        labels: set[str] = set()
        found: list = []
        present = tuple(marker in block for marker, _, _ in BLOCK_PREFIXES)
        if not self.weak_style and not count and not present[2] and any(present):
            anywhere = {f"rank {n.decode()}" for n in set(TORCHRUN_BYTES.findall(block))} if present[0] else set()
            if present[1]:
                anywhere |= {f"local rank {n.decode()}" for n in set(ROLE_BYTES.findall(block))}
            if anywhere <= known:
                present = (False,) * len(present)
        if self.weak_style or any(present):
            found = self._block_regex(present).findall(b"\n" + block)
            for groups in set(found):
                text = tuple(g.decode("utf-8", "replace") if g else None for g in groups) + (None,)
                label = _label(text, self.weak_style)
                if label:
                    labels.add(label)
        labelled = len(found)
        if b"Rank " in block:
            done = -1
            for match in IN_MESSAGE_BYTES.finditer(block):
                start = block.rfind(b"\n", 0, match.start()) + 1
                if start <= done:
                    continue
                end = block.find(b"\n", match.end())
                done = end if end >= 0 else len(block)
                line = block[start:done].decode("utf-8", "replace")
                if self._prefix(line) is None:
                    label = strong_rank(line)
                    if label:
                        labels.add(label)
                        labelled += 1
        return labels, labelled

    def _prefix(self, line: str) -> Optional[str]:
        """The label of a launcher prefix at the start of the line (not one inside the message)."""
        if self.weak_style and WEAK_LINE[self.weak_style].match(line):
            return "weak"
        return _label(PREFIX_LINE.match(line).groups() + (None,)) if PREFIX_LINE.match(line) else None


def split_flattened(line: str) -> list[str]:
    """A line holding several torchrun-prefixed lines (a paste that lost its newlines, or ranks
    writing into one line at once), cut before each `[rankN]:` after the first."""
    starts = [m.start() for m in TORCHRUN_ANYWHERE.finditer(line)]
    starts = [s for s in starts if s > 40]
    if not starts:
        return [line]
    bounds = [0] + starts + [len(line)]
    return [line[a:b] for a, b in zip(bounds, bounds[1:]) if line[a:b].strip()]


def rank_order(label: str):
    """Natural order: rank 2 before rank 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label)]


def sorted_ranks(labels: Iterable[Optional[str]]) -> list[str]:
    return sorted({label for label in labels if label}, key=rank_order)


def timestamp(line: str) -> Optional[tuple]:
    """(kind, comparable fields) of the first timestamp near the start of a line, or None."""
    match = TIME.search(line, 0, 160)
    if not match:
        return None
    groups = match.groups()
    if groups[0]:
        return ("iso",) + tuple(int(g or 0) for g in groups[:6]) + (float("0." + (groups[6] or "0")),)
    return ("glog",) + tuple(int(g) for g in groups[7:12]) + (float("0." + groups[12]),)


def time_text(stamp: Optional[tuple]) -> str:
    if not stamp:
        return ""
    if stamp[0] == "iso":
        _, y, mo, d, h, mi, s, frac = stamp
        return f"{y:04d}-{mo:02d}-{d:02d} {h:02d}:{mi:02d}:{s:02d}{str(round(frac, 3))[1:] if frac else ''}"
    _, mo, d, h, mi, s, frac = stamp
    return f"{mo:02d}-{d:02d} {h:02d}:{mi:02d}:{s:02d}{str(round(frac, 3))[1:] if frac else ''}"


LOG_SUFFIXES = re.compile(r"(?:\.(?:gz|bz2|xz))?$")
NAME_SUFFIXES = re.compile(r"(?:\.(?:log|out|err|txt|stdout|stderr))+$", re.IGNORECASE)
STD_STREAM = re.compile(r"[-_.]?(?:std)?(?:out|err)$", re.IGNORECASE)
FILE_NUMBER = re.compile(r"(?:(rank|node|task|worker|proc|process)[-_.]?)?(\d{1,7})$", re.IGNORECASE)


def file_rank(path: str) -> Optional[str]:
    """The rank a per-rank log's path gives: `train-3.out` (Slurm's %t) is task 3, `rank_3.log`
    rank 3, `node-1.err` node 1; a name without a number takes its directory's, if that is a
    number (torchrun --log-dir writes <run>/attempt_0/<rank>/stderr.log); None otherwise.

    >>> [file_rank(n) for n in ("job-12.out", "rank_3.log.gz", "node1.err", "train.log", "a/attempt_0/2/stderr.log")]
    ['task 12', 'rank 3', 'node 1', None, 'rank 2']
    """
    parts = path.replace("\\", "/").rstrip("/").split("/")
    stem = NAME_SUFFIXES.sub("", LOG_SUFFIXES.sub("", parts[-1]))
    match = FILE_NUMBER.search(stem)
    if match:
        word = (match.group(1) or "task").lower().replace("process", "proc")
        return f"{word} {int(match.group(2))}"
    if len(parts) > 1 and parts[-2].isdigit() and len(parts[-2]) <= 7:
        return f"rank {int(parts[-2])}"
    return None


def stream_of(path: str) -> str:
    """What names one process's output: the path without its stdout/stderr part and extensions,
    so `job-3.out` and `job-3.err` (or `2/stdout.log` and `2/stderr.log`) are one stream."""
    head, _, name = path.replace("\\", "/").rpartition("/")
    stem = NAME_SUFFIXES.sub("", LOG_SUFFIXES.sub("", name))
    return head + "/" + STD_STREAM.sub("", stem)
