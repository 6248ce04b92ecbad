"""The CUDA extension wheel cache: causal-conv1d compiled for sm_90 once, then reused.

Three builds of the CI stack with `--ext causal-conv1d`, all for the arch list 9.0:

1. h100, ops cpu_adam,fused_adam: the wheel is compiled (the baseline). The matrix is a copy
   whose causal-conv1d carries one extra build variable naming this run, so its cache key is new
   and the compile is really cold, without emptying anyone's cache.
2. h20, ops cpu_adam only: the DeepSpeed layer differs, so the extension step runs again, and
   takes the wheel from the BuildKit cache mount (same key: same sdist, torch build, nvcc,
   Python, arch list).
3. h20, ops cpu_adam,fused_adam: the builder is the first build's, so the step is a cached layer.

    python bench/extension_cache.py        # about 15 minutes on 2 cores
"""

import re
import shutil
import time
from pathlib import Path

import yaml

import common
from common import OUT, ROOT, build, machine, table


def step_seconds(log: str) -> str:
    """The extensions step's time in BuildKit's plain log: its `#N DONE Xs`, or CACHED."""
    found = re.search(r"^#(\d+) \[builder[^\]]*\] RUN .*extensions\.sh", log, re.M)
    if not found:
        return "absent"
    n = found.group(1)
    if re.search(rf"^#{n} CACHED$", log, re.M):
        return "cached layer"
    done = re.search(rf"^#{n} DONE ([\d.]+)s$", log, re.M)
    return done.group(1) if done else "?"


def cache_line(log: str) -> str:
    if "not compiled again" in log:
        return "wheel from the cache"
    return "compiled" if "compiling for" in log else "-"


def matrix_with_new_key(name: str) -> Path:
    """A copy of the matrix in OUT/name whose causal-conv1d carries a build variable naming this
    run: a new cache key, so its compile is cold without emptying anyone's cache."""
    matrix = OUT / name
    shutil.rmtree(matrix, ignore_errors=True)
    shutil.copytree(ROOT / "matrices", matrix)
    path = matrix / "extensions.yaml"
    data = yaml.safe_load(path.read_text())
    for ext in data["extensions"]:
        if ext["name"] == "causal-conv1d":
            ext["build_env"]["ENVBUILD_BENCH_RUN"] = f"{name}-{time.time_ns()}"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return matrix


def main():
    matrix = matrix_with_new_key("ext-matrix")
    runs = [("h100", "ext-cold", "cpu_adam,fused_adam", "compiled (baseline)"),
            ("h20", "ext-wheel", "cpu_adam", "other DeepSpeed layer, same arch list"),
            ("h20", "ext-layer", "cpu_adam,fused_adam", "same builder as the baseline")]
    rows, times = [], []
    for gpu, name, ops, what in runs:
        _, seconds = build(gpu, name, "--ext", "causal-conv1d", "--ds-ops", ops, "--matrix-dir", str(matrix))
        log = (OUT / name / "build.log").read_text()
        step = step_seconds(log)
        times.append(float(step) if re.fullmatch(r"[\d.]+", step) else 0.0)
        rows.append([f"{gpu} --ds-ops {ops}: {what}", step, cache_line(log), f"{seconds:.0f}"])
    rows.append(["ratio: wheel from the cache / compiled", f"{times[1] / times[0]:.3f}" if times[0] else "-", "", ""])
    table(f"causal-conv1d 1.7.0 for sm_90 on {common.STACK}: the extensions step — {machine()}",
          ["build", "extensions step (s)", "wheel", "whole build (s)"], rows)


if __name__ == "__main__":
    main()
