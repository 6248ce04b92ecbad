"""Deciding an op's CUDA bound from any compile outcomes (hypothesis): the oldest rejecting release
when no newer one accepts, otherwise no bound made up. The parsing of real nvcc logs is
tests/unit/test_op_bounds.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envbuild.base.errors import EnvbuildError
from envbuild.refresh import op_bounds
from envbuild.refresh.op_bounds import ReleaseResult


OUTCOMES = st.lists(st.sampled_from(["accepts", "rejects", "not-tried"]), min_size=1, max_size=8)


@given(OUTCOMES)
def test_any_outcomes_give_the_oldest_rejecting_release_or_refuse(outcomes):
    """The bound is <X.Y, X.Y the oldest rejecting release, exactly when no newer release
    tried accepts; otherwise (or nothing tried) no bound is made up."""
    results = [ReleaseResult(f"13.{i}", f"13.{i}", o) for i, o in enumerate(outcomes)]
    tried = [(i, o) for i, o in enumerate(outcomes) if o != "not-tried"]
    first = next((i for i, o in tried if o == "rejects"), None)
    if not tried or (first is not None and any(o == "accepts" for i, o in tried if i > first)):
        with pytest.raises(EnvbuildError):
            op_bounds.decide_bound(results, "op")
        return
    assert op_bounds.decide_bound(results, "op") == ("" if first is None else f"<13.{first}")
