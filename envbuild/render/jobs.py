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

Every value is checked by its grammar (:func:`check_job`) and quoted for each shell it passes:
the training command is split into words as a shell would (`--train 'train.py --name "a b"'`
is four words) and each word is one element of a bash array, handed on as "$@": a `;`, a
`$(...)` or a newline in it arrives at the program as text, never runs on the batch host or in
the container.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError

RUNTIMES = ("pyxis", "apptainer")
# Bounds of the counts a job asks for, each where Slurm or the hardware stops:
MAX_NODES = grammar.INT_MAX  # Slurm keeps a job's node count in a C int (src/common/slurm_opt.c)
MAX_TASKS_PER_NODE = 512  # slurm/slurm.h.in MAX_TASKS_PER_NODE
# NVIDIA's largest single-node systems hold 16 GPUs (DGX-2 / HGX-2 on NVSwitch:
# nvidia.com/en-us/data-center/dgx-2/); 64 leaves room for large PCIe chassis.
MAX_GPUS_PER_NODE = 64
APPTAINER_SCHEMES = ("docker://", "docker-daemon://", "oras://", "library://", "shub://")
PYXIS_SCHEMES = ("docker://", "dockerd://", "podman://")


@dataclass(frozen=True)
class Job:
    image: str  # pyxis: an enroot URI (registry#repo:tag), dockerd://ref or a staged .sqsh; apptainer: a .sif
    runtime: str = "pyxis"
    nodes: int = 2
    gpus_per_node: int = 8  # 0: a CPU job (gloo): the smoke test and torchrun on CPUs
    tasks_per_node: int = 0  # ranks of the smoke test per node (default: the GPUs, or 2 on CPU)
    time: str = "24:00:00"
    train: str = "train.py"  # the command torchrun starts, split into words as a shell would


def _refuse(flag: str, value, error: grammar.GrammarError, choice: str) -> EnvbuildError:
    return grammar.refuse(flag, str(value), str(error), choice)


def _check_image(job: Job) -> None:
    flag = "--image"
    if not job.image.strip():
        raise EnvbuildError("--image is empty; give a staged .sqsh (envbuild stage), an enroot URI such as "
                            "ghcr.io#acme/envbuild:TAG, or a .sif for --runtime apptainer.")
    try:
        grammar.path(job.image)
    except grammar.GrammarError as e:
        raise _refuse(flag, job.image, e, "give the image's path or URI on one line, e.g. --image "
                                          "/shared/containers/envbuild-<id>.sqsh.") from None
    lower = job.image.lower()
    if job.runtime == "pyxis" and (lower.endswith(".sif") or lower.startswith(APPTAINER_SCHEMES[2:])):
        raise EnvbuildError(f"--image {job.image} is an Apptainer image (a .sif, or an oras/library/shub URI), which "
                            f"pyxis cannot start: its --container-image takes an enroot squashfs (.sqsh), an "
                            f"enroot URI (REGISTRY#REPO:TAG) or dockerd://IMAGE. Nearest valid choices: --runtime "
                            f"apptainer with this .sif, or a .sqsh from `envbuild stage IMAGE --to DIR`.")
    if job.runtime == "apptainer":
        if lower.endswith(".sqsh") or lower.startswith(("dockerd://", "podman://")) or "#" in job.image:
            raise EnvbuildError(f"--image {job.image} is an enroot image (a .sqsh, an enroot URI or dockerd://), "
                                f"which Apptainer does not start as built: it holds enroot's own /etc/rc and "
                                f"/etc/environment, not the .sif's %environment that sources the image's env.sh. "
                                f"Nearest valid choices: --runtime pyxis with this image, or a .sif (`apptainer "
                                f"build X.sif docker-daemon://IMAGE`) or docker://REGISTRY/REPO:TAG.")
        if not (lower.endswith(".sif") or lower.startswith(APPTAINER_SCHEMES)):
            raise EnvbuildError(f"--image {job.image} is neither a .sif nor an image URI Apptainer pulls "
                                f"({', '.join(APPTAINER_SCHEMES)}); give the .sif built from the image, e.g. "
                                f"--image /shared/images/TAG.sif.")


