"""Cold start: process start -> first optimizer step, in a fresh container.

Baseline, measured in the same run: the same stack with the ops left to JIT
(`--ds-ops none --keep-toolchain`, so a compiler and ninja are there to JIT with), the
usual set-up. Third case: a stale `lock` in the extensions dir (field reports 1, 2),
which hangs a JIT build forever; reported as timed out after TIMEOUT seconds.

    python bench/cold_start.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from common import DOCKER, build, machine, table

TIMEOUT = 300  # a JIT compile of cpu_adam on 2 busy cores can take minutes; a stale-lock hang never ends
STEP = r"""
import time; t0 = time.time()
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
p = torch.nn.Parameter(torch.randn(1 << 20)); p.grad = torch.randn(1 << 20)
DeepSpeedCPUAdam([p], lr=1e-3).step()
print(f"first step after {time.time() - t0:.2f} s in python")
"""


def run(image: str, stale_lock: bool) -> str:
    with tempfile.TemporaryDirectory() as ext:
        if stale_lock:
            (Path(ext) / "cpu_adam").mkdir()
            (Path(ext) / "cpu_adam" / "lock").write_text("")
        name = f"envbuild-bench-{os.getpid()}-{time.monotonic_ns()}"
        cmd = [DOCKER, "run", "--rm", "--name", name, "--network", "none", "-v", f"{ext}:/ext",
               "-e", "TORCH_EXTENSIONS_DIR=/ext", "-e", "DS_ACCELERATOR=cuda", image, "python", "-c", STEP]
        t = time.monotonic()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            subprocess.run([DOCKER, "kill", name], capture_output=True)  # only the container this run started
            return f"timed out (> {TIMEOUT} s)"
        if r.returncode != 0:
            return "failed: " + r.stderr.strip().splitlines()[-1][:80]
        return f"{time.monotonic() - t:.1f} s"


def main():
    prebuilt, _ = build("h20", "cold-prebuilt", "--ds-ops", "cpu_adam,fused_adam")
    jit, _ = build("h20", "cold-jit", "--ds-ops", "none", "--keep-toolchain")
    rows = []
    results = {}
    for name, image, lock in (("pre-built ops (envbuild)", prebuilt, False), ("JIT ops (baseline)", jit, False),
                              ("pre-built ops, stale lock", prebuilt, True), ("JIT ops, stale lock", jit, True)):
        results[name] = run(image, lock)
        rows.append([name, image.split(":", 1)[1], results[name]])
    a, b = results["pre-built ops (envbuild)"], results["JIT ops (baseline)"]
    ratio = f"{float(b.split()[0]) / float(a.split()[0]):.1f}x" if a.endswith(" s") and b.endswith(" s") else "n/a"
    rows.append(["ratio JIT / pre-built", "", ratio])
    table(f"Cold start to the first DeepSpeedCPUAdam step (docker run wall time) — {machine()}",
          ["case", "image", "time"], rows)


if __name__ == "__main__":
    main()
