"""Facts about the node a container runs on (NVIDIA driver, GPUs, RDMA devices, /dev/shm, the
locked-memory limit) and what follows from them: the driver-floor warning, the container warnings
(RDMA devices the container cannot use, a small /dev/shm, a GPU node's GPUs not handed in) and the
manifest's conditional ``node_env``.

env.sh runs :func:`main` at container start only when its own POSIX-sh pre-checks (the same tests,
made with shell builtins) find something to say: a GPU is visible and a warning is due or the
manifest has node_env entries, or one of :func:`container_problems` may apply. So on an ordinary
node no process starts, and this module imports nothing heavy (no re, glob, argparse or
dataclasses) and runs nvidia-smi only when /proc/driver/nvidia/version is missing. The smoke
test's ``driver`` and ``node_env`` checks use the same functions, and a smoke check can report
:func:`container_problems` in the same words.

    python -I -S -B -c 'import sys; sys.path[:0] = ["/opt/envbuild/lib"]; from envbuild_image.node import main; main()' \
        [--driver VERSION]

prints the warnings on stderr and, on stdout, ``NAME=VALUE`` for each node_env entry whose
condition holds here and whose variable is unset (a user's value always wins).
"""

from __future__ import annotations

import json
import os
import sys

from . import paths
from .versions import older_than

ROOT_ENV = "ENVBUILD_NODE_ROOT"  # test hook: a directory standing in for / (proc, dev, sys)
DRIVER_FILE = "/proc/driver/nvidia/version"
NVIDIACTL = "/dev/nvidiactl"
INFINIBAND_DIR = paths.RDMA_SYSFS
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
NVIDIA_SMI_TIMEOUT = 20.0
FORWARD_COMPAT_DOC = "https://docs.nvidia.com/deploy/cuda-compatibility/forward-compatibility.html"

# The container's side, each read as env.sh reads it (POSIX sh, builtins only).
UVERBS_DIR = paths.RDMA_DEVICES         # /dev/infiniband/uverbsN: what ibv_open_device opens
PROC_LIMITS = "/proc/self/limits"       # "Max locked memory  <soft> <hard> bytes"
PROC_STATUS = "/proc/self/status"       # "CapEff:\t<hex>"
PROC_UID_MAP = "/proc/self/uid_map"     # "0 0 4294967295" in the initial user namespace
PROC_MOUNTS = "/proc/mounts"            # "shm /dev/shm tmpfs rw,...,size=65536k 0 0"
PCI_DEVICES = "/sys/bus/pci/devices"    # <address>/vendor, <address>/class (sysfs: the host's, in any container)
NVIDIA_PCI_DRIVER = "/sys/bus/pci/drivers/nvidia"  # exists once the host's nvidia.ko is loaded
NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASS = "0x03"                  # PCI base class 03: VGA (0x0300xx), 3D controller (0x0302xx), other
CAP_IPC_LOCK = 14                       # linux/capability.h
# Below this NCCL cannot register its buffers (ibv_reg_mr / ibv_create_cq: "Cannot allocate memory");
# the NCCL troubleshooting guide prescribes --ulimit memlock=-1. transport.py reads it from here.
MEMLOCK_FLOOR = 1 << 30
# Below this /dev/shm is Docker's default size (64 MiB) or near it; the NCCL troubleshooting guide's
# Docker example is --shm-size=1g. https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html
SHM_FLOOR = 1 << 30
NO_GPU_VALUES = ("", "none", "void")    # NVIDIA_VISIBLE_DEVICES asking for no GPU (nvidia-container-runtime)
# Where the driver's libcuda.so.1 lands when GPUs are handed in: the NVIDIA Container Toolkit (docker
# --gpus, enroot's hook, Kubernetes) mounts it into the image's library directory, apptainer --nv into
# /.singularity.d/libs (https://apptainer.org/docs/user/latest/gpu.html); both also hand in nvidia-smi
# (NVIDIA_DRIVER_CAPABILITIES has utility; https://github.com/apptainer/apptainer/blob/main/etc/nvliblist.conf).
# /dev/nvidiactl alone proves nothing: apptainer and enroot bind the host's whole /dev.
LIBCUDA_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/.singularity.d/libs")


