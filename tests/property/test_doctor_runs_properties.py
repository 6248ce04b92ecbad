"""`envbuild doctor` over flight-recorder dumps with anything in any field (hypothesis): exit 2 in
one paragraph naming the dump, or read or skipped with a line; never exit 70. The real dumps and
per-rank logs are tests/behaviour/test_doctor_runs.py."""

import json
import pickle
import re
import shutil
import sys

from hypothesis import given, settings, strategies as st

from property_settings import EXAMPLES
from test_doctor_runs import DUMPS, _one_paragraph

_HOSTILE_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([2 ** 64, -(10 ** 100), "HUGE"]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30).map(lambda t: t + "\nINJECTED\r\x1b]0;"),
)
_HOSTILE = st.recursive(_HOSTILE_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                        max_leaves=12)
_FIELDS = ["entries", "process_group", "collective_seq_id", "profiling_name", "state", "input_sizes", "pg_id", "pg_config",
           "pg_status", "version", "is_p2p", "p2p_seq_id"]


def _nested(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _huge(value):
    """`value` with "HUGE" as a 5,000-digit integer (which hypothesis could not print in a report)."""
    if value == "HUGE":
        return 10 ** 5000
    if isinstance(value, list):
        return [_huge(v) for v in value]
    return {k: _huge(v) for k, v in value.items()} if isinstance(value, dict) else value


def _hostile_dump(field_name: str, value, depth: int, form: str) -> bytes:
    """The never-entered dump of rank 0 with one field (of the dump or of its entries) replaced by
    `value`, a field nested `depth` deep, pickled or as JSON."""
    dump = pickle.loads((DUMPS / "never-entered" / "rank_0").read_bytes())  # a fixture this repository made
    value = _huge(value)
    dump["version"] = "2.10\nINJECTED"  # what the report quotes carries control characters in every example
    for entry in dump["entries"]:
        entry["profiling_name"] += "\nINJECTED\r\x1b[2K\x85"
    if field_name in ("entries", "pg_config", "pg_status", "version"):
        dump[field_name] = value
    else:
        for entry in dump["entries"]:
            entry[field_name] = value
    dump["extra"] = "DEEP"
    if form == "pickle":
        dump["extra"] = _nested(min(depth, 300))
        return pickle.dumps(dump, protocol=4)
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # a 5,000-digit integer written as JSON
    try:
        text = json.dumps(dump, default=str)
    finally:
        sys.set_int_max_str_digits(limit)
    return text.replace('"DEEP"', "[" * depth + "]" * depth).encode()


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(field_name=st.sampled_from(_FIELDS), value=_HOSTILE, depth=st.integers(0, 5000),
       form=st.sampled_from(["pickle", "json"]), named=st.booleans())
def test_any_hostile_dump_is_one_paragraph_or_a_skipped_line(tmp_path_factory, field_name, value, depth, form, named):
    """Wrong types, deep nesting, huge integers and control characters in any field of a dump:
    exit 2 in one paragraph naming the dump, or read (or skipped with a line) beside rank 1's good
    dump; never exit 70, and no line of the report is one a dump wrote."""
    from conftest import run_here

    d = tmp_path_factory.mktemp("dumps")
    (d / "rank_0").write_bytes(_hostile_dump(field_name, value, depth, form))
    shutil.copy(DUMPS / "never-entered" / "rank_1", d)
    r = run_here("doctor", str(d / "rank_0") if named else str(d), timeout=60)
    assert r.returncode in ((0, 2, 3) if named else (2, 3)), (r.returncode, r.stderr)
    if r.returncode == 2:
        _one_paragraph(r)
        assert "rank_0" in r.stderr
    elif not named:  # rank 0's dump read, or skipped with a line
        assert "dumps, ranks 0, 1;" in r.stdout or f"Skipped: {d / 'rank_0'}: " in r.stdout, r.stdout
    assert not any(line.lstrip().startswith("INJECTED") for line in (r.stdout + r.stderr).splitlines())
    assert not re.search("[\r\x1b\x85\u2028]", r.stdout + r.stderr)
