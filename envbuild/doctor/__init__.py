"""`envbuild doctor`: recognise known failure signatures in training logs and say what to do.

signatures.py loads the signatures and their families (matrices/known_issues.yaml),
reading.py turns any log file into clean blocks of lines in bounded memory and time, ranks.py
tells which rank printed a line and when, engine.py matches in one streaming pass (screen.py picks
the lines that concern a signature, trackers.py holds what each signature has seen, finding.py is
what it reports), flight.py reads torch's flight-recorder dumps safely, run.py puts several logs,
ranks and dumps together, report.py prints the result as text or JSON, image.py reads the manifest
of the image a log came from.
"""

from envbuild.doctor.engine import diagnose_blocks
from envbuild.doctor.finding import Finding
from envbuild.doctor.image import Image, find_image, read_image
from envbuild.doctor.reading import Budget, LogReader, parse_size, text_blocks
from envbuild.doctor.report import render_json, render_text
from envbuild.doctor.run import Report, examine
from envbuild.doctor.signatures import KnownIssue, load_catalogue, load_issues

__all__ = ["Budget", "Finding", "Image", "KnownIssue", "LogReader", "Report", "diagnose_log", "diagnose_text", "examine",
           "find_image", "load_catalogue", "load_issues", "parse_size", "read_image", "render_json", "render_text"]


def diagnose_log(log: str, issues: list[KnownIssue]) -> list[Finding]:
    """Findings for one LOG (a path, or "-" for standard input); EnvbuildError for input that is not a log."""
    return diagnose_blocks(LogReader(log).blocks(), issues)[0]


def diagnose_text(text: str, issues: list[KnownIssue]) -> list[Finding]:
    """`diagnose_log` for a log already in memory (tests, small inputs)."""
    return diagnose_blocks(text_blocks(text), issues)[0]
