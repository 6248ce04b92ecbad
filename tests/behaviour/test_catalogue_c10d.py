"""c10d's C++ catalogue: the string pieces of ProcessGroupNCCL, NCCLUtils, TCPStore and the socket
layer, read from the .rodata of the torch wheels' libtorch_cuda.so and libtorch_cpu.so.

tests/fixtures/c10d/rodata-runs-2.15.0.json holds contiguous runs of the real .rodata strings of
torch 2.15.0's Linux wheel (its URL and sha256 in the file): the selection rule is tested on them
against pieces public failure logs show are c10d's, and against strings of the compile units beside
c10d's. The tests write those runs into small ELF files of their own, in a wheel of their own, to
run the reader and the command offline.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, load_yaml
from envbuild.base.errors import EnvbuildError
from envbuild.refresh import c10d_catalogue as c10d

RUNS = json.loads((ROOT / "tests" / "fixtures" / "c10d" / "rodata-runs-2.15.0.json").read_text())
CPU, CUDA = c10d.MEMBERS[1], c10d.MEMBERS[0]
# Pieces of c10d's messages as public failure logs print them (tests/fixtures/c10d-said/INDEX.yaml, LlamaFactory#7396).
PUBLIC = {"Watchdog caught collective operation timeout: ", "recvValue failed on {}: {}",
          "Received a dump signal due to a collective timeout from ",
          "TCP client failed to connect/validate to host {}:{} - retrying (try={}, timeout={}ms, delay={}ms): {}",
          "The client socket has timed out after {} while trying to connect to ({}, {})."}
# Beside c10d's in .rodata: torch/csrc/jit's fuser and torch/csrc/cuda/nccl.cpp.
NEIGHBOURS = {"Compiler passed via CXX envvar does not exist!", "CompilerConfig",
              "NCCL timeout when waiting for nonblocking call to become successful.",
              "Using experimental non-blocking NCCL communicator."}


def elf(strings: list[str]) -> bytes:
    """A 64-bit little-endian ELF file whose .rodata holds `strings`, NUL-terminated, as a linker leaves them."""
    rodata = b"".join(s.encode() + b"\0" for s in strings)
    names = b"\0.rodata\0.shstrtab\0"
    rodata_at, names_at = 64, 64 + len(rodata)
    table_at = names_at + len(names)
    head = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, table_at, 0, 64, 0, 0,
                                                             64, 3, 2)
    section = struct.Struct("<IIQQQQIIQQ")
    table = (section.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0) + section.pack(1, 1, 2, 0, rodata_at, len(rodata), 0, 0, 1, 0)
             + section.pack(9, 3, 0, 0, names_at, len(names), 0, 0, 1, 0))
    return head + rodata + names + table


def wheel(directory: Path, release: str = "2.15.0", extra: str = "") -> tuple[Path, str]:
    """A torch wheel whose two libraries hold the fixture's runs (and `extra`), with its sha256."""
    path = directory / f"torch-{release}-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, runs in RUNS["runs"].items():
            strings = [s for run in runs for s in run] + ([extra] if extra and member == CPU else [])
            archive.writestr(member, elf(strings))
        archive.writestr("torch/version.py", "__version__ = '2.15.0'\n")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def matrix(tmp_path: Path, pins: dict[str, str]) -> Path:
    """A matrix directory whose one lock pins torch==RELEASE by the sha256 given."""
    directory = tmp_path / "m"
    (directory / "locks").mkdir(parents=True)
    (directory / "locks" / "stack.txt").write_text("".join(
        f"torch=={release} \\\n    --hash=sha256:{digest}\n" for release, digest in pins.items()))
    return directory


def kept(member: str) -> set[str]:
    return {text for run in RUNS["runs"][member] for _, text in c10d.c10d_strings(run)}


def test_the_rule_keeps_the_pieces_public_logs_show_and_not_the_units_beside_them():
    """The public pieces are all kept and are messages; the fuser's and torch/csrc/cuda/nccl.cpp's strings are not."""
    held = kept(CPU) | kept(CUDA)
    assert PUBLIC <= held and all(c10d.is_message(text) for text in PUBLIC)
    assert not held & NEIGHBOURS
    assert not [t for t in held if c10d.is_message(t) and t.startswith(("N4c10d", "_ZN", "St23"))]


