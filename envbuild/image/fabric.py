"""The smoke test's ``fabric`` check: the image carries the network user space its fabric
profile promises (manifest ``fabric``), loaded the way NCCL loads it, so a multi-node job
cannot silently fall back to TCP sockets for want of a library.

NCCL links no RDMA library: it ``dlopen``s ``libibverbs.so.1`` (and ``libmlx5.so.1`` for
ConnectX's direct verbs) at communicator set-up, and libibverbs in turn loads the provider of
each device from ``/etc/libibverbs.d/*.driver`` and ``<libdir>/libibverbs/lib<name>-rdmav*.so``.
A missing library is no error there, only ``NET/IB : No device found`` at INFO level, then
sockets. This check loads each library and provider with ``ctypes`` (standard library only),
lists the RDMA devices (none on a machine without them: a result, not an error), resolves every
NCCL net plugin the profile bakes (``ldd``: no missing library) and finds its tools.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess

from .report import Skipped
from .sandbox import sha256_of, unresolved_libraries

DRIVER_DIR = "/etc/libibverbs.d"  # rdma-core: one `driver NAME` file per provider
PROVIDER_GLOBS = ("/usr/lib/*/libibverbs/lib{name}-rdmav*.so", "/usr/lib64/libibverbs/lib{name}-rdmav*.so",
                  "/usr/lib/libibverbs/lib{name}-rdmav*.so")


def load_library(name: str) -> str | None:
    """None when `name` loads as the dynamic linker would for NCCL; else the linker's words."""
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        return str(error)
    return None


def registered_providers(driver_dir: str = DRIVER_DIR) -> set[str]:
    """Provider names rdma-core will try (``driver mlx5`` lines of its .driver files).

    >>> import tempfile, pathlib
    >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "mlx5.driver").write_text("driver mlx5\\n")
    >>> sorted(registered_providers(d))
    ['mlx5']
    """
    names = set()
    for path in glob.glob(os.path.join(driver_dir, "*.driver")):
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                for line in handle.read(4096).splitlines():
                    words = line.split()
                    if len(words) == 2 and words[0] == "driver":
                        names.add(os.path.basename(words[1]))
        except OSError:
            continue
    return names


def verbs_dirs(prefix: str | None) -> tuple[str, tuple[str, ...]]:
    """(driver directory, provider library patterns) of the OS's rdma-core, or of one built into
    `prefix` (the aws-efa fabric: /opt/amazon/efa, configured with its own libibverbs.d).

    >>> verbs_dirs("/opt/amazon/efa")
    ('/opt/amazon/efa/etc/libibverbs.d', ('/opt/amazon/efa/lib/libibverbs/lib{name}-rdmav*.so',))
    """
    if not prefix:
        return DRIVER_DIR, PROVIDER_GLOBS
    return f"{prefix}/etc/libibverbs.d", (f"{prefix}/lib/libibverbs/lib{{name}}-rdmav*.so",)


def provider_problem(name: str, registered: set[str], root: str = "", prefix: str | None = None) -> str | None:
    """None when provider `name` is registered and its library loads; else why not."""
    driver_dir, patterns = verbs_dirs(prefix)
    if name not in registered:
        return f"provider {name} is not registered in {driver_dir}"
    found = sorted(p for pattern in patterns for p in glob.glob(root + pattern.format(name=name)))
    if not found:
        return f"provider {name}: no lib{name}-rdmav*.so under a libibverbs directory"
    why = load_library(found[0])
    return f"provider {name}: {why}" if why else None


def rdma_devices() -> tuple[list[str], str]:
    """(device names, how they were found) through libibverbs itself, as NCCL asks for them."""
    try:
        verbs = ctypes.CDLL("libibverbs.so.1", use_errno=True)
    except OSError:
        return [], "libibverbs.so.1 does not load"
    get, free, name_of = verbs.ibv_get_device_list, verbs.ibv_free_device_list, verbs.ibv_get_device_name
    get.restype, get.argtypes = ctypes.POINTER(ctypes.c_void_p), [ctypes.POINTER(ctypes.c_int)]
    name_of.restype, name_of.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    free.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    count = ctypes.c_int(0)
    devices = get(ctypes.byref(count))
    if not devices:  # ENOSYS: the kernel exposes no verbs devices here (no uverbs), as on a machine without RDMA
        errno = ctypes.get_errno()
        return [], f"ibv_get_device_list: {os.strerror(errno) if errno else 'no list'}"
    try:
        names = [name_of(devices[i]).decode("ascii", "replace") for i in range(count.value)]
    finally:
        free(devices)
    return names, "ibv_get_device_list"


