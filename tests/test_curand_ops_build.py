"""Opt-in (ENVBUILD_CURAND_OPS=1; 13 minutes on 2 cores with the lower layers cached, see bench/RESULTS.md): four of the five
DeepSpeed ops that link -lcurand, built for real on the CI stack (PyPI toolchain, torch 2.15,
whose wheels bring no cuRAND) for H20 (sm_90). The lock's [curand] section must reach the venv,
every op must be recorded as pre-built for CUDA and load in the smoke test's no-JIT sandbox
(libcurand.so.10 found through the ops' RUNPATH), and the image must hold exactly one libcurand.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import BASE_IMAGE, ci_stack_id, docker, run_build, run_cli, unique

pytestmark = [
    pytest.mark.docker,
    pytest.mark.usefixtures("images_removed"),
    pytest.mark.skipif(os.environ.get("ENVBUILD_CURAND_OPS") != "1",
                       reason="opt-in: builds the four cuRAND ops of the CI stack (15 minutes or more); set "
                              "ENVBUILD_CURAND_OPS=1"),
]

REPO = unique("envbuild-curand-test")
# fp_quantizer, the fifth op that links -lcurand, is refused on this stack's CUDA 13.2 (its
# sources do not compile with nvcc 13.2: deepspeed.yaml says why).
OPS = ("random_ltd", "stochastic_transformer", "transformer", "transformer_inference")


def test_the_curand_ops_build_and_load_without_jit(tmp_path):
    out = tmp_path / "curand"
    args = ("--gpu", "h20", "--stack", ci_stack_id(), "--ds-ops", ",".join(OPS))
    r = run_build(*args, "--image-repo", REPO, "-o", str(out), base_image=BASE_IMAGE, timeout=4 * 3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["ds_ops"]) == sorted(OPS)
    image = f"{REPO}:{manifest['tag']}"
    smoke = run_cli("smoke", image, "--json", timeout=1800, env={"ENVBUILD_STATE_DIR": str(tmp_path / "state")},
                    production=True)
    checks = {c["name"]: c for c in json.loads(smoke.stdout)["checks"]}
    print("no_jit:", checks["no_jit"]["detail"])
    assert smoke.returncode == 0 and checks["no_jit"]["ok"] and checks["ds_record"]["ok"], checks
    parts = {part.split()[0]: part for part in checks["no_jit"]["detail"].split("; ")}
    assert all(parts[op].startswith(f"{op} ok") for op in OPS), parts
    # One libcurand, the lock's, where the ops' RUNPATH points; and its size, for bench/RESULTS.md.
    found = docker("run", "--rm", "--network", "none", "--entrypoint", "/bin/sh", image, "-c",
                   "find / -xdev -name 'libcurand.so*' -exec du -bL {} +; "
                   "du -sbL /opt/venv/lib/python3.11/site-packages/deepspeed/ops").stdout
    print("sizes:", found)
    libs = [line.split()[1] for line in found.splitlines() if "libcurand" in line]
    assert len(libs) == 1 and libs[0].endswith("nvidia/cu13/lib/libcurand.so.10"), found
    size = docker("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()
    print("image bytes:", size)
