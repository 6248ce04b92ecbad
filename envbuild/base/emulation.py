"""Building and running another CPU architecture's image under qemu-user emulation: what is
bound into the builder's RUNs (`render --qemu`) and which CPU the emulator presents to the smoke
test (`smoke --qemu`). Native runners need none of it."""

from __future__ import annotations

from pathlib import Path

from envbuild.base.resources import templates_dir

# --qemu: a stub /sys/devices/system/cpu (templates/files/qemu/cpu: a Neoverse V2's MIDR_EL1), bound
# in every builder RUN of an arm64 image built under qemu-user, where torch's oneDNN crashes at
# import without it. The rendered files stay the same otherwise.
QEMU_CPU_SYSFS = ("envbuild/qemu/cpu", "/sys/devices/system/cpu")  # (build-directory folder, target)


def qemu_cpu_stub() -> Path:
    """The stub CPU sysfs tree that --qemu binds (templates/files/qemu/cpu)."""
    return templates_dir() / "files" / "qemu" / "cpu"


# --qemu smoke runs: the CPU qemu-user emulates. Its default, `max`, has 512-bit SVE, so torch
# reports CPU capability SVE256 and Inductor compiles its CPU code with -msve-vector-bits=256
# (which failed with GCC 12.2 in an emulated smoke run, bench/RESULTS.md). Grace's Neoverse V2
# cores have "4x 128b SVE2" (NVIDIA's Grace Performance Tuning Guide,
# docs.nvidia.com/grace-perf-tuning-guide), where torch 2.15 reports SVE128 and Inductor generates
# its NEON (asimd) code, as the emulated smoke record shows; `sve128=on` caps the emulated vector
# length there (qemu's "sveN" CPU properties, docs/system/arm/cpu-features.rst).
QEMU_CPU = "max,sve128=on"
# What `uname -m` prints inside an image of each OCI platform that is rendered explicitly.
PLATFORM_MACHINES = {"linux/arm64": "aarch64"}
