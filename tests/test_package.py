"""Packaging and docs: the wheel ships templates and matrices; the README is current."""

import re
import subprocess
import sys
import venv

from conftest import ROOT


def test_wheel_renders_from_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = dist.glob("envbuild-*.whl")
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert "envbuild/matrices/stacks.yaml" in names and "envbuild/templates/docker/Dockerfile.j2" in names
    assert "envbuild/templates/files/smoke.py" in names
    # A fresh venv that sees the already-installed dependencies but not this checkout.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = subprocess.run([str(env_dir / "bin" / "envbuild"), "render", "--gpu", "h20", "-o", "out"], cwd=work,
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert (work / "out" / "Dockerfile").is_file() and (work / "out" / "envbuild" / "smoke.py").is_file()
    where = subprocess.run([str(py), "-c", "import envbuild.resources as r; print(r.matrices_dir())"],
                           cwd=work, capture_output=True, text=True).stdout
    assert str(env_dir) in where, where


def test_readme_tables_are_current():
    from envbuild.matrix import load_matrix
    from envbuild.tables import update_readme

    text = (ROOT / "README.md").read_text()
    assert update_readme(text, load_matrix()) == text, "run: envbuild readme-tables README.md"


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)\n(.*?)```", quick, re.S)


def test_readme_quick_start_is_two_commands_and_ci_runs_the_test_one():
    blocks = _readme_commands()
    assert len(blocks) == 2, blocks
    assert "envbuild render --gpu h20" in blocks[0]
    test_cmd = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, f".ci/run must call the README's test command: {test_cmd}"
