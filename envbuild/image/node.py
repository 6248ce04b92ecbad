"""Facts about the node a container runs on (NVIDIA driver, GPU devices, InfiniBand) and what
follows from them: the driver-floor warning and the manifest's conditional ``node_env``.

env.sh runs :func:`main` at container start, but only where a GPU is visible and only when a
warning is due or the manifest has node_env entries; so this module imports nothing heavy
(no re, argparse or dataclasses) and runs nvidia-smi only when /proc/driver/nvidia/version is
missing. The smoke test's ``driver`` and ``node_env`` checks use the same functions.

    python -I -S -B -c 'import sys; sys.path[:0] = ["/opt/envbuild/lib"]; from envbuild_image.node import main; main()' \
        [--driver VERSION]

prints at most one warning on stderr and, on stdout, ``NAME=VALUE`` for each node_env entry
whose condition holds here and whose variable is unset (a user's value always wins).
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
INFINIBAND_DIR = "/sys/class/infiniband"
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
NVIDIA_SMI_TIMEOUT = 20.0
FORWARD_COMPAT_DOC = "https://docs.nvidia.com/deploy/cuda-compatibility/forward-compatibility.html"


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


def infiniband_devices(root: str = "") -> list[str]:
    """RDMA devices (InfiniBand or RoCE HCAs) the kernel lists; empty when there are none."""
    try:
        return sorted(os.listdir(root + INFINIBAND_DIR))
    except OSError:
        return []


class NodeFacts:
    """What env.sh and the smoke test know about this node."""

    __slots__ = ("driver", "driver_source", "gpu_visible", "infiniband")

    def __init__(self, driver, driver_source, gpu_visible, infiniband):
        self.driver = driver
        self.driver_source = driver_source
        self.gpu_visible = gpu_visible
        self.infiniband = infiniband


def probe(root: str | None = None, driver: str | None = None) -> NodeFacts:
    """Read the node; `driver` (env.sh passes the one it read) saves a second look."""
    root = os.environ.get(ROOT_ENV, "") if root is None else root
    source = "env.sh"
    if not driver or not is_dotted_number(driver):
        driver, source = read_driver(root)
    return NodeFacts(driver, source, gpu_visible(root), infiniband_devices(root))


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
        problem = driver_problem(facts, manifest, use_manifest=False)
        if problem:
            print(f"envbuild: warning: {problem}", file=sys.stderr)
        for decision in node_env_decisions(manifest, facts):
            if decision["state"] == "apply":
                print(f"{decision['name']}={decision['value']}")
    except Exception as error:  # noqa: BLE001 - a node check must never stop a container from starting
        print(f"envbuild: node check skipped ({type(error).__name__}: {error})", file=sys.stderr)
    sys.stdout.flush()
    return 0
