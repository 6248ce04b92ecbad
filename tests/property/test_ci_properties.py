"""`envbuild ci` with any hostile publish.yaml (hypothesis): refused naming the field, and no
workflow written (issue 40). The generated workflows themselves are tests/behaviour/test_ci.py."""

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE_MATRIX
from property_settings import EXAMPLES
from test_hostile_input import envbuild, refused
from test_hostile_input_properties import HOSTILE


INJECT = ["$(touch PWNED)", "${{ github.event.issue.title }}", "\nRUN touch PWNED", '"', "'", "`id`", ": x", "\n",
          "{a: b}", "#x", " ", "$"]
INJECTED = st.tuples(HOSTILE, st.sampled_from(INJECT), HOSTILE).map("".join)
GOOD = {"registry": "ghcr.io/$OWNER", "image_repo": "envbuild", "gpus": ["h100"],
        "runners": {"x86_64": "ubuntu-latest", "aarch64": "ubuntu-24.04-arm"},
        "extensions": {"flash-attn": ["h100"]}, "extension_runners": {"flash-attn": "big-x86"}}
FIELDS = ["registry", "image_repo", "runners.x86_64", "runners.aarch64", "extension_runners.flash-attn"]
HOSTILE_PUBLISH = st.one_of(
    st.tuples(st.sampled_from(FIELDS), INJECTED | st.sampled_from([1, 1.5, True, [], {}, ["x"], 10 ** 60])),
    st.tuples(st.sampled_from(["gpus", "runners", "extensions"]), st.sampled_from(["h100", 1, [[["x"]]]])),
)


def _publish_text(path: str, value) -> str:
    import yaml

    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    key, _, sub = path.partition(".")
    if sub:
        doc[key][sub] = value
    else:
        doc[key] = value
    return yaml.safe_dump(doc, width=1 << 20)


@pytest.fixture(scope="module")
def ci_matrix(tmp_path_factory):
    d = tmp_path_factory.mktemp("ci") / "matrices"
    shutil.copytree(FIXTURE_MATRIX, d)
    return d


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=HOSTILE_PUBLISH)
def test_any_hostile_publish_yaml_is_refused_naming_the_field_and_writes_no_workflow(ci_matrix, tmp_path_factory,
                                                                                    case):
    """Issue 40: `registry` went into a `run:` line (`$(...)` ran on the runner, `${{ }}` was expanded
    into the script) and `runners` unquoted into the YAML (exit 0, a workflow that does not parse)."""
    path, value = case
    (ci_matrix / "publish.yaml").write_text(_publish_text(path, value))
    out = tmp_path_factory.mktemp("wf")
    r = envbuild("ci", "--matrix-dir", str(ci_matrix), "-o", str(out / "publish.yml"))
    refused(r, "publish.yaml", path.split(".")[0])
    assert list(out.iterdir()) == []
