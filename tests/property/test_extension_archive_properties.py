"""A hostile string in any field of FA3's `archives` (extensions.yaml, with the cutlass archive
pinned so that it renders): exit 2 naming extensions.yaml and nothing written, or a render
whose files pass their linters and hold the value as data (extensions.json, never a command)."""

from __future__ import annotations

import shutil

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE_MATRIX
from property_settings import examples
from test_extension_archives import pinned_text
from test_hostile_input import envbuild
from test_hostile_input_properties import HOSTILE, _leaves, refused_or_data_with

REQUEST = ["--gpu", "h100", "--ext", "fa3"]


def _pinned_matrix(folder):
    shutil.copytree(FIXTURE_MATRIX, folder)
    path = folder / "extensions.yaml"
    path.write_text(pinned_text(path.read_text(), "ab" * 32))
    return folder


def _archive_fields(document) -> list[tuple]:
    at = next(i for i, e in enumerate(document["extensions"]) if e["name"] == "flash-attn-3")
    return [path for path, _ in _leaves(document) if path[:3] == ("extensions", at, "archives")]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    matrix_dir = _pinned_matrix(tmp_path_factory.mktemp("b") / "m")
    out = matrix_dir.parent / "o"
    r = envbuild("render", *REQUEST, "--matrix-dir", str(matrix_dir), "-o", str(out))
    assert r.code == 0, r.err
    return {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.suffix in ("", ".def")}


@settings(max_examples=examples(30), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), value=HOSTILE)
def test_any_archive_field_is_refused_naming_it_or_rendered_as_data(tmp_path_factory, baseline, data, value):
    matrix_dir = _pinned_matrix(tmp_path_factory.mktemp("m") / "m")
    document = yaml.safe_load((matrix_dir / "extensions.yaml").read_text())
    path = data.draw(st.sampled_from(_archive_fields(document)), label="field")
    refused_or_data_with(matrix_dir, "extensions.yaml", document, path, value, REQUEST, baseline)
