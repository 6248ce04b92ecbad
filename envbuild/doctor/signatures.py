"""Known failure signatures, read from matrices/known_issues.yaml.

A signature is data: regular expressions, the cause, the fix and the source, so a new field
report is a new entry, not new code. Two kinds exist:

- `match` (the default): every line matching `pattern` is a hit, unless `unless` appears later
  in the log (the step finished after all), and, when `context` is set, only if `context`
  appears within `context_lines` lines before or after the hit, and not if `excused_by` appears
  within `context_lines` lines before it (the user chose this on purpose, e.g. disabled IB).
- `wait`: `pattern` opens a wait (e.g. a JIT compile taking the torch_extensions lock) and
  `resolved_by` closes one, per rank. A wait still open at the end of the log is a hang, unless
  `moved_on` (training progress) appears after it or `quiet_lines` other lines of that rank
  follow it. `evidence` (e.g. a stack parked in the lock's wait loop) is a hang on its own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

try:  # Python >= 3.11
    from re import _constants as sre_constants, _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants
    import sre_parse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import EnvbuildError

REGEX_FIELDS = ("pattern", "unless", "context", "excused_by", "resolved_by", "evidence", "moved_on")


class KnownIssue(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    title: str
    kind: Literal["match", "wait"] = "match"
    pattern: str
    unless: Optional[str] = None
    context: Optional[str] = None
    context_lines: int = Field(default=30, ge=1, le=1000)
    excused_by: Optional[str] = None
    superseded_by: list[str] = []
    resolved_by: Optional[str] = None
    evidence: Optional[str] = None
    moved_on: Optional[str] = None
    quiet_lines: int = Field(default=1000, ge=1)
    cause: str
    fix: str
    source: str

    @model_validator(mode="after")
    def _wait_needs_resolution(self):
        if self.kind == "wait" and not self.resolved_by:
            raise ValueError(f"{self.id}: a `wait` signature needs `resolved_by`")
        if self.kind == "match" and (self.resolved_by or self.evidence or self.moved_on):
            raise ValueError(f"{self.id}: `resolved_by`, `evidence` and `moved_on` belong to `wait` signatures")
        if self.kind == "wait" and (self.context or self.excused_by):
            raise ValueError(f"{self.id}: `context` and `excused_by` belong to `match` signatures")
        return self

    def regex(self, name: str) -> Optional["GuardedRegex"]:
        """The compiled regular expression of field `name` (None where the field is unset)."""
        value = getattr(self, name)
        return GuardedRegex(value) if value else None


MIN_GUARD = 3


def _literal_runs(items) -> list[str]:
    """The runs of plain characters in a parsed branch (anything else ends a run)."""
    runs, run = [], ""
    for op, arg in items:
        if op is sre_constants.LITERAL:
            run += chr(arg)
            continue
        runs.append(run)
        run = ""
    return runs + [run]


def literal_guard(pattern: str) -> Optional[tuple[str, ...]]:
    """Substrings one of which every match of `pattern` contains, or None if some branch has none.

    Each top-level alternative contributes its longest run of plain characters, so
    `any(word in line for word in guard)` is a necessary condition for a match; testing it first
    is far cheaper than running the regular expression on every line of a long log.
    """
    tree = sre_parse.parse(pattern)
    if tree.state.flags & re.IGNORECASE:
        return None
    items = list(tree)
    if len(items) == 1 and items[0][0] is sre_constants.SUBPATTERN and not items[0][1][1] and not items[0][1][2]:
        items = list(items[0][1][3])  # (?:a|b) around the whole pattern
    branches = items[0][1][1] if len(items) == 1 and items[0][0] is sre_constants.BRANCH else [items]
    guard = []
    for branch in branches:
        longest = max(_literal_runs(list(branch)), key=len)
        if len(longest) < MIN_GUARD:
            return None
        guard.append(longest)
    return tuple(dict.fromkeys(guard))


class GuardedRegex:
    """A compiled regular expression that skips lines without any of its literal guard words."""

    def __init__(self, pattern: str):
        self.regex = re.compile(pattern)
        self.guard = literal_guard(pattern)
        if self.guard is None:
            self.possible = lambda line: True
        elif len(self.guard) == 1:
            word = self.guard[0]
            self.possible = lambda line: word in line
        else:
            words = re.compile("|".join(re.escape(word) for word in self.guard))
            self.possible = lambda line: words.search(line) is not None

    def search(self, line: str):
        return self.regex.search(line) if self.possible(line) else None

    def finditer(self, line: str):
        return self.regex.finditer(line) if self.possible(line) else iter(())

    def count(self, line: str) -> int:
        return len(self.regex.findall(line)) if self.possible(line) else 0


def load_issues(matrix_dir: Path) -> list[KnownIssue]:
    """Every signature in `matrix_dir/known_issues.yaml`, validated and with its regexes compiled once."""
    path = matrix_dir / "known_issues.yaml"
    try:
        data = yaml.safe_load(path.read_text())
        issues = [KnownIssue.model_validate(i) for i in data["issues"]]
        for issue in issues:
            for name in REGEX_FIELDS:
                issue.regex(name)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "an entry"
        raise EnvbuildError(f"known-issues file {path} is malformed: {where}: {error['msg']}.") from None
    except (OSError, yaml.YAMLError, KeyError, TypeError, re.error) as e:
        raise EnvbuildError(f"known-issues file {path} is malformed: {str(e).splitlines()[0]}.") from None
    ids = [i.id for i in issues]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    unknown = sorted({s for i in issues for s in i.superseded_by} - set(ids))
    if duplicates or unknown:
        problem = f"duplicate ids {duplicates}" if duplicates else f"superseded_by names unknown ids {unknown}"
        raise EnvbuildError(f"known-issues file {path} is malformed: {problem}.")
    return issues
