"""envbuild's wheel built from this checkout and installed in a fresh venv that does not see the
checkout (marked `wheel`): it ships the templates and matrices, and renders from them. The
generated tables in docs/ and the README's commands are tests/behaviour/test_package.py."""

import subprocess
import sys
import os
import venv
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.wheel


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
    # A fresh venv that sees the already-installed dependencies but not this checkout: the running
    # interpreter's site-packages (a venv's own, where the tests run in one) as a .pth, whose own
    # .pth files (the editable install of this checkout) are not read.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    import site
    import sysconfig
    own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in dict.fromkeys([*site.getsitepackages(), sysconfig.get_path("purelib")]) if os.path.isdir(p)]
    (Path(own) / "outer-site-packages.pth").write_text("".join(p + "\n" for p in outer))
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = subprocess.run([str(env_dir / "bin" / "envbuild"), "render", "--gpu", "h20", "-o", "out"], cwd=work,
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert (work / "out" / "Dockerfile").is_file() and (work / "out" / "envbuild" / "smoke.py").is_file()
    where = subprocess.run([str(py), "-c", "import envbuild.base.resources as r; print(r.matrices_dir())"],
                           cwd=work, capture_output=True, text=True).stdout
    assert str(env_dir) in where, where
