"""What a scan reports of one signature: a Finding (where first, how often, on which ranks, with
which parts), the excerpt it quotes, and the bounds on what one lists. Below the trackers that make
findings, the run that merges them and the report that prints them, so each of those reads one model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from envbuild.doctor.reading import printable
from envbuild.doctor.said import UNEXPLAINED
from envbuild.doctor.signatures import KnownIssue

MAX_LABELS = 4096  # rank labels a finding, a wait or a scan remembers
MAX_VALUES = 8  # values of one part a finding lists
EXCERPT = 240


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
