"""The request as error messages and `next:` lines print it, for any request (hypothesis): a
command line that resolves to the same tag, or is refused the same way. The rest of the
request's fields are tests/behaviour/test_request.py."""

from __future__ import annotations

import shlex

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE_MATRIX, run_here
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.matrix import load_matrix
from envbuild.knowledge.request import Request
from envbuild.resolve.resolver import resolve
from property_settings import examples


MATRIX = load_matrix(FIXTURE_MATRIX)


REQUESTS = st.builds(
    Request,
    gpu=st.sampled_from(sorted(g.name for g in MATRIX.gpus)[:12]),
    stack=st.one_of(st.none(), st.sampled_from(sorted(s.id for s in MATRIX.stacks))),
    python=st.sampled_from([None, "3.12", ">=3.11"]),
    cuda=st.sampled_from([None, "12.8", ">=13"]),
    fabric=st.sampled_from([None, "none", "aws-efa"]),
    extensions=st.sampled_from([(), ("flash-attn",), ("causal-conv1d", "flash-attn")]),
)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(REQUESTS)
def test_describe_picks_the_same_stack_and_tag_again(req):
    """What error messages and `next:` lines print as the request is a command line that resolves
    to the same tag (or is refused the same way)."""
    try:
        want = resolve(MATRIX, req).tag
    except EnvbuildError as e:
        want = e.message.split(":")[0]
    r = run_here("render", *shlex.split(req.describe()), "--print-tag", "--matrix-dir", str(FIXTURE_MATRIX))
    got = r.stdout.strip() if r.returncode == 0 else r.stderr.removeprefix("envbuild: error: ").split(":")[0]
    assert got == want, (req.describe(), r.stderr)
