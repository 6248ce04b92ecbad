"""extensions.yaml's op_libraries, for any string (hypothesis): a path the catalogue accepts is a
shared library inside site-packages, which the build and the smoke test can hand to
torch.ops.load_library as site-packages/PATH; anything else is refused when the matrix loads."""

from __future__ import annotations

from pathlib import PurePosixPath

import yaml
from hypothesis import given, settings, strategies as st

from conftest import FIXTURE_MATRIX
from property_settings import EXAMPLES

_XFORMERS = next(e for e in yaml.safe_load((FIXTURE_MATRIX / "extensions.yaml").read_text())["extensions"]
                 if e["name"] == "xformers")
_SEGMENT = st.text(st.sampled_from("abcXY09_.-/\\ ;$`\n"), min_size=0, max_size=12)


def _accepted(lib: str) -> bool:
    from pydantic import ValidationError

    from envbuild.knowledge.matrix.files.extensions_yaml import CudaExtension

    try:
        CudaExtension.model_validate({**_XFORMERS, "op_libraries": [lib]})
    except ValidationError:
        return False
    return True


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(st.one_of(_SEGMENT.map(lambda s: s + ".so"), _SEGMENT, st.text(max_size=30)))
def test_an_accepted_op_library_stays_inside_site_packages(lib):
    if not _accepted(lib):
        return
    path = PurePosixPath(lib)
    assert not path.is_absolute() and ".." not in path.parts and lib.endswith(".so")
    assert all(part and not part.startswith(".") for part in lib.split("/"))
    assert not set(lib) - set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-/")
    site = PurePosixPath("/venv/site-packages")
    assert (site / lib).parent.is_relative_to(site)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,8}", fullmatch=True), min_size=0, max_size=3),
       st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,12}", fullmatch=True))
def test_a_plain_path_to_a_library_is_accepted(folders, name):
    assert _accepted("/".join([*folders, name + ".so"]))
