"""`envbuild ext-cache save|load` on the real BuildKit cache mount (scripts/host-setup.sh's engine):
the compiled extension wheels saved on one machine are loaded into an empty cache. The file
checks, which need no engine, are in tests/behaviour/test_extcache.py."""

from __future__ import annotations

import os
import secrets
import subprocess
import tarfile

from conftest import BASE_IMAGE as BASE  # scripts/host-setup.sh's debootstrap image: sh, GNU cp, tar
from conftest import DOCKER, docker, run_cli
from envbuild.builds import extcache
from envbuild.image import paths
from envbuild.base.buildcache import EXTENSION_CACHE_ID


def _in_cache(script: str) -> None:
    """Run `script` in a build step with the extension cache mounted (what extensions.py sees)."""
    context = {"Dockerfile": f"FROM {BASE}\nARG RUN\nRUN --mount=type=cache,id={EXTENSION_CACHE_ID},"
                             f"target={paths.EXTENSION_CACHE},sharing=locked sh -c '{script}'\n"}
    proc = subprocess.run([DOCKER, "build", "--network", "host", "--build-arg", f"RUN={secrets.token_hex(4)}",
                           "-o", "type=tar,dest=/dev/null", "-"], input=context["Dockerfile"], text=True,
                          capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})  # DOCKER_HOST kept
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_wheels_saved_on_one_machine_are_loaded_into_an_empty_cache_and_a_kept_wheel_wins(tmp_path):
    """save -> the key's wheel removed (a fresh runner) -> load puts it back, stamp and all; a
    second load moves nothing (the key has a wheel); an unfinished compile's tree is not saved."""
    docker("info")
    name = f"envbuild-test-{secrets.token_hex(4)}"
    key = f"{paths.EXTENSION_CACHE}/{name}/00112233aabbccdd"
    wheel = f"{key}/pkg-1.0-cp311-cp311-linux_x86_64.whl"
    try:
        _in_cache(f"mkdir -p {key}/partial && echo wheel > {wheel} && echo stamp > {key}/pkg-1.0-cp311-cp311-linux_x86_64.sha256 "
                  f"&& echo object > {key}/partial/flash_fwd.o")
        file = tmp_path / "ext-cache.tar"
        saved = run_cli("ext-cache", "save", str(file), "--base-image", BASE, timeout=600)
        assert saved.returncode == 0, saved.stderr
        mine = [w for w in extcache.wheels_in(file) if w.startswith(name + "/")]
        assert mine == [f"{name}/00112233aabbccdd/pkg-1.0-cp311-cp311-linux_x86_64.whl"], saved.stdout
        with tarfile.open(file) as tar:
            assert not [m for m in tar.getnames() if "partial" in m]
        _in_cache(f"rm -rf {paths.EXTENSION_CACHE}/{name}")
        loaded = run_cli("ext-cache", "load", str(file), "--base-image", BASE, timeout=600)
        assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr
        _in_cache(f"test \"$(cat {wheel})\" = wheel && test -f {key}/pkg-1.0-cp311-cp311-linux_x86_64.sha256")
        again = run_cli("ext-cache", "load", str(file), "--base-image", BASE, timeout=600)
        assert again.returncode == 0 and again.stdout.startswith("loaded 0 of"), again.stdout
        # a second save replaces the file it wrote
        assert run_cli("ext-cache", "save", str(file), "--base-image", BASE, timeout=600).returncode == 0
    finally:
        _in_cache(f"rm -rf {paths.EXTENSION_CACHE}/{name}")
