"""The first optimizer step of a fresh process: DeepSpeed's pre-built FusedAdam against a JIT
build of the same op, in the same run, on one GPU.

    python bench/gpu/cold_start.py [--timeout S]

Each side runs in a fresh Python process from interpreter start to the end of the first
FusedAdam step (what a training job's rank pays before its first step). The JIT side is the
same DeepSpeed install told that the op was not pre-built (its `installed_ops` record says
False), with an empty TORCH_EXTENSIONS_DIR: DeepSpeed then compiles the op with ninja and nvcc,
as a conda install without pre-built ops does at every first start on a node. Both sides step
the same seeded parameter; the table says whether the two results are bitwise equal.
Needs a GPU, DeepSpeed with fused_adam pre-built, and ninja + nvcc for the JIT side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
jit = sys.argv[1] == "jit"
import torch
import deepspeed
if jit:
    import deepspeed.git_version_info as info
    info.installed_ops["fused_adam"] = False  # DeepSpeed's load() then JIT-compiles the op
from deepspeed.ops.adam import FusedAdam
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda"))
p.grad = torch.randn(1 << 20, device="cuda")
FusedAdam([p], lr=1e-3).step()
torch.cuda.synchronize()
print(json.dumps({"checksum": p.detach().double().sum().item()}))
torch.save(p.detach().cpu(), sys.argv[2])
"""


def first_step(kind: str, timeout: float, work: str) -> dict:
    env = dict(os.environ)
    if kind == "jit":
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(work, "torch_extensions")
    out = os.path.join(work, f"{kind}.pt")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, kind, out], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "ok": False, "seconds": time.perf_counter() - start, "detail": f"timeout {timeout:g}s"}
    seconds = time.perf_counter() - start
    ok = proc.returncode == 0
    result = {"kind": kind, "ok": ok, "seconds": seconds, "tensor": out if ok else None,
              "detail": "" if ok else (proc.stderr or proc.stdout)[-2000:]}
    if ok:
        result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="envbuild-cold-") as work:
        pre = first_step("prebuilt", args.timeout, work)
        jit = first_step("jit", args.timeout, work)
        same = None
        if pre["ok"] and jit["ok"]:
            import torch

            a, b = torch.load(pre["tensor"]), torch.load(jit["tensor"])
            same = bool(torch.equal(a, b))
            max_diff = float((a - b).abs().max())
    print("| first FusedAdam step, fresh process | seconds | ok |")
    print("| --- | --- | --- |")
    for row in (pre, jit):
        print(f"| {row['kind']} | {row['seconds']:.2f} | {row['ok']} |")
    for row in (pre, jit):
        if not row["ok"]:
            print(f"{row['kind']} failed: {row['detail']}")
    if pre["ok"] and jit["ok"]:
        print(f"ratio (JIT / pre-built): {jit['seconds'] / pre['seconds']:.1f}x")
        print(f"results bitwise equal: {same} (max |diff| {max_diff:.3e})")
    return 0 if pre["ok"] and jit["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
