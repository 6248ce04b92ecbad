"""Container engines behind one interface (:class:`Engine`); Docker is the one implemented.

``ENVBUILD_ENGINE`` picks one by name (default ``docker``).
"""

from __future__ import annotations

import os
from typing import Optional

from envbuild.base.errors import EnvbuildError, nearest
from envbuild.engine.base import (
    BuildFailed,
    BuildOutcome,
    BuildSecrets,
    Engine,
    ImageConfig,
    ImageInfo,
    RegistryError,
    RunResult,
    StepCallback,
)
from envbuild.oci.registry import registry_of

ENGINE_ENV = "ENVBUILD_ENGINE"


def _docker():
    # The Docker SDK loads only when an engine is used: `render` and `--help` never need it.
    from envbuild.engine.docker import DockerEngine  # noqa: PLC0415

    return DockerEngine()


ENGINES = {"docker": _docker}


def get_engine(name: Optional[str] = None) -> Engine:
    """The engine called `name` (default: $ENVBUILD_ENGINE, else docker)."""
    name = (name or os.environ.get(ENGINE_ENV) or "docker").strip().lower()
    if name not in ENGINES:
        close = nearest(name, list(ENGINES))
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise EnvbuildError(f"unknown container engine '{name}' (from {ENGINE_ENV}); {hint}"
                            f"envbuild knows: {', '.join(sorted(ENGINES))}.")
    return ENGINES[name]()


__all__ = ["BuildFailed", "BuildOutcome", "BuildSecrets", "Engine", "ImageConfig", "ImageInfo", "RegistryError", "RunResult",
           "StepCallback", "get_engine", "registry_of", "ENGINES", "ENGINE_ENV"]
