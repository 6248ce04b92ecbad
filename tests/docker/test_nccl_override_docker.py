"""`--nccl` for real (opt-in, `-m docker`): the CI stack built with a newer NCCL than its torch
pins; the image holds that one wheel (no torch-pinned libnccl beside it), pip check passes, and
the smoke test's `nccl` check reports the overriding version as the library torch loaded.

`--ds-ops none`: what --nccl changes is the venv, not the ops (tests/docker/test_docker_e2e.py builds
those), so the build stays short on a two-core machine.
"""

from __future__ import annotations

import json

import pytest
from packaging.version import Version

import conftest
from conftest import remove_images, run_build, run_cli, unique

from envbuild.knowledge import rules
from envbuild.supply.ci import real_build_stack
from envbuild.knowledge.matrix import load_matrix

MATRIX = load_matrix()
STACK = real_build_stack(MATRIX)
REPO = unique("envbuild-nccl")
PIN = MATRIX.torch_release(STACK.torch).nccl


def newest_accepted() -> str:
    """The newest release of nccl.yaml the CI stack accepts: newer than torch's pin."""
    package = MATRIX.nccl_package(STACK.torch)
    accepted = [r.version for r in package.releases
                if rules.nccl_rejection(MATRIX, STACK, package, PIN, r, "x86_64") is None]
    return max(accepted, key=Version)


NEWER = newest_accepted()


@pytest.fixture(scope="module")
def built(docker_engine, tmp_path_factory):
    assert Version(NEWER) > Version(PIN), f"nccl.yaml has no release newer than torch {STACK.torch}'s pin {PIN}"
    work = tmp_path_factory.mktemp("nccl")
    state = {"ENVBUILD_STATE_DIR": str(work / "state")}
    out = work / "out"
    try:
        r = run_build("--gpu", "h20", "--stack", STACK.id, "--ds-ops", "none", "--nccl", NEWER,
                      "--image-repo", REPO, "-o", str(out), env=state)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        manifest = json.loads((out / "manifest.json").read_text())
        yield {"image": f"{REPO}:{manifest['tag']}", "manifest": manifest, "state": state}
    finally:
        remove_images(REPO)


def test_the_tag_and_manifest_name_the_override(built):
    m = built["manifest"]
    assert f"-h20-nccl{NEWER}-" in m["tag"] and m["nccl"] == NEWER  # then -ops-none
    assert m["nccl_override"]["replaced"] == PIN


def test_the_image_holds_only_the_override_and_pip_check_passes(built):
    package = MATRIX.nccl_package(STACK.torch).package
    probe = (f"from importlib import metadata; import json; print(json.dumps([metadata.version({package!r}), "
             f"[r for r in metadata.requires('torch') if r.startswith({package!r})]]))")
    version, requires = json.loads(conftest.docker("run", "--rm", built["image"], "python", "-c", probe,
                                                   timeout=300).stdout)
    assert version == NEWER and requires and all(f"=={NEWER}" in r for r in requires), requires
    r = conftest.docker("run", "--rm", built["image"], "pip", "check", check=False, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_smoke_reports_the_override_as_loaded(built):
    r = run_cli("smoke", built["image"], "--json", env=built["state"], timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["nccl"]["ok"] and checks["nccl"]["data"]["version"] == NEWER, checks["nccl"]
    assert "/nvidia/nccl/lib/libnccl.so" in checks["nccl"]["data"]["path"]
    assert checks["nccl_copies"]["ok"] and checks["nccl_copies"]["detail"].startswith("one NCCL in "), checks["nccl_copies"]
    assert checks["lock"]["ok"], checks["lock"]
