"""The build stage's `pip check` (pip_check.py) run for real, in a venv holding the images' pip
from PyPI (marked `network`): NVIDIA's sbsa wheel tag accepted on aarch64 only, with a reason,
and everything else it reports failing. The rest of the build logic needing no engine is
tests/unit/test_build_units.py."""

from pathlib import Path

import pytest

from envbuild import buildsteps

pytestmark = pytest.mark.network


def test_pip_check_names_nvidia_s_sbsa_wheel_tag_and_fails_everything_else(tmp_path):
    """Real pip in a real venv, with the real dist-info of NVIDIA's aarch64 cusparselt wheel
    (tests/fixtures/wheels/nvidia_cusparselt_cu13-0.8.1.dist-info: its WHEEL verbatim and the
    first lines of its METADATA, from
    https://files.pythonhosted.org/packages/46/e1/cdc1797eadf82d3a9a575a19b33fdc871a97edbec42c00b5b5e914f4aff4/nvidia_cusparselt_cu13-0.8.1-py3-none-manylinux2014_aarch64.whl,
    sha256 4dca476c..., the hash the aarch64 locks pin). Its "Tag: py3-none-manylinux2014_sbsa"
    made the emulated GH200 build's `pip check` fail. Accepted on aarch64 only, with a reason;
    a missing requirement still fails. The venv gets the images' pip (the lock's pin, from PyPI):
    pip reports unsupported wheels since 23.3."""
    import doctest
    import importlib.util
    import os
    import re
    import shutil
    import subprocess
    import sys

    from conftest import ROOT
    script = buildsteps.path("pip_check.py")
    spec = importlib.util.spec_from_file_location("pip_check", script)
    pip_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pip_check)
    assert doctest.testmod(pip_check).failed == 0

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
    lock = (ROOT / "matrices" / "locks" / "torch2.15-cu132-py3.11-pypi.aarch64.txt").read_text()
    pip_pin = re.search(r"^pip==(\S+)", lock, re.M)[1]
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"pip=={pip_pin}"], check=True, env=env)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    clean = subprocess.run([str(python), str(script)], capture_output=True, text=True, env=env)
    assert (clean.returncode, clean.stdout) == (0, "No broken requirements found.\n")  # pip's words, as before
    fixture = ROOT / "tests" / "fixtures" / "wheels" / "nvidia_cusparselt_cu13-0.8.1.dist-info"
    shutil.copytree(fixture, site / fixture.name)
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True,
                           env=env)
    assert check.returncode == 1 and "nvidia-cusparselt-cu13 0.8.1 is not supported on this platform" in check.stdout

    tags = {"nvidia-cusparselt-cu13": ["py3-none-manylinux2014_sbsa"]}
    problems, tolerated = pip_check.sort_lines(check.stdout, "aarch64", tags_of=tags.get)
    assert problems == [] and "manylinux2014_sbsa (NVIDIA's name for aarch64)" in tolerated[0]
    assert pip_check.sort_lines(check.stdout, "x86_64", tags_of=tags.get)[0] == [check.stdout.strip()]
    # The script itself, run by the venv's python on this x86_64 host: the line is a real problem here.
    run = subprocess.run([str(python), str(script)], capture_output=True, text=True, env=env)
    assert run.returncode == 1 and "not supported on this platform" in run.stdout

    broken = site / "envbuild_probe-1.0.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: envbuild-probe\nVersion: 1.0\n"
                                     "Requires-Dist: envbuild-not-installed\n")
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True,
                           env=env)
    problems, tolerated = pip_check.sort_lines(check.stdout, "aarch64", tags_of=tags.get)
    assert len(tolerated) == 1 and problems == ["envbuild-probe 1.0 requires envbuild-not-installed, which is not installed."]
