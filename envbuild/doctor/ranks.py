"""Which rank (process, task or host) printed a log line, from the prefixes launchers add.

Strong prefixes name a rank unambiguously wherever they appear:
  `[rank3]:` (torchrun, PyTorch >= 2.2), `[default3]:` (torchrun --tee/--role: local rank),
  `(pid=1234)` / `(WorkerDict pid=1234, ip=10.0.0.1)` (Ray), and, inside a message,
  `[Rank 3]` / `[PG 1 Rank 3]` (ProcessGroupNCCL, DeepSpeed's log_dist).
Weak prefixes look like ordinary text (`0: ` from `srun --label`, `gpu1505: ` from pdsh and the
DeepSpeed multi-node launcher), so they count only when most lines of the log carry them;
`RankStyle.sniff` decides that from the first lines.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

TORCHRUN = re.compile(r"\[rank(\d+)\]:")
TORCHRUN_ROLE = re.compile(r"^\[default(\d+)\]:")
RAY = re.compile(r"^(?:\((?:[\w.-]+ )?pid=\d+(?:, ip=[\d.]+)?\)\s*)+")
RAY_LAST = re.compile(r"\((?:([\w.-]+) )?pid=(\d+)(?:, ip=([\d.]+))?\)\s*$")
IN_MESSAGE = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]")
SRUN = re.compile(r"^\s*(\d{1,5}): ")
HOST = re.compile(r"^([A-Za-z][\w.-]*\d[\w.-]*): ")
NOT_A_HOST = re.compile(r"(Error|Exception|Warning|Interrupt|Exit)$")

SNIFF_LINES = 500
WEAK_SHARE = 0.5


def strong_rank(line: str) -> Optional[str]:
    """The rank a strong prefix names, or None."""
    match = TORCHRUN.search(line, 0, 48)
    if match:
        return f"rank {match.group(1)}"
    match = TORCHRUN_ROLE.match(line)
    if match:
        return f"local rank {match.group(1)}"
    match = RAY.match(line)
    if match:
        last = RAY_LAST.search(match.group(0))
        if last:
            actor, pid, ip = last.groups()
            return f"{actor + ' ' if actor else ''}pid {pid}{' @' + ip if ip else ''}"
    match = IN_MESSAGE.search(line)
    if match:
        return f"rank {match.group(1)}"
    return None


def _weak(line: str) -> tuple[Optional[str], Optional[str]]:
    """(style, label) of a weak prefix on this line."""
    match = SRUN.match(line)
    if match:
        return "srun", f"task {int(match.group(1))}"
    match = HOST.match(line)
    if match and not NOT_A_HOST.search(match.group(1)):
        return "host", f"host {match.group(1)}"
    return None, None


class RankStyle:
    """Labels lines with the rank that printed them (None where nothing says)."""

    def __init__(self, weak_style: Optional[str] = None):
        self.weak_style = weak_style

    @classmethod
    def sniff(cls, first_lines: Iterable[str]) -> "RankStyle":
        """Accept a weak prefix style only if it is on at least half of the non-blank first lines."""
        counts: dict[str, int] = {}
        total = 0
        for line in first_lines:
            if not line.strip():
                continue
            total += 1
            style, _ = _weak(line)
            if style:
                counts[style] = counts.get(style, 0) + 1
        best = max(counts, key=lambda s: counts[s], default=None)
        if best and total and counts[best] >= WEAK_SHARE * total:
            return cls(best)
        return cls()

    def label(self, line: str) -> tuple[Optional[str], str]:
        """(rank label, the line without the launcher's prefix)."""
        if self.weak_style:
            style, label = _weak(line)
            if style == self.weak_style:
                return label, line.split(": ", 1)[1]
        match = TORCHRUN.search(line, 0, 48)
        if match:
            return f"rank {match.group(1)}", line[match.end():]
        return strong_rank(line), line
