"""Opt-in (ENVBUILD_FLASH_ATTN=1; hours on 2 cores, see bench/RESULTS.md): flash-attn 2 compiled
for real by `envbuild build --ext flash-attn` for one arch (h100, sm_90), on the newest stack the
rules allow it (torch 2.15 on NVIDIA's devel image, with upstream's C++20 fix applied as the
matrix's source patch; ENVBUILD_FA_STACK and ENVBUILD_FA_BASE name others: on a machine without
Docker Hub, ENVBUILD_FA_STACK=torch2.15-cu132-py3.11-pypi ENVBUILD_FA_BASE=local/debian:bookworm), then audited and smoke-tested. No GPU here: the import in the no-JIT sandbox and the SASS audit run;
the forward/backward check against scaled_dot_product_attention needs a GPU node.

The build's own record says how long it took, with how many jobs and how much memory:
the test prints it for bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os

import pytest
from packaging.version import Version

from conftest import docker, run_build, run_cli, unique

pytestmark = [
    pytest.mark.usefixtures("images_removed"),
    pytest.mark.skipif(os.environ.get("ENVBUILD_FLASH_ATTN") != "1",
                       reason="opt-in: compiles flash-attn (72 kernel files for sm_90); set ENVBUILD_FLASH_ATTN=1"),
]

STACK = os.environ.get("ENVBUILD_FA_STACK")  # default: the newest the rules allow for h100 + flash-attn
BASE = os.environ.get("ENVBUILD_FA_BASE")  # default: the stack's own base images
REPO = unique("envbuild-fa-test")


def test_flash_attn_builds_for_sm_90_only_imports_and_passes_the_smoke_test(tmp_path):
    out = tmp_path / "fa"
    r = run_build("--gpu", "h100", *(["--stack", STACK] if STACK else []), "--ds-ops", "cpu_adam", "--ext",
                  "flash-attn", "--image-repo", REPO, "-o", str(out), base_image=BASE, stack_bases=not BASE,
                  timeout=6 * 3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    image = f"{REPO}:{json.loads((out / 'manifest.json').read_text())['tag']}"
    (record,) = json.loads(docker("run", "--rm", image, "cat", "/opt/envbuild/built/extensions.json").stdout)
    print("flash-attn build record:", json.dumps(record["build"]), record["wheel"])
    assert record["version"] == "2.8.3.post2" and list(record["sass"].values()) == [["sm_90"]], record["sass"]
    torch = json.loads((out / "manifest.json").read_text())["torch"]
    assert bool(record["determines"].get("patches")) is (Version(torch) >= Version("2.13")), torch  # C++20
    smoke = run_cli("smoke", image, "--json", timeout=1800, env={"ENVBUILD_STATE_DIR": str(tmp_path / "state")})
    checks = {c["name"]: c for c in json.loads(smoke.stdout)["checks"]}
    assert smoke.returncode == 0 and checks["extensions"]["ok"], checks.get("extensions", smoke.stderr[-2000:])
