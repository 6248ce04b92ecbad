"""A real SIGINT before every filesystem call of a render's write, not one of each kind as
tests/process/test_output_failures.py does in the fast suite: CI's whole run (marked `whole`,
which tests/conftest.py marks `docker` too)."""

from __future__ import annotations

import pytest

from test_output_failures import SIGNALS, _ctrl_c_at
from test_output import h100, h20  # noqa: F401  (fixtures)

pytestmark = pytest.mark.whole


@SIGNALS
def test_a_ctrl_c_at_any_filesystem_call_of_the_write_completes_or_restores(h100, h20, tmp_path, monkeypatch, signals):  # noqa: F811
    _ctrl_c_at(lambda names: range(1, len(names) + 1), h100, h20, tmp_path, monkeypatch, signals)
