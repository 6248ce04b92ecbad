"""Findings as text for people and as JSON for programs."""

from __future__ import annotations

import json

from .engine import Finding

NOTHING = "no known signature found in the log (known: `matrices/known_issues.yaml`)."


def _ranks(finding: Finding) -> str:
    if not finding.ranks and not finding.other_ranks:
        return ""
    if finding.issue.kind == "wait":
        words = [("stuck", finding.ranks), ("loaded", finding.other_ranks)]
    else:
        words = [("on", finding.ranks), ("not on", finding.other_ranks)]
    return "; ".join(f"{word}: {', '.join(labels)}" for word, labels in words if labels)


def render_text(findings: list[Finding]) -> str:
    """One block per finding: title, where, the line itself, cause, fix, source."""
    if not findings:
        return NOTHING
    blocks = []
    for f in findings:
        head = f"{f.issue.title} ({f.issue.id}), line {f.line_no}" + (f", {f.count} times" if f.count > 1 else "")
        lines = [head]
        if f.detail:
            lines.append(f"  what:   {f.detail}")
        ranks = _ranks(f)
        if ranks:
            lines.append(f"  ranks:  {ranks}")
        lines += [f"  > {f.excerpt}", f"  cause:  {f.issue.cause}", f"  fix:    {f.issue.fix}",
                  f"  source: {f.issue.source}"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def render_json(findings: list[Finding]) -> str:
    """A JSON list, one object per finding (id, title, line, count, rank, excerpt, cause, fix, source, ...)."""
    return json.dumps([f.as_dict() for f in findings], indent=2, ensure_ascii=False)
