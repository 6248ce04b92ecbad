"""A hostile string in any field of a source-built fabric's `build:` block (the test fabric of
tests/fixtures/fabric-build, added to a copy of the fixture matrix): exit 2 naming fabrics.yaml
and nothing written, or a render whose files pass their linters and hold the value as text
(the step's words are shell-quoted, never code)."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from property_settings import examples
from test_fabric_build import matrix_with_test_fabric
from test_hostile_input import envbuild
from test_hostile_input_properties import HOSTILE, _leaves, refused_or_data_with

REQUEST = ["--gpu", "h20", "--fabric", "greet"]


def _build_fields(matrix_dir):
    data = yaml.safe_load((matrix_dir / "fabrics.yaml").read_text())
    return [path for path, _ in _leaves(data) if path[:3] == ("fabrics", len(data["fabrics"]) - 1, "build")]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    matrix_dir = matrix_with_test_fabric(tmp_path_factory.mktemp("b") / "m")
    out = matrix_dir.parent / "o"
    r = envbuild("render", *REQUEST, "--matrix-dir", str(matrix_dir), "-o", str(out))
    assert r.code == 0, r.err
    return {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.suffix in ("", ".def")}


@settings(max_examples=examples(40), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), value=HOSTILE)
def test_any_build_field_is_refused_naming_it_or_rendered_as_data(tmp_path_factory, baseline, data, value):
    matrix_dir = matrix_with_test_fabric(tmp_path_factory.mktemp("m") / "m")
    document = yaml.safe_load((matrix_dir / "fabrics.yaml").read_text())
    path = data.draw(st.sampled_from(_build_fields(matrix_dir)), label="field")
    refused_or_data_with(matrix_dir, "fabrics.yaml", document, path, value, REQUEST, baseline)
