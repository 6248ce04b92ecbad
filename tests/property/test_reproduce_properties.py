"""`envbuild rebuild` of any hostile record (hypothesis, issue 40): exit 2 naming the field, with
nothing written, built or asked of an engine. `diff` and `rebuild` otherwise are
tests/behaviour/test_reproduce.py."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE_MATRIX
from property_settings import EXAMPLES
from test_hostile_input import envbuild, refused
from test_hostile_input_properties import HOSTILE
from test_reproduce import BIG, DEEP, no_engine_work, with_field


INJECT = ["\nRUN touch /PWNED", "\n%post\ntouch /PWNED", "$(touch PWNED)", "${{ github.event.issue.title }}", "'",
          '"', "`id`", "\n"]
INJECTED = st.tuples(HOSTILE, st.sampled_from(INJECT), HOSTILE).map("".join)  # never a value any field takes
WRONG = st.sampled_from([0, -1, 1.5, True, [], {}, ["x"], {"a": "b"}])
TEXT_FIELDS = ["envbuild", "tag", "image", "base_images.builder", "base_images.runtime", "matrix.sha256",
               "render.sha256", "request.gpu", "request.stack", "request.base_image", "request.builder_image",
               "request.ds_ops", "request.image_repo", "request.cpu_target", "request.fabric", "request.torch",
               "request.nccl", "extend.from"]


HOSTILE_RECORDS = st.one_of(
    st.tuples(st.sampled_from(TEXT_FIELDS), INJECTED | WRONG),
    st.tuples(st.just("request.extensions"), INJECTED.map(lambda v: [v]) | st.sampled_from(["flash-attn", 1, {}])),
    st.tuples(st.just("request.env"), INJECTED.map(lambda v: [["NCCL_DEBUG", v]]) | INJECTED.map(lambda v: [[v, "1"]])
              | st.sampled_from(["A=1", [["A"]], [["A", 1]], [[1, 2]], 5])),
    st.tuples(st.just("request.keep_toolchain"), st.sampled_from(["yes", 1, 0, [], "true"])),
    st.tuples(st.sampled_from(["request", "matrix", "render", "base_images", "extend"]),
              st.sampled_from(["x", 1, ["gpu"], True])),
    st.tuples(st.sampled_from(["schema", "request.gpu", "base_images.builder", "matrix.sha256", "request.env"]),
              st.sampled_from([BIG, DEEP])),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=HOSTILE_RECORDS)
def test_any_hostile_record_is_refused_naming_the_field_before_any_engine_work(tmp_path_factory, case):
    """Issue 40: a newline in a base reached the Dockerfile and was built; a wrong type, deep
    nesting or a 5,000-digit integer was exit 70. Every one is exit 2 naming the field (the
    document, for what the bounded parser refuses), with nothing written, built or asked."""
    path, value = case
    work = tmp_path_factory.mktemp("record")
    (work / "manifest.json").write_text(with_field(path, value))
    with no_engine_work() as (engine, stops):
        r = envbuild("rebuild", str(work / "manifest.json"), "--matrix-dir", str(FIXTURE_MATRIX), "-o", str(work / "out"))
    assert engine.calls == [] and stops == [], (path, value, engine.calls, stops)
    if value in (BIG, DEEP):
        refused(r, "manifest.json", "digits" if value == BIG else "nests deeper")
    else:
        refused(r, path.split(".")[0] if path.startswith("request.") else path)
    assert sorted(p.name for p in work.iterdir()) == ["manifest.json"]
