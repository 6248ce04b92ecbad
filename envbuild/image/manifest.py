"""The image's manifest.json: what was built, read by the smoke test and the node checks."""

from __future__ import annotations

import json
import os

from . import paths

REQUIRED_KEYS = ("python", "torch", "cuda", "deepspeed", "ds_ops")


class UsageError(Exception):
    """A problem with how the smoke test was called (exit 2), not with the image."""


def manifest_path(explicit: str | None = None, environ=None) -> str:
    """--manifest, else $ENVBUILD_MANIFEST, else the image's own manifest."""
    environ = os.environ if environ is None else environ
    return explicit or environ.get(paths.MANIFEST_ENV) or paths.MANIFEST


def load_manifest(path: str) -> dict:
    """Read the manifest; a missing or malformed one is a usage error, not a failed image."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise UsageError(f"manifest not found: {path} (use --manifest PATH or {paths.MANIFEST_ENV})") from None
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read manifest {path}: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"manifest {path} is not a JSON object")
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise UsageError(f"manifest {path} lacks keys: {', '.join(missing)}")
    return data
