"""Opt-in (ENVBUILD_ALL_OPS=1; about an hour on 2 cores, see bench/RESULTS.md): `--ds-ops all`
of the CI stack built for real, for H20 (sm_90). Every op the rules select must build, be
recorded as pre-built for CUDA, and load in the smoke test's no-JIT sandbox; every op they leave
out must be left out with its reason, before the build. An op the matrix offers that cannot build
here fails this test, not a user's build (its first run found async_io's `-lcuda`).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import BASE_IMAGE, build_ops_image, ci_stack_id, run_cli, unique

pytestmark = [
    pytest.mark.usefixtures("images_removed"),
    pytest.mark.skipif(os.environ.get("ENVBUILD_ALL_OPS") != "1",
                       reason="opt-in: builds every DeepSpeed op of the CI stack (about an hour); set ENVBUILD_ALL_OPS=1"),
]

BASE = os.environ.get("ENVBUILD_ALL_OPS_BASE", BASE_IMAGE)
REPO = unique("envbuild-allops-test")


def test_every_op_all_selects_builds_and_loads_without_jit(tmp_path):
    args = ("--gpu", "h20", "--stack", ci_stack_id(), "--ds-ops", "all")
    plan = run_cli("render", *args, "--base-image", BASE, "--json", "-o", str(tmp_path / "plan"), production=True)
    assert plan.returncode == 0, plan.stderr
    selected = json.loads(plan.stdout)
    ops = selected["ds_ops"]
    assert len(ops) > 10 and all(d["reason"] for d in selected["ds_ops_dropped"]), selected["ds_ops_dropped"]
    _, parts = build_ops_image(args, ops, REPO, tmp_path, BASE)
    # No GPU driver here: only an op linked with -lcuda may be left unloaded, and it says so.
    assert {op for op, part in parts.items() if "not loaded here" in part} <= {"async_io"}, parts
