"""`envbuild doctor --manifest` for any NCCL value an image's manifest holds (hypothesis): only a
dotted version reaches the regular expression it is compared through. The signature on real
logs is tests/behaviour/test_doctor_image.py."""

from __future__ import annotations

import json
import os
import re
import tempfile

import pytest
from hypothesis import assume, given, strategies as st

from envbuild.doctor import read_image
from envbuild.base.errors import EnvbuildError


@given(st.one_of(st.text(max_size=24), st.integers(), st.floats(), st.lists(st.integers(), max_size=3)))
def test_an_nccl_that_is_not_a_version_is_refused(value):
    """The value is compared through a regular expression: only a dotted version may get there."""
    assume(not (isinstance(value, str) and re.fullmatch(r"\d+(?:\.\d+){1,3}", value)))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "manifest.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"torch": "2.5.1", "nccl": value}, handle)
        with pytest.raises(EnvbuildError, match="not a version such as 2.21.5"):
            read_image(path)
