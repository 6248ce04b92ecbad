"""The matrix's NCCL variable patterns, for any value (hypothesis): what they accept NCCL reads the
same way in every release, in the cases NCCL's own comparison takes. The facts derived again
from their sources are tests/unit/test_matrix_sources.py."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envbuild.knowledge.matrix import load_matrix
from conftest import FIXTURE_MATRIX, ROOT
from property_settings import EXAMPLES
from test_matrix_sources import DOCUMENTED, nccl_debug_pattern_agrees, nccl_int_readers


@given(st.sampled_from(sorted(DOCUMENTED["NCCL_P2P_LEVEL"])), st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_a_level_in_another_case_is_refused(level, data):
    """Any spelling NCCL's strcmp would not match (ignored silently there) is refused here."""
    other = "".join(c.lower() if data.draw(st.booleans()) else c for c in level)
    grammar = load_matrix(FIXTURE_MATRIX).gpus_file.variables["NCCL_P2P_LEVEL"]
    assert (grammar.problem("NCCL_P2P_LEVEL", other) is None) == (other == level)


@given(st.sampled_from(["VERSION", "WARN", "INFO", "ABORT", "TRACE"]), st.lists(st.booleans(), min_size=7, max_size=7))
@settings(max_examples=EXAMPLES, deadline=None)
def test_nccl_debug_level_in_any_case_is_accepted(name, flips):
    """strcasecmp (and v2.30's iequals) take a level in any mix of cases; so does the pattern."""
    nccl_debug_pattern_agrees("".join(c.lower() if f else c for c, f in zip(name, flips)))


# What each value gpus.yaml accepts switches, in the words its `means` uses for it.
SWITCHED = {"NCCL_P2P_DISABLE": "P2P", "NCCL_SHM_DISABLE": "shared memory", "NCCL_IB_DISABLE": "InfiniBand/RoCE",
            "NCCL_NVLS_ENABLE": "NVLS"}


@pytest.mark.parametrize("name", sorted(SWITCHED))
@given(value=st.sampled_from(["0", "1", "2", "-1", "01", "0x1", " 1", "1 ", "1abc", "true", "yes", "on", "", "00"])
       | st.text(alphabet="012x+- abt", max_size=4))
@settings(max_examples=EXAMPLES, deadline=None)
def test_switch_patterns_accept_only_values_that_mean_what_means_says(name, value):
    """NCCL reads any leading integer (strtol/strtoll, base 0) and text as 0, so `[01]` is the
    documented values by choice: each value the pattern accepts is read the same way by every
    release, and `means` names what it does ("1 (P2P off)"); the source text says it is a choice."""
    grammar = load_matrix(ROOT / "matrices").gpus_file.variables[name]
    assert "strtol" in grammar.source and "documented" in grammar.source
    if re.fullmatch(grammar.pattern, value):
        effects = {r[name](value) for r in nccl_int_readers().values()}
        assert len(effects) == 1 and effects != {"auto"}, effects
        said = re.search(rf"(?<![0-9]){re.escape(value)} \(([^)]*)\)", grammar.means)
        assert said and said.group(1).startswith(f"{SWITCHED[name]} {effects.pop()}"), grammar.means
