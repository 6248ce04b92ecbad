"""`envbuild export --enroot` of the base image in the engine (scripts/host-setup.sh): the .sqsh is
reproducible, wired as `enroot import` wires it, and started by the real enroot where
scripts/slurm-setup.sh installed it. Staging the file needs no engine: tests/behaviour/test_enroot.py."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from conftest import BASE_IMAGE as BASE
from conftest import DOCKER, need_tool, run_cli


def test_export_is_reproducible_and_enroot_starts_it(tmp_path):
    if subprocess.run([DOCKER, "image", "inspect", BASE], capture_output=True).returncode != 0:
        pytest.fail(f"{BASE} missing; run scripts/host-setup.sh")
    need_tool("mksquashfs", "squashfs-tools")
    hashes = []
    for name in ("a.sqsh", "b.sqsh"):
        r = run_cli("export", BASE, "--enroot", "-o", str(tmp_path / name), timeout=600)
        assert r.returncode == 0, r.stderr
        hashes.append(hashlib.sha256((tmp_path / name).read_bytes()).hexdigest())
    assert hashes[0] == hashes[1]
    r = run_cli("export", BASE, "--enroot", "-o", str(tmp_path / "a.sqsh"))
    assert r.returncode == 2 and "never replaces a file" in r.stderr
    listing = subprocess.run(["unsquashfs", "-l", str(tmp_path / "a.sqsh")], capture_output=True, text=True).stdout
    assert "squashfs-root/etc/rc" in listing and "squashfs-root/.dockerenv" not in listing
    assert "squashfs-root/dev/" not in listing.replace("squashfs-root/dev\n", "")
    if not shutil.which("enroot"):
        pytest.skip("enroot is not installed here (scripts/slurm-setup.sh builds it); the file was checked above")
    name = f"envbuild-test-{os.getpid()}"
    subprocess.run(["enroot", "create", "-n", name, str(tmp_path / "a.sqsh")], check=True, capture_output=True)
    try:
        r = subprocess.run(["enroot", "start", name, "sh", "-c", ". /etc/os-release; echo $ID; test ! -e /.dockerenv"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "debian", r.stderr
    finally:
        subprocess.run(["enroot", "remove", "-f", name], capture_output=True)
