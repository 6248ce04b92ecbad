"""Fail the image build unless DeepSpeed recorded every requested op as pre-built for CUDA.

DeepSpeed decides at run time from this record (installed_ops + accelerator_name) whether
to load a pre-built op or JIT-compile it; a build that silently skipped an op, or that
recorded the CPU accelerator, would JIT-compile on the cluster (field reports 1 and 2).
"""

import sys

from deepspeed.git_version_info import accelerator_name, installed_ops

wanted = sys.argv[1:]
missing = [op for op in wanted if not installed_ops.get(op)]
problems = []
if accelerator_name != "cuda":
    problems.append(f"accelerator recorded as '{accelerator_name}', expected 'cuda' (set DS_ACCELERATOR=cuda)")
if missing:
    problems.append(f"ops not pre-built: {', '.join(missing)}")
if problems:
    print("envbuild: DeepSpeed build check FAILED: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"envbuild: DeepSpeed ops pre-built for cuda: {', '.join(wanted) or '(none)'}")
