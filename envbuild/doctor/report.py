"""A doctor run as text for people and as JSON for programs."""

from __future__ import annotations

import json

from envbuild.doctor.finding import Finding
from envbuild.doctor.flight import Recording
from envbuild.doctor.reading import printable, size_text
from envbuild.doctor.run import Report

NOTHING = "no known signature found (known: `matrices/known_issues.yaml`)."


def _ranks(finding: Finding) -> str:
    if not finding.ranks and not finding.other_ranks:
        return ""
    if finding.issue.kind == "wait":
        words = [("stuck", finding.ranks), ("loaded", finding.other_ranks)]
    else:
        words = [("on", finding.ranks), ("not on", finding.other_ranks)]
    return "; ".join(f"{word}: {', '.join(map(printable, labels))}" for word, labels in words if labels)


def _finding(f: Finding, report: Report) -> str:
    where = f"{printable(f.file)} line {f.line_no}" if f.file else f"line {f.line_no}"
    head = f"{printable(f.title)} ({f.issue.id}), {where}" + (f", {f.count} times" if f.count > 1 else "")
    lines = [head]
    if f.detail:
        lines.append(f"  what:   {printable(f.detail)}")
    ranks = _ranks(f)
    if ranks:
        lines.append(f"  ranks:  {ranks}")
    likely = "likely (the log does not say which): " if f.certainty == "likely" else ""
    lines += [f"  > {f.excerpt}", f"  cause:  {likely}{f.text('cause')}", f"  fix:    {f.text('fix')}"]
    family = report.families.get(f.issue.family)
    if family:
        lines.append(f"  family: {family.title}; {family.envbuild}")
    lines.append(f"  source: {f.issue.source}")
    return "\n".join(lines)


def _order(report: Report) -> list[str]:
    order = report.order
    if not order or not (order.first or order.followed):
        return []
    lines = ["Ranks:"]
    likely = "likely " if order.certainty == "likely" else ""
    if order.first:
        what = []
        for rank in order.first[:8]:
            firsts = [e for e in report.ranks.get(rank, []) if not e["follows"]]
            if firsts:
                e = firsts[0]
                where = f"{printable(e['file']) + ' ' if e['file'] else ''}line {e['line']}" + (f", {e['time']}" if e["time"] else "")
                what.append(f"{printable(rank)} ({e['id']}, {where})")
            else:
                what.append(f"{printable(rank)} (no finding in its log)")
        lines.append(f"  {likely}first to fail: {'; '.join(what)}" + (" …" if len(order.first) > 8 else ""))
    if order.followed:
        ids = sorted({e["id"] for rank in order.followed for e in report.ranks.get(rank, [])})
        lines.append(f"  only followed: {', '.join(map(printable, order.followed))} ({', '.join(ids)})")
    if order.quiet and order.quiet != order.first:
        lines.append(f"  no finding:    {', '.join(map(printable, order.quiet))}")
    lines.append(f"  decided by:    {printable(order.how)}")
    return lines


def _recording(recording: Recording) -> list[str]:
    lines = [f"Flight recorder ({len(recording.files)} dumps, ranks {', '.join(map(str, recording.ranks)) or 'none'}; "
             f"dump format {printable(recording.version)}):"]
    if not recording.files:
        lines.append("  no dump could be read (each is listed under Skipped: with the reason): no verdict.")
    elif not recording.hangs:
        lines.append("  every collective recorded completed on every rank whose dump was read: no hang recorded.")
    for hang in recording.hangs:
        kind = "point-to-point op" if hang.p2p else "collective"
        lines.append(f"  process group {printable(hang.pg)}: {kind} #{hang.seq} {printable(hang.op)} (input sizes "
                     f"{hang.sizes}) did not complete")
        if hang.entered:
            lines.append(f"    entered it:       {', '.join(f'rank {r}' for r in hang.entered)}")
        if hang.never_entered:
            last = "; ".join(f"rank {r}: {printable(op)}" for r, op in hang.last.items())
            lines.append(f"    never entered it: {', '.join(f'rank {r}' for r in hang.never_entered)}"
                         + (f" (last recorded: {last})" if last else ""))
        if hang.others:
            lines.append("    called another collective at this number: "
                         + ", ".join(f"rank {r} ({printable(op)})" for r, op in hang.others.items()))
        if hang.no_dump:
            lines.append(f"    wrote no dump:    {', '.join(f'rank {r}' for r in hang.no_dump)} (died, or never "
                         "reached the watchdog)")
    if recording.unread_ranks:
        lines.append(f"  dump not read:     {', '.join(f'rank {r}' for r in recording.unread_ranks)} (see Skipped:)")
    if recording.ignored_entries:
        lines.append(f"  {recording.ignored_entries} entries lacked the fields read and were left out.")
    return lines


def _reading(report: Report) -> list[str]:
    lines = []
    empty = [info.path for info in report.inputs if not info.bytes and not info.stopped]
    if empty:
        lines.append(f"Empty (0 bytes): {', '.join(map(printable, empty[:20]))}" + (" …" if len(empty) > 20 else ""))
    for info in report.inputs:
        if info.stopped:
            lines.append(f"Not read to the end: {printable(info.path)}: stopped after {size_text(info.bytes)} "
                         f"({info.lines} lines) at {info.stopped}; the findings cover only what was read.")
    for path, why in report.skipped[:20]:
        lines.append(f"Skipped: {printable(path)}: {printable(why)}")
    if len(report.skipped) > 20:
        lines.append(f"Skipped: {len(report.skipped) - 20} more")
    return lines


def render_text(report: Report) -> str:
    """One block per finding (title, where, ranks, the line itself, cause, fix, family, source),
    then the ranks' order, the flight recorder's verdict, what was not read and the image compared with."""
    blocks = [_finding(f, report) for f in report.findings]
    if not blocks and not (report.recording and report.recording.hangs):
        blocks.append(NOTHING)
    reading = _reading(report) + ([report.image.describe()] if report.image else [])
    for part in (_order(report), _recording(report.recording) if report.recording else [], reading):
        if part:
            blocks.append("\n".join(part))
    return "\n\n".join(blocks)


def render_json(report: Report) -> str:
    """The run as one JSON object: findings, ranks, order, flight_recorder, inputs, skipped, image."""
    return json.dumps({
        "findings": [f.as_dict() for f in report.findings],
        "ranks": report.ranks,
        "order": report.order.as_dict() if report.order else None,
        "flight_recorder": report.recording.as_dict() if report.recording else None,
        "inputs": [info.as_dict() for info in report.inputs],
        "skipped": [{"path": path, "why": why} for path, why in report.skipped],
        "image": report.image.as_dict() if report.image else None,
    }, indent=2, ensure_ascii=False)
