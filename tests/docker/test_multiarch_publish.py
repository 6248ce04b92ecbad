"""Multi-arch tags against the real local registry (scripts/host-setup.sh): push by platform,
merge one manifest list, verify it, and refuse what would publish an untested platform or cut
one off. The images are two tiny FROM-scratch images (amd64 and arm64, no emulation needed);
their smoke records are written here instead of by a smoke run (nothing in them can run):
what is under test is how push/merge/verify read records and manifest lists, not the smoke test.
The full arm64 image with a real smoke run is tests/builds/test_arm64_build.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess

import pytest

import conftest
from conftest import DOCKER, remove_images, run_cli, unique
from envbuild.supply.publish import DOCKER_LIST, OCI_INDEX, served_images

REGISTRY = "127.0.0.1:5000"
REPO = unique("envbuild-mtest")  # in the shared registry: this run's own, nothing an earlier run left


docker = functools.partial(conftest.docker, timeout=300)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two single-platform images, tagged REPO:a (amd64) and REPO:b (arm64)."""
    context = tmp_path_factory.mktemp("mtest")
    (context / "hello").write_text("envbuild multi-arch test\n")
    (context / "Dockerfile").write_text("FROM scratch\nCOPY hello /hello\n")
    made = {}
    for tag, platform in (("a", "linux/amd64"), ("b", "linux/arm64")):
        subprocess.run([DOCKER, "build", "-q", "--platform", platform, "-t", f"{REPO}:{tag}", str(context)],
                       check=True, capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})  # DOCKER_HOST kept
        made[platform] = docker("image", "inspect", "--format", "{{.Id}}", f"{REPO}:{tag}").stdout.strip()
    yield made
    remove_images(REPO)


def _record(state, image_id, platform, ok=True):
    path = state / "smoke" / (image_id.split(":", 1)[1] + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"image": "x", "image_id": image_id, "platform": platform, "ok": ok, "checks": []}))
    return path


def _digest(result) -> str:
    return next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("digest "))


def test_push_by_platform_merge_and_verify(images, tmp_path):
    state = tmp_path / "state"
    env = {"ENVBUILD_STATE_DIR": str(state)}
    for platform, image_id in images.items():
        _record(state, image_id, platform)
    pushed = {}
    for tag, platform in (("a", "linux/amd64"), ("b", "linux/arm64")):
        r = run_cli("push", f"{REPO}:{tag}", "--registry", REGISTRY, "--by-platform", env=env)
        assert r.returncode == 0, r.stderr
        assert f"pushed {REGISTRY}/{REPO}:{tag}-{platform.split('/')[1]}" in r.stdout
        assert f"platform {platform}" in r.stdout
        pushed[platform] = _digest(r)

    merged = run_cli("push", f"{REPO}:multi", "--registry", REGISTRY, "--merge", pushed["linux/amd64"],
                     "--merge", pushed["linux/arm64"], env=env)
    assert merged.returncode == 0, merged.stderr
    served = served_images(REGISTRY, REPO, "multi")
    assert {(i.platform, i.digest, i.config) for i in served} == {
        ("linux/amd64", pushed["linux/amd64"], images["linux/amd64"]),
        ("linux/arm64", pushed["linux/arm64"], images["linux/arm64"])}
    raw = subprocess.run(["curl", "-sf", "-H", f"Accept: {DOCKER_LIST}, {OCI_INDEX}",
                          f"http://{REGISTRY}/v2/{REPO}/manifests/multi"], capture_output=True, text=True)
    assert json.loads(raw.stdout)["mediaType"] in (DOCKER_LIST, OCI_INDEX)
    assert run_cli("push", f"{REPO}:multi", "--registry", REGISTRY, "--verify", env=env).returncode == 0

    # A plain push of one platform's image over the multi-arch tag would cut the other off.
    docker("tag", f"{REPO}:a", f"{REPO}:multi")
    flatten = run_cli("push", f"{REPO}:multi", "--registry", REGISTRY, env=env)
    assert flatten.returncode == 1 and "also holds linux/arm64" in flatten.stderr, flatten.stderr

    # The smoke record is per platform image: without the arm64 one, verify and merge refuse.
    (state / "smoke" / (images["linux/arm64"].split(":", 1)[1] + ".json")).unlink()
    verify = run_cli("push", f"{REPO}:multi", "--registry", REGISTRY, "--verify", env=env)
    assert verify.returncode == 1 and "no smoke test has been recorded" in verify.stderr
    again = run_cli("push", f"{REPO}:multi2", "--registry", REGISTRY, "--merge", pushed["linux/amd64"],
                    "--merge", pushed["linux/arm64"], env=env)
    assert again.returncode == 1 and "no smoke test" in again.stderr

    # A record of another platform does not vouch for an entry the list names arm64.
    _record(state, images["linux/arm64"], "linux/amd64")
    wrong = run_cli("push", f"{REPO}:multi2", "--registry", REGISTRY, "--merge", pushed["linux/arm64"], env=env)
    assert wrong.returncode == 1 and "is linux/amd64" in wrong.stderr, wrong.stderr
    two = run_cli("push", f"{REPO}:multi2", "--registry", REGISTRY, "--merge", pushed["linux/amd64"],
                  "--merge", pushed["linux/amd64"], env=env)
    assert two.returncode == 1 and "two images for linux/amd64" in two.stderr
