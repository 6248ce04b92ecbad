"""`--nccl`: an NCCL release in a stack's image in place of the one torch pins. Which releases
a stack accepts (``envbuild nccl``), and the stack's lock with the [nccl] section of the
one a request names (its wheels' hashes from matrices/nccl.yaml); :mod:`envbuild.knowledge.rules`
decides whether a release may be used, this module applies its decision to a resolution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from packaging.version import Version

from envbuild.knowledge import rules
from envbuild.knowledge.lock import Lock, stack_lock
from envbuild.knowledge.matrix import Fabric, Matrix, Stack
from envbuild.knowledge.request import Request
from envbuild.knowledge.rules import PLATFORMS


@dataclass(frozen=True)
class NcclOverride:
    """The NCCL wheel `--nccl` installs in place of the one torch pins, hash-locked."""

    package: str  # the wheel family torch pins (nvidia-nccl-cu13)
    version: str
    replaced: str  # torch's own pin of `package`
    source: str  # the release's page on PyPI
    wheels: tuple[tuple[str, str], ...]  # (file, sha256) of the wheels that install on the image


def torch_nccl_pin(rel, s: Stack) -> Optional[str]:
    """The NCCL release torch pins in stack `s`: read from the PyPI default wheel, so unknown for
    another CUDA variant (it may bundle another)."""
    return rel.nccl if s.cuda == rel.default_cuda else None


def lock_with_nccl(m: Matrix, s: Stack, pin: Optional[str], req: Request, arch: str,
                   fabric: Fabric) -> tuple[Optional[Lock], Optional[NcclOverride]]:
    """The stack's lock, with the [nccl] section --nccl adds (and the override it records)."""
    lock = stack_lock(m, s, arch)
    override = _nccl_override(m, s, pin, lock, req.nccl, arch, fabric) if req.nccl else None
    if override:
        lock = lock.with_nccl(override.package, override.version, tuple(sha for _, sha in override.wheels),
                              (f"replaces {override.package}=={override.replaced}, the pin of torch {s.torch}: "
                               f"--nccl {override.version}", f"from {override.source}"))
    return lock, override


@dataclass(frozen=True)
class NcclChoices:
    """What `--nccl` may install in one stack's image for one CPU architecture."""

    stack: Stack
    arch: str
    package: Optional[str]  # the wheel family torch pins (nvidia-nccl-cu13), None where unknown
    pin: Optional[str]  # torch's own pin of it
    accepted: tuple[str, ...]  # the releases --nccl accepts, oldest first (torch's pin among them)
    unusable: Optional[str]  # why no --nccl can be used with the stack, and what to do instead


def nccl_choices(m: Matrix) -> list[NcclChoices]:
    """Each stack, for each CPU architecture it has a lock for (x86_64 where it has none): the
    NCCL releases --nccl accepts, decided by the rules that decide a render's (rules.accepted_nccl)."""
    out = []
    for s in m.stacks:
        pin = torch_nccl_pin(m.torch_release(s.torch), s)
        locks = {arch: stack_lock(m, s, arch) for arch in PLATFORMS}
        for arch in [a for a, lock in locks.items() if lock is not None] or ["x86_64"]:
            lock, package = locks[arch], m.nccl_package(s.torch)
            unusable = rules.nccl_unusable(m, s, pin, lock.pins() if lock else None)
            accepted = () if unusable else tuple(r.version for r in rules.accepted_nccl(m, s, package, pin, arch))
            out.append(NcclChoices(s, arch, package.package if package else None, pin, accepted, unusable))
    return out


def _nccl_override(m: Matrix, s: Stack, pin: Optional[str], lock: Optional[Lock], version: str, arch: str,
                   fabric: Fabric) -> Optional[NcclOverride]:
    """What --nccl installs (rules.select_nccl decides whether it may); None when it names the
    release torch pins already (one image, so one tag)."""
    package, release = rules.select_nccl(m, s, pin, lock.pins() if lock else None, version, arch, fabric)
    if Version(release.version) == Version(pin):
        return None
    wheels = rules.nccl_wheels(release, arch, m.bases.families[s.os].glibc, s.python)
    return NcclOverride(package=package.package, version=release.version, replaced=pin, source=release.source,
                        wheels=tuple((w.file, w.sha256) for w in wheels))
