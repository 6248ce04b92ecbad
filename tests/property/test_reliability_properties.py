"""The output-directory rules for any sequence of renders, user edits, user files and left-over
temporaries (hypothesis): a user's file is never changed or removed, and a render either
succeeds with exactly its files plus the user's or refuses with exit 2 and changes nothing."""

import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_reliability import _listing, _temporaries, _verifies


FILES = st.dictionaries(st.sampled_from(["Dockerfile", "a/b.sh", "a/c.txt", "d/e/f", "manifest.json"]),
                        st.binary(max_size=8), min_size=1)
ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("render"), FILES),
    st.tuples(st.just("edit"), st.sampled_from(["Dockerfile", "a/b.sh", "d/e/f"])),
    st.tuples(st.just("user"), st.sampled_from(["build.log", "a/mine.txt", "x.sif"])),
    st.tuples(st.just("stale"), st.sampled_from(["Dockerfile", "a/b.sh"])),
), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_output_directory_rules_hold_for_any_sequence(tmp_path_factory, actions):
    """Whatever renders, user edits, user files and left-over temporaries come in whatever order:
    a user's file is never changed or removed; a render either succeeds (then the tree is
    exactly its files plus the user's, and the record verifies) or refuses with exit 2 and
    changes nothing."""
    from envbuild.base.errors import EnvbuildError
    from envbuild.render.output import recorded_files, write_build_dir

    out = tmp_path_factory.mktemp("prop") / "out"
    user: dict[str, bytes] = {}
    for kind, arg in actions:
        if kind == "render":
            before = _listing(out) if out.exists() else None
            try:
                write_build_dir(arg, out)
            except EnvbuildError:
                assert (_listing(out) if out.exists() else None) == before
                continue
            assert _verifies(out) and _temporaries(out) == []
            for rel, data in arg.items():
                assert (out / rel).read_bytes() == data
        elif kind == "edit" and (out / arg).is_file():
            (out / arg).write_bytes((out / arg).read_bytes() + b"edited")
            user[arg] = (out / arg).read_bytes()
        elif kind == "user" and out.is_dir() and not os.path.lexists(out / arg):
            (out / arg).parent.mkdir(parents=True, exist_ok=True)
            if not (out / arg).parent.is_dir():
                continue
            (out / arg).write_bytes(b"user")
            user[arg] = b"user"
        elif kind == "stale" and arg in recorded_files(out) and (out / arg).parent.is_dir():
            (out / arg).parent.joinpath(f".{Path(arg).name}.envbuild-tmp-0123abcd").write_bytes(b"left by a kill")
        for rel, data in user.items():
            assert (out / rel).read_bytes() == data, rel
    # what a killed run left is gone once a render succeeds in that directory
