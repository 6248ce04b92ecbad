"""The OS lock, for any lock text and any request (hypothesis): what parses is apt's words only,
which os.sh reads as data, and every OS step of a plan asks only for its stage's inputs. The
grammar and refusals one by one are tests/unit/test_oslock.py."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from envbuild.knowledge import oslock
from envbuild.base.errors import EnvbuildError
from envbuild.plan import stack_plan
from envbuild.resolve.resolver import Request, resolve
from test_oslock import LOCKED_STACK, SHA, lock_text

_WORD = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Z", "Cc")), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(name=_WORD, version=_WORD, archive=_WORD, path=_WORD)
def test_every_accepted_line_is_words_the_shell_reads_as_data(name, version, archive, path):
    """Whatever a hostile or corrupt lock holds, what parses is made of apt's words only: os.sh
    reads the parts with `read` and awk, and hands them to apt, never to an eval."""
    text = lock_text(f"deb {name} amd64 {version} {SHA} 10 {archive} pool/{path}.deb", source=f"{archive} x1 / main")
    try:
        lock = oslock.parse_os_lock(text, "x.txt")
    except EnvbuildError:
        return
    part = lock.stage_part("builder", "http://h/{archive}/20261126T000000Z", "/k.gpg", False)
    for line in part.splitlines()[1:]:
        assert re.fullmatch(r"[A-Za-z0-9 ._+~:/{}=-]+", line), line


_REQUESTS = st.builds(
    lambda gpu, fabric, ops, no_compiler, keep: Request(gpu=gpu, stack=LOCKED_STACK, fabric=fabric, ds_ops=ops,
                                                        no_compiler=no_compiler, keep_toolchain=keep,
                                                        base_image="local/debian:bookworm"),
    st.sampled_from(["h20", "h100", "a100", "l40s"]), st.sampled_from([None, "none", "ib"]),
    st.sampled_from(["training", "none", "cpu_adam", "cpu_adam,async_io", "all"]), st.booleans(), st.booleans())


@settings(max_examples=40, deadline=None)
@given(request=_REQUESTS)
def test_every_os_step_of_any_request_installs_only_its_stages_inputs(matrix, request):
    """The lock holds the closure of everything any request may ask of a stage: every OS step a
    plan renders asks only for packages of its stage's inputs, and is given that stage's part."""
    try:
        r = resolve(matrix, request)
    except EnvbuildError:
        return  # a request the rules refuse renders nothing
    family = matrix.bases.families[r.stack.os]
    plan = stack_plan(r)
    stages = [("builder", plan.builder), ("runtime", plan.runtime)]
    for stage_name, stage in stages:
        for step in stage.steps:
            if step.name != "os":
                continue
            env = dict(step.env)
            part_stage = "builder" if "os-lock-builder" in env.get("ENVBUILD_OS_LOCK", "") else "runtime"
            assert set(step.args) <= set(oslock.stage_inputs(family, r.stack.python, part_stage)), (stage_name, step.args)
            assert "ENVBUILD_OS_LOCK" in env, f"an OS step of a locked stage without the lock: {step.args}"
