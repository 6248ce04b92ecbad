"""The DeepSpeed and Triton catalogues: what DeepSpeed's launcher and op loading and Triton's compiler
and runtime raise or log, per release the matrix ships, read from PyPI's sdists and wheels.

tests/fixtures/catalogue/deepspeed and .../triton hold whole, unchanged files of two releases each
(SOURCE.txt: the sdist or wheel, the member and the sha256), saved as .txt; the tests pack them into
sdists and wheels of their own, at the real members' paths, to run the extraction and the command
offline. DeepSpeed 0.19.8 dropped builder.py's `cuda is missing or is incompatible` warning and added
`found no CUDA devices`; Triton 3.4.0 added PTXASError.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, load_yaml
from envbuild.refresh import package_catalogue as packages

FIXTURES = ROOT / "tests" / "fixtures" / "catalogue"
DS_RELEASES, TRITON_RELEASES = ["0.18.9", "0.19.8"], ["3.1.0", "3.4.0"]
BUILDER, LAUNCH = "op_builder/builder.py", "deepspeed/launcher/launch.py"
ERRORS, DRIVER = "triton/runtime/errors.py", "triton/backends/nvidia/driver.c"


def sdist(directory: Path, release: str) -> str:
    """An sdist holding the fixture's files under deepspeed-RELEASE/, as PyPI's do, and one file not read."""
    name = f"deepspeed-{release}.tar.gz"
    with tarfile.open(directory / name, "w:gz") as archive:
        files = {path: (FIXTURES / "deepspeed" / release / f"{path}.txt").read_bytes() for path in (BUILDER, LAUNCH)}
        files["deepspeed/runtime/engine.py"] = b"raise RuntimeError('not in the launcher or the op loading at all')\n"
        for path, data in files.items():
            info = tarfile.TarInfo(f"deepspeed-{release}/{path}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return name


def wheel(directory: Path, release: str) -> str:
    name = f"triton-{release}-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(directory / name, "w") as archive:
        for member in (ERRORS, DRIVER):
            archive.writestr(member, (FIXTURES / "triton" / release / f"{member}.txt").read_text())
        archive.writestr("triton/language/semantic.py", "raise ValueError('the language is not read at all')\n")
    return name


def matrix(tmp_path: Path, wheels: Path, releases=("0.18.9", "0.19.8")) -> Path:
    """A matrix directory whose deepspeed.yaml lists `releases` and whose lock pins the test's Triton wheels."""
    directory = tmp_path / "m"
    (directory / "locks").mkdir(parents=True)
    (directory / "deepspeed.yaml").write_text("releases:\n" + "".join(f"  - deepspeed: '{r}'\n" for r in releases))
    lines = []
    for path in sorted(wheels.glob("triton-*.whl")):
        release = path.name.split("-")[1]
        lines.append(f"triton=={release} \\\n    --hash=sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}\n")
    (directory / "locks" / "stack.x86_64.txt").write_text("".join(lines))
    return directory


def test_the_fixtures_are_the_real_files_they_name():
    for component in ("deepspeed", "triton"):
        for line in (FIXTURES / component / "SOURCE.txt").read_text().splitlines():
            if " file sha256 " in line:
                name = line.split(":", 1)[0]
                digest = hashlib.sha256((FIXTURES / component / f"{name}.txt").read_bytes()).hexdigest()
                assert digest == line.rsplit(" ", 1)[1], name


def test_deepspeed_wordings_have_their_releases_files_and_lines(tmp_path):
    for release in DS_RELEASES:
        sdist(tmp_path, release)
    pkg = packages.package("deepspeed")
    releases = packages.shipped_releases(pkg, matrix(tmp_path, tmp_path, DS_RELEASES + ["0.17.6"]))
    data = packages.derive(pkg, tmp_path, releases)
    assert [r["release"] for r in data["releases"]] == DS_RELEASES and not any(r["locked"] for r in data["releases"])
    assert data["not_catalogued"] == [{"release": "0.17.6", "why": "no sdist of it in the directory"}]
    found = {m["text"]: m for m in data["messages"]}
    exits = found["%s exits with return code = %s"]
    assert (exits["level"], exits["file"], exits["line"], exits["releases"]) == ("ERROR", LAUNCH, 259, "0.18.9..0.19.8")
    ninja = found["Unable to JIT load the %s op due to ninja not being installed."]
    assert (ninja["level"], ninja["error"], ninja["line"]) == ("RAISE", "RuntimeError", 577)
    assert found["%s %s cuda is missing or is incompatible with installed torch, only cpu ops can be compiled!"][
        "releases"] == "0.18.9"  # print(f"{WARNING} ...") is a WARNING
    assert found["DeepSpeed JIT builder for '%s' found no CUDA devices. Set TORCH_CUDA_ARCH_LIST or make GPUs "
                 "visible."]["releases"] == "0.19.8"
    assert all(m["file"] in (BUILDER, LAUNCH) for m in data["messages"])
    assert packages.render(pkg, data) == packages.render(pkg, packages.derive(pkg, tmp_path, releases))


