"""`--nccl VERSION` under generated input: only the version grammar reaches a generated file, and
anything outside it is refused before anything is resolved or written
(tests/behaviour/test_nccl_override.py has the rest of --nccl)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from conftest import FIXTURE_MATRIX

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge import rules
from envbuild.knowledge.matrix import load_matrix

H20_STACK = "torch2.11-cu130-py3.12"  # the fixture matrix's default for h20: torch 2.11.0 pins nvidia-nccl-cu13 2.28.9


@given(st.text(max_size=12))
def test_only_the_version_grammar_reaches_a_generated_file(text):
    """Whatever --nccl is given, it is a MAJOR.MINOR.PATCH[.postN] of digits or a GrammarError."""
    try:
        grammar.nccl_version(text)
    except grammar.GrammarError:
        return
    head, _, post = text.partition(".post")
    assert all(part.isdigit() and part.isascii() for part in head.split(".")) and len(head.split(".")) == 3
    assert not post or post.isdigit()


@given(st.from_regex(r"[0-9.a-z;$ `'\n-]{1,14}", fullmatch=True))
def test_a_version_outside_the_grammar_is_refused_before_anything_is_resolved_or_written(text):
    try:
        grammar.nccl_version(text)
        return
    except grammar.GrammarError:
        pass
    m = load_matrix(FIXTURE_MATRIX)  # cached by the loader
    with pytest.raises(EnvbuildError, match="--nccl .*MAJOR.MINOR.PATCH"):
        rules.select_nccl(m, m.stack(H20_STACK), "2.28.9", {}, text, "x86_64")
