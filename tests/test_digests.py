"""Base images pinned by digest where one can be known (envbuild/digests.py), against the
real local registry that scripts/host-setup.sh starts (Debian's docker-registry)."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import run_cli

REGISTRY = "127.0.0.1:5000"
BASE = "local/debian:bookworm"  # imported by debootstrap: no registry digest


def docker(*args):
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600, check=True)


@pytest.mark.docker
def test_a_named_base_in_a_registry_is_pinned_by_digest_and_an_imported_one_says_it_is_not(tmp_path):
    mirror = f"{REGISTRY}/envbuild-digest-test/debian:bookworm"
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
