"""`envbuild matrix refresh` against PyPI as it is today (opt-in: ENVBUILD_LIVE=1; marked `live`):
known facts still derive, and the committed matrix refreshes without a shape error. The refresh
on saved upstream data, offline, is tests/behaviour/test_refresh.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from conftest import ROOT
from envbuild.refresh import ds_history, torch_facts
from envbuild.refresh.cli import refresh
from envbuild.refresh.pypi import PyPI
from test_refresh import TRACKED_DS

pytestmark = pytest.mark.live


@pytest.mark.skipif(os.environ.get("ENVBUILD_LIVE") != "1", reason="set ENVBUILD_LIVE=1 to run against PyPI")
def test_live_pypi(tmp_path):
    """The real index: known facts still derive, and the committed matrix refreshes without
    a shape error (a diff is allowed: PyPI moves on)."""
    pypi = PyPI(Path(os.environ.get("ENVBUILD_LIVE_CACHE", tmp_path / "cache")))
    row = torch_facts.derive_release(pypi, Version("2.15.0")).fields
    assert (row["python"], row["default_cuda"], row["extension_lock"]) == (">=3.11,<3.16", "13.2", "flock")
    history = ds_history.derive(pypi, TRACKED_DS)
    assert history.ops["fp_quantizer"].since == "0.14.1" and history.ops["utils"].since == "0.17.1"
    assert history.ops["sparse_attn"].until == "0.19.7"
    shutil.copytree(ROOT / "matrices", tmp_path / "matrices")
    changes, _, _ = refresh(pypi, tmp_path / "matrices")
    assert all(yaml.safe_load(c.new) for c in changes)
