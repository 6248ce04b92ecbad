"""`envbuild doctor`'s reading, for generated logs (hypothesis): a message wrapped at any terminal
width is still found whole, and the shortcut of the label pass loses no label. doctor against
the real logs is tests/behaviour/test_doctor.py."""

from hypothesis import given, settings, strategies as st

from envbuild.doctor import diagnose_text
from envbuild.doctor.ranks import RankStyle
from test_doctor import ISSUES, LOGS, by_id, wrapped


@given(st.integers(min_value=45, max_value=240))
@settings(max_examples=25, deadline=None)
def test_a_wrapped_message_is_found_at_any_width(width):
    """Every terminal width: the library and the symbol still come out whole."""
    text = (LOGS / "ragflow-4466-nvjitlink.log").read_text()
    finding = by_id(diagnose_text(wrapped(text, width), ISSUES), "undefined-symbol")
    assert "__nvJitLinkAddData_12_1" in finding.detail


@given(st.lists(st.sampled_from(["[rank1]:step 3", "[rank12]:x", "[default2]:y", "plain line",
                                 "x" * 45 + "[rank7]: deep in the line", "[pid 9] [rank3]:after a pid",
                                 "[rank0]:[rank5]: two prefixes"]), max_size=12),
       st.sets(st.sampled_from(["rank 0", "rank 1", "rank 3", "rank 7", "rank 12", "local rank 2"])))
@settings(max_examples=200, deadline=None)
def test_the_shortcut_of_labels_in_finds_what_the_exact_pass_finds(lines, known):
    """Skipping the exact prefix pass when every marker names a known label loses no label."""
    block = "\n".join(lines).encode()
    exact, _ = RankStyle().labels_in(block)
    quick, _ = RankStyle().labels_in(block, known, count=False)
    assert quick | known == exact | known
