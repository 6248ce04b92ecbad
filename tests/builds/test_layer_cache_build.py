"""Opt-in (ENVBUILD_LAYER_CACHE=1; about 12 minutes after the image, and 40 GB of disk): a publish
job's layer cache (envbuild/builds/build.py LayerCache) and compile cache (Redis) for real. The
e2e image of tests/docker/test_docker_e2e.py (its module fixtures, built here when this module
runs alone) is built with both and its builder stage pushed; a second, empty Docker engine then
builds the same directory with no RUN step executed and the same content, and the pushed builder
stage holds no secret. Without an engine: tests/behaviour/test_layer_cache.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import conftest
from conftest import BASE_IMAGE, run_cli, unique
from test_docker_e2e import REGISTRY, REPO, _secret_hits, docker
from test_docker_e2e import compile_cache, credential, h20, state, test_ca, work  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(os.environ.get("ENVBUILD_LAYER_CACHE") != "1",
                                reason="opt-in: a second, empty Docker engine pulls the e2e image from the layer cache "
                                       "(about 12 minutes after the image, and 40 GB of disk: the engine and the "
                                       "pushed builder stage); set ENVBUILD_LAYER_CACHE=1")


@pytest.fixture
def empty_engine(tmp_path):
    """A Docker engine of its own (data root, containerd, socket), empty: what a fresh CI runner
    has. It holds only the base image, loaded from this engine (no registry serves local/debian)."""
    exec_root = Path(f"/run/envbuild-e2-{conftest.RUN_ID}")
    host = f"unix://{exec_root}.sock"
    log = open(tmp_path / "dockerd.log", "w")
    proc = subprocess.Popen(["/usr/sbin/dockerd", "--data-root", str(tmp_path / "data"), "--exec-root",
                             str(exec_root), "-H", host, "--pidfile", str(tmp_path / "dockerd.pid"),
                             "--iptables=false", "--bridge=none", "--storage-driver=overlay2"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {**os.environ, "DOCKER_HOST": host}
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([conftest.DOCKER, "info"], env=env, capture_output=True).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "dockerd.log").read_text()[-2000:]
            time.sleep(0.5)
        save = subprocess.Popen([conftest.DOCKER, "save", BASE_IMAGE], stdout=subprocess.PIPE)
        subprocess.run([conftest.DOCKER, "load", "-q"], stdin=save.stdout, env=env, check=True, capture_output=True)
        assert save.wait() == 0
        yield host
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()
        shutil.rmtree(tmp_path / "data", ignore_errors=True)
        for leftover in (exec_root, Path(f"{exec_root}.sock")):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)


def test_an_unchanged_image_is_pulled_from_the_layer_cache_on_an_empty_engine(h20, test_ca, credential, work,  # noqa: F811
                                                                             empty_engine, monkeypatch, compile_cache):  # noqa: F811
    """What `publish --job` does with its layer cache (envbuild/builds/build.py LayerCache) and the
    compile cache (Redis): the first engine builds with them and pushes the builder stage and the
    image; an empty engine then builds the same directory with no RUN step executed (no compiler,
    no download) and the same content, and the pushed builder stage holds no secret."""
    from envbuild.knowledge.validate import compile_cache_secret

    from envbuild.builds.build import LayerCache, build_image
    from envbuild.engine import BuildSecrets
    from envbuild.engine.docker import DockerEngine

    cache_repo = f"{REGISTRY}/{unique('envbuild-cache')}"
    cache = LayerCache(builder=f"{cache_repo}:h20-amd64-builder", final=f"{cache_repo}:h20-amd64")
    idx = credential["indexes"]
    secrets_ = BuildSecrets(ca_cert=test_ca["bundle"], pip_index_url=idx["--pip-index-url"],
                            torch_index_url=idx["--torch-index-url"], apt_mirror=idx["--apt-mirror"],
                            compile_cache=compile_cache_secret(compile_cache["url"], {}))
    said: list[str] = []
    try:
        cold = build_image(h20["out"], "layer-cache-cold", REPO, secrets_, cache=cache, say=said.append)
        assert said == [f"layer cache: the builder stage is {cache.builder}"], said
        docker("tag", cold.image_id, cache.final)
        docker("push", cache.final, timeout=1800)
        from envbuild.supply.jobplan import _held_refs  # what `publish --plan` reports
        assert _held_refs(REGISTRY, [cache.builder, cache.final, f"{cache_repo}:absent"]) == {
            cache.builder: True, cache.final: True, f"{cache_repo}:absent": False}

        monkeypatch.setenv("DOCKER_HOST", empty_engine)  # the CLI, the SDK and docker() below: the empty engine
        warm = build_image(h20["out"], "layer-cache-warm", REPO, secrets_, engine=DockerEngine(), cache=cache,
                           say=said.append)
        ran = [name for name, _ in warm.steps if " RUN " in f" {name} "]
        assert ran == [], f"steps that ran on the empty engine: {ran}"
        docker("tag", warm.image_id, f"{cache_repo}:warm")
        docker("push", f"{cache_repo}:warm", timeout=1800)
        monkeypatch.delenv("DOCKER_HOST")

        r = run_cli("diff", cache.final, f"{cache_repo}:warm", timeout=1800)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        docker("pull", cache.builder, timeout=1800)
        needles = ([m.encode() for m in test_ca["markers"]] + [t.encode() for t in credential["tokens"]]
                   + [compile_cache["password"].encode()])
        assert _secret_hits(cache.builder, needles) == []
    finally:
        monkeypatch.delenv("DOCKER_HOST", raising=False)
        docker("rmi", cache.final, cache.builder, f"{cache_repo}:warm", check=False)
