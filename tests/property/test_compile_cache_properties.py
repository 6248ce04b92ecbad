"""`--compile-cache` for any value (hypothesis): refused, or exactly one NAME=VALUE line per
variable lib.sh passes to sccache, so no input can set another. The rest of the compile cache
is tests/unit/test_compile_cache.py."""

from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st

from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.validate import compile_cache_secret
from property_settings import EXAMPLES


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.text(min_size=1, max_size=40), st.sampled_from(["redis://h:1/", "s3://bucket-name/", "redis://"]))
def test_any_value_is_refused_or_exactly_one_line_per_variable(tail, head):
    """Whatever follows, the secret's lines are NAME=VALUE of the variables lib.sh passes: no
    input adds a line, so none can set a variable sccache reads for something else."""
    try:
        text = compile_cache_secret(head + tail, {"AWS_REGION": tail})
    except EnvbuildError:
        return
    names = [line.split("=", 1)[0] for line in text.split("\n")]
    assert set(names) <= {"SCCACHE_REDIS_ENDPOINT", "SCCACHE_REDIS_USERNAME", "SCCACHE_REDIS_PASSWORD", "SCCACHE_REDIS_DB",
                          "SCCACHE_BUCKET", "SCCACHE_S3_KEY_PREFIX", "SCCACHE_REGION"}
    assert len(names) == len(set(names))
    assert not re.search(r"[\r\x00]", text)
