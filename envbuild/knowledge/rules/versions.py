"""Version arithmetic every family shares: a user's version or specifier, a range holding a
version, a pin's lowest release, a compute capability as a number pair."""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from envbuild.base.errors import EnvbuildError


def mm(version: str) -> str:
    """'13.0.2' -> '13.0'."""
    v = Version(version)
    return f"{v.major}.{v.minor}"


def compute_capability(text: str) -> tuple[int, int]:
    """'9.0' -> (9, 0), to compare compute capabilities as numbers."""
    major, minor = text.split(".")
    return int(major), int(minor)


def user_specifier(flag: str, text: str) -> SpecifierSet:
    """Parse a user's --torch/--cuda/--python/--deepspeed value.

    A bare version means that release line: ``2.5`` is ``==2.5.*``, ``2.5.1`` is
    ``==2.5.1``; anything else must be a PEP 440 specifier.
    """
    raw = text.strip().split("+", 1)[0]  # '2.11.0+cu130' (torch.__version__) means 2.11.0
    try:
        v = Version(raw)
    except InvalidVersion:
        v = None
    if v is not None and raw[:1].isdigit():
        plain = not (v.is_prerelease or v.is_postrelease or v.is_devrelease)
        return SpecifierSet(f"=={raw}.*" if plain and len(v.release) < 3 else f"=={raw}")
    try:
        spec = SpecifierSet(raw)
    except InvalidSpecifier:
        raise EnvbuildError(
            f"{flag} '{text}' is neither a version nor a PEP 440 specifier; examples: "
            f"{flag} 2.11, {flag} 2.11.0, {flag} '>=2.5,<2.8'.") from None
    if not str(spec):
        raise EnvbuildError(f"{flag} is empty; give a version like 2.11 or a specifier like '>=2.5'.")
    return spec


def contains(spec: str | SpecifierSet, version: str) -> bool:
    return SpecifierSet(str(spec)).contains(Version(version), prereleases=True)


def lowest_pinned_version(requirement: str) -> str:
    """The version a pin installs at least: '==3.3.1' -> '3.3.1', '~=3.8.0' -> '3.8.0'.

    >>> lowest_pinned_version("~=3.8.0")
    '3.8.0'
    """
    for spec in SpecifierSet(requirement):
        if spec.operator in ("==", "===", "~=", ">="):
            return spec.version.removesuffix(".*")
    raise ValueError(f"{requirement!r} pins no version")


def pin_overlaps(requirement: str, accepted: str) -> bool:
    """Can a version satisfying torch's `requirement` (a pin) also satisfy `accepted`?

    >>> pin_overlaps("~=3.8.0", ">=2.3,<3.3"), pin_overlaps("==3.1.0", ">=3.0,<3.2")
    (False, True)
    """
    return contains(accepted, lowest_pinned_version(requirement))
