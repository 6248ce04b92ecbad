"""The Slurm job script users copy, for pyxis/enroot and for Apptainer, from one function: the
README's Slurm sections and `envbuild job` print the same text, and the tests submit it.

What every script does, and why:
- the multi-node smoke test as the first step (every rank of every node runs the same image,
  and collectives really cross the nodes, before hours of training are queued behind a hang);
- one `torchrun` per node with the c10d rendezvous on the first node, keyed by the job ID;
- the image's per-job caches, GPU defaults and guard: pyxis does not run the image's entrypoint,
  so each step sources /opt/envbuild/env.sh itself; Apptainer's %environment does it;
- for pyxis: the RDMA devices (`MELLANOX_VISIBLE_DEVICES=all`: enroot's hook mounts them),
  `--container-mount-home` kept (the flight recorder's dumps go under $HOME), and a staged
  .sqsh or a registry URI; for Apptainer: `--nv`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

RUNTIMES = ("pyxis", "apptainer")


@dataclass(frozen=True)
class Job:
    image: str  # pyxis: an enroot URI (registry#repo:tag), dockerd://ref or a staged .sqsh; apptainer: a .sif
    runtime: str = "pyxis"
    nodes: int = 2
    gpus_per_node: int = 8  # 0: a CPU job (gloo): the smoke test and torchrun on CPUs
    tasks_per_node: int = 0  # ranks of the smoke test per node (default: the GPUs, or 2 on CPU)
    time: str = "24:00:00"
    train: str = "train.py"


def job_script(job: Job) -> str:
    """The sbatch script for `job`.

    >>> print(job_script(Job("ghcr.io#acme/envbuild:tag", nodes=1, gpus_per_node=0)).splitlines()[1])
    #SBATCH --nodes=1
    """
    ranks = job.tasks_per_node or job.gpus_per_node or 2
    # the allocation holds the smoke test's ranks; the training step then runs one torchrun per node
    lines = ["#!/bin/bash", f"#SBATCH --nodes={job.nodes}", f"#SBATCH --ntasks-per-node={ranks}"]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    lines += [f"#SBATCH --time={job.time}", "set -euo pipefail",
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "export HEAD_NODE=$head_node"]
    torchrun = (f'torchrun --nnodes "$SLURM_NNODES" --nproc_per_node {job.gpus_per_node or ranks} '
                f'--rdzv_backend c10d --rdzv_endpoint "$HEAD_NODE:29500" --rdzv_id "$SLURM_JOB_ID" '
                f'{shlex.quote(job.train)}')
    if job.runtime == "pyxis":
        # A CPU job says so: the image asks for every GPU (NVIDIA_VISIBLE_DEVICES=all), and enroot's
        # nvidia hook fails on a node without libnvidia-container; the image's value wins unless named.
        cpu = " --container-env=NVIDIA_VISIBLE_DEVICES" if not job.gpus_per_node else ""
        lines += ["# enroot's hook mounts the RDMA devices (and fails on a node that has none)",
                  "if [ -d /sys/class/infiniband ]; then export MELLANOX_VISIBLE_DEVICES=all; fi",
                  *(["export NVIDIA_VISIBLE_DEVICES=void  # a CPU job: no GPU hook"] if cpu else []),
                  f"image={shlex.quote(job.image)}",
                  "# first step: every rank of every node runs the same image, and collectives really cross the nodes",
                  f'srun --ntasks-per-node={ranks} --container-image="$image" --container-name=envbuild{cpu} \\',
                  "  bash -c '. /opt/envbuild/env.sh && exec python /opt/envbuild/smoke.py --multinode'",
                  f'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --container-image="$image" '
                  f'--container-name=envbuild{cpu} \\',
                  '     --container-mounts="$PWD:/work" --container-workdir=/work \\',
                  f"  bash -c '. /opt/envbuild/env.sh && exec {torchrun}'"]
    elif job.runtime == "apptainer":
        nv = "--nv " if job.gpus_per_node else ""
        lines += [f"sif={shlex.quote(job.image)}",
                  "# first step: every rank of every node runs the same image, and collectives really cross the nodes",
                  f'srun --ntasks-per-node={ranks} apptainer exec {nv}"$sif" python /opt/envbuild/smoke.py --multinode',
                  f'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 apptainer exec {nv}"$sif" \\', f"  {torchrun}"]
    else:
        raise ValueError(job.runtime)
    return "\n".join(lines) + "\n"
