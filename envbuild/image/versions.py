"""Version strings as the image reports them ('2.11.0+cu130', (2, 28, 9), '580.65.06')."""

from __future__ import annotations


def normalize_version(version: object) -> str:
    """'2.11.0+cu130' -> '2.11.0'; (2, 28, 9) -> '2.28.9': local build tags are not part of the pin."""
    if isinstance(version, (tuple, list)):
        version = ".".join(str(part) for part in version)
    return str(version).strip().split("+", 1)[0]


def major_minor(version: object) -> str:
    """'13.0.2' -> '13.0': CUDA is pinned by major.minor (torch.version.cuda has no patch)."""
    return ".".join(normalize_version(version).split(".")[:2])


def version_matches(expected: object, actual: object) -> bool:
    """True if every component of `expected` equals the same component of `actual` ('3.11' ~ '3.11.7')."""
    if actual is None:
        return False
    want = normalize_version(expected).split(".")
    have = normalize_version(actual).split(".")
    return len(have) >= len(want) and have[: len(want)] == want


def numeric_key(version: str) -> tuple[int, ...]:
    """'550.40.07' -> (550, 40, 7): driver versions compare numerically ('05' is 5, not octal)."""
    return tuple(int(part) for part in version.strip().split("."))


def older_than(version: str, floor: str) -> bool:
    """True if dotted numeric `version` is below `floor` ('535.104.05' < '580.65.06'); missing parts are 0."""
    have, want = numeric_key(version), numeric_key(floor)
    width = max(len(have), len(want))
    return have + (0,) * (width - len(have)) < want + (0,) * (width - len(want))