def check_job(job: Job) -> Job:
    """Every value of `job` in its grammar, or EnvbuildError (exit 2) naming the option and the
    nearest valid choice; the job itself when it is fine."""
    if job.runtime not in RUNTIMES:
        raise EnvbuildError(f"--runtime {job.runtime}: unknown; choose one of {', '.join(RUNTIMES)}.")
    _check_image(job)
    counts = (("--nodes", job.nodes, 1, MAX_NODES, "Slurm keeps a node count in a C int", "--nodes 2"),
              ("--gpus-per-node", job.gpus_per_node, 0, MAX_GPUS_PER_NODE,
               "NVIDIA's largest nodes hold 16 GPUs: DGX-2, HGX-2", "--gpus-per-node 8 (the GPUs of one node)"),
              ("--tasks-per-node", job.tasks_per_node, 0, MAX_TASKS_PER_NODE,
               "Slurm's MAX_TASKS_PER_NODE", "--tasks-per-node 8, or leave it out for one per GPU"))
    for flag, value, low, high, why, choice in counts:
        try:
            grammar.count(value, low, high, why)
        except grammar.GrammarError as e:
            nearest = f"{flag} {low if value < low else high}"
            raise _refuse(flag, value, e, f"nearest valid value: {nearest}; usually {choice}.") from None
    try:
        grammar.slurm_time(job.time)
    except grammar.GrammarError as e:
        raise _refuse("--time", job.time, e, "nearest valid choices: --time UNLIMITED (where the partition allows "
                                             "no limit), --time 7-00:00:00 (a week), --time 24:00:00 (a day).") from None
    try:
        grammar.shell_words(job.train)
    except grammar.GrammarError as e:
        raise _refuse("--train", job.train, e, "e.g. --train 'train.py --lr 1e-4 --name \"run 1\"'.") from None
    return job


def _array(words: list[str]) -> str:
    """A bash array of `words`, each quoted (a newline inside a word stays inside its quotes)."""
    return "(" + " ".join(shlex.quote(w) for w in words) + ")"


def job_script(job: Job) -> str:
    """The sbatch script for `job` (checked first: :func:`check_job`).

    >>> print(job_script(Job("ghcr.io#acme/envbuild:tag", nodes=1, gpus_per_node=0)).splitlines()[1])
    #SBATCH --nodes=1
    """
    check_job(job)
    ranks = job.tasks_per_node or job.gpus_per_node or 2
    # the allocation holds the smoke test's ranks; the training step then runs one torchrun per node
    lines = ["#!/bin/bash", f"#SBATCH --nodes={job.nodes}", f"#SBATCH --ntasks-per-node={ranks}"]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    words = grammar.shell_words(job.train)
    lines += [f"#SBATCH --time={job.time}", "set -euo pipefail",
              "# the training command, one word per element: each reaches torchrun as it is, nothing in it runs",
              *(["# shellcheck disable=SC2016  # '$' here is text"] if any(set("$`") & set(w) for w in words) else []),
              f"train={_array(words)}",
              # sed reads every name: `head -n 1` would close the pipe early, and under pipefail a long
              # node list's SIGPIPE to scontrol would end the job
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
              "export HEAD_NODE=$head_node"]
    torchrun = (f'torchrun --nnodes "$SLURM_NNODES" --nproc_per_node {job.gpus_per_node or ranks} '
                f'--rdzv_backend c10d --rdzv_endpoint "$HEAD_NODE:29500" --rdzv_id "$SLURM_JOB_ID" "${{train[@]}}"')
    if job.runtime == "pyxis":
        # A CPU job says so: the image asks for every GPU (NVIDIA_VISIBLE_DEVICES=all), and enroot's
        # nvidia hook fails on a node without libnvidia-container; the image's value wins unless named.
        cpu = " --container-env=NVIDIA_VISIBLE_DEVICES" if not job.gpus_per_node else ""
        # the step's words go in as "$@" of a fixed bash -c: no second level of quoting to get wrong
        in_image = "bash -c '. /opt/envbuild/env.sh && exec \"$@\"' bash"
        lines += ["# enroot's hook mounts the RDMA devices (and fails on a node that has none)",
                  "if [ -d /sys/class/infiniband ]; then export MELLANOX_VISIBLE_DEVICES=all; fi",
                  *(["export NVIDIA_VISIBLE_DEVICES=void  # a CPU job: no GPU hook"] if cpu else []),
                  f"image={shlex.quote(job.image)}",
                  "# first step: every rank of every node runs the same image, and collectives really cross the nodes",
                  f'srun --ntasks-per-node={ranks} --container-image="$image" --container-name=envbuild{cpu} \\',
                  f"  {in_image} python /opt/envbuild/smoke.py --multinode",
                  f'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --container-image="$image" '
                  f'--container-name=envbuild{cpu} \\',
                  '     --container-mounts="$PWD:/work" --container-workdir=/work \\',
                  f"  {in_image} {torchrun}"]
    else:
        nv = "--nv " if job.gpus_per_node else ""
        lines += [f"sif={shlex.quote(job.image)}",
                  "# first step: every rank of every node runs the same image, and collectives really cross the nodes",
                  f'srun --ntasks-per-node={ranks} apptainer exec {nv}"$sif" python /opt/envbuild/smoke.py --multinode',
                  f'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 apptainer exec {nv}"$sif" \\', f"  {torchrun}"]
    return "\n".join(lines) + "\n"
