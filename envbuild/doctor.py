"""Recognise known failure signatures in a training log and say what to do.

The signatures are data (matrices/known_issues.yaml): a regular expression, the cause,
the fix and the source, so a new field report is a new entry, not new code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import EnvbuildError


class KnownIssue(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    title: str
    pattern: str
    unless: Optional[str] = None
    cause: str
    fix: str
    source: str


@dataclass
class Finding:
    issue: KnownIssue
    line_no: int
    line: str
    count: int


def load_issues(matrix_dir: Path) -> list[KnownIssue]:
    path = matrix_dir / "known_issues.yaml"
    try:
        data = yaml.safe_load(path.read_text())
        issues = [KnownIssue.model_validate(i) for i in data["issues"]]
        for i in issues:
            re.compile(i.pattern)
            if i.unless:
                re.compile(i.unless)
        return issues
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValidationError, re.error) as e:
        raise EnvbuildError(f"known-issues file {path} is malformed: {str(e).splitlines()[0]}.") from None


def diagnose(text: str, issues: list[KnownIssue]) -> list[Finding]:
    """Every known issue whose signature is in `text`, first occurrence first."""
    lines = text.splitlines()
    found = []
    for issue in issues:
        pat = re.compile(issue.pattern)
        hits = [(n, ln) for n, ln in enumerate(lines, 1) if pat.search(ln)]
        if not hits:
            continue
        if issue.unless:
            later = "\n".join(lines[hits[-1][0]:])
            if re.search(issue.unless, later):
                continue
        found.append(Finding(issue, hits[0][0], hits[0][1].strip(), len(hits)))
    return sorted(found, key=lambda f: f.line_no)