def is_dotted_number(word: str) -> bool:
    """'580.65.06' yes; '2017', '15:16:01', 'x86_64', '1.' no. env.sh applies the same test."""
    parts = word.split(".")
    return len(parts) >= 2 and all(part.isascii() and part.isdigit() for part in parts)


def parse_driver_file(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version: the first dotted number of line 1.

    'NVRM version: NVIDIA UNIX x86_64 Kernel Module  384.98  Thu Oct 26 ...' and the open
    modules' 'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  565.57.01  Release Build ...'.
    """
    first = text.split("\n", 1)[0]
    for word in first.split():
        if is_dotted_number(word):
            return word
    return None


def parse_nvidia_smi(text: str) -> str | None:
    """`nvidia-smi --query-gpu=driver_version --format=csv,noheader`: one line per GPU, all equal."""
    for line in text.splitlines():
        if line.strip():
            return line.strip() if is_dotted_number(line.strip()) else None
    return None


def _which(name: str) -> str | None:
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def read_driver(root: str = "") -> tuple[str | None, str]:
    """(driver version, where it came from); (None, why) when no driver answers."""
    try:
        with open(root + DRIVER_FILE, "rb") as handle:
            found = parse_driver_file(handle.read(4096).decode("utf-8", "replace"))
        return (found, DRIVER_FILE) if found else (None, f"{DRIVER_FILE} has no version")
    except OSError:
        pass
    smi = _which(NVIDIA_SMI[0])
    if not smi:
        return None, f"no {DRIVER_FILE} and no nvidia-smi"
    import subprocess

    try:
        done = subprocess.run([smi, *NVIDIA_SMI[1:]], capture_output=True, text=True, errors="replace",
                              timeout=NVIDIA_SMI_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"nvidia-smi failed: {error}"
    found = parse_nvidia_smi(done.stdout) if done.returncode == 0 else None
    return (found, "nvidia-smi") if found else (None, f"nvidia-smi exited {done.returncode}")


def gpu_visible(root: str = "") -> bool:
    """A GPU was handed to this container: /dev/nvidiactl (docker --gpus, apptainer --nv) or nvidia-smi."""
    return os.path.exists(root + NVIDIACTL) or _which(NVIDIA_SMI[0]) is not None


def driver_libraries(root: str = "") -> bool:
    """The NVIDIA driver's user space was handed to this container: nvidia-smi on PATH or libcuda.so.1
    where the container runtimes put it."""
    return _which(NVIDIA_SMI[0]) is not None or any(os.path.exists(f"{root}{d}/libcuda.so.1") for d in LIBCUDA_DIRS)


def infiniband_devices(root: str = "") -> list[str]:
    """RDMA devices (InfiniBand, RoCE, EFA ...) the kernel lists; empty when there are none."""
    try:
        return sorted(os.listdir(root + INFINIBAND_DIR))
    except OSError:
        return []


def _read(path: str, limit: int = 65536) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def rdma_devices(root: str = "") -> dict[str, dict]:
    """{device: {"driver", "link_layers"}} for each /sys/class/infiniband entry.

    The driver is the kernel driver of the device's parent (the basename of its device/driver
    link: mlx5_core for ConnectX, efa, ice or i40e under irdma, bnxt_en under bnxt_re; '' where
    sysfs hides it); the link layers are those of its ports (InfiniBand, Ethernet for RoCE/iWARP,
    Unknown for EFA).
    """
    base = root + INFINIBAND_DIR
    out = {}
    for name in infiniband_devices(root):
        try:
            driver = os.path.basename(os.readlink(os.path.join(base, name, "device", "driver")))
        except OSError:
            driver = ""
        layers = []
        try:
            ports = sorted(os.listdir(os.path.join(base, name, "ports")), key=lambda p: (len(p), p))
        except OSError:
            ports = []
        for port in ports:
            layer = (_read(os.path.join(base, name, "ports", port, "link_layer"), 64) or "").strip()
            if layer and layer not in layers:
                layers.append(layer)
        out[name] = {"driver": driver, "link_layers": layers}
    return out


def uverbs_devices(root: str = "") -> list[str]:
    """The verbs character devices in this container's /dev/infiniband (none: it was not handed in)."""
    try:
        return sorted(n for n in os.listdir(root + UVERBS_DIR) if n.startswith("uverbs"))
    except OSError:
        return []


