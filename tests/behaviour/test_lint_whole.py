"""hadolint over every rendered Dockerfile of the fixture matrix (every stack x every GPU it
allows), not one of each shape as tests/behaviour/test_lint.py does in the fast suite: CI's
whole run (marked `whole`, which tests/conftest.py marks `docker` too)."""

import pytest

from test_lint import _hadolint
from test_lint import rendered  # noqa: F401  (fixtures)

pytestmark = pytest.mark.whole


def test_hadolint_every_dockerfile(rendered):  # noqa: F811
    _hadolint(rendered)
