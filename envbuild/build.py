"""Build images with BuildKit: secrets for mirrors and CAs, progress, logs, tags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class BuildSecrets:
    """Mirror URLs and an extra CA, handed to the build as BuildKit secrets only.

    They are never rendered into a file of the build directory, a layer, the history or a
    label: setup.sh reads them from /run/secrets inside one RUN step.
    """

    ca_cert: Optional[Path] = None
    pip_index_url: Optional[str] = None
    torch_index_url: Optional[str] = None
    apt_mirror: Optional[str] = None
