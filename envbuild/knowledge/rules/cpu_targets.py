"""The CPU an image is for: the OCI platform of each CPU architecture, and the CPU target its
host-compiled code (DeepSpeed's CPU ops) is built for: rule cpu-target."""

from __future__ import annotations

from typing import Optional

from packaging.version import Version

from envbuild.knowledge.rules.rejection import Rejection

DEFAULT_CPU_TARGET = "x86-64-v3"  # x86_64 images; aarch64 ones default to their host CPU's (gpus.yaml)
PLATFORMS = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}  # OCI platform of each CPU architecture


def cpu_target_rejection(m, s, target: str, cpu_arch: str) -> Optional[Rejection]:
    """Why `--cpu-target target` cannot build this stack's CPU ops for a `cpu_arch` image
    (None: it can): another architecture's target, or one the OS's GCC does not know."""
    known = m.gpus_file.cpu_targets.get(target)
    if known is None:
        return Rejection("cpu-target", f"'{target}' is not a CPU target in gpus.yaml cpu_targets")
    if known.arch != cpu_arch:
        return Rejection("cpu-target", f"'{target}' is an {known.arch} target and the image is {cpu_arch}")
    family = m.bases.families[s.os]
    if Version(family.gcc) < Version(known.min_gcc):
        return Rejection("cpu-target", f"'{target}' ({known.flag}) needs GCC >= {known.min_gcc} and {s.os} ships GCC "
                                       f"{family.gcc} ({known.source})")
    return None


def default_cpu_target_rejection(m, s, gpu, cpu_arch: str) -> Optional[Rejection]:
    """Rule cpu-target without --cpu-target: the GPU's host CPU has a target the OS's GCC knows."""
    try:
        m.cpu_target_for(cpu_arch, gpu, m.bases.families[s.os])
    except KeyError as e:
        return Rejection("cpu-target", f"{e.args[0]} ({s.os} ships GCC {m.bases.families[s.os].gcc})")
    return None
