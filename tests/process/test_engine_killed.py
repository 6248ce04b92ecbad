"""envbuild killed mid-build (a CI job cancelled, `kill`, even SIGKILL), as a real process: the
docker CLI it started gets SIGINT, which cancels the build, instead of running on for hours. The
engine boundary itself, in-process, is tests/unit/test_engine.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import ROOT
from test_engine import BUILD_RUNNER
from test_engine import fake_cli  # noqa: F401  (fixtures)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_killed_envbuild_cancels_the_build_it_started(tmp_path, fake_cli, monkeypatch, how):  # noqa: F811
    """envbuild killed mid-build (a CI job cancelled, `kill`, even SIGKILL) must not leave the
    docker CLI running its build for hours: the CLI gets SIGINT, which cancels the build."""
    import signal
    import subprocess
    import time

    cli, calls = fake_cli
    monkeypatch.setenv("FAKE_DOCKER_MODE", "hang")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a SIGKILLed envbuild leaves its secrets directory: here, not in /tmp
    proc = subprocess.Popen([sys.executable, "-c", BUILD_RUNNER, str(cli), str(tmp_path)])
    log = tmp_path / "build.log"
    for _ in range(1200):  # deadlines, not timings: a busy machine is slow, never wrong
        if log.exists() and "setup.sh extensions" in log.read_text():
            break
        time.sleep(0.05)
    else:
        pytest.fail("the fake build step never started (no 'setup.sh extensions' in build.log)")
    proc.send_signal(getattr(signal, how))
    assert proc.wait(timeout=60) == (143 if how == "SIGTERM" else -9)
    cancelled = Path(str(tmp_path / "calls.jsonl") + ".cancelled")
    for _ in range(1200):
        if cancelled.exists():
            break
        time.sleep(0.05)
    else:
        pytest.fail("the docker CLI was never cancelled (no SIGINT reached it)")
    assert cancelled.read_text() == str(int(signal.SIGINT))
