"""The catalogues' format matchers, for any values a component fills in (hypothesis): the line
it prints is matched by the expression of its format. The drift checks themselves are
tests/unit/test_catalogue_drift.py."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from property_settings import EXAMPLES
from envbuild.doctor.said import to_regex


SPECIFIERS = {"%d": st.integers(-2**31, 2**31 - 1), "%u": st.integers(0, 2**32), "%lu": st.integers(0, 2**64),
              "%zu": st.integers(0, 2**64), "%x": st.integers(0, 2**32), "%lx": st.integers(0, 2**64),
              "%s": st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12),
              "%p": st.integers(1, 2**48), "%.2f": st.floats(0, 1e6, allow_nan=False)}


def _c_render(spec: str, value) -> str:
    """What glibc's printf writes for these conversions (Python's % has no length modifiers or %p)."""
    if spec == "%p":
        return hex(value)
    return (spec.replace("l", "").replace("z", "")) % value


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.one_of(st.text("abcXYZ :/=()[]<>-_.,'", min_size=1, max_size=8),
                          st.sampled_from(sorted(SPECIFIERS))), min_size=1, max_size=6).flatmap(
    lambda parts: st.tuples(st.just(parts), st.tuples(*[SPECIFIERS[p] if p in SPECIFIERS else st.just(p)
                                                        for p in parts]))))
def test_any_printf_rendering_is_matched_by_its_format_s_matcher(case):
    """Whatever values NCCL fills in, the line it prints is matched by the expression of its format."""
    import re
    parts, values = case
    fmt = "".join(p.replace("%", "%%") if p not in SPECIFIERS else p for p in parts)
    line = "".join(_c_render(p, v) if p in SPECIFIERS else p for p, v in zip(parts, values))
    assert re.search(to_regex(fmt), line), (fmt, line)
