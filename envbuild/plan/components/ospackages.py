"""The OS packages: Python with headers and a host compiler in the builder, the Python runtime
(and a C compiler for torch.compile) in the final image, plus what the ops and a source-built
fabric need; each stage's apt step pinned by the OS lock where it has one (steps/os.sh)."""

from __future__ import annotations

import posixpath
from dataclasses import replace

from envbuild.image import paths
from envbuild.plan.blocks import APT_CACHE, STEPS_SOURCE, FileCopy, Step, step_files
from envbuild.plan.components.base import Context, Part
from envbuild.resolve.resolver import Resolution

APT_SECRETS = ("ca_cert", "apt_mirror")
OS_SECRETS = ("ca_cert", "apt_snapshot", "apt_key", "apt_mirror")
OS_LOCK_FILE = "envbuild/os-lock.txt"  # the whole OS lock in the build directory (copied into the image)
OS_LOCK_PART = STEPS_SOURCE + "/os-lock-{stage}.txt"  # a stage's part, beside os.sh (the runtime binds that folder)
# What a kept builder's base brings that the final image must not have: the nvidia/cuda images'
# own NCCL beside the nvidia-nccl wheel torch loads (two libnccl: the smoke test's nccl_copies).
KEPT_BASE_DROPS = ("libnccl2", "libnccl-dev")


def fabric_packages(resolution: Resolution) -> list[str]:
    """The OS packages the image's fabric needs in the final image (bases.yaml capabilities)."""
    fabric = resolution.fabric
    family = resolution.facts.family
    return [p for need in (fabric.needs if fabric else ()) for p in family.capabilities[need].get("runtime", [])]


def apt_step(resolution: Resolution, packages, comment: str, stage: str, files=()) -> Step:
    """An apt step of `stage` (os.sh), pinned by the OS lock where it pins that stage."""
    family = resolution.facts.family
    step = Step("os", tuple(packages), files=files, env=(("ENVBUILD_APT_HOSTS", " ".join(family.mirror_hosts)),),
                secrets=APT_SECRETS, caches=(APT_CACHE,), comment=comment)
    return locked(step, resolution, stage)


def locked(step: Step, resolution: Resolution, stage: str) -> Step:
    """An OS step of a stage the OS lock pins: os.sh reads the stage's part (steps/os.sh)."""
    if stage not in resolution.os_locked:
        return step
    part = OS_LOCK_PART.format(stage=stage)
    target = f"{paths.SETUP_DIR}/{posixpath.basename(part)}"
    files = step.files + ((FileCopy(part, target),) if step.files else ())  # a bound stage sees the folder
    return replace(step, files=files, env=(*step.env, ("ENVBUILD_OS_LOCK", target)), secrets=OS_SECRETS)


def _lock_files(resolution: Resolution) -> tuple[tuple[str, str], ...]:
    """The OS lock (into the image, for the record) and each pinned stage's part for os.sh."""
    lock = resolution.os_lock
    if lock is None:
        return ()
    apt = resolution.facts.family.apt
    snapshot = lock.snapshot_url(apt.snapshot)
    return ((OS_LOCK_FILE, lock.text),
            *((OS_LOCK_PART.format(stage=stage), lock.stage_part(stage, snapshot, apt.keyring, apt.check_valid_until))
              for stage in resolution.os_locked))


def part(ctx: Context) -> Part:
    resolution = ctx.resolution
    family, request, fabric = resolution.facts.family, resolution.request, resolution.fabric
    python_pkg = ctx.python_pkg
    needs = sorted({n for o in resolution.ops for n in resolution.facts.ops[o].needs})
    builder_pkgs = [p.replace("{python}", python_pkg) for p in family.builder_packages]
    runtime_pkgs = [p.replace("{python}", python_pkg) for p in family.runtime_packages]
    if not request.no_compiler:  # torch.compile compiles C at run time; DeepSpeed still cannot (no ninja/nvcc)
        runtime_pkgs += [p.replace("{python}", python_pkg) for p in family.compiler_packages]
    for need in needs:  # the OS's packages; a need the toolchain provides (curand) brings none
        builder_pkgs += family.capabilities.get(need, {}).get("builder", [])
        runtime_pkgs += family.capabilities.get(need, {}).get("runtime", [])
    for need in (fabric.needs if fabric and fabric.build else ()):  # a fabric built from source
        builder_pkgs += [p for p in family.capabilities[need].get("builder", []) if p not in builder_pkgs]
    if ctx.keep:  # the final image is the builder: the fabric's user space goes in there
        builder_pkgs += [p for p in fabric_packages(resolution) if p not in builder_pkgs]
    builder = apt_step(resolution, builder_pkgs, f"{python_pkg} with headers and a host compiler for the DeepSpeed ops",
                       "builder", files=step_files("lib.sh", "os.sh"))
    if ctx.keep:
        drop = Step("os-drop", KEPT_BASE_DROPS, files=step_files("os-drop.sh"),
                    comment="--keep-toolchain: the final image is this builder; its base's own NCCL goes "
                            "(torch loads the venv's nvidia-nccl wheel)")
        again = replace(builder, files=(), comment="--keep-toolchain: the compilers of the builder base stay.")
        return Part(builder_steps=(builder, drop), runtime_steps=(again, replace(drop, files=())),
                    generated=_lock_files(resolution))
    else:
        runtime = apt_step(resolution, runtime_pkgs,
                           f"{python_pkg} runtime only: no compiler, no headers" if request.no_compiler
                           else f"{python_pkg} runtime, with a C compiler and Python headers for torch.compile "
                                f"(no nvcc, no ninja: DeepSpeed cannot JIT)", "runtime")
    return Part(builder_steps=(builder,), runtime_steps=(runtime,), generated=_lock_files(resolution))