def test_triton_wordings_come_from_exceptions_str_and_the_drivers_c(tmp_path):
    for release in TRITON_RELEASES:
        wheel(tmp_path, release)
    pkg = packages.package("triton")
    data = packages.derive(pkg, tmp_path, packages.shipped_releases(pkg, matrix(tmp_path, tmp_path)))
    assert [(r["release"], r["locked"]) for r in data["releases"]] == [("3.1.0", True), ("3.4.0", True)]
    found = {(m["error"], m["text"]): m for m in data["messages"]}
    resources = found[("OutOfResources", "out of resource: %s, Required: %s, Hardware limit: %s. Reducing block "
                                         "sizes or `num_stages` may help.")]
    assert (resources["file"], resources["line"], resources["releases"]) == (ERRORS, 22, "3.1.0..3.4.0")
    assert found[("PTXASError", "PTXAS error: %s")]["releases"] == "3.4.0"
    cuda = found[("RuntimeError", "Triton Error [CUDA]: %s")]  # gpuAssert's prefix and cuGetErrorString's text
    assert (cuda["file"], cuda["releases"]) == (DRIVER, "3.1.0..3.4.0")
    assert ("RuntimeError", "Failed to retrieve %s from libcuda.so.1") in found  # "..." #symbolName "..."
    assert all(m["file"] in (ERRORS, DRIVER) for m in data["messages"])
    assert data["paths"]["triton/"] == "python/triton/"


def test_a_wheel_whose_sha256_no_lock_pins_is_not_read(tmp_path):
    wheel(tmp_path, "3.4.0")
    directory = matrix(tmp_path, tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.whl").write_bytes(b"")
    wheel(tmp_path / "other", "3.4.0")
    with zipfile.ZipFile(next((tmp_path / "other").glob("triton-*.whl")), "a") as archive:
        archive.writestr("triton/errors.py", "raise RuntimeError('a changed wheel, not the pinned one')\n")
    pkg = packages.package("triton")
    data = packages.derive(pkg, tmp_path / "other", packages.shipped_releases(pkg, directory))
    assert data["releases"] == [] and data["not_catalogued"] == [
        {"release": "3.4.0", "why": "no wheel whose sha256 a lock pins"}]


def test_the_command_writes_both_catalogues_then_finds_them_current(tmp_path, cli):
    archives = tmp_path / "a"
    archives.mkdir()
    for release in DS_RELEASES:
        sdist(archives, release)
    for release in TRITON_RELEASES:
        wheel(archives, release)
    directory = matrix(tmp_path, archives)
    args = ("matrix", "catalogue", "--deepspeed-sdists", archives, "--triton-wheels", archives, "--matrix-dir", directory)
    first = cli(*args, "--write")
    assert first.returncode == 0, first.stderr
    assert "deepspeed catalogue: release 0.19.8 added: " in first.stderr
    assert "triton catalogue: release 3.4.0 added: " in first.stderr
    again = cli(*args)
    assert (again.returncode, again.stdout) == (0, ""), again.stderr
    assert "current" in again.stderr
    (directory / "deepspeed.yaml").write_text("releases:\n  - deepspeed: '0.15.4'\n")
    none = cli("matrix", "catalogue", "--deepspeed-sdists", archives, "--matrix-dir", directory)
    assert none.returncode == 2 and "holds no DeepSpeed sdist" in none.stderr and "Traceback" not in none.stderr


def test_a_file_named_like_an_sdist_that_is_not_one_is_a_one_paragraph_error(tmp_path, cli):
    (tmp_path / "deepspeed-0.19.8.tar.gz").write_bytes(b"not a tar")
    directory = matrix(tmp_path, tmp_path, ("0.19.8",))
    result = cli("matrix", "catalogue", "--deepspeed-sdists", tmp_path, "--matrix-dir", directory)
    assert result.returncode == 2 and "cannot be read as a sdist" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("name, shipped", [("deepspeed", "deepspeed.yaml"), ("triton", "locks")])
def test_the_shipped_catalogues_cover_the_releases_the_matrix_ships(name, shipped):
    """Every release of the matrix is catalogued or listed as not catalogued, with why; locked archives by the locks' sha256."""
    data = load_yaml((ROOT / "matrices" / "catalogues" / f"{name}.yaml").read_text())
    pkg = packages.package(name)
    releases = packages.shipped_releases(pkg, ROOT / "matrices")
    assert [r["release"] for r in data["releases"]] + [r["release"] for r in data["not_catalogued"]] == list(releases)
    for entry in data["releases"]:
        assert entry["locked"] == bool(releases[entry["release"]])
        assert not entry["locked"] or entry["sha256"] in releases[entry["release"]]
    assert data["component"] == name and data["messages"]
