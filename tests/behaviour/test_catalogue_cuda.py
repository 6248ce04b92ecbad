"""The CUDA catalogue: cudaError_t and CUresult from the headers of the runtime wheels the locks pin.

tests/fixtures/catalogue/cuda holds excerpts of the real headers of two pinned wheels (SOURCE.txt:
wheel, member, lines and sha256); the tests pack them into wheels of their own, with a lock that
pins those wheels' sha256, to run the command offline. The shipped catalogue is checked against
the locks: every pinned version is catalogued.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path


from conftest import ROOT, load_yaml
from envbuild.refresh import cuda_catalogue as cuda

FIXTURE = ROOT / "tests" / "fixtures" / "catalogue" / "cuda"
PREFIX = "nvidia/cuda_runtime/include/"


def wheel(directory: Path, version: str) -> str:
    """A wheel holding the fixture's excerpts at the real members' paths; its sha256."""
    path = directory / f"nvidia_cuda_runtime_cu12-{version}-py3-none-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name in ("driver_types.h", "cuda.h"):
            archive.writestr(PREFIX + name, (FIXTURE / version / name).read_text())
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lock(directory: Path, pins: dict[str, str]):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "torch-test.txt").write_text("".join(
        f"nvidia-cuda-runtime-cu12=={v} \\\n    --hash=sha256:{digest} \\\n    --hash=sha256:{'0' * 64}\n"
        f"nvidia-cudnn-cu12==9.1.0.70 \\\n    --hash=sha256:{'1' * 64}\n" for v, digest in pins.items()))


def test_the_excerpts_are_the_real_lines_they_name():
    for line in (FIXTURE / "SOURCE.txt").read_text().splitlines():
        if "excerpt sha256" in line:
            name = line.split(":", 1)[0]
            assert hashlib.sha256((FIXTURE / name).read_bytes()).hexdigest() == line.rsplit(" ", 1)[1], name


def test_an_error_whose_documentation_changed_has_one_entry_per_wording(tmp_path):
    pins = {v: wheel(tmp_path, v) for v in ("12.1.105", "12.4.127")}
    lock(tmp_path / "locks", pins)
    data = cuda.derive(tmp_path, tmp_path / "locks")
    assert [r["release"] for r in data["releases"]] == ["12.1.105", "12.4.127"] and not data["not_catalogued"]
    assert data["releases"][0]["sha256"] == pins["12.1.105"]
    oom = [e for e in data["errors"] if e["name"] == "CUDA_ERROR_OUT_OF_MEMORY"]
    assert [(e["releases"], e["doc"].split(" enough memory ")[1]) for e in oom] == [
        ("12.4.127", "or other resources to perform the requested operation."),
        ("12.1.105", "to perform the requested operation.")]
    success = next(e for e in data["errors"] if e["name"] == "cudaSuccess")
    assert (success["api"], success["value"], success["header"], success["releases"]) == \
        ("runtime", 0, "include/driver_types.h", "12.1.105..12.4.127")
    assert cuda.render(data) == cuda.render(cuda.derive(tmp_path, tmp_path / "locks"))


def test_a_wheel_the_locks_do_not_pin_is_not_read(tmp_path):
    """A wheel whose sha256 no lock names (a rebuilt or tampered file) is listed as not catalogued."""
    wheel(tmp_path, "12.1.105")
    lock(tmp_path / "locks", {"12.1.105": "f" * 64, "12.4.127": "e" * 64})
    data = cuda.derive(tmp_path, tmp_path / "locks")
    assert data["releases"] == []
    assert [(m["release"], m["why"]) for m in data["not_catalogued"]] == [
        ("12.1.105", "no wheel whose sha256 a lock pins"), ("12.4.127", "no wheel of it in the directory")]


def test_the_command_writes_both_catalogues_then_finds_them_current(tmp_path, cli):
    matrix = tmp_path / "m"
    lock(matrix / "locks", {"12.1.105": wheel(tmp_path, "12.1.105")})
    (matrix / "nccl.yaml").write_text("packages: []\n")
    first = cli("matrix", "catalogue", "--cuda-wheels", tmp_path, "--matrix-dir", matrix, "--write")
    assert first.returncode == 0, first.stderr
    assert "cuda catalogue: release 12.1.105 added" in first.stderr
    again = cli("matrix", "catalogue", "--cuda-wheels", tmp_path, "--matrix-dir", matrix)
    assert (again.returncode, again.stdout) == (0, "")
    neither = cli("matrix", "catalogue", "--matrix-dir", matrix)
    assert neither.returncode == 2 and "--cuda-wheels" in neither.stderr


def test_the_shipped_catalogue_covers_every_pinned_cuda_runtime():
    data = load_yaml((ROOT / "matrices" / "catalogues" / "cuda.yaml").read_text())
    pinned = cuda.pins(ROOT / "matrices" / "locks")
    assert {(r["package"], r["release"]) for r in data["releases"]} == set(pinned)
    assert all(r["sha256"] in pinned[(r["package"], r["release"])] for r in data["releases"])
    names = {e["name"] for e in data["errors"]}
    assert {"cudaErrorNoDevice", "CUDA_ERROR_SYSTEM_NOT_READY", "cudaErrorUnsupportedPtxVersion"} <= names
