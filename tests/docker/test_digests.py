"""Base images pinned by digest where one can be known (envbuild/builds/digests.py), against the
real local registry that scripts/host-setup.sh starts (Debian's docker-registry), under a
repository name of this run's own (the registry and the engine are shared)."""

from __future__ import annotations

import functools
import json

import pytest

import conftest
from conftest import BASE_IMAGE as BASE  # imported by debootstrap: no registry digest
from conftest import run_cli, unique

REGISTRY = "127.0.0.1:5000"
MIRROR = f"{REGISTRY}/{unique('envbuild-digest-test')}/debian"

docker = functools.partial(conftest.docker, timeout=600)


@pytest.fixture(autouse=True, scope="module")
def _mirror_removed():
    """The mirror's tags go with the module (the engine's copy of the base stays: the base holds it)."""
    yield
    conftest.remove_images("debian", registry=MIRROR.rsplit("/", 1)[0])


def test_a_named_base_in_a_registry_is_pinned_by_digest_and_an_imported_one_says_it_is_not(tmp_path):
    mirror = f"{MIRROR}:bookworm"
    docker("tag", BASE, mirror)
    pushed = docker("push", mirror).stdout
    digest = next(word for word in pushed.split() if word.startswith("sha256:"))
    out = tmp_path / "pinned"
    result = run_cli("render", "--gpu", "h20", "--stack", "torch2.11-cu130-py3.11-pypi", "--base-image", mirror,
                     "-o", str(out))
    assert result.returncode == 0, result.stderr
    dockerfile = (out / "Dockerfile").read_text()
    assert f"FROM {mirror}@{digest} AS builder" in dockerfile and f"FROM {mirror}@{digest} AS runtime" in dockerfile
    assert json.loads((out / "manifest.json").read_text())["base_images"]["runtime"] == f"{mirror}@{digest}"
    # Known only by the registry (this machine's Docker forgets the pushed name): still pinned.
    docker("rmi", mirror)
    out2 = tmp_path / "remote"
    assert run_cli("render", "--gpu", "h20", "--stack", "torch2.11-cu130-py3.11-pypi", "--base-image", mirror,
                   "-o", str(out2)).returncode == 0
    assert f"FROM {mirror}@{digest} AS runtime" in (out2 / "Dockerfile").read_text()
    # An imported image has no registry digest: a tag, and the render says so.
    out3 = tmp_path / "imported"
    result = run_cli("render", "--gpu", "h20", "--stack", "torch2.11-cu130-py3.11-pypi", "--base-image", BASE,
                     "-o", str(out3))
    assert f"FROM {BASE} AS runtime" in (out3 / "Dockerfile").read_text()
    assert result.stderr.count(f"{BASE} is pinned by tag only") == 1


def test_lock_bases_records_the_published_digest_and_renders_pin_to_it(tmp_path):
    """The matrix's own base, on a registry this machine reaches (the local one standing in
    for Docker Hub, which it cannot): `envbuild lock --bases` records its digest, a render
    pins FROM to it; a registry that does not answer keeps what was recorded."""
    import shutil

    import yaml

    from conftest import FIXTURE_MATRIX

    mirror = f"{MIRROR}:bookworm-slim"
    docker("tag", BASE, mirror)
    digest = next(word for word in docker("push", mirror).stdout.split() if word.startswith("sha256:"))
    matrix_dir = tmp_path / "m"
    shutil.copytree(FIXTURE_MATRIX, matrix_dir)
    stacks = yaml.safe_load((matrix_dir / "stacks.yaml").read_text())
    row = next(s for s in stacks["stacks"] if s["id"] == "torch2.11-cu130-py3.11-pypi")
    row["base_images"] = {"builder": mirror, "runtime": mirror}
    (matrix_dir / "stacks.yaml").write_text(yaml.safe_dump(stacks, sort_keys=False))
    result = run_cli("lock", "--bases", "--stack", row["id"], "--matrix-dir", str(matrix_dir), timeout=300)
    assert f"base      {mirror}  {digest}" in result.stdout, result.stdout + result.stderr
    recorded = yaml.safe_load((matrix_dir / "base-digests.yaml").read_text())["bases"]
    assert recorded[mirror]["digest"] == digest
    out = tmp_path / "out"
    assert run_cli("render", "--gpu", "h20", "--stack", row["id"], "-o", str(out),
                   env={"ENVBUILD_MATRIX_DIR": str(matrix_dir)}).returncode == 0
    assert f"FROM {mirror}@{digest} AS builder" in (out / "Dockerfile").read_text()
