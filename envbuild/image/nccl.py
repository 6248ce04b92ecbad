"""Which NCCL torch really loads, and how many NCCLs the image carries: the smoke test's
`nccl` and `nccl_copies` checks.

torch.cuda.nccl.version() is the nccl.h torch was compiled against, not the library the process
loaded: a pip nightly reported 2.18.1 while its nvidia-nccl-cu12 2.19.3 was what ran
(https://github.com/pytorch/builder/issues/1666), and a torch 2.2.1 job reporting 2.19.3 printed
"NCCL version 2.14.3+cuda11.8" at init (https://github.com/NVIDIA/nccl/issues/1212). So the
check asks the library itself: after `import torch`, the libnccl.so* mapped into this process
(/proc/self/maps) is opened again with ctypes, which hands back the handle already loaded (the
same file is never mapped twice), and its ncclGetVersion() is called; no GPU is needed, as
ncclGetVersion only returns a constant. A torch with NCCL linked statically (conda builds,
https://github.com/pytorch/pytorch/issues/132617) maps no libnccl: its libtorch_cuda.so carries
NCCL's exported symbols, ncclGetVersion included (pytorch/pytorch#42517 lists them with nm).

Standard library only; torch is imported inside the check that needs it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
import sysconfig

from .report import Skipped
from .versions import normalize_version, version_matches

# libnccl.so, libnccl.so.2, libnccl.so.2.21.5; not libnccl-net.so (a net plugin) or libnccl_static.a.
LIBRARY = re.compile(r"libnccl\.so(?:\.\d+)*")
STATIC_HOST = re.compile(r"libtorch_cuda\.so")  # where a static NCCL lives in a torch build
MAPS = "/proc/self/maps"
# Where a loader or a user's process finds a libnccl without asking: the default directories of
# glibc's loader and of a multiarch Debian/Ubuntu system, and CUDA's own (a devel base image).
SYSTEM_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib/{triplet}", "/usr/lib/{triplet}",
               "/usr/local/cuda/lib64", "/usr/local/nccl/lib")
LDCONFIG_TIMEOUT = 30


def decode_version(code: int) -> str:
    """ncclGetVersion()'s integer as 'major.minor.patch'.

    nccl.h encodes it with NCCL_VERSION(X,Y,Z): X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z
    from 2.9 on (https://github.com/NVIDIA/nccl/blob/v2.30.7-1/src/nccl.h.in; v2.8.4-1 has the old
    macro alone). Every old code is below 10000 and every new one above it.

    >>> decode_version(2708), decode_version(22105), decode_version(23007)
    ('2.7.8', '2.21.5', '2.30.7')
    """
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def mapped(maps_text: str, pattern: re.Pattern = LIBRARY) -> list[str]:
    """The distinct files of /proc/PID/maps whose name matches `pattern`, in mapping order
    (a path may hold spaces; one replaced on disk after it was loaded ends in ' (deleted)')."""
    found: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].removesuffix(" (deleted)")
        if pattern.fullmatch(os.path.basename(path)) and path not in found:
            found.append(path)
    return found


def library_version(path: str) -> str:
    """ncclGetVersion() of the library at `path`, decoded; OSError or AttributeError where the
    file does not load or exports no ncclGetVersion. dlopen of a file already mapped returns
    the handle it has, so for the library torch loaded this asks that very copy."""
    library = ctypes.CDLL(path)
    code = ctypes.c_int(0)
    result = library.ncclGetVersion(ctypes.byref(code))
    if result != 0:
        raise OSError(f"ncclGetVersion returned ncclResult {result}")
    return decode_version(code.value)


def _version_or_why(path: str) -> str:
    try:
        return library_version(path)
    except (OSError, AttributeError) as error:
        return f"version unreadable: {error}"


def _exports_nccl(path: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), "ncclGetVersion")
    except OSError:
        return False


def _torch_reports():
    """torch's own answer (its build's nccl.h), or None when this torch has no NCCL."""
    import torch

    try:
        return normalize_version(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a torch without NCCL support raises here
        return None


def loaded_library(maps_text: str) -> tuple[list[str], str | None]:
    """(the libnccl files mapped, the file whose ncclGetVersion answers for this process): the one
    mapped libnccl, else the libtorch_cuda.so that has NCCL linked in statically; None for none
    (or for two mapped: which one a call reaches is the loader's choice)."""
    libraries = mapped(maps_text)
    if libraries:
        return libraries, libraries[0] if len(libraries) == 1 else None
    hosts = [p for p in mapped(maps_text, STATIC_HOST) if _exports_nccl(p)]
    return [], hosts[0] if hosts else None


def loaded_version() -> str | None:
    """The version of the NCCL this process has loaded (after `import torch`), else torch's own
    report (two mapped, or none readable: check_loaded says which); None without NCCL."""
    try:
        _, path = loaded_library(_read_maps())
    except OSError:
        path = None
    if path is not None:
        try:
            return library_version(path)
        except (OSError, AttributeError):
            pass
    return _torch_reports()


def _read_maps() -> str:
    with open(MAPS, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def check_loaded(manifest: dict, maps_text: str | None = None, torch_reports: str | None = None):
    """The NCCL torch loaded is the manifest's: the mapped libnccl's own ncclGetVersion()."""
    want = manifest.get("nccl")
    if not want:
        return Skipped("the manifest pins no NCCL")
    if maps_text is None:
        torch_reports = _torch_reports()  # imports torch: what it loads is then mapped
        maps_text = _read_maps()
    libraries, path = loaded_library(maps_text)
    if len(libraries) > 1:
        named = ", ".join(f"{path} ({_version_or_why(path)})" for path in libraries)
        return False, f"{len(libraries)} NCCL libraries are loaded in one process: {named}"
    if path is None:
        return False, ("torch loaded no libnccl.so* and no libtorch_cuda.so exporting ncclGetVersion: "
                       f"this torch has no NCCL, but the image pins NCCL {want}")
    how = "loaded dynamically" if libraries else "linked statically into torch"
    have = library_version(path)
    data = {"path": path, "version": have, "linked": "dynamic" if libraries else "static",
            "torch_reports": torch_reports}
    detail = f"NCCL {have} {how} from {path} (its ncclGetVersion)"
    if torch_reports and torch_reports != have:
        detail += (f"; torch.cuda.nccl.version() says {torch_reports}: the nccl.h torch was built with, "
                   "not the library it loaded")
    if not version_matches(want, have):
        return False, f"{detail}, but the manifest pins NCCL {want}", None, data
    return True, detail, None, data


# ----------------------------------------------------------------------------- copies on disk
def ldconfig_cache() -> tuple[str, str]:
    """`ldconfig -p`'s text, and how the cache was read ('ldconfig's cache' or why it was not)."""
    try:
        run = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=LDCONFIG_TIMEOUT,
                             env=dict(os.environ, PATH="/usr/sbin:/sbin:/usr/bin:/bin"), check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return "", f"not ldconfig's cache ({type(error).__name__}: {error})"
    if run.returncode != 0:
        return "", f"not ldconfig's cache (ldconfig -p exited {run.returncode})"
    return run.stdout, "ldconfig's cache"


def ldconfig_paths(text: str) -> list[str]:
    """The libnccl.so* files ldconfig's cache names (`ldconfig -p`: 'libnccl.so.2 (libc6,x86-64) => PATH')."""
    paths = (line.rpartition(" => ")[2].strip() for line in text.splitlines() if " => " in line)
    return [p for p in paths if LIBRARY.fullmatch(os.path.basename(p))]


def search_dirs(environ=None, system_dirs=SYSTEM_DIRS) -> list[str]:
    """The directories searched one level deep: LD_LIBRARY_PATH's, then the system's."""
    environ = os.environ if environ is None else environ
    triplet = f"{platform.machine()}-linux-gnu"
    listed = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d.startswith("/")]
    return list(dict.fromkeys(listed + [d.format(triplet=triplet) for d in system_dirs]))


def site_dirs() -> list[str]:
    """The venv's site-packages, searched through: the nvidia-* wheels' nvidia/*/lib, torch/lib and the rest."""
    return list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))


