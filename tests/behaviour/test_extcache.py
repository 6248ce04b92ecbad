"""`envbuild ext-cache save|load`: the compiled extension wheels carried between machines. The
file checks here need no engine; the round trip on the real BuildKit cache mount is in
tests/docker/test_extcache_docker.py."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import BASE_IMAGE as BASE  # scripts/host-setup.sh's debootstrap image: sh, GNU cp, tar
from conftest import ROOT, run_cli
from envbuild.builds import extcache
from envbuild.base.errors import EnvbuildError
from envbuild.image import paths
from envbuild.knowledge.matrix import load_matrix


def _tar(path, members, mode="w"):
    """A tar of {name: bytes}; a value ("symlink"|"hardlink"|"fifo", target) makes a link or a FIFO."""
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(data, tuple):
                info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}[data[0]]
                info.linkname = data[1]
                tar.addfile(info)
                continue
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
    (b"root:x:0:0:root:/root:/bin/bash\n", "is not a plain (uncompressed) tar file"),
    ({"notes.txt": b"mine"}, "a tar file envbuild did not write"),
    ({extcache.MARKER: b"", "../../etc/cron.d/x": b"* * * * * root sh"}, "path outside its directory"),
    ({extcache.MARKER: b"", "pkg/k1": ("symlink", "/var/cache/envbuild-ext"), "pkg/k1/x.whl": b"w"}, "a link"),
    ({extcache.MARKER: b"", "pkg/k1/x.whl": ("hardlink", ".envbuild-ext-cache")}, "a link"),
    ({extcache.MARKER: b"", "pkg/k1/x.whl": ("fifo", "")}, "device"),
    ({extcache.MARKER: b"", "/var/cache/envbuild-ext/pkg/k1/x.whl": b"w"}, "path outside its directory"),
    (b"", "is not a plain (uncompressed) tar file"),
    # what save writes, compressed: refused unread (a small .gz can unpack to any size)
    (("w:gz", {extcache.MARKER: b"", "pkg/k1/x.whl": b"w", "pkg/k1/x.sha256": b"s"}), "not a plain (uncompressed)"),
])
def test_load_refuses_a_file_save_did_not_write_before_reaching_the_engine(tmp_path, content, words):
    file = tmp_path / "ext-cache.tar"
    if isinstance(content, bytes):
        file.write_bytes(content)
    elif isinstance(content, tuple):
        _tar(file, content[1], mode=content[0])
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
def test_both_copy_dockerfiles_pass_hadolint_and_mount_the_cache_the_extension_step_writes(tmp_path, steps):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(extcache.dockerfile("debian:bookworm-slim@sha256:" + "0" * 64, steps))
    r = subprocess.run([shutil.which("hadolint"), "--no-color", "--failure-threshold", "style", str(dockerfile)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    rendered = (ROOT / "tests" / "golden" / "h100-ext" / "Dockerfile").read_text()  # an image with --ext
    mount = re.search(r"--mount=type=cache,id=envbuild-ext,[^ ]*", rendered).group(0)  # not the apt or uv caches
    assert mount in steps


def _script(steps: str, root: Path) -> list[str]:
    """The `sh -c` script of a copy Dockerfile, its container paths moved under `root`."""
    body = re.search(r"sh -c '(.*)'\n", steps.replace("\\\n", "\n"), re.S).group(1)
    for path in (paths.EXTENSION_CACHE, "/out", "/tmp/in", "/envbuild-in.tar"):
        body = body.replace(path, f"{root}{path}")
    return ["sh", "-c", body]


def _wheel(cache: Path, key: str, name="pkg-1.0-py3-none-any", stamp=True):
    (cache / key).mkdir(parents=True, exist_ok=True)
    (cache / key / f"{name}.whl").write_text(f"wheel {key}")
    if stamp:
        (cache / key / f"{name}.sha256").write_text("stamp\n")


def test_the_copy_scripts_move_stamped_wheels_only_and_never_replace_one(tmp_path):
    """Both scripts, run by sh on directories standing for the container's: save takes the named
    keys' stamped wheels (not an unstamped one, not a compile's tree); load fills only a key with
    no stamped wheel, through temporary names."""
    cache = tmp_path / paths.EXTENSION_CACHE.lstrip("/")
    _wheel(cache, "flash-attn/k1")
    _wheel(cache, "flash-attn/k2")
    _wheel(cache, "causal-conv1d/k3", stamp=False)  # a store() cut off: no stamp
    (cache / "flash-attn" / "k1" / "partial").mkdir()
    env = {"ENVBUILD_RUN": "1", "ENVBUILD_KEYS": "flash-attn/k1 causal-conv1d/k3", "PATH": os.environ["PATH"]}
    assert subprocess.run(_script(extcache.SAVE_STEPS, tmp_path), env=env).returncode == 0
    out = tmp_path / "out"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        extcache.MARKER, "flash-attn/k1/pkg-1.0-py3-none-any.sha256", "flash-attn/k1/pkg-1.0-py3-none-any.whl"]
    with tarfile.open(tmp_path / "envbuild-in.tar", "w") as tar:
        tar.add(out, arcname=".")
    shutil.rmtree(cache / "flash-attn" / "k1")
    _wheel(cache, "flash-attn/k1", name="half-copied", stamp=False)  # a load cut off before
    (cache / "flash-attn" / "k1" / "keep.txt").write_text("mine")
    env.pop("ENVBUILD_KEYS")
    assert subprocess.run(_script(extcache.LOAD_STEPS, tmp_path), env=env).returncode == 0
    assert (out / extcache.LOADED).read_text().strip() == "1"
    k1 = cache / "flash-attn" / "k1"
    assert (k1 / "pkg-1.0-py3-none-any.whl").read_text() == "wheel flash-attn/k1" and (k1 / "keep.txt").exists()
    assert not [p for p in k1.iterdir() if "envbuild-tmp" in p.name]
    assert subprocess.run(_script(extcache.LOAD_STEPS, tmp_path), env=env).returncode == 0
    assert (out / extcache.LOADED).read_text().strip() == "0"  # k1 now has a stamped wheel: kept


def test_save_for_build_directories_takes_their_cache_keys_and_refuses_another_directory(tmp_path):
    golden = ROOT / "tests" / "golden" / "h100-ext"
    spec = json.loads((golden / "envbuild" / "extensions.json").read_text())
    deepspeed = json.loads((golden / "envbuild" / "deepspeed.json").read_text())["cache_key"]
    assert deepspeed.startswith("deepspeed/")  # DeepSpeed's wheel travels with the extensions' (issue: cost at scale)
    assert extcache.keys_of([golden]) == tuple(sorted([deepspeed, *(f"{e['name']}/{e['cache_key']}" for e in spec["extensions"])]))
    r = run_cli("ext-cache", "save", str(tmp_path / "c.tar"), "--for", str(tmp_path), "--base-image", BASE)
    assert r.returncode == 2 and f"--for {tmp_path}: it holds neither envbuild/extensions.json nor" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where, words", [("no-such-dir/c.tar", "does not exist"), ("a,b/c.tar", "comma")])
def test_save_refuses_a_path_docker_cannot_write_and_writes_nothing(tmp_path, where, words):
    (tmp_path / "a,b").mkdir()
    with pytest.raises(EnvbuildError) as refused:
        extcache.save(tmp_path / where, BASE, engine=NoEngine())
    assert words in refused.value.message and refused.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a,b"]
