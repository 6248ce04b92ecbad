"""The container warnings: RDMA devices on the node that this container cannot use, a /dev/shm
too small for NCCL, a GPU node whose GPUs were not handed in. Each names its cause and the
flags that fix it (docker, apptainer, Slurm + pyxis); env.sh prints them at start (node.py)
and a smoke check can report them in the same words.
"""

from __future__ import annotations

import os

from .nodefacts import NodeFacts

# Below this NCCL cannot register its buffers (ibv_reg_mr / ibv_create_cq: "Cannot allocate memory");
# the NCCL troubleshooting guide prescribes --ulimit memlock=-1. transport.py reads it from here.
MEMLOCK_FLOOR = 1 << 30
# Below this /dev/shm is Docker's default size (64 MiB) or near it; the NCCL troubleshooting guide's
# Docker example is --shm-size=1g. https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html
SHM_FLOOR = 1 << 30
NO_GPU_VALUES = ("", "none", "void")    # NVIDIA_VISIBLE_DEVICES asking for no GPU (nvidia-container-runtime)


# Sources of the flags named below (each checked at its source):
#   docker run --device, --ulimit, --cap-add, --shm-size, --ipc, --gpus:
#     https://docs.docker.com/reference/cli/docker/container/run/
#   NCCL in containers: --shm-size=1g --ulimit memlock=-1 ("Docker" under "Shared memory"),
#     https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html
#   the kernel lifts RLIMIT_MEMLOCK for RDMA registration only with CAP_IPC_LOCK (capable(), i.e. in
#     the initial user namespace): ib_umem_get in
#     https://github.com/torvalds/linux/blob/master/drivers/infiniband/core/umem.c
#   apptainer binds /dev (so /dev/infiniband and /dev/shm) unless --contain/--containall, and --nv:
#     https://apptainer.org/docs/user/latest/bind_paths_and_mounts.html,
#     https://apptainer.org/docs/user/latest/gpu.html,
#     https://github.com/apptainer/apptainer/issues/3001 (--contain gives a container-local /dev/shm)
#   enroot (pyxis' runtime) binds the host's /dev and /dev/shm, and its hooks inject GPUs when
#     NVIDIA_VISIBLE_DEVICES is set (the image sets all) and ConnectX HCAs when MELLANOX_VISIBLE_DEVICES is:
#     https://github.com/NVIDIA/enroot/blob/master/conf/mounts/10-system.fstab,
#     https://github.com/NVIDIA/enroot/blob/master/doc/standard-hooks.md (hooks/98-nvidia.sh, 99-mellanox.sh)
#   pyxis: srun --container-mounts=SRC[:DST[:FLAGS]] (DST defaults to SRC, bind mounted with rbind):
#     https://github.com/NVIDIA/pyxis (README; args.c)
#   Slurm propagates the submitting shell's limits, memlock included, unless slurm.conf says
#     PropagateResourceLimitsExcept=MEMLOCK: https://slurm.schedmd.com/faq.html#memlock
def _size(n: int) -> str:
    """
    >>> _size(65536), _size(8388608), _size(1073741824), _size(1536 << 20)
    ('64 KiB', '8 MiB', '1 GiB', '1536 MiB')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _names(items: list[str], most: int = 4) -> str:
    """
    >>> _names(["a", "b"]), _names([str(i) for i in range(6)])
    ('a, b', '0, 1, 2, 3 and 2 more')
    """
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _kind(device: dict) -> str:
    if device.get("driver") == "efa":
        return "EFA"
    layers = device.get("link_layers") or []
    return "InfiniBand" if "InfiniBand" in layers else "RoCE" if "Ethernet" in layers else "RDMA"


def served_rdma(facts: NodeFacts, manifest: dict | None = None) -> list[str]:
    """The node's RDMA devices this image's fabric would use: all of them when the manifest names
    no fabric; none for a socket-only fabric; else those whose kernel driver the fabric lists
    (``device_drivers``), devices whose driver sysfs hides included."""
    fabric = (manifest or {}).get("fabric") or {}
    if not isinstance(fabric, dict) or not fabric:
        return sorted(facts.rdma)
    if str(fabric.get("transport") or "").lower() == "socket":
        return []
    drivers = fabric.get("device_drivers") or fabric.get("device_driver") or []
    if isinstance(drivers, str):
        drivers = [drivers]
    return sorted(name for name, dev in facts.rdma.items()
                  if not drivers or not dev.get("driver") or dev.get("driver") in drivers)


def rdma_problem(facts: NodeFacts, manifest: dict | None = None) -> str | None:
    """RDMA devices on the node that this container cannot use: no verbs devices handed in, or a
    locked-memory limit too low to register memory without CAP_IPC_LOCK."""
    devices = served_rdma(facts, manifest)
    if not devices:
        return None
    no_devices = facts.uverbs is not None and not facts.uverbs
    low_memlock = (facts.memlock is not None and 0 <= facts.memlock < MEMLOCK_FLOOR and facts.ipc_lock is False)
    if not no_devices and not low_memlock:
        return None
    kinds = "/".join(sorted({_kind(facts.rdma.get(name) or {}) for name in devices}))
    causes, docker, apptainer, pyxis = [], [], [], []
    if no_devices:
        causes.append("it has no /dev/infiniband/uverbs* (it was started without the RDMA devices)")
        docker.append("--device /dev/infiniband")
        apptainer.append("/dev/infiniband is there unless --contain/--containall (then add --bind /dev/infiniband)")
        pyxis.append("srun --container-mounts=/dev/infiniband (enroot's Mellanox hook does it for ConnectX HCAs "
                     "when the job's environment has MELLANOX_VISIBLE_DEVICES=all)")
    if low_memlock:
        causes.append(f"its locked-memory limit is {_size(facts.memlock)} and it lacks CAP_IPC_LOCK, so registering "
                      f"NCCL's buffers fails (ibv_reg_mr / ibv_create_cq: Cannot allocate memory)")
        docker.append("--ulimit memlock=-1 (or --cap-add IPC_LOCK where docker refuses that with 'error setting "
                      "rlimit type 8')")
        apptainer.append("it keeps the limit of the shell that starts it: ulimit -l unlimited there (up to the hard "
                         "limit) or memlock unlimited in /etc/security/limits.conf")
        pyxis.append("a job keeps the limit of the shell that ran srun unless slurm.conf has "
                     "PropagateResourceLimitsExcept=MEMLOCK and slurmd runs with LimitMEMLOCK=infinity (ask the "
                     "admins; srun grep locked /proc/self/limits shows a job's limit)")
    them = "them" if len(devices) > 1 else "it"
    return (f"this node has {len(devices)} RDMA device{'s' if len(devices) > 1 else ''} ({_names(devices)}: {kinds}) "
            f"but this container cannot use {them}: {'; and '.join(causes)}. NCCL then fails at init where its "
            f"transport is pinned (NCCL_NET=IB) or falls back to TCP sockets at a fraction of the bandwidth. Start it "
            f"with docker run {' '.join(docker)}; apptainer: {'; '.join(apptainer)}; Slurm + pyxis: "
            f"{'; '.join(pyxis)}.")


def shm_problem(facts: NodeFacts) -> str | None:
    """A /dev/shm smaller than NCCL and DataLoader workers need (Docker's default is 64 MiB)."""
    if facts.shm is None or facts.shm >= SHM_FLOOR:
        return None
    default = "Docker's default" if facts.shm == 64 << 20 else "Docker's default is 64 MiB"
    return (f"/dev/shm in this container is {_size(facts.shm)} ({default}): NCCL's shared-memory segments between "
            f"the GPUs of one node and PyTorch DataLoader workers live there and fail with 'Bus error', 'No space "
            f"left on device' or NCCL's 'failed to extend /dev/shm/nccl-*' once it is full. Start it with docker run "
            f"--shm-size=1g or more (the NCCL troubleshooting guide's setting, and DataLoader workers with large "
            f"batches want more) or --ipc=host; apptainer and Slurm + pyxis use the node's own /dev/shm "
            f"(apptainer: unless --contain/--containall, then add --bind /dev/shm), so there it is the node's that "
            f"is small (df -h /dev/shm on the node); Kubernetes: mount an emptyDir with medium: Memory at /dev/shm.")


def gpu_problem(facts: NodeFacts, manifest: dict | None = None, environ=None) -> str | None:
    """A GPU node whose GPUs were not handed to this container (docker without --gpus, apptainer
    without --nv: no nvidia-smi, no libcuda.so.1), unless NVIDIA_VISIBLE_DEVICES asks for none."""
    environ = os.environ if environ is None else environ
    if facts.driver_libs or not facts.nvidia_gpus or not facts.nvidia_driver:
        return None
    if manifest is not None and not (manifest.get("cuda") or (manifest.get("driver") or {}).get("cuda")):
        return None
    if environ.get("NVIDIA_VISIBLE_DEVICES", "all").strip().lower() in NO_GPU_VALUES:
        return None
    gpus = facts.nvidia_gpus
    return (f"this node has {len(gpus)} NVIDIA GPU{'s' if len(gpus) > 1 else ''} (PCI {_names(gpus)}) but none "
            f"was handed to this container (no nvidia-smi, no libcuda.so.1): torch will run on the CPU. Start it "
            f"with docker run --gpus all (with the NVIDIA Container Toolkit on the node); apptainer exec --nv; Slurm "
            f"+ pyxis: request GPUs (srun --gpus=N or --gres=gpu:N; enroot's nvidia hook mounts them because the "
            f"image sets NVIDIA_VISIBLE_DEVICES=all). A CPU-only job says so with NVIDIA_VISIBLE_DEVICES=none "
            f"(docker run -e, apptainer --env), which also silences this.")


def container_problems(facts: NodeFacts, manifest: dict | None = None, environ=None) -> list[str]:
    """Every container warning that applies here, one paragraph each, in a fixed order (RDMA,
    /dev/shm, GPUs): what env.sh prints at start and what a smoke check can report.

    `manifest` (optional) narrows the RDMA check to the devices the image's fabric serves and
    skips the GPU check for an image without CUDA.
    """
    found = [rdma_problem(facts, manifest), shm_problem(facts), gpu_problem(facts, manifest, environ)]
    return [problem for problem in found if problem]