def plugin_problem(path: str, environ=None) -> str | None:
    """None when the NCCL net plugin at `path` exists and every library it needs resolves."""
    if not os.path.isfile(path):
        return f"net plugin {path} is missing"
    try:
        missing, returncode = unresolved_libraries(path, environ)
    except (OSError, subprocess.SubprocessError) as error:
        return f"net plugin {path}: ldd failed ({error})"
    if missing:
        return f"net plugin {path} needs {', '.join(missing)}, which the image lacks"
    return None if returncode == 0 else f"net plugin {path}: ldd exited {returncode}"


def env_problems(fabric: dict, environ) -> list[str]:
    """Settings that contradict the fabric: each would make NCCL fail or fall back.

    >>> env_problems({"name": "none", "transport": "Socket"}, {"NCCL_NET": "IB"})
    ['NCCL_NET=IB asks for a net this image (fabric none) does not carry: it provides Socket']
    >>> env_problems({"name": "ib", "transport": "IB"}, {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "1"})
    ['NCCL_NET=IB and NCCL_IB_DISABLE=1 contradict each other: NCCL cannot initialise']
    >>> env_problems({"name": "ib", "transport": "IB"}, {"NCCL_NET": "Socket"})
    []
    """
    out = []
    net = (environ.get("NCCL_NET") or "").strip()
    names = {fabric.get("transport", "").lower(), "socket"}
    if "libfabric" in names:  # aws-ofi-nccl answers to its older names too (src/nccl_ofi_interface_nvidia.cpp)
        names |= {"aws libfabric", "ofi"}
    if net and net.lower() not in names:
        out.append(f"NCCL_NET={net} asks for a net this image (fabric {fabric.get('name')}) does not carry: "
                   f"it provides {fabric.get('transport')}")
    if net.upper() == "IB" and (environ.get("NCCL_IB_DISABLE") or "").strip() == "1":
        out.append("NCCL_NET=IB and NCCL_IB_DISABLE=1 contradict each other: NCCL cannot initialise")
    for name, value in (fabric.get("env") or {}).items():
        if name not in environ:
            out.append(f"{name} (the fabric's {name}={value}) did not reach this process")
        elif environ[name].startswith("/") and not os.path.exists(environ[name]):
            out.append(f"{name}={environ[name]} names no file (NCCL ignores a missing file without a word)")
    return out


def file_problems(fabric: dict, root: str = "") -> list[str]:
    """The fabric's baked files (a VM size's topology file) are there, unchanged (the whole file:
    a pinned file over 1 MiB once could never match, only its first MiB was hashed)."""
    out = []
    for f in fabric.get("files") or []:
        try:
            digest = sha256_of(root + f["path"])
        except OSError as error:
            out.append(f"file {f['path']}: {error.strerror}")
            continue
        if digest != f.get("sha256"):
            out.append(f"file {f['path']} is not the one the fabric pins (sha256 {digest[:12]}, not {f.get('sha256', '')[:12]})")
    return out


def check_fabric(manifest: dict, environ=None) -> tuple[bool, str] | Skipped:
    """Every library, provider, net plugin and tool of the image's fabric is there and loads."""
    fabric = manifest.get("fabric")
    if not fabric:
        return Skipped("the manifest names no fabric (built by an older envbuild)")
    environ = os.environ if environ is None else environ
    problems = [f"{lib}: {why}" for lib in fabric.get("libraries") or [] if (why := load_library(lib))]
    providers = fabric.get("providers") or []
    prefix = fabric.get("verbs_prefix")
    registered = registered_providers(verbs_dirs(prefix)[0]) if providers else set()
    problems += [why for p in providers if (why := provider_problem(p, registered, prefix=prefix))]
    problems += [why for path in fabric.get("net_plugins") or [] if (why := plugin_problem(path, environ))]
    problems += [f"tool {t} is not on PATH" for t in fabric.get("tools") or [] if not shutil.which(t)]
    problems += env_problems(fabric, environ)
    problems += file_problems(fabric)
    if problems:
        return False, (f"fabric {fabric.get('name')} promises NCCL net {fabric.get('transport')}, but: "
                       + "; ".join(problems) + ". A multi-node job would fall back to TCP sockets or fail; rebuild "
                       "the image (`envbuild build ... --fabric " + str(fabric.get("name")) + "`)")
    devices, how = rdma_devices() if fabric.get("libraries") else ([], "no verbs library in this fabric")
    found = (f"RDMA devices {', '.join(devices)}" if devices
             else f"no RDMA device on this node ({how}): a result, not an error")
    loaded = [f"{len(fabric.get('libraries') or [])} libraries", f"{len(providers)} providers",
              f"{len(fabric.get('net_plugins') or [])} net plugins", f"tools {', '.join(fabric.get('tools') or []) or 'none'}"]
    return True, f"fabric {fabric.get('name')} (NCCL net {fabric.get('transport')}): {', '.join(loaded)} present; {found}"
