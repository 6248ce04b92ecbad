"""Fail the image build unless DeepSpeed recorded every requested op as pre-built for CUDA.

DeepSpeed decides at run time from this record (installed_ops + accelerator_name) whether
to load a pre-built op or JIT-compile it; a build that silently skipped an op, or that
recorded the CPU accelerator, would JIT-compile on the cluster (field reports 1 and 2).
The record is read from its file without importing deepspeed: DeepSpeed 0.16.4 to 0.17.4
cannot be imported with DS_ACCELERATOR=cuda and triton on a machine without a GPU driver
(ops/transformer/inference/ds_transformer.py asks torch for the device capability; 0.17.5
adds the guard).
"""

import importlib.util
import os
import runpy
import sys

spec = importlib.util.find_spec("deepspeed")
if spec is None or not spec.submodule_search_locations:
    sys.exit("envbuild: DeepSpeed build check FAILED: deepspeed is not installed")
record = os.path.join(list(spec.submodule_search_locations)[0], "git_version_info_installed.py")
try:
    info = runpy.run_path(record)
except OSError as e:
    sys.exit(f"envbuild: DeepSpeed build check FAILED: no build record ({e}); were the ops pre-built?")

wanted = sys.argv[1:]
installed = info.get("installed_ops", {})
accelerator = info.get("accelerator_name", "(not recorded)")
missing = [op for op in wanted if not installed.get(op)]
problems = []
if accelerator != "cuda":
    problems.append(f"accelerator recorded as '{accelerator}', expected 'cuda' (set DS_ACCELERATOR=cuda)")
if missing:
    problems.append(f"ops not pre-built: {', '.join(missing)}")
if problems:
    print("envbuild: DeepSpeed build check FAILED: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"envbuild: DeepSpeed ops pre-built for cuda: {', '.join(wanted) or '(none)'}")
