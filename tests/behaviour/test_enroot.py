"""The enroot artifact's files and `envbuild stage` (once per image, locked, checked for space
and by sha256): plain files. `envbuild export --enroot` (reproducible, started by the real enroot
where scripts/slurm-setup.sh installed it) needs Docker: tests/docker/test_enroot_docker.py;
staging at once from several processes is tests/process/test_enroot_staging_at_once.py."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import need_tool, run_here
from envbuild.builds.enroot import enroot_files
from envbuild.builds.staging import stage


def _sqsh(path, size=3 * 2**20):
    """A real squashfs of `size` random bytes (stage checks its superblock before copying)."""
    need_tool("mksquashfs", "squashfs-tools")
    content = path.parent / f".{path.name}.content"
    content.mkdir()
    (content / "data").write_bytes(os.urandom(size))
    subprocess.run(["mksquashfs", str(content), str(path), "-noappend", "-quiet", "-noI", "-noD", "-noF", "-noX"],
                   check=True, capture_output=True)
    shutil.rmtree(content)
    return path


def test_a_truncated_staged_file_is_refused_with_its_checksum(tmp_path):
    source, shared = _sqsh(tmp_path / "img.sqsh"), tmp_path / "shared"
    shared.mkdir()
    assert run_here("stage", str(source), "--to", str(shared)).returncode == 0
    with open(shared / "img.sqsh", "r+b") as f:
        f.truncate(1000)  # a copy cut short (a full disk, a killed rsync)
    r = run_here("stage", str(source), "--to", str(shared))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    said = " ".join(r.stderr.split())
    assert f"{shared / 'img.sqsh'} is partial or corrupt" in said and "Remove both and stage again" in said


def test_no_space_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from envbuild.builds import staging
    from envbuild.base.errors import EnvbuildError

    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10, 10, 2**20))
    with pytest.raises(EnvbuildError, match=r"has 0.00 GiB free; staging x.sqsh needs"):
        stage(shared, "x.sqsh", 5 * 2**20, lambda dest: pytest.fail("nothing may be written"))
    assert sorted(p.name for p in shared.iterdir()) == [".envbuild-stage.lock"]


def test_a_killed_stage_leaves_a_partial_copy_the_next_stage_removes(tmp_path):
    source, shared = _sqsh(tmp_path / "img.sqsh"), tmp_path / "shared"
    shared.mkdir()
    (shared / ".img.sqsh.envbuild-tmp-0123abcd").write_bytes(b"half")
    assert run_here("stage", str(source), "--to", str(shared)).returncode == 0
    assert not list(shared.glob(".img.sqsh.envbuild-tmp-*"))


def test_stage_refuses_a_missing_directory_and_an_unknown_image(tmp_path):
    r = run_here("stage", str(_sqsh(tmp_path / "a.sqsh", 10)), "--to", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_here("stage", "no-such-image:1", "--to", str(tmp_path))
    assert r.returncode == 2 and "no such local image" in r.stderr


def test_enroot_files_match_enroots_own_configure():
    """Volumes, Env, labels, WorkingDir, Entrypoint and Cmd as enroot v4.1.2's docker::configure
    writes them (src/docker.sh), quoting included."""
    files = enroot_files({"Env": ["A=1", "B=two words"], "Volumes": {"/data": {}}, "WorkingDir": "/work",
                          "Entrypoint": ["/opt/envbuild/entrypoint.sh"], "Cmd": ["it's"], "Labels": {"x": "a\nb"}})
    assert files["etc/environment"] == b"A=1\nB=two words\n"
    assert files["etc/fstab"] == b"${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
    rc = files["etc/rc"].decode()
    assert rc.startswith("# x a b\n\nmkdir -p \"/work\" 2> /dev/null\ncd \"/work\" && unset OLDPWD || exit 1\n")
    assert "    exec '/opt/envbuild/entrypoint.sh' \"$@\"\n" in rc
    assert "    exec '/opt/envbuild/entrypoint.sh' 'it'\\''s'\n" in rc
    assert enroot_files({})["etc/rc"].decode().endswith("else\n    exec '/bin/sh'\nfi\n")
