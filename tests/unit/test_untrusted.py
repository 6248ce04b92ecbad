"""The one parser of documents another machine or person wrote (envbuild/base/untrusted.py): every
hostile shape is an EnvbuildError (exit 2) naming the document, never a traceback."""

import json
import re

import pytest
from pydantic import BaseModel, ConfigDict

from conftest import ROOT
from envbuild.base.errors import EnvbuildError
from envbuild.base.files import parse_yaml
from envbuild.base.untrusted import loads_json, loads_yaml, validated

HOSTILE = {
    "deep list": b"[" * 100_000 + b"]" * 100_000,
    "deep object": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "5,000-digit integer": b'{"size": ' + b"9" * 5000 + b"}",
    "50-digit integer": b'{"size": ' + b"9" * 50 + b"}",
    "NaN": b'{"size": NaN}',
    "infinite float": b'{"size": 1e999}',
    "not UTF-8": b'{"a": "\xff"}',
    "NUL": b'{"a": "\x00"}',
    "truncated": b'{"a": [1, 2',
    "too many values": b"[" + b"[]," * 2_000_000 + b"[]]",
    "too large": b'"' + b"a" * (17 << 20) + b'"',
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_json_document_is_refused_naming_it(case):
    with pytest.raises(EnvbuildError) as e:
        loads_json(HOSTILE[case], "the record r.json")
    assert e.value.exit_code == 2 and e.value.message.startswith("the record r.json ")
    assert "\n" not in e.value.message


@pytest.mark.parametrize("text", ["a: " + "9" * 5000, "a: " + "9" * 50, "a: &x [1]\nb: *x", "a:" + " [" * 200 + " ]" * 200,
                                  "a: .nan", "a: [1, 2"])
def test_a_hostile_yaml_document_is_refused(text):
    with pytest.raises(EnvbuildError) as e:
        loads_yaml(text, "publish.yaml")
    assert e.value.message.startswith("publish.yaml ") and e.value.exit_code == 2


def test_a_plain_document_comes_back_as_parsed():
    doc = {"a": [1, 2.5, None, True, "x"], "b": {"c": -(10 ** 30)}}
    assert loads_json(json.dumps(doc).encode(), "r") == doc
    assert loads_yaml("a: [1, 2.5, null, true, x]\nb: {c: -1000000000000000000000000000000}\n", "y") == doc


class Base(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    image: str
    size: int


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    bases: list[Base]


def test_a_wrong_field_is_named_by_its_path():
    with pytest.raises(EnvbuildError) as e:
        validated(Record, {"bases": [{"image": "a", "size": 1}, {"image": 3, "size": 1}]}, "manifest.json")
    assert "'bases[1].image'" in e.value.message and e.value.message.startswith("manifest.json: ")


@pytest.mark.parametrize("text, said", [
    ("a: &x [1]\nb: *x", "an alias (*name)"),
    ("a:" + " [" * 64 + " 1" + " ]" * 64, "nesting deeper than 64 levels"),
    ("a:" + " [" * 100_000, "nesting deeper than 64 levels"),  # libyaml's own stack: refused before composing
    ("a: [1, 2", "is not valid YAML at line 1"),
])
def test_the_libyaml_path_refuses_as_the_bounded_loader_does(text, said):
    """parse_yaml takes libyaml only where a document is plainly within the bounds, so an alias,
    deep nesting or a broken document gets the bounded loader's own words, and never a crash."""
    with pytest.raises(EnvbuildError, match=re.escape(said)):
        parse_yaml(text, "publish.yaml")


def test_the_libyaml_path_gives_the_bounded_loaders_values_for_every_shipped_yaml_file():
    """Every YAML file this checkout ships or tests with reads the same through libyaml as through
    PyYAML's own loader (the matrix digest and every golden render hang on those values)."""
    import yaml

    from envbuild.base import files

    paths = sorted({*ROOT.glob("matrices/**/*.yaml"), *ROOT.glob("tests/fixtures/**/*.yaml")})
    assert len(paths) > 50 and files._LIBYAML is not None
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            expected = yaml.load(text, Loader=files._BoundedLoader)  # noqa: S506  (a SafeLoader)
        except (yaml.YAMLError, ValueError):
            continue
        assert parse_yaml(text, str(path)) == expected, path
