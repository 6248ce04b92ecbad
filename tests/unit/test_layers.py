"""layers.sh: the CUDA wheels' libraries leave the venv for layers of their own (parallel pulls,
shared by stacks with the same CUDA wheels), and the venv still imports them. Run for real on a
real virtual environment; the nvidia packages are stand-ins with the layout the wheels install
(site-packages/nvidia/<package>/lib), since the real ones are gigabytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from envbuild.plan import CUDA_LAYERS, cuda_layer_args

STEPS = ROOT / "templates" / "files" / "steps"
PACKAGES = {"cu13": "cuda", "cudnn": "cudnn", "nccl": "nccl", "nvshmem": "nccl", "cusparselt": "other"}


def _venv(tmp_path: Path, name: str) -> tuple[Path, Path]:
    venv = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "nvidia").mkdir()
    (site / "nvidia" / "__init__.py").write_text("")
    for package in PACKAGES:
        (site / "nvidia" / package / "lib").mkdir(parents=True)
        (site / "nvidia" / package / "__init__.py").write_text(f"NAME = {package!r}\n")
        (site / "nvidia" / package / "lib" / f"lib{package}.so.1").write_bytes(package.encode() * 1000)
    imports = ", ".join(f"nvidia.{package}" for package in PACKAGES)
    subprocess.run([str(venv / "bin" / "python"), "-c", f"import {imports}"], check=True)  # each a __pycache__
    return venv, site


def _run(venv: Path, layers: Path) -> str:
    r = subprocess.run(["bash", str(STEPS / "layers.sh"), str(venv), str(layers), *cuda_layer_args()],
                       capture_output=True, text=True, env={**os.environ, "ENVBUILD_SECRETS_DIR": "/nonexistent"})
    assert r.returncode == 0, r.stderr
    return r.stderr


def _tar_digest(directory: Path) -> str:
    """What a layer of `directory` holds: names, modes, times and contents, in a fixed order."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        st = path.lstat()
        digest.update(f"{path.relative_to(directory)} {st.st_mode} {int(st.st_mtime)}".encode())
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_libraries_move_to_their_layers_and_still_import(tmp_path):
    venv, site = _venv(tmp_path, "venv")
    layers = tmp_path / "layers"
    assert "5 nvidia packages" in _run(venv, layers)
    for package, layer in PACKAGES.items():
        moved = layers / layer / "nvidia" / package
        assert (moved / "lib" / f"lib{package}.so.1").is_file()
        assert (site / "nvidia" / package).is_symlink() and (site / "nvidia" / package).resolve() == moved
        r = subprocess.run([str(venv / "bin" / "python"), "-B", "-c",
                            f"import nvidia.{package} as m; print(m.NAME)"], capture_output=True, text=True)
        assert r.stdout.strip() == package, r.stderr
    assert sorted(p.name for p in layers.iterdir()) == sorted(CUDA_LAYERS)
    assert not list(layers.rglob("__pycache__"))
    assert {int(p.lstat().st_mtime) for p in layers.rglob("*")} == {0}
    assert "0 nvidia packages" in _run(venv, layers)  # a second run moves nothing and breaks nothing


def test_two_stacks_with_the_same_cuda_wheels_get_identical_layers(tmp_path):
    """Built at different times in different venvs (another Python, another stack), the same
    wheels give layers with the same bytes and metadata: what lets a registry share them."""
    first, _ = _venv(tmp_path, "stack-a")
    _run(first, tmp_path / "layers-a")
    second, _ = _venv(tmp_path, "stack-b")
    _run(second, tmp_path / "layers-b")
    for layer in CUDA_LAYERS:
        assert _tar_digest(tmp_path / "layers-a" / layer) == _tar_digest(tmp_path / "layers-b" / layer), layer


def test_no_nvidia_wheels_leaves_empty_layers(tmp_path):
    venv = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    assert "0 nvidia packages" in _run(venv, tmp_path / "layers")
    assert all((tmp_path / "layers" / layer / "nvidia").is_dir() for layer in CUDA_LAYERS)


def test_a_package_no_layer_takes_fails_the_step(tmp_path):
    """The plan's layer map is the only map: a package none of its globs match is an error,
    not a silent extra layer (here the map has no catch-all `other`)."""
    venv, _ = _venv(tmp_path, "venv")
    r = subprocess.run(["bash", str(STEPS / "layers.sh"), str(venv), str(tmp_path / "layers"), "cudnn=cudnn"],
                       capture_output=True, text=True, env={**os.environ, "ENVBUILD_SECRETS_DIR": "/nonexistent"})
    assert r.returncode == 1 and "no LAYER=GLOB argument matches nvidia/" in r.stderr, r.stderr

