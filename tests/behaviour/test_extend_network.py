"""`envbuild extend` resolving with uv against PyPI, as the real builds do (marked `network`): a
layer on the stack image from a hash-locked resolution, and a conflict, an unknown package or
an uninstallable one refused (exit 2) before anything is built. What needs no index is
tests/behaviour/test_extend.py; the build of an extended image is in tests/docker/test_docker_e2e.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from conftest import run_here, tree
from test_extend import CI_STACK, _extend

pytestmark = pytest.mark.network

AS_OF = "2026-11-22"


def test_extend_renders_a_layer_on_the_stack_image_from_a_hash_locked_resolution(tmp_path):
    (tmp_path / "r.txt").write_text("accelerate\nsafetensors\neinops\n")
    result = _extend(tmp_path, "-r", str(tmp_path / "r.txt"), "--gpu", "h20", "--stack", CI_STACK,
                     "--name", "demo", "--as-of", AS_OF)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    stack_tag = manifest["extend"]["stack_tag"]
    assert manifest["tag"] == f"{stack_tag}-ext-demo" and manifest["torch"] == "2.11.0"
    dockerfile = (out / "Dockerfile").read_text()
    assert f"FROM envbuild:{stack_tag}" in dockerfile
    assert "extend.sh /opt/envbuild/extend-lock.txt /opt/envbuild/manifest.json accelerate einops safetensors" in dockerfile
    lock = (out / "envbuild" / "extend-lock.txt").read_text()
    assert "\naccelerate==" in lock and "--hash=sha256:" in lock
    # Nothing the stack installed is in the layer: torch, numpy, einops (DeepSpeed's) stay the stack's.
    for name in ("torch==", "numpy==", "einops==", "deepspeed=="):
        assert f"\n{name}" not in lock
    singularity = (out / "Singularity.def").read_text()
    assert f"From: envbuild:{stack_tag}" in singularity and "bash /opt/envbuild-setup/extend.sh" in singularity
    # Every rendered file passes its linter, as the stack's do.
    hadolint = subprocess.run([shutil.which("hadolint"), "--no-color", "--failure-threshold", "style",
                               str(out / "Dockerfile")], capture_output=True, text=True)
    assert hadolint.returncode == 0, hadolint.stdout
    from spython.main.parse.parsers import SingularityParser

    (recipe,) = SingularityParser(str(out / "Singularity.def")).recipe.values()
    assert recipe.fromHeader == f"envbuild:{stack_tag}" and any("extend.sh" in line for line in recipe.install)
    # Same inputs (the date included), same files.
    again = run_here("extend", "-r", str(tmp_path / "r.txt"), "--gpu", "h20", "--stack", CI_STACK, "--name", "demo",
                    "--as-of", AS_OF, "-o", str(tmp_path / "again"), timeout=600)
    assert again.returncode == 0
    first, second = tree(out), tree(tmp_path / "again")
    assert {k: v for k, v in first.items() if k != ".envbuild-files"} == \
        {k: v for k, v in second.items() if k != ".envbuild-files"}


def test_a_conflict_is_exit_2_before_any_build_with_what_it_needs_and_where_it_fits(tmp_path):
    """torchvision 0.20.1 needs torch 2.5.1; the fixture's locked torch 2.5 stack is where it fits."""
    (tmp_path / "r.txt").write_text("torchvision==0.20.1\n")
    result = _extend(tmp_path, "-r", str(tmp_path / "r.txt"), "--gpu", "rtx4090", "--stack", CI_STACK,
                     "--as-of", AS_OF)
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "the requirements (torchvision==0.20.1) cannot be added to stack" in message
    assert "conflicts with what the stack pins" in message and "torch==2.5.1 (the stack: 2.11.0)" in message
    assert "The stack pins torch==2.11.0, torchvision==0.26.0" in message
    assert "It would fit on: torch2.5-cu124-py3.10" in message and "Nothing was written." in message
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("requirement, kind", [
    ("nosuchpkg-envbuild-zz", "names a package no index has"),
    ("pywin32==306", "has no wheel or sdist that installs on Python 3.11"),
])
def test_an_unknown_or_uninstallable_package_is_exit_2(tmp_path, requirement, kind):
    (tmp_path / "r.txt").write_text(requirement + "\n")
    result = _extend(tmp_path, "-r", str(tmp_path / "r.txt"), "--gpu", "h20", "--stack", CI_STACK, "--as-of", AS_OF)
    assert result.returncode == 2 and kind in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "out").exists()