def nccl_files(trees, dirs, listed=()) -> dict[tuple[int, int], list[str]]:
    """Every libnccl.so* file under `trees` (recursively, through symlinked folders), in `dirs` (one level) and `listed`,
    grouped by the file they are (libnccl.so -> libnccl.so.2 -> libnccl.so.2.21.5 is one)."""
    found: dict[tuple[int, int], list[str]] = {}

    def add(path: str):
        try:
            info = os.stat(path)
        except OSError:
            return
        names = found.setdefault((info.st_dev, info.st_ino), [])
        if path not in names:
            names.append(path)

    seen: set[str] = set()
    for tree in trees:
        # Through symlinks: layers.sh moves each nvidia-* wheel's package out of the venv into a
        # layer of its own and leaves a symlink in its place (site-packages/nvidia/nccl -> ...).
        for root, subdirs, files in os.walk(tree, followlinks=True):
            real = os.path.realpath(root)
            if real in seen:  # a link back into the tree: walked already
                subdirs[:] = []
                continue
            seen.add(real)
            subdirs.sort()
            for name in sorted(files):
                if LIBRARY.fullmatch(name):
                    add(os.path.join(root, name))
    for directory in dirs:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if LIBRARY.fullmatch(name):
                add(os.path.join(directory, name))
    for path in listed:
        add(path)
    return found


def check_copies(manifest: dict, environ=None, trees=None, dirs=None, ldconfig_text: str | None = None):
    """One NCCL on the image's library paths: with two, which one a process gets depends on
    its loader's search order, and a second `nvidia-nccl` wheel or a host library silently wins
    or loses (three libnccl.so.2 in one image: https://github.com/verl-project/verl/pull/6621)."""
    trees = site_dirs() if trees is None else trees
    dirs = search_dirs(environ) if dirs is None else dirs
    cache, cache_read = ldconfig_cache() if ldconfig_text is None else (ldconfig_text, "ldconfig's cache")
    found = nccl_files(trees, dirs, ldconfig_paths(cache))
    files = [sorted(names, key=lambda p: (os.path.islink(p), p)) for names in found.values()]
    shown = [f"{names[0]}" + (f" (also {', '.join(names[1:])})" if names[1:] else "")
             + f" ({_version_or_why(names[0])})" for names in files]
    where = f"{len(trees)} site-packages, {len(dirs)} library directories and {cache_read}"
    if len(files) > 1:
        return False, (f"{len(files)} NCCL libraries on the image's library paths: {'; '.join(shown)}. "
                       "Keep one: the one torch loads (`nccl` check)")
    if not files:
        return (not manifest.get("nccl")), f"no libnccl.so* in {where}"
    return True, f"one NCCL in {where}: {shown[0]}"