def parse_memlock(text: str | None) -> int | None:
    """The soft locked-memory limit in /proc/self/limits: bytes, -1 for unlimited, None if absent.

    >>> parse_memlock("Max locked memory         8388608              8388608              bytes     ")
    8388608
    >>> parse_memlock("Max locked memory         unlimited            unlimited            bytes")
    -1
    """
    for line in (text or "").splitlines():
        words = line.split()
        if words[:3] == ["Max", "locked", "memory"] and len(words) > 3:
            if words[3] == "unlimited":
                return -1
            return int(words[3]) if words[3].isascii() and words[3].isdigit() else None
    return None


def parse_cap_eff(text: str | None) -> int | None:
    """The effective capability set in /proc/self/status, as a number; None if absent.

    >>> hex(parse_cap_eff("CapPrm:\\t00000000a80425fb\\nCapEff:\\t00000000a80465fb\\n"))
    '0xa80465fb'
    """
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key == "CapEff":
            try:
                return int(value.strip(), 16)
            except ValueError:
                return None
    return None


def initial_user_namespace(text: str | None) -> bool:
    """Does /proc/self/uid_map say this is the initial user namespace? (unreadable: assume so)

    Capabilities held inside a user namespace (enroot, rootless containers) do not lift the
    memlock limit: the kernel checks CAP_IPC_LOCK against the initial namespace.

    >>> initial_user_namespace("         0          0 4294967295\\n"), initial_user_namespace("0 1000 1\\n")
    (True, False)
    """
    if text is None:
        return True
    return text.split()[:3] == ["0", "0", "4294967295"]


