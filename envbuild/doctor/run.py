"""One doctor run over what the user named: log files, directories of per-rank logs (a Slurm
job's `--output=%x-%t.out` files, gzip included) and flight-recorder dumps.

Each log is scanned on its own (line numbers, context windows and waits are per file); a log
of a set names its rank in its file name unless its lines carry their own prefixes. Findings of
the same signature and parts are then merged over the files, and the ranks are ordered: the
first to fail is the earliest failure of its own (by timestamps where the failure lines carry
them, by line order within one log), and ranks whose only findings are the consequences of
another rank's failure (`follows: true`: a collective timeout, a peer that closed) only followed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import escaped
from envbuild.doctor.engine import diagnose_blocks
from envbuild.doctor.finding import MAX_VALUES, Finding
from envbuild.doctor.flight import Recording, is_dump, read_recording
from envbuild.doctor.ranks import file_rank, rank_order, sorted_ranks, stream_of, time_text
from envbuild.doctor.reading import Budget, LogReader, read_head, sniff_binary
from envbuild.doctor.image import Image
from envbuild.doctor.said import load_said
from envbuild.doctor.screen import Screen
from envbuild.doctor.signatures import Family, KnownIssue, bind_image

MAX_FILES = 10_000
MAX_DEPTH = 8
HEAD = 4096


@dataclass
class Source:
    path: str
    kind: str  # "log" or "dump"
    named: bool  # named by the user (an error stops the run) or found in a directory (skipped)
    rank: Optional[str] = None


@dataclass
class InputInfo:
    path: str
    rank: Optional[str]
    format: str = ""
    lines: int = 0
    bytes: int = 0
    stopped: Optional[str] = None  # why reading ended early; None when the whole log was read

    def as_dict(self) -> dict:
        return {"path": self.path, "rank": self.rank, "format": self.format, "lines": self.lines,
                "bytes": self.bytes, "complete": self.stopped is None, "stopped": self.stopped}


@dataclass
class Order:
    """Which rank failed first and which only followed, and how that was decided."""
    first: list[str]  # one rank, or several when nothing orders them
    how: str
    followed: list[str]
    quiet: list[str]  # ranks seen in the logs with no finding
    certainty: str = "certain"

    def as_dict(self) -> dict:
        return {"first_to_fail": self.first, "decided_by": self.how, "followed": self.followed,
                "no_finding": self.quiet, "certainty": self.certainty}


@dataclass
class Report:
    inputs: list[InputInfo] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    ranks: dict[str, list[dict]] = field(default_factory=dict)
    order: Optional[Order] = None
    recording: Optional[Recording] = None
    families: dict[str, Family] = field(default_factory=dict)
    image: Optional[Image] = None  # the image the logs were compared with (--manifest)

    def found(self) -> bool:
        """A curated finding or a hang: what a component only said (not yet explained) is a lead, not a verdict."""
        return any(f.explained for f in self.findings) or bool(self.recording and self.recording.hangs)


def _kind(path: str, named: bool) -> tuple[Optional[str], Optional[str]]:
    """("log" or "dump", None), or (None, why it is skipped) for a file found in a directory that
    is neither (whether a log is text is told by LogReader, when it is read)."""
    try:
        head = read_head(path, "log", HEAD)
    except EnvbuildError as e:
        if named:
            raise
        return None, e.message.split(";")[0].removeprefix(f"log {escaped(path)} ")
    if is_dump(head):
        return "dump", None
    why = sniff_binary(head)
    return (None, why) if why and not named else ("log", None)


def expand(paths: list[str]) -> tuple[list[Source], list[tuple[str, str]]]:
    """The files to read: named ones, and every regular file under a named directory (sorted,
    at most MAX_FILES, MAX_DEPTH deep); what a directory holds that is not a log or a dump is
    listed as skipped with the reason."""
    sources: list[Source] = []
    skipped: list[tuple[str, str]] = []
    for path in paths:
        if path == "-":
            sources.append(Source("-", "log", True))
            continue
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            raise EnvbuildError(f"log {escaped(path)} cannot be read: {e.strerror}. Give `envbuild doctor` training logs, "
                                "a directory of per-rank logs or flight-recorder dumps, or - for standard input.") from None
        if not stat.S_ISDIR(mode):
            kind, _ = _kind(path, True)
            sources.append(Source(path, kind, True))
            continue
        found = 0
        for root, dirs, files in os.walk(path):
            depth = root[len(path):].count(os.sep)
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < MAX_DEPTH else []
            for name in sorted(files):
                full = os.path.join(root, name)
                if name.startswith("."):
                    continue
                if found >= MAX_FILES:
                    skipped.append((path, f"holds more than {MAX_FILES} files; only the first {MAX_FILES} were read"))
                    break
                found += 1
                kind, why = _kind(full, False)
                if kind:
                    sources.append(Source(full, kind, False))
                else:
                    skipped.append((full, why))
            if found >= MAX_FILES:
                break
        if not any(s.path.startswith(os.path.join(path, "")) for s in sources):
            first = f"; first {escaped(skipped[0][0])}: {escaped(skipped[0][1])}" if skipped else ""
            raise EnvbuildError(f"directory {escaped(path)} holds no log or flight-recorder dump"
                                f"{f' ({len(skipped)} files skipped{first})' if skipped else ''}. Give it the "
                                "job's per-rank logs (text, gzip, bzip2 or xz) or torch's dumps.")
    _name_ranks([s for s in sources if s.kind == "log"])
    return sources, skipped


def _name_ranks(logs: list[Source]):
    """Per-rank labels from the paths of a set of logs: `job-3.out` and `job-3.err` are both
    task 3; paths that would give two different streams one label give each file its own name."""
    if len(logs) < 2:
        return
    streams: dict[str, set[str]] = {}
    for source in logs:
        source.rank = file_rank(source.path)
        if source.rank:
            streams.setdefault(source.rank, set()).add(stream_of(source.path))
    clash = any(len(s) > 1 for s in streams.values()) or any(s.rank is None for s in logs)
    for source in logs:
        if clash:
            source.rank = f"file {os.path.basename(source.path)}"


def _merge(findings: list[Finding], all_ranks: set[str]) -> list[Finding]:
    """One finding per signature and title over all the files: counts added, ranks joined."""
    merged: dict[tuple[str, str], Finding] = {}
    for f in findings:
        key = (f.issue.id, f.title)
        m = merged.get(key)
        if m is None:
            merged[key] = f
            continue
        m.count += f.count
        for name, values in f.parts.items():
            seen = m.parts.setdefault(name, [])
            seen += [v for v in values if v not in seen][:max(0, MAX_VALUES - len(seen))]
        m.ranks = sorted_ranks(set(m.ranks) | set(f.ranks))
        m.other_ranks = sorted_ranks(set(m.other_ranks) | set(f.other_ranks))
        for rank, first in f.firsts.items():
            m.firsts.setdefault(rank, first)
        if f.detail and f.detail not in m.detail:
            m.detail = "; ".join(filter(None, [m.detail, f.detail]))
    for m in merged.values():
        if m.issue.kind == "match" and m.issue.detail:
            m.detail = m.issue.fill_detail(m.parts)
        if m.issue.kind == "match" and m.ranks:
            m.other_ranks = sorted_ranks(all_ranks - set(m.ranks))
        else:
            m.other_ranks = sorted_ranks(set(m.other_ranks) - set(m.ranks))
    return list(merged.values())


def _order(findings: list[Finding], all_ranks: set[str]) -> Optional[Order]:
    """The first rank to fail, the ranks that only followed, and how that was told."""
    events = []  # (rank, finding, file, line, time)
    for f in findings:
        for rank, (file, line_no, stamp) in f.firsts.items():
            events.append((rank, f, file, line_no, stamp))
    ranks = {e[0] for e in events}
    if len(ranks | all_ranks) < 2 or not events:
        return None
    own = [e for e in events if not e[1].issue.follows]
    followed = sorted_ranks(ranks - {e[0] for e in own})
    quiet = sorted_ranks(all_ranks - ranks)
    candidates = own or []
    if not candidates:
        if quiet:
            return Order(quiet, "every rank with a finding reports only waiting for another rank; the ranks with "
                         "no finding are the ones they waited for", followed, quiet, "likely")
        return Order([], "every rank reports only waiting for another; none shows a failure of its own",
                     followed, quiet, "likely")
    stamps = [e[4] for e in candidates]
    if len({e[0] for e in candidates}) == 1:
        first, how = [candidates[0][0]], "the only rank with a failure of its own; the others only report waiting for it"
    elif all(stamps) and len({s[0] for s in stamps}) == 1:
        earliest = min(candidates, key=lambda e: (e[4], rank_order(e[0])))
        first, how = [earliest[0]], f"timestamps on the failure lines ({time_text(earliest[4])} first)"
    elif len({e[2] for e in candidates}) == 1:
        earliest = min(candidates, key=lambda e: (e[3], rank_order(e[0])))
        first, how = [earliest[0]], f"line order in {earliest[2] or 'the log'} (line {earliest[3]} first)"
    else:
        first = sorted_ranks({e[0] for e in candidates})
        how = "nothing orders them: the failure lines carry no comparable timestamps"
    return Order(first, how, followed, quiet)


def _rank_table(findings: list[Finding]) -> dict[str, list[dict]]:
    table: dict[str, list[dict]] = {}
    for f in findings:
        for rank, (file, line_no, stamp) in f.firsts.items():
            table.setdefault(rank, []).append({"id": f.issue.id, "title": f.title, "file": file, "line": line_no,
                                               "time": time_text(stamp) or None, "follows": f.issue.follows})
    return {rank: sorted(table[rank], key=lambda e: (e["file"] or "", e["line"])) for rank in sorted_ranks(table)}


def examine(paths: list[str], issues: list[KnownIssue], families: list[Family] = (),
            budget: Optional[Budget] = None, image: Optional[Image] = None) -> Report:
    """Read every input and put the findings, the ranks and the flight recorder's verdict
    together; with an `image`, the signatures that compare a log with its image apply too."""
    budget = budget or Budget()
    sources, skipped = expand(paths)
    report = Report(skipped=skipped, families={f.id: f for f in families}, image=image)
    issues = bind_image(issues, image.facts if image else None)
    screen = Screen(issues, load_said())
    findings: list[Finding] = []
    all_ranks: set[str] = set()
    logs = sorted((s for s in sources if s.kind == "log"), key=lambda s: (rank_order(s.rank or ""), s.path))
    for source in logs:
        info = InputInfo("standard input" if source.path == "-" else source.path, source.rank)
        report.inputs.append(info)
        try:
            reader = LogReader(source.path, budget)
        except EnvbuildError as e:
            if source.named:
                raise
            report.inputs.pop()
            report.skipped.append((source.path, e.message.split(". Give")[0].removeprefix(f"log {escaped(source.path)} ")))
            continue
        found, scan = diagnose_blocks(reader.blocks(), issues, screen, source.rank)
        info.format, info.lines, info.bytes, info.stopped = reader.format, scan.lines, reader.bytes_read, reader.stopped
        if reader.encoding != "utf-8":
            info.format += f", {reader.encoding}"
        for f in found:
            f.file = info.path if len(logs) > 1 else None
            f.firsts = {rank: (f.file, line_no, stamp) for rank, (line_no, stamp) in f.firsts.items()}
        findings += found
        all_ranks |= scan.all_ranks
    report.findings = sorted(_merge(findings, all_ranks),
                             key=lambda f: (not f.explained, f.issue.follows, f.file or "", f.line_no))
    explained = [f for f in report.findings if f.explained]  # what a component only said decides no rank
    report.ranks = _rank_table(explained)
    report.order = _order(explained, all_ranks)
    dumps = [s for s in sources if s.kind == "dump"]
    if dumps:
        named = [s.path for s in dumps if s.named]
        found = [s.path for s in dumps if not s.named]
        report.recording = read_recording(named + found, report.skipped if not named else None, budget)
    check_read(report, paths)
    return report


def check_read(report: Report, paths: list[str]):
    """Refuse (exit 2) a run that read nothing: every log empty or skipped and no dump read, so
    "no known signature found" would be said of no text at all."""
    if sum(info.bytes for info in report.inputs) or (report.recording and report.recording.files):
        return
    named = ", ".join(escaped(p) if p != "-" else "standard input" for p in paths[:4]) + (" ..." if len(paths) > 4 else "")
    empty = [info.path for info in report.inputs if not info.bytes]
    said = [f"{len(empty)} log{'s' * (len(empty) != 1)} held 0 bytes ({', '.join(escaped(p) for p in empty[:3])})"] if empty else []
    said += [f"{escaped(path)} was skipped: {escaped(why)}" for path, why in report.skipped[:3]]
    more = len(report.skipped) - 3
    raise EnvbuildError(f"doctor read nothing from {named}: {'; '.join(said) or 'no input held a byte'}"
                        f"{f' (and {more} more skipped)' if more > 0 else ''}. Give it the job's logs (text, gzip, "
                        "bzip2 or xz), torch's flight-recorder dumps, or - for standard input.")


def unread_dumps(report: Report):
    """Refuse (exit 2) a run that found nothing while some of its dumps could not be read: their
    ranks' verdict is unknown, so "nothing found" would not be true of the job."""
    unread = report.recording.unread if report.recording else []
    if report.found() or not unread:
        return
    names = ", ".join(escaped(p) for p in unread[:4]) + (" ..." if len(unread) > 4 else "")
    raise EnvbuildError(f"{len(unread)} flight-recorder dump{'s' * (len(unread) != 1)} could not be read ({names}; "
                         "each is listed under Skipped: with the reason), so nothing found covers only what was read. "
                         "Give the files torch wrote (TORCH_FR_DUMP_TEMP_FILE<rank>, pickled or JSON).")