def test_a_piece_records_the_compile_unit_it_sits_among():
    nears = {text: near for run in RUNS["runs"][CPU] for near, text in c10d.c10d_strings(run)}
    assert nears["recvValue failed on {}: {}"].startswith("c10d/")
    assert nears["The client socket has timed out after {} while trying to connect to ({}, {})."] == "c10d/socket.cpp"


def test_the_command_reads_a_pinned_wheel_then_its_extraction_and_writes_the_same_bytes(cli, tmp_path):
    """Reading a wheel leaves its extraction; with the wheel gone, the extraction gives the same catalogue."""
    wheels = tmp_path / "w"
    wheels.mkdir()
    path, digest = wheel(wheels)
    directory = matrix(tmp_path, {"2.14.1": "0" * 64, "2.15.0": digest})
    first = cli("matrix", "catalogue", "--c10d-wheels", wheels, "--matrix-dir", directory, "--write")
    assert first.returncode == 0, first.stderr
    written = (directory / "catalogues" / "c10d.yaml").read_text()
    data = load_yaml(written)
    assert data["releases"] == [{"release": "2.15.0", "file": path.name, "sha256": digest,
                                 "url": "https://pypi.org/project/torch/2.15.0/#files", "members": list(c10d.MEMBERS)}]
    assert [m["release"] for m in data["not_catalogued"]] == ["2.14.1"]
    texts = {m["text"]: m for m in data["messages"]}
    assert texts["recvValue failed on %s: %s"]["library"] == "libtorch_cpu.so"
    assert texts["Watchdog caught collective operation timeout: "]["releases"] == "2.15.0"
    assert not set(texts) & NEIGHBOURS
    path.unlink()
    again = cli("matrix", "catalogue", "--c10d-wheels", wheels, "--matrix-dir", directory)
    assert (again.returncode, (directory / "catalogues" / "c10d.yaml").read_text()) == (0, written), again.stderr


def test_a_wording_new_in_a_release_is_held_by_that_release_only(tmp_path):
    wheels = tmp_path / "w"
    wheels.mkdir()
    _, old = wheel(wheels, "2.14.1")
    _, new = wheel(wheels, "2.15.0", extra="The server socket on {} lost its store in a new way.")
    data = c10d.derive(wheels, {"2.14.1": {old}, "2.15.0": {new}})
    texts = {m["text"]: m["releases"] for m in data["messages"]}
    assert texts["The server socket on %s lost its store in a new way."] == "2.15.0"
    assert texts["recvValue failed on %s: %s"] == "2.14.1..2.15.0"


def test_a_wheel_no_lock_pins_is_not_read(tmp_path):
    wheels = tmp_path / "w"
    wheels.mkdir()
    wheel(wheels)
    data = c10d.derive(wheels, {"2.15.0": {"f" * 64}})
    assert (data["releases"], data["not_catalogued"][0]["release"]) == ([], "2.15.0")
    assert not list(wheels.glob("*.c10d.json"))


@pytest.mark.parametrize("damage", ["not json", '{"wheel": "torch-2.15.0-x-y-z.whl", "sha256": "a", "strings": {}}'])
def test_a_damaged_extraction_is_a_one_paragraph_error_naming_it(cli, tmp_path, damage):
    wheels = tmp_path / "w"
    wheels.mkdir()
    (wheels / "torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl.c10d.json").write_text(damage)
    result = cli("matrix", "catalogue", "--c10d-wheels", wheels, "--matrix-dir", matrix(tmp_path, {"2.15.0": "a" * 64}))
    assert result.returncode == 2 and "c10d extraction" in result.stderr and "Traceback" not in result.stderr


def test_a_wheel_without_the_libraries_or_not_an_elf_is_an_error_naming_it(tmp_path):
    wheels = tmp_path / "w"
    wheels.mkdir()
    path = wheels / "torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(CUDA, b"not an ELF file")
        archive.writestr(CPU, b"not an ELF file")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(EnvbuildError, match="cannot be read as a torch wheel"):
        c10d.derive(wheels, {"2.15.0": {digest}})


def test_the_shipped_catalogue_holds_the_public_pieces_in_the_releases_read():
    data = load_yaml((ROOT / "matrices" / "catalogues" / "c10d.yaml").read_text())
    read = [r["release"] for r in data["releases"]]
    assert {"2.14.1", "2.15.0"} <= set(read) and all(len(r["sha256"]) == 64 for r in data["releases"])
    texts = {m["text"] for m in data["messages"]}
    assert {p.replace("{}", "%s") for p in PUBLIC} <= texts
