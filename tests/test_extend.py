"""`envbuild extend`: a researcher's packages on top of a stack image, resolved against the
stack's lock before anything is built. The tests marked `network` run uv against PyPI (as the
real builds do); the build of an extended image is in test_docker_e2e.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from conftest import run_cli, tree
from envbuild.errors import EnvbuildError
from envbuild.extend import read_requirements

CI_STACK = "torch2.11-cu130-py3.11-pypi"  # a locked stack of the fixture matrix
AS_OF = "2026-11-22"


@pytest.mark.parametrize("text, message", [
    ("-e ./mypkg", "is a VCS URL or a path"),
    ("./dist/mypkg-1.0-py3-none-any.whl", "is a VCS URL or a path"),
    ("git+https://github.com/huggingface/accelerate", "is a VCS URL or a path"),
    ("mypkg @ https://example.com/mypkg-1.0.tar.gz", "is a VCS URL or a path"),
    ("--index-url https://example.com/simple", "pip options are not taken here"),
    ("accelerate>=>1.0", "is not a requirement"),
    ("# only a comment\n\n", "no requirements in it"),
])
def test_what_cannot_be_hash_locked_or_parsed_is_refused_with_its_line(text, message):
    with pytest.raises(EnvbuildError, match=message):
        read_requirements(text, "requirements.txt")


def test_requirement_lines_keep_markers_and_extras():
    assert read_requirements("einops\naccelerate[deepspeed]>=1.0 ; python_version >= '3.10'  # why\n", "r") == [
        "einops", "accelerate[deepspeed]>=1.0 ; python_version >= '3.10'"]


def _extend(tmp_path, *args, timeout=600):
    return run_cli("extend", *args, "-o", str(tmp_path / "out"), timeout=timeout)


def test_extend_needs_exactly_one_source_of_packages(tmp_path):
    for args in ([], ["-r", "a.txt", "-f", "b.yaml"]):
        result = _extend(tmp_path, "--gpu", "h20", *args)
        assert result.returncode == 2 and "-r requirements.txt, or -f envbuild.yaml" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, message", [
    ("gpu: h20\nrequirements: [einops]\npackages: [x]\n", "packages: Extra inputs are not permitted. Known keys:"),
    ("gpu: [h20\n", "not valid YAML"),
    ("requirements: [einops]\n", "no GPU: give --gpu"),
    ("gpu: h20\nrequirements: missing.txt\n", "missing.txt: cannot read it"),
])
def test_a_bad_project_file_is_one_paragraph_and_writes_nothing(tmp_path, content, message):
    project = tmp_path / "envbuild.yaml"
    project.write_text(content)
    result = _extend(tmp_path, "-f", str(project))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_an_option_on_the_command_line_wins_over_the_project_file_even_the_default_preset(tmp_path):
    """`--ds-ops training` used to lose to a project file's ds_ops, because the CLI could not tell
    it from the default. The project's (invalid) ops show which value was used; the stack has no
    lock, so both runs stop before any resolution, offline."""
    project = tmp_path / "envbuild.yaml"
    project.write_text("gpu: v100\nstack: torch2.11-cu126-py3.12\nds_ops: no_such_op\nrequirements: [einops]\n")
    from_file = _extend(tmp_path, "-f", str(project))
    assert from_file.returncode == 2 and "no_such_op" in from_file.stderr, from_file.stderr
    given = _extend(tmp_path, "-f", str(project), "--ds-ops", "training")
    assert given.returncode == 2 and "has no lock" in given.stderr and "no_such_op" not in given.stderr, given.stderr


def test_a_stack_without_a_lock_cannot_be_extended(tmp_path):
    (tmp_path / "r.txt").write_text("einops\n")
    result = _extend(tmp_path, "-r", str(tmp_path / "r.txt"), "--gpu", "v100", "--stack", "torch2.11-cu126-py3.12")
    assert result.returncode == 2 and "has no lock" in result.stderr
    assert "envbuild lock --stack torch2.11-cu126-py3.12" in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.network
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
    # Nothing the stack installed is in the extension: torch, numpy, einops (DeepSpeed's) stay the stack's.
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
    again = run_cli("extend", "-r", str(tmp_path / "r.txt"), "--gpu", "h20", "--stack", CI_STACK, "--name", "demo",
                    "--as-of", AS_OF, "-o", str(tmp_path / "again"), timeout=600)
    assert again.returncode == 0
    first, second = tree(out), tree(tmp_path / "again")
    assert {k: v for k, v in first.items() if k != ".envbuild-files"} == \
        {k: v for k, v in second.items() if k != ".envbuild-files"}


@pytest.mark.network
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


@pytest.mark.network
@pytest.mark.parametrize("requirement, kind", [
    ("nosuchpkg-envbuild-zz", "names a package no index has"),
    ("pywin32==306", "has no wheel or sdist that installs on Python 3.11"),
])
def test_an_unknown_or_uninstallable_package_is_exit_2(tmp_path, requirement, kind):
    (tmp_path / "r.txt").write_text(requirement + "\n")
    result = _extend(tmp_path, "-r", str(tmp_path / "r.txt"), "--gpu", "h20", "--stack", CI_STACK, "--as-of", AS_OF)
    assert result.returncode == 2 and kind in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "out").exists()


def test_a_gpu_the_stack_does_not_allow_is_refused_before_resolving(tmp_path):
    (tmp_path / "r.txt").write_text("einops\n")
    result = _extend(tmp_path, "-r", str(tmp_path / "r.txt"), "--gpu", "v100", "--stack", CI_STACK)
    assert result.returncode == 2 and "v100" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_project_file_holds_only_fields_the_command_line_has():
    """envbuild.yaml's request fields are the request options by name (the CLI fills the ones
    the command line left out from it), so the two lists cannot drift apart."""
    import click

    from envbuild.cli import main
    from envbuild.extend import Project

    options = {p.name for p in main.commands["extend"].params if isinstance(p, click.Option)}
    own = {"name", "requirements", "image"}  # the project's own: --name, -r, --from
    request = {("stack_id" if f == "stack" else f) for f in Project.model_fields if f not in own}
    assert request and request <= options, request - options
