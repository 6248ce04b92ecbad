"""`envbuild doctor -` fed by a process that never stops writing (`yes`): the real `python -m
envbuild` stops at --max-seconds and says the input was not read to the end. doctor's other
bounds are tests/behaviour/test_doctor_runs.py."""

import json
import subprocess
import sys

from conftest import ROOT


def test_an_endless_stream_stops_at_the_time_limit():
    endless = subprocess.Popen(["yes", "step 1 loss 0.5"], stdout=subprocess.PIPE)
    try:
        r = subprocess.run([sys.executable, "-m", "envbuild", "doctor", "--json", "--max-seconds", "1", "-"],
                           stdin=endless.stdout, capture_output=True, cwd=ROOT, timeout=120)
    finally:
        endless.kill()
        endless.wait()
    (info,) = json.loads(r.stdout)["inputs"]
    assert r.returncode == 0 and not info["complete"] and "time limit" in info["stopped"] and info["lines"] > 0
