"""The vulnerability gate's allowlist, for any advisory id (hypothesis): an id is either refused
or usable, never half taken. The gate itself, on real advisories, is tests/behaviour/test_audit.py."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_an_advisory_id_is_either_refused_or_usable(text):
    from envbuild.supply.audit import ADVISORY_ID, AllowFile
    from pydantic import ValidationError

    try:
        AllowFile.model_validate({"allow": [{"id": text, "reason": "r", "expires": "2099-01-01"}]})
    except ValidationError:
        return
    assert ADVISORY_ID.match(text) and "\n" not in text and " " not in text
