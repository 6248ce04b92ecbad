"""An interrupted CUDA extension compile resumes: causal-conv1d for sm_90, cut off half-way.

Two keys, each new (the matrix copy's causal-conv1d carries a build variable naming the run, so
nothing is taken from anyone's cache), on the CI stack, h100, ops cpu_adam:

1. the compile uninterrupted: the baseline;
2. the same compile under a second new key, `envbuild build` sent SIGTERM (as a cancelled CI
   job or `kill` would) once the step has compiled for half the baseline's step time, then the
   same build run again: it finds the tree ninja left and compiles only what is missing.

The extensions step's times come from BuildKit's log; kept/compiled from the build's own line.

    python bench/extension_resume.py        # about 20 minutes on 2 cores
"""

import re
import shutil
import signal
import subprocess
import sys
import time

import common
from common import OUT, ROOT, build, build_args, machine, table
from extension_cache import matrix_with_new_key, step_seconds

COMPILING = re.compile(r"causal-conv1d [\d.]+: compiling for")


def interrupted(name: str, matrix, after: float) -> float:
    """Start the build, SIGTERM it `after` seconds into the compile; seconds it compiled."""
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    args = build_args("h100", name, "--ext", "causal-conv1d", "--ds-ops", "cpu_adam", "--matrix-dir", str(matrix))
    proc = subprocess.Popen([sys.executable, "-m", "envbuild", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "build.log"
    while not (log.exists() and COMPILING.search(log.read_text(errors="replace"))):
        if proc.poll() is not None:
            sys.exit(f"the build ended before compiling: {log}")
        time.sleep(1)
    start = time.monotonic()
    time.sleep(after)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return time.monotonic() - start


def main():
    cold = "ext-resume-cold"
    build("h100", cold, "--ext", "causal-conv1d", "--ds-ops", "cpu_adam",
          "--matrix-dir", str(matrix_with_new_key(cold + "-matrix")))
    baseline = float(step_seconds((OUT / cold / "build.log").read_text()))
    matrix = matrix_with_new_key("ext-resume-matrix")
    cut = interrupted("ext-resume-cut", matrix, baseline / 2)
    build("h100", "ext-resume", "--ext", "causal-conv1d", "--ds-ops", "cpu_adam", "--matrix-dir", str(matrix))
    log = (OUT / "ext-resume" / "build.log").read_text()
    resumed = float(step_seconds(log))
    kept = re.search(r"kept (\d+) objects of an earlier attempt, compiled (\d+)", log)
    rows = [["compiled whole (baseline)", f"{baseline:.0f}", "-"],
            ["cut off by SIGTERM after", f"{cut:.0f}", "-"],
            ["the same build again: resumed", f"{resumed:.0f}",
             f"kept {kept.group(1)}, compiled {kept.group(2)}" if kept else "no resume line"],
            ["ratio: resumed / baseline", f"{resumed / baseline:.2f}", ""],
            ["ratio: (cut + resumed) / baseline", f"{(cut + resumed) / baseline:.2f}", ""]]
    table(f"causal-conv1d 1.7.0 for sm_90 on {common.STACK}, a compile cut off and resumed — {machine()}",
          ["extensions step", "seconds", "objects"], rows)


if __name__ == "__main__":
    main()
