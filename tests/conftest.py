"""Shared fixtures. Tests marked `docker` need the engine, registry and base image that
scripts/host-setup.sh starts; the rest run anywhere in seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def matrix():
    from envbuild.matrix import load_matrix

    return load_matrix()


def run_cli(*args, cwd=None, env=None, timeout=120):
    """Run the real console entry point in a subprocess (exit codes, stderr, no traceback)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("ENVBUILD_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "envbuild", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def tree(path: Path) -> dict[str, bytes]:
    """All files under path, relative path -> bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def matrix_copy(tmp_path):
    """A writable copy of the built-in matrix, for tests that break it on purpose."""
    d = tmp_path / "matrices"
    shutil.copytree(ROOT / "matrices", d)
    return d