def _size_bytes(value: str) -> int | None:
    """A tmpfs size= option in bytes: '65536k', '1g', '67108864'; None for '50%' or junk."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    factor = units.get(value[-1:].lower(), 1)
    number = value[:-1] if value[-1:].lower() in units else value
    return int(number) * factor if number.isascii() and number.isdigit() else None


def parse_shm(text: str | None) -> int | None:
    """The size of /dev/shm from /proc/mounts (the last mount there wins); None when it has no
    size= option (tmpfs' default, half of RAM) or is not a mount of its own.

    >>> parse_shm("shm /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime,size=65536k 0 0\\n")
    67108864
    """
    found = None
    for line in (text or "").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[1] == "/dev/shm":
            found = None
            for option in fields[3].split(","):
                if option.startswith("size="):
                    found = _size_bytes(option[5:])
    return found


def nvidia_gpus(root: str = "") -> list[str]:
    """PCI addresses of NVIDIA display / 3D controllers (vendor 0x10de, class 0x03xxxx) on the host.

    sysfs shows the host's PCI devices in any container; NVSwitches (0x0680) and Grace's bridges
    (0x06xx) are NVIDIA's but no GPU.
    """
    base = root + PCI_DEVICES
    try:
        addresses = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for address in addresses:
        if (_read(os.path.join(base, address, "vendor"), 16) or "").strip() != NVIDIA_VENDOR:
            continue
        if (_read(os.path.join(base, address, "class"), 16) or "").strip().startswith(DISPLAY_CLASS):
            out.append(address)
    return out


class NodeFacts:
    """What env.sh and the smoke test know about this node and this container.

    ``infiniband``: every /sys/class/infiniband device; ``rdma``: {device: {"driver",
    "link_layers"}}; ``uverbs``: /dev/infiniband/uverbs* here; ``memlock``: the soft locked-memory
    limit (bytes, -1 unlimited, None unknown); ``ipc_lock``: CAP_IPC_LOCK effective in the initial
    user namespace; ``shm``: /dev/shm's size in bytes (None: no size= limit, or unknown);
    ``nvidia_gpus``: the host's NVIDIA GPUs by PCI address; ``nvidia_driver``: the host's nvidia
    kernel driver is loaded; ``driver_libs``: the driver's user space (nvidia-smi, libcuda.so.1) is
    in this container. Fields not probed are None (nothing is concluded from them).
    """

    __slots__ = ("driver", "driver_source", "gpu_visible", "infiniband", "rdma", "uverbs", "memlock",
                 "ipc_lock", "shm", "nvidia_gpus", "nvidia_driver", "driver_libs")

    def __init__(self, driver, driver_source, gpu_visible, infiniband, rdma=None, uverbs=None, memlock=None,
                 ipc_lock=None, shm=None, nvidia_gpus=None, nvidia_driver=None, driver_libs=None):
        self.driver = driver
        self.driver_source = driver_source
        self.gpu_visible = gpu_visible
        self.infiniband = infiniband
        self.rdma = rdma if rdma is not None else {name: {"driver": "", "link_layers": []} for name in infiniband}
        self.uverbs = uverbs
        self.memlock = memlock
        self.ipc_lock = ipc_lock
        self.shm = shm
        self.nvidia_gpus = nvidia_gpus
        self.nvidia_driver = nvidia_driver
        self.driver_libs = gpu_visible if driver_libs is None else driver_libs

    @property
    def efa(self) -> list[str]:
        """The AWS Elastic Fabric Adapter devices among the RDMA devices (kernel driver efa)."""
        return [name for name, dev in sorted(self.rdma.items()) if dev.get("driver") == "efa"]


def probe(root: str | None = None, driver: str | None = None) -> NodeFacts:
    """Read the node and this container; `driver` (env.sh passes the one it read) saves a second look."""
    root = os.environ.get(ROOT_ENV, "") if root is None else root
    source = "env.sh"
    if not driver or not is_dotted_number(driver):
        driver, source = read_driver(root)
    rdma = rdma_devices(root)
    cap = parse_cap_eff(_read(root + PROC_STATUS))
    ipc_lock = None if cap is None else bool(cap >> CAP_IPC_LOCK & 1) and initial_user_namespace(
        _read(root + PROC_UID_MAP))
    return NodeFacts(driver, source, gpu_visible(root), sorted(rdma), rdma=rdma, uverbs=uverbs_devices(root),
                     memlock=parse_memlock(_read(root + PROC_LIMITS)), ipc_lock=ipc_lock,
                     shm=parse_shm(_read(root + PROC_MOUNTS, 1 << 20)), nvidia_gpus=nvidia_gpus(root),
                     nvidia_driver=os.path.isdir(root + NVIDIA_PCI_DRIVER), driver_libs=driver_libraries(root))


# ----------------------------------------------------------------------------- driver floor
def driver_floor(manifest: dict, environ=None, use_manifest: bool = True) -> tuple[str | None, str]:
    """(minimum driver, where it came from): $ENVBUILD_MIN_DRIVER (baked, overridable), else the manifest.

    env.sh passes use_manifest=False: setting ENVBUILD_MIN_DRIVER empty silences the start-up
    warning, while the smoke test still checks the manifest's floor.
    """
    environ = os.environ if environ is None else environ
    if environ.get(paths.MIN_DRIVER_ENV):
        return environ[paths.MIN_DRIVER_ENV].strip(), paths.MIN_DRIVER_ENV
    minimum = (manifest.get("driver") or {}).get("min_driver") if use_manifest else None
    return (str(minimum), "manifest") if minimum else (None, "none recorded")


def too_old_message(found: str, minimum: str, manifest: dict) -> str:
    """The one explanation, shared by env.sh's warning and the smoke test's failure."""
    info = manifest.get("driver") or {}
    cuda = info.get("cuda") or manifest.get("cuda") or "?"
    package = "cuda-compat-" + "-".join(str(cuda).split(".")[:2])
    compat = info.get("forward_compat")
    return (f"NVIDIA driver {found} on this node is older than {minimum}, the minimum for CUDA {cuda} in this "
            f"image: CUDA will fail with error 803 (system has unsupported display driver / cuda driver "
            f"combination) or 804 (forward compatibility was attempted on non supported HW). Use an image of a "
            f"stack with an older CUDA (`envbuild matrix`, then render with --cuda), have the node's driver "
            f"updated to >= {minimum}, or, on data-centre GPUs that support it, use the CUDA forward-compatibility "
            f"package {package} (" + (compat or FORWARD_COMPAT_DOC) + ").")


def driver_problem(facts: NodeFacts, manifest: dict, environ=None, use_manifest: bool = True) -> str | None:
    """The too-old message when a driver is visible and below the floor; else None."""
    minimum, _ = driver_floor(manifest, environ, use_manifest)
    if not facts.driver or not minimum or not is_dotted_number(minimum):
        return None
    return too_old_message(facts.driver, minimum, manifest) if older_than(facts.driver, minimum) else None


# ----------------------------------------------------------------------------- node_env
def condition_holds(when: dict, facts: NodeFacts) -> tuple[bool, str]:
    """Does every condition of a node_env entry hold on this node? An unknown condition does not."""
    reasons = []
    for key, value in sorted((when or {}).items()):
        if key == "driver_below":
            if not is_dotted_number(str(value)):
                return False, f"invalid driver_below {value!r}"
            if not facts.driver:
                return False, "no driver visible"
            if not older_than(facts.driver, str(value)):
                return False, f"driver {facts.driver} >= {value}"
            reasons.append(f"driver {facts.driver} < {value}")
        elif key == "infiniband":
            if value not in ("absent", "present"):
                return False, f"invalid infiniband condition {value!r} (absent or present)"
            if (value == "present") != bool(facts.infiniband):
                return False, (f"InfiniBand devices {', '.join(facts.infiniband)}" if facts.infiniband
                               else "no InfiniBand device")
            reasons.append(f"InfiniBand {', '.join(facts.infiniband)}" if facts.infiniband
                           else "no InfiniBand device")
        elif key == "efa":
            if value not in ("absent", "present"):
                return False, f"invalid efa condition {value!r} (absent or present)"
            efa = facts.efa
            if (value == "present") != bool(efa):
                return False, f"EFA devices {', '.join(efa)}" if efa else "no EFA device"
            reasons.append(f"EFA {', '.join(efa)}" if efa else "no EFA device")
        else:
            return False, f"unknown condition {key!r}"
    return True, "; ".join(reasons) or "no condition"


def _valid_entry(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "value" not in entry:
        return False
    name, value = entry["name"], str(entry["value"])
    return (name.isascii() and name.replace("_", "a").isalnum() and not name[:1].isdigit()
            and "\n" not in value and "\0" not in value)


def node_env_decisions(manifest: dict, facts: NodeFacts, environ=None) -> list[dict]:
    """For each node_env entry: does it hold here, and is it applied, left to the user, or invalid?

    ``state`` is ``apply`` (holds, variable unset or empty), ``user`` (holds, the user's value
    wins), ``skip`` (condition false) or ``invalid`` (malformed entry).
    """
    environ = os.environ if environ is None else environ
    out = []
    for entry in manifest.get("node_env") or []:
        if not _valid_entry(entry):
            out.append({"name": str(entry.get("name") if isinstance(entry, dict) else entry), "value": None,
                        "state": "invalid", "why": "needs a variable name and a one-line value"})
            continue
        holds, why = condition_holds(entry.get("when") or {}, facts)
        name, value = entry["name"], str(entry["value"])
        state = "skip" if not holds else ("user" if environ.get(name) else "apply")
        out.append({"name": name, "value": value, "state": state, "why": why, "have": environ.get(name)})
    return out


# ----------------------------------------------------------------------------- container warnings
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


# ----------------------------------------------------------------------------- env.sh entry
def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def main(argv=None) -> int:
    """env.sh's node step: one warning on stderr, NAME=VALUE lines on stdout. Never fails the start."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        driver = argv[argv.index("--driver") + 1] if "--driver" in argv[:-1] else None
        manifest = _load(os.environ.get(paths.MANIFEST_ENV) or paths.MANIFEST)
        facts = probe(driver=driver)
        problems = container_problems(facts, manifest or None)
        if facts.gpu_visible:  # the driver floor and node_env concern a container with a GPU
            problems[:0] = [p for p in (driver_problem(facts, manifest, use_manifest=False),) if p]
        for problem in problems:
            print(f"envbuild: warning: {problem}", file=sys.stderr)
        for decision in node_env_decisions(manifest, facts) if facts.gpu_visible else ():
            if decision["state"] == "apply":
                print(f"{decision['name']}={decision['value']}")
    except Exception as error:  # noqa: BLE001 - a node check must never stop a container from starting
        print(f"envbuild: node check skipped ({type(error).__name__}: {error})", file=sys.stderr)
    sys.stdout.flush()
    return 0
