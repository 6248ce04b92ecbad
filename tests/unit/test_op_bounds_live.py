"""deepspeed.yaml's CUDA bound of fp_quantizer derived again by compiling with PyPI's nvcc (opt-in:
ENVBUILD_LIVE=1, about 4 GB of downloads and a few minutes of nvcc; marked `live`). The parsing
and deciding on saved nvcc logs, offline, is tests/unit/test_op_bounds.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import ROOT
from envbuild.refresh import op_bounds

pytestmark = pytest.mark.live


@pytest.mark.skipif(os.environ.get("ENVBUILD_LIVE") != "1", reason="set ENVBUILD_LIVE=1 to compile with PyPI's nvcc")
def test_live_the_fp_quantizer_bound_derives_again_from_pypi(tmp_path):
    """Downloads the sdist, torch's headers and each release's nvcc and headers, compiles."""
    from envbuild.refresh.pypi import PyPI

    deepspeed, torch, ops = op_bounds.pinned(ROOT / "matrices")
    work = Path(os.environ.get("ENVBUILD_LIVE_CACHE", tmp_path)) / "op-bounds"
    bound, results = op_bounds.derive(PyPI(work / "pypi-cache"), work, deepspeed, torch, "fp_quantizer")
    assert bound == ops["fp_quantizer"]["cuda"], op_bounds.describe(results)
    assert all(e.line in (234, 413) for r in results for e in r.errors), op_bounds.describe(results)
