"""`envbuild doctor`: recognise known failure signatures in a training log and say what to do.

signatures.py loads the signatures (matrices/known_issues.yaml), reading.py turns any log
file into clean lines in bounded memory, ranks.py tells which rank printed a line, engine.py
matches in one streaming pass, report.py prints the findings as text or JSON.
"""

from .engine import Finding, diagnose, diagnose_text
from .reading import LogReader
from .report import render_json, render_text
from .signatures import KnownIssue, load_issues

__all__ = ["Finding", "KnownIssue", "LogReader", "diagnose", "diagnose_log", "diagnose_text", "load_issues",
           "render_json", "render_text"]


def diagnose_log(log: str, issues: list[KnownIssue]) -> list[Finding]:
    """Findings for LOG (a path, or "-" for standard input); EnvbuildError for input that is not a log."""
    return diagnose(LogReader(log).lines(), issues)
