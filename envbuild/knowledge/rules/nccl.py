"""NCCL (nccl.yaml): which release ``--nccl`` may install in place of the NCCL torch pins (rule
nccl), its wheel for the image, and why a stack accepts none."""

from __future__ import annotations

from typing import Optional

from packaging.version import Version

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.rules.versions import contains


def _glibc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def nccl_wheels(release, cpu_arch: str, glibc: str, python: str) -> list:
    """The wheels of an NCCL release that install on the image: its CPU, a manylinux glibc no
    newer than the OS's, a Requires-Python that admits the stack's Python."""
    return [w for w in release.wheels
            if any(arch == cpu_arch and need <= _glibc(glibc) for arch, need in w.platforms())
            and (w.requires_python is None or contains(w.requires_python, python + ".0"))]


def nccl_rejection(m, s, package, pin: str, release, cpu_arch: str, fabric=None) -> Optional[str]:
    """Why NCCL `release` of wheel family `package` cannot replace torch's pin `pin` in an image of
    stack `s` (None: it can). NCCL keeps its ABI within a major (libnccl.so.2, `ncclGetVersion`)
    and adds to it with each minor, so a newer 2.x serves a torch built against an older one and
    an older one may lack a function torch calls."""
    why = _nccl_version_rejection(s, package, pin, release.version)
    if why:
        return why
    glibc = m.bases.families[s.os].glibc
    if not nccl_wheels(release, cpu_arch, glibc, s.python):
        return (f"PyPI has no {package.package} {release.version} wheel for {cpu_arch} with glibc <= {glibc} "
                f"({s.os}) and Python {s.python}")
    need = fabric.requires.nccl if fabric is not None and fabric.requires else None
    if need and not contains(need, release.version):
        return f"fabric {fabric.name} needs NCCL {need} ({fabric.requires.source})"
    return None


def _nccl_version_rejection(s, package, pin: str, version: str) -> Optional[str]:
    """What the version number alone rules out: another CUDA major, another ABI, older than the pin."""
    if package.cuda_major != s.cuda.split(".")[0]:
        return f"{package.package} is built for CUDA {package.cuda_major} and the stack's torch for CUDA {s.cuda}"
    if Version(version).major != Version(pin).major:
        return (f"NCCL {Version(version).major} is another ABI than the NCCL {Version(pin).major} torch {s.torch} "
                f"links (libnccl.so.{Version(pin).major})")
    if Version(version) < Version(pin):
        return (f"it is older than the NCCL {pin} torch {s.torch} pins, and torch may call what an older "
                f"release lacks")
    return None


def select_nccl(m, s, pin: Optional[str], locked: Optional[dict[str, str]], version: str, cpu_arch: str,
                fabric=None):
    """(wheel family, release) that `--nccl version` installs in stack `s`'s image in place of
    torch's pin; an EnvbuildError naming --nccl, why, and the nearest releases it accepts."""
    try:
        grammar.nccl_version(version)
    except grammar.GrammarError as e:
        raise grammar.refuse("--nccl", version, str(e), "give a release of matrices/nccl.yaml, such as 2.31.2, or "
                                                         "leave --nccl out for the NCCL torch pins.") from None
    package = m.nccl_package(s.torch)
    where = m.directory / "nccl.yaml"
    unusable = nccl_unusable(m, s, pin, locked)
    if unusable:
        raise EnvbuildError(f"--nccl {version} cannot be used with stack {s.id}: {unusable}")
    accepted = accepted_nccl(m, s, package, pin, cpu_arch, fabric)
    chosen = next((r for r in package.releases if Version(r.version) == Version(version)), None)
    why = (nccl_rejection(m, s, package, pin, chosen, cpu_arch, fabric) if chosen is not None else
           _nccl_version_rejection(s, package, pin, version)
           or f"PyPI has no {package.package} {version} (as of the matrix's {where.name})")
    if why is None:
        return package, chosen
    near = sorted(accepted, key=lambda r: (abs(_nccl_number(r.version) - _nccl_number(version)), Version(r.version)))
    choices = ", ".join(r.version for r in sorted(near[:3], key=lambda r: Version(r.version)))
    raise EnvbuildError(f"--nccl {version} is refused for stack {s.id} (torch {s.torch} pins {package.package} "
                        f"{pin}): {why}. Nearest releases it accepts: {choices or 'none'} (rule nccl; the releases "
                        f"are {where}); or leave --nccl out for torch's own.")


def nccl_unusable(m, s, pin: Optional[str], locked: Optional[dict[str, str]]) -> Optional[str]:
    """Why no --nccl can be used with stack `s` at all, and what to do instead (None: releases
    may replace torch's pin `pin`; `locked`: the stack lock's pins, None without a lock)."""
    package = m.nccl_package(s.torch)
    if pin is None or package is None:
        why = (f"the NCCL its torch {s.torch} (CUDA {s.cuda}) pins is not known: the matrix reads torch's pin "
               f"from its PyPI wheel, and this stack's torch comes from PyTorch's CUDA-variant index"
               if pin is None else f"{m.directory / 'nccl.yaml'} lists no NCCL wheel family for torch {s.torch} "
                                   f"(`envbuild matrix refresh --write` derives it where the matrix has an nccl.yaml)")
        return (f"{why}. Leave --nccl out for the NCCL torch pins, or pick a stack whose torch is the PyPI default "
                f"wheel (`envbuild nccl` lists the stacks and the releases each accepts).")
    if locked is None:
        return (f"it has no lock (matrices/locks), and --nccl replaces a pin of the stack's lock with another "
                f"hash-locked wheel. Leave --nccl out, or pick a locked stack (`envbuild lock --stack {s.id}` makes one).")
    if locked.get(package.package) != pin:
        return (f"its lock pins {package.package} {locked.get(package.package) or 'not at all'} and torch.yaml says "
                f"torch {s.torch} pins {pin}; refresh the lock (`envbuild lock --stack {s.id}`).")
    return None


def accepted_nccl(m, s, package, pin: str, cpu_arch: str, fabric=None) -> list:
    """The releases of wheel family `package` that may replace torch's pin in stack `s`'s image, oldest first."""
    return [r for r in package.releases if nccl_rejection(m, s, package, pin, r, cpu_arch, fabric) is None]


def _nccl_number(version: str) -> int:
    """A release as one number, for 'nearest' (2.31.2 -> 2031002)."""
    v = Version(version)
    return v.major * 1_000_000 + v.minor * 1_000 + v.micro
