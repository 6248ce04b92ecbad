#!/usr/bin/env python3
"""Derive DeepSpeed ops' CUDA bounds by compiling them with PyPI's nvcc of each CUDA release,
and compare them with matrices/deepspeed.yaml (`ops.<op>.cuda`).

Usage: python3 scripts/derive_op_bounds.py [--work DIR] [--keep] [OP...]   (default: fp_quantizer)

For each op: the sdist of the newest DeepSpeed release deepspeed.yaml lists, the headers of
the newest torch a CUDA 13 stack pins with it (stacks.yaml), and cuda-toolkit[nvcc,cudart,cccl,
curand,cublas] of each release in envbuild.refresh.op_bounds.TOOLKITS, one release at a time.
Prints one line per release (accepts / rejects with file:line: error / not tried and why), the
derived bound and the data's; exits 1 when they differ, 2 when an op could not be derived.
Downloads about 4 GB into DIR (default /var/tmp/envbuild-op-bounds), deleted at the end unless
--keep.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envbuild.base.errors import EnvbuildError  # noqa: E402
from envbuild.refresh import op_bounds  # noqa: E402
from envbuild.refresh.pypi import PyPI  # noqa: E402

MATRIX = Path(__file__).resolve().parent.parent / "matrices"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", default=["fp_quantizer"])
    parser.add_argument("--work", default="/var/tmp/envbuild-op-bounds")
    parser.add_argument("--keep", action="store_true", help="keep the downloads (a second run reuses them)")
    args = parser.parse_args(argv)
    deepspeed, torch, ops = op_bounds.pinned(MATRIX)
    work = Path(args.work)
    differ = underived = 0
    try:
        for op in args.ops:
            try:
                bound, results = op_bounds.derive(PyPI(work / "pypi-cache"), work, deepspeed, torch, op)
            except EnvbuildError as e:  # this op cannot be derived (say why); the others still can
                print(f"{op}: not derived: {e}")
                underived += 1
                continue
            print(f"{op} (deepspeed {deepspeed}, torch {torch} headers, sm_{op_bounds.ARCH}):")
            for line in op_bounds.describe(results):
                print(f"  {line}")
            data = ops.get(op, {}).get("cuda", "")
            print(f"  derived cuda bound: {bound or '(none)'}; deepspeed.yaml: {data or '(none)'}")
            differ += bound != data
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if differ else 2 if underived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
