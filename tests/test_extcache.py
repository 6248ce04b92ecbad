"""`envbuild ext-cache save|load`: the compiled extension wheels carried between machines. The
file checks need no engine; the round trip runs on the real BuildKit cache mount (docker)."""

from __future__ import annotations

import io
import secrets
import shutil
import subprocess
import tarfile

import pytest

from conftest import docker, run_cli
from envbuild import extcache
from envbuild.errors import EnvbuildError
from envbuild.image import paths
from envbuild.matrix import load_matrix
from envbuild.plan import EXTENSION_CACHE_ID

BASE = "local/debian:bookworm"  # scripts/host-setup.sh's debootstrap image: sh, GNU cp, tar


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


class NoEngine:
    """Stands in where the engine must not be reached: the input is refused first."""

    def build(self, *args, **kwargs):
        raise AssertionError("the engine was used for an input that should have been refused")


def test_a_saved_file_lists_its_wheels_by_name_and_cache_key(tmp_path):
    file = _tar(tmp_path / "c.tar", {extcache.MARKER: b"", "flash-attn/0123456789abcdef/f-2.8-cp311.whl": b"w",
                                     "flash-attn/0123456789abcdef/f-2.8-cp311.sha256": b"s\n"})
    assert extcache.wheels_in(file) == ("flash-attn/0123456789abcdef/f-2.8-cp311.whl",)


@pytest.mark.parametrize("content, words", [
    (None, "no such file"),
    (b"root:x:0:0:root:/root:/bin/bash\n", "is not a tar file"),
    ({"notes.txt": b"mine"}, "a tar file envbuild did not write"),
    ({extcache.MARKER: b"", "../../etc/cron.d/x": b"* * * * * root sh"}, "path outside its directory"),
])
def test_load_refuses_a_file_save_did_not_write_before_reaching_the_engine(tmp_path, content, words):
    file = tmp_path / "ext-cache.tar"
    if isinstance(content, bytes):
        file.write_bytes(content)
    elif content is not None:
        _tar(file, content)
    with pytest.raises(EnvbuildError) as refused:
        extcache.load(file, BASE, engine=NoEngine())
    assert words in refused.value.message and refused.value.exit_code == 2
    assert "ext-cache save" in refused.value.message


def test_save_never_replaces_a_file_envbuild_did_not_write(tmp_path):
    mine = _tar(tmp_path / "backup.tar", {"notes.txt": b"mine"})
    before = mine.read_bytes()
    r = run_cli("ext-cache", "save", str(mine), "--base-image", BASE)
    assert r.returncode == 2 and "refusing to replace it, and nothing was written" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and mine.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.tar"]


def test_the_copy_runs_on_the_stacks_builder_base_by_default():
    m = load_matrix()
    newest = m.stacks[-1]
    assert extcache.copy_image(m).split("@")[0] == newest.base_images.builder
    with pytest.raises(EnvbuildError) as refused:
        extcache.copy_image(m, "torch9.9-cu999")
    assert "unknown stack 'torch9.9-cu999'" in refused.value.message


@pytest.mark.parametrize("steps", [extcache.SAVE_STEPS, extcache.LOAD_STEPS], ids=["save", "load"])
def test_both_copy_dockerfiles_pass_hadolint_and_use_the_builds_cache_mount(tmp_path, steps):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(extcache.dockerfile("debian:bookworm-slim@sha256:" + "0" * 64, steps))
    r = subprocess.run([shutil.which("hadolint"), "--no-color", "--failure-threshold", "style", str(dockerfile)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    # the mount the extensions step writes (plan.py renders the same id and target)
    assert f"--mount=type=cache,id={EXTENSION_CACHE_ID},target={paths.EXTENSION_CACHE},sharing=locked" in steps


# ---------------------------------------------------------------- the real cache mount


def _in_cache(script: str) -> None:
    """Run `script` in a build step with the extension cache mounted (what extensions.py sees)."""
    context = {"Dockerfile": f"FROM {BASE}\nARG RUN\nRUN --mount=type=cache,id={EXTENSION_CACHE_ID},"
                             f"target={paths.EXTENSION_CACHE},sharing=locked sh -c '{script}'\n"}
    proc = subprocess.run(["/usr/bin/docker", "build", "--network", "host", "--build-arg", f"RUN={secrets.token_hex(4)}",
                           "-o", "type=tar,dest=/dev/null", "-"], input=context["Dockerfile"], text=True,
                          capture_output=True, env={"DOCKER_BUILDKIT": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.docker
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
