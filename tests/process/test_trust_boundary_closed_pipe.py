"""A reader that stops early (`envbuild matrix | head -0`): the real process ends quietly, with no
traceback and no "Exception ignored". The rest of the trust boundary is
tests/behaviour/test_trust_boundary.py."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, _cli_env


def test_a_reader_that_stops_early_ends_the_run_quietly(tmp_path):
    env = {**_cli_env(("matrix",), None, False), "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "envbuild", "matrix"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # `envbuild matrix | head -0`
    _, err = p.communicate(timeout=120)
    assert p.returncode in (1, 141) and b"Traceback" not in err and b"Exception ignored" not in err, err
