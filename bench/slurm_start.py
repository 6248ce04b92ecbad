"""Job start on the one-node Slurm cluster (scripts/slurm-setup.sh): `srun --container-image`
from the local registry (pyxis imports the image on every job: pull, unpack, mksquashfs) against
the same image staged once as a .sqsh (`envbuild stage`: the job starts from the file).

    python bench/slurm_start.py IMAGE [--runs 2]   # IMAGE: a local Docker image, e.g. the CI image

Each run is `srun --container-image=X true`, timed whole; the registry copy is pushed first,
the staged file made first (their own times are printed, not counted). The ratio is staged /
registry, medians of the runs, measured in the same run of this script.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, docker, machine, table

REGISTRY = "127.0.0.1:5000"


def timed(*args) -> float:
    start = time.monotonic()
    env = {**os.environ, "NVIDIA_VISIBLE_DEVICES": "void"}  # a CPU node: no GPU hook
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(args)} failed: {r.stderr[-1500:]}")
    return time.monotonic() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("image")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--sqsh", help="an already staged .sqsh of IMAGE (skips staging)")
    args = parser.parse_args()
    name = args.image.rsplit("/", 1)[-1]
    remote = f"{REGISTRY}/{name}"
    docker("tag", args.image, remote)
    push_s = timed("/usr/bin/docker", "push", remote)
    if args.sqsh:
        sqsh, stage_s = Path(args.sqsh), 0.0
    else:
        shared = Path(tempfile.mkdtemp(prefix="envbuild-bench-stage-"))
        stage_s = timed(sys.executable, "-m", "envbuild", "stage", args.image, "--to", str(shared))
        sqsh = next(shared.glob("*.sqsh"))
    uri = f"{REGISTRY}#{name}"
    rows, medians = [], {}
    for what, image in (("--container-image from the local registry (import per job)", uri),
                        ("--container-image=<staged .sqsh> (envbuild stage)", str(sqsh))):
        runs = [timed("srun", f"--container-image={image}", "--container-env=NVIDIA_VISIBLE_DEVICES", "true")
                for _ in range(args.runs)]
        medians[what] = statistics.median(runs)
        rows.append([what, " ".join(f"{r:.1f}" for r in runs), f"{medians[what]:.1f}"])
    registry, staged = medians.values()
    rows.append(["ratio: staged / registry", "", f"{staged / registry:.3f}"])
    table(f"Slurm job start, {args.image} ({sqsh.stat().st_size / 2**30:.2f} GiB .sqsh) — {machine()}; "
          f"push {push_s:.0f} s and stage {stage_s:.0f} s beforehand, not counted",
          ["srun --container-image", "runs (s)", "median (s)"], rows)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
