"""Facts about the node a container runs on and about the container itself, read once: the
NVIDIA driver, GPUs, RDMA devices, /dev/shm, the locked-memory limit (:class:`NodeFacts`,
:func:`probe`). node.py and container.py judge them; the smoke checks and the multi-node
fingerprints read them too.

env.sh runs this at container start, so it imports nothing heavy (no re, glob, argparse or
dataclasses) and runs nvidia-smi only when /proc/driver/nvidia/version is missing.
"""

from __future__ import annotations

import os

from . import paths

ROOT_ENV = "ENVBUILD_NODE_ROOT"  # test hook: a directory standing in for / (proc, dev, sys)
DRIVER_FILE = "/proc/driver/nvidia/version"
NVIDIACTL = "/dev/nvidiactl"
INFINIBAND_DIR = paths.RDMA_SYSFS
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
NVIDIA_SMI_TIMEOUT = 20.0

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
