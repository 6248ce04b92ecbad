"""The smoke test's verdict: one check at a time, one JSON report, one exit code.

A check function returns ``(ok, detail)``, optionally followed by its duration in seconds
and a dict of measurements (``data``); a :class:`Skipped` return is a check that does not
apply here (ok, and marked ``skipped`` so a table can say so).
"""

from __future__ import annotations

import time


class Skipped:
    """Returned by a check that cannot run on this node (CPU mode, one GPU): not a failure."""

    def __init__(self, reason: str, data: dict | None = None):
        self.reason = reason
        self.data = data


def short_error(error: BaseException, limit: int = 300) -> str:
    """An exception's first line, bounded (torch's store errors carry C++ backtraces)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:limit]


def run_check(name: str, fn, *args) -> dict:
    """Run one check; any exception becomes a failed check with its text, never a traceback."""
    start = time.monotonic()
    data = None
    skipped = False
    try:
        result = fn(*args)
        if isinstance(result, Skipped):
            ok, detail, seconds, data, skipped = True, f"skipped: {result.reason}", None, result.data, True
        else:
            ok, detail = bool(result[0]), str(result[1])
            seconds = result[2] if len(result) > 2 else None
            data = result[3] if len(result) > 3 else None
    except BaseException as error:  # noqa: BLE001 - a check must never kill the report
        if isinstance(error, KeyboardInterrupt):
            raise
        ok, detail, seconds = False, f"{type(error).__name__}: {error}", None
    if seconds is None:
        seconds = time.monotonic() - start
    check = {"name": name, "ok": ok, "detail": detail, "seconds": round(float(seconds), 3)}
    if skipped:
        check["skipped"] = True
    if data:
        check["data"] = data
    return check


def build_report(manifest: dict, mode: str, checks: list[dict], manifest_path: str = "") -> dict:
    """The one JSON object CI and users parse: ok iff every check is ok (and there is one)."""
    image = {key: manifest.get(key) for key in ("tag", "gpu", "python", "torch", "cuda", "deepspeed")}
    image["manifest"] = manifest_path
    return {"ok": bool(checks) and all(c["ok"] for c in checks), "mode": mode, "image": image, "checks": checks}


def exit_code(report: dict) -> int:
    return 0 if report.get("ok") else 1


def status_word(check: dict) -> str:
    """'ok', 'skip' or 'FAIL': what a table shows for a check."""
    if not check.get("ok"):
        return "FAIL"
    return "skip" if check.get("skipped") else "ok"


def render_text(report: dict) -> str:
    """A plain aligned table for humans (Apptainer %test, docker run without --json)."""
    image = report["image"]
    lines = [f"envbuild smoke test: {image.get('tag') or '(untagged)'} gpu={image.get('gpu')} mode={report['mode']}"]
    width = max([len(c["name"]) for c in report["checks"]] + [5])
    for check in report["checks"]:
        lines.append(f"  {check['name']:<{width}}  {status_word(check):<4}  {check['seconds']:>8.3f}s  "
                     f"{check['detail']}")
    lines.append("RESULT: " + ("ok" if report["ok"] else "FAILED"))
    return "\n".join(lines)
