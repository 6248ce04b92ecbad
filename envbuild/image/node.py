"""What follows for this image from the node's facts (nodefacts.py): the driver-floor warning and
the manifest's conditional ``node_env``; and env.sh's entry, :func:`main`, which prints them
with the container warnings (container.py).

env.sh runs :func:`main` at container start only when its own POSIX-sh pre-checks (the same tests,
made with shell builtins) find something to say: a GPU is visible and a warning is due or the
manifest has node_env entries, or one of the container warnings may apply. So on an ordinary
node no process starts, and these modules import nothing heavy (no re, glob, argparse or
dataclasses). The smoke test's ``driver`` and ``node_env`` checks use the same functions.

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
from .container import container_problems
from .nodefacts import NodeFacts, is_dotted_number, probe
from .versions import older_than

FORWARD_COMPAT_DOC = "https://docs.nvidia.com/deploy/cuda-compatibility/forward-compatibility.html"


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
# The device conditions of manifests written before they were data (no "node_conditions" key):
# infiniband and efa with the meaning matrices/fabrics.yaml declares for them, so an older image
# decides its node_env as it always did. A manifest's own node_conditions come first.
FALLBACK_CONDITIONS = {
    "infiniband": {"label": "InfiniBand", "devices": "any"},
    "efa": {"label": "EFA", "devices": {"drivers": ["efa"]}},
}
BUILT_IN = "driver_below"  # the one comparison that is no set of devices: the driver's version


def node_conditions(manifest: dict) -> dict:
    """The device conditions a manifest's node_env may name: its own table over the fallbacks."""
    table = manifest.get("node_conditions")
    return {**FALLBACK_CONDITIONS, **(table if isinstance(table, dict) else {})}


def _words(value) -> list | None:
    if value is None:
        return []
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def counted_devices(definition, facts: NodeFacts) -> list[str] | None:
    """The node's RDMA devices a condition counts (None: the definition is malformed).

    ``devices`` is ``any`` (every /sys/class/infiniband device) or ``{"drivers": [...],
    "link_layers": [...]}``: the devices whose parent's kernel driver is listed and (when both
    are given) that have a port of a listed link layer.
    """
    devices = definition.get("devices") if isinstance(definition, dict) else None
    if devices == "any":
        return list(facts.infiniband)
    if not isinstance(devices, dict):
        return None
    drivers, layers = _words(devices.get("drivers")), _words(devices.get("link_layers"))
    if drivers is None or layers is None or not (drivers or layers):
        return None
    return [name for name, dev in sorted(facts.rdma.items())
            if (not drivers or dev.get("driver") in drivers)
            and (not layers or any(layer in layers for layer in dev.get("link_layers") or ()))]


def condition_holds(when: dict, facts: NodeFacts, conditions: dict | None = None) -> tuple[bool, str]:
    """Does every condition of a node_env entry hold on this node? An unknown condition does not.

    `conditions` are the device conditions by name (:func:`node_conditions` of the manifest;
    the fallbacks when None); driver_below is built in.
    """
    conditions = FALLBACK_CONDITIONS if conditions is None else conditions
    reasons = []
    for key, value in sorted((when or {}).items()):
        if key == BUILT_IN:
            if not is_dotted_number(str(value)):
                return False, f"invalid driver_below {value!r}"
            if not facts.driver:
                return False, "no driver visible"
            if not older_than(facts.driver, str(value)):
                return False, f"driver {facts.driver} >= {value}"
            reasons.append(f"driver {facts.driver} < {value}")
        elif key in conditions:
            if value not in ("absent", "present"):
                return False, f"invalid {key} condition {value!r} (absent or present)"
            found = counted_devices(conditions[key], facts)
            if found is None:
                return False, f"invalid definition of condition {key!r} in the manifest's node_conditions"
            label = str(conditions[key].get("label") or key)
            if (value == "present") != bool(found):
                return False, f"{label} devices {', '.join(found)}" if found else f"no {label} device"
            reasons.append(f"{label} {', '.join(found)}" if found else f"no {label} device")
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
    conditions = node_conditions(manifest)
    out = []
    for entry in manifest.get("node_env") or []:
        if not _valid_entry(entry):
            out.append({"name": str(entry.get("name") if isinstance(entry, dict) else entry), "value": None,
                        "state": "invalid", "why": "needs a variable name and a one-line value"})
            continue
        holds, why = condition_holds(entry.get("when") or {}, facts, conditions)
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
