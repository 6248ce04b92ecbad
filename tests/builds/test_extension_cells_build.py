"""Opt-in (ENVBUILD_EXT_CELLS=fa4,te,mamba or all): one real cell of each extension issue 42 added,
built by `envbuild build --ext ...` on the CI stack for the H20 (sm_90) with this machine's base,
then audited in the build (SASS per arch, NEEDED CUDA libraries of the image's major, torch's
symbols) and smoke-tested here without a GPU (the import in the no-JIT sandbox, the lock, each
extension present and fitting). The numerics checks against torch need a GPU node.

Cells (what each costs on 2 cores is in docs/testing.md, with the date it last ran):
- fa4: FlashAttention 4, PyPI's pure-Python wheel and its locked CuTe DSL closure, by hash;
- te: Transformer Engine's cu13 core wheel and its torch binding compiled from the sdist;
- mamba: mamba-ssm's selective scan compiled for sm_90, beside causal-conv1d (17 min cold here).
xformers is not a cell: its PyPI wheel is CUDA 12 (torch >= 2.10), the CI stack is CUDA 13 (there it is
a source build of hundreds of kernels), and no CUDA 12 stack builds on this machine: those stacks'
base is NVIDIA's devel image, which it cannot pull, and the PyPI toolchain is CUDA 13 only (rule
`toolchain`: the CUDA 12 nvcc wheels hold no bin/nvcc, no CUDA 12 wheel holds cuobjdump). What a
cell needs, and what the wheel passed outside a build here: docs/extensions.md.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import ci_stack_id, docker, run_build, run_cli, unique

REPO = unique("envbuild-ext-cells")
CELLS = {"fa4": ("flash-attn-4",), "te": ("transformer-engine-cu13", "transformer-engine-torch"),
         "mamba": ("causal-conv1d", "mamba-ssm")}
WANTED = {c.strip() for c in os.environ.get("ENVBUILD_EXT_CELLS", "").split(",") if c.strip()}
if "all" in WANTED:
    WANTED = set(CELLS)

pytestmark = [pytest.mark.usefixtures("images_removed")]


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_one_cell_builds_passes_its_audit_and_the_cpu_smoke_test(cell, tmp_path):
    if cell not in WANTED:
        pytest.skip(f"opt-in: set ENVBUILD_EXT_CELLS={cell} (or all) to build {', '.join(CELLS[cell])} for real")
    out = tmp_path / cell
    r = run_build("--gpu", "h20", "--stack", ci_stack_id(), "--ds-ops", "cpu_adam,fused_adam",
                  "--ext", ",".join(CELLS[cell]), "--image-repo", REPO, "-o", str(out), timeout=8 * 3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    image = f"{REPO}:{json.loads((out / 'manifest.json').read_text())['tag']}"
    records = json.loads(docker("run", "--rm", image, "cat", "/opt/envbuild/built/extensions.json").stdout)
    print(f"{cell} build records:", json.dumps([{k: e.get(k) for k in ("name", "wheel", "build", "sass")}
                                                for e in records]))
    assert sorted(e["name"] for e in records) == sorted(CELLS[cell])
    device = {(e["name"], lib): arches for e in records for lib, arches in e["sass"].items() if arches}
    for where, arches in device.items():  # host-only libraries (TE's binding) and FA4's pure Python have none
        assert "sm_90" in arches or "sm_90a" in arches, (where, arches)
    assert device or cell == "fa4", records  # TE's core and mamba's scan carry device code
    smoke = run_cli("smoke", image, "--json", timeout=1800, env={"ENVBUILD_STATE_DIR": str(tmp_path / "state")},
                    production=True)
    checks = {c["name"]: c for c in json.loads(smoke.stdout)["checks"]}
    assert smoke.returncode == 0 and checks["extensions"]["ok"], checks.get("extensions", smoke.stderr[-2000:])
    for name in CELLS[cell]:
        assert name in checks["extensions"]["detail"], checks["extensions"]
