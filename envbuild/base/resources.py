"""Where the shipped data lives: inside the wheel, or at the top of a source checkout."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # envbuild/, where the wheel puts the data
# doctor's knowledge in a matrix directory: the curated signatures and the catalogues of what each
# component can print. Neither reaches an image (knowledge/matrix/core.py NOT_IN_IMAGES).
KNOWN_ISSUES = "known_issues.yaml"
CATALOGUES = "catalogues"


def _find(name: str) -> Path:
    # The wheel force-includes templates/ and matrices/ into the package; a source
    # checkout (editable install, tests) keeps them at the repository top.
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"envbuild data directory '{name}' not found next to {_PKG}")


def matrices_dir() -> Path:
    return _find("matrices")


def is_installed_copy(directory: Path) -> bool:
    """Whether `directory` is the matrix shipped inside the installed package (site-packages):
    envbuild reads it, but a lab's edits and locks belong in a matrix directory it owns."""
    return Path(directory).resolve() == (_PKG / "matrices").resolve()


def templates_dir() -> Path:
    return _find("templates")
