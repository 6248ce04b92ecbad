"""Derive matrices/catalogues/c10d.yaml: the C++ wordings of c10d (ProcessGroupNCCL's watchdog and
heartbeat monitor, NCCLUtils, TCPStore's server and client, the socket layer) per torch release.

PyPI's torch wheels hold c10d compiled: torch/lib/libtorch_cuda.so (ProcessGroupNCCL, NCCLUtils)
and torch/lib/libtorch_cpu.so (TCPStore, socket, Utils). What they can print is read from the
`.rodata` section of those two members (an ELF reader over the zip member's stream; nothing is
run or loaded): `c10::str(...)` concatenations leave each fixed piece as its own literal
(`Watchdog caught collective operation timeout: `), fmt's `{}` stay in theirs (`The client socket
has timed out after {} while trying to connect to ({}, {}).`).

Which strings are c10d's: the linker keeps each compile unit's strings together, and every
`TORCH_CHECK` leaves its file's build path (`/__w/pytorch/pytorch/torch/csrc/distributed/c10d/TCPStore.cpp`)
among them. A string is kept when the compile-unit path (a .cpp/.cc/.cu path string) nearest to it,
before or after, is under torch/csrc/distributed/c10d/ (`near` records which), and when it has the
shape of a message: two words or more, not a mangled symbol, a path or a counter's name. A wording
has no file or line: the binary does not hold them, and `near` is the compile unit it sits among,
not a source reference.

A wheel is read only if its sha256 is one a lock in matrices/locks/ pins. Each wheel read leaves
its extraction beside it (WHEEL.c10d.json: the wheel's name, sha256 and the c10d strings with their
`near`), so a wheel of 0.5-2.5 GB can be deleted before the next is downloaded; the extraction is
read in its place, and it is what the tests hold. Same wheels (or extractions), same bytes.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Iterator, Optional

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import sha256_file
from envbuild.base.untrusted import loads_json, validated
from envbuild.refresh import nccl_catalogue
from envbuild.refresh.cuda_catalogue import pins
from envbuild.refresh.nccl_catalogue import comment, layout, spans

MEMBERS = ("torch/lib/libtorch_cuda.so", "torch/lib/libtorch_cpu.so")
C10D = "torch/csrc/distributed/c10d/"
PIN = re.compile(r"^(torch)==([0-9][0-9.]*)\b")
UNIT = re.compile(r"/(?:torch|aten|c10|caffe2|third_party|functorch)/\S*\.(?:cpp|cc|cu|c)$")
STRING = re.compile(rb"[\t\n\r\x20-\x7e]{6,}(?=\0)")
SYMBOL = re.compile(r"^\*?(?:_Z|N\d|St\d|NSt|St[a-z])|^pytorch\.|^\S*$")
MAX_RODATA = 1 << 30  # libtorch_cpu's .rodata is ~300 MB in 2.15
MAX_EXTRACT = 8 << 20  # an extraction is ~300 KB
SUFFIX = ".c10d.json"
FETCH = ("pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 "
         "torch==VERSION -d DIR (one at a time: its extraction is kept, the wheel can go)")


class Extraction(BaseModel):
    """A wheel's c10d strings as this module writes them (WHEEL.c10d.json)."""
    model_config = ConfigDict(extra="forbid")
    wheel: str = Field(pattern=r"^torch-[0-9][0-9.]*(?:-\d\w*)?-[\w.]+-[\w.]+-[\w.]+\.whl$")  # a build tag: 2.10.0-3
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    strings: dict[str, list[tuple[str, str]]]  # member -> (near, text), in .rodata order


def sections(stream: IO[bytes]) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) of an ELF64 little-endian file's sections, from its header and section table."""
    stream.seek(0)
    head = stream.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", head, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", head, 0x3A)
    if entsize < 64 or not 0 < count < 1 << 16 or names_index >= count:
        raise ValueError("its section header table is malformed")
    stream.seek(shoff)
    table = stream.read(entsize * count)
    rows = [struct.unpack_from("<IIQQQQ", table, i * entsize) for i in range(count) if len(table) >= (i + 1) * entsize]
    _, _, _, _, offset, size = rows[names_index]
    stream.seek(offset)
    names = stream.read(min(size, 1 << 20))
    return {names[r[0]:names.find(b"\0", r[0])].decode("ascii", "replace"): (r[4], r[5]) for r in rows if r[0] < len(names)}


def rodata_strings(stream: IO[bytes]) -> list[str]:
    """The NUL-terminated printable strings of the ELF file's .rodata, in order."""
    found = sections(stream).get(".rodata")
    if found is None or found[1] > MAX_RODATA:
        raise ValueError("it has no .rodata section" if found is None else "its .rodata is over 1 GiB")
    stream.seek(found[0])
    data = stream.read(found[1])
    return [m.group().decode("ascii") for m in STRING.finditer(data)]


def c10d_strings(strings: list[str]) -> list[tuple[str, str]]:
    """(near, text) of each string whose nearest compile-unit path is c10d's, `near` that path's
    file under torch/csrc/distributed/ (the rule of the module docstring, before the message shape)."""
    units = [i for i, s in enumerate(strings) if UNIT.search(s)]
    kept = []
    for index, text in enumerate(strings):
        at = bisect.bisect_right(units, index)
        near = min(units[max(at - 1, 0):at + 1], key=lambda u: abs(u - index), default=None)
        if near is not None and C10D in strings[near] and not UNIT.search(text):
            kept.append((strings[near].split("torch/csrc/distributed/", 1)[1], text))
    return kept


def is_message(text: str) -> bool:
    """A string with a message's shape: two words or more, not a symbol, a path or a counter's name."""
    return (len(text.split()) >= 2 and not SYMBOL.search(text) and not text.startswith("/")
            and sum(c.isalpha() for c in text) * 2 >= len(text.strip()))


def extract(wheel: Path, digest: str) -> Extraction:
    """The c10d strings of a torch wheel's libtorch_cuda.so and libtorch_cpu.so."""
    strings = {}
    try:
        with zipfile.ZipFile(wheel) as archive:
            for member in MEMBERS:
                with archive.open(member) as stream:
                    strings[member] = c10d_strings(rodata_strings(stream))
    except KeyError as e:
        raise EnvbuildError(f"--c10d-wheels: {wheel.name} has no {e.args[0]}; give the Linux x86_64 CUDA wheel "
                            f"the locks pin ({FETCH}).") from None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error) as e:
        raise EnvbuildError(f"--c10d-wheels: {wheel} cannot be read as a torch wheel ({e}); download it again "
                            f"({FETCH}).") from None
    return Extraction(wheel=wheel.name, sha256=digest, strings=strings)


def _save(path: Path, extraction: Extraction) -> None:
    """The extraction beside its wheel (a file of that name envbuild did not write is left alone)."""
    if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
        raise EnvbuildError(f"{path} exists and is not a regular file (a link or a device?); envbuild replaces only "
                            f"the extraction it wrote. Move it away and run again.")
    if path.exists():
        _read_extraction(path)  # refuses a file that is not an extraction envbuild wrote
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(extraction.model_dump(), indent=0, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def _read_extraction(path: Path) -> Optional[Extraction]:
    if not path.is_file() or path.is_symlink():
        return None
    if path.stat().st_size > MAX_EXTRACT:
        raise EnvbuildError(f"{path} is over {MAX_EXTRACT >> 20} MiB; an extraction is ~300 KB. Delete it and read "
                            f"the wheel again.")
    data = loads_json(path.read_bytes(), f"c10d extraction {path}", MAX_EXTRACT)
    return validated(Extraction, data, f"c10d extraction {path}")


def _candidates(directory: Path, release: str) -> Iterator[Path]:
    name = re.compile(rf"torch-{re.escape(release)}(?:-\d\w*)?-[\w.]+-[\w.]+-[\w.]*x86_64[\w.]*\.whl")
    return iter(sorted(p for p in Path(directory).iterdir() if name.fullmatch(p.name) and p.is_file()
                       and not p.is_symlink()))


def release_strings(directory: Path, release: str, hashes: set[str], progress) -> tuple[Optional[Extraction], str]:
    """The release's extraction: one saved beside a wheel, else read from a pinned wheel (and saved); or (None, why)."""
    saved = [e for e in (_read_extraction(Path(directory) / (p + SUFFIX)) for p in _saved_names(directory, release))
             if e is not None and e.sha256 in hashes]
    if saved:
        return saved[0], ""
    for wheel in _candidates(directory, release):
        digest = sha256_file(wheel)
        if digest in hashes:
            progress(f"c10d {wheel.name}")
            extraction = extract(wheel, digest)
            _save(wheel.with_name(wheel.name + SUFFIX), extraction)
            return extraction, ""
    return None, "no Linux x86_64 wheel (or its extraction) whose sha256 a lock pins"


def _saved_names(directory: Path, release: str) -> list[str]:
    return sorted(p.name[:-len(SUFFIX)] for p in Path(directory).iterdir()
                  if p.name.startswith(f"torch-{release}-") and p.name.endswith(SUFFIX))


def shipped_releases(matrix: Path) -> dict[str, set[str]]:
    """Each torch release the locks pin, oldest first, with the sha256 they accept."""
    pinned = {version: hashes for (_, version), hashes in pins(matrix / "locks", PIN).items()}
    try:
        return {r: pinned[r] for r in sorted(pinned, key=Version)}
    except InvalidVersion as e:
        raise EnvbuildError(f"{matrix}/locks: a torch pin is not a version ({e}); run `envbuild lock`.") from None


# An assertion's message names the file it was compiled from (`INTERNAL ASSERT FAILED at
# "<build dir>/aten/src/ATen/core/ivalue_inl.h":138`): one from a header c10d includes is not c10d's.
ASSERTED_AT = re.compile(r'at "([^"]+)":\d+')


def own(text: str) -> bool:
    """False for an assertion whose own message names a file outside c10d."""
    at = ASSERTED_AT.search(text)
    return at is None or C10D in at.group(1)


def messages(extraction: Extraction) -> dict[tuple[str, str], dict]:
    """(library, text) -> its first `near`, each printf-escaped message-shaped string ({} as %s)."""
    found: dict[tuple[str, str], dict] = {}
    for member, strings in sorted(extraction.strings.items()):
        library = member.rsplit("/", 1)[-1]
        for near, text in strings:
            if is_message(text) and own(text):
                wording = text.replace("%", "%%").replace("{}", "%s")
                found.setdefault((library, wording), {"near": near})
    return found


def derive(directory: Path, releases: dict[str, set[str]], progress=lambda _: None) -> dict:
    """The catalogue's data for these releases (oldest first) from the wheels or extractions in `directory`."""
    read, missing, per_release = [], [], {}
    for release, hashes in releases.items():
        extraction, why = release_strings(directory, release, hashes, progress)
        if extraction is None:
            missing.append({"release": release, "why": why})
            continue
        read.append({"release": release, "file": extraction.wheel, "sha256": extraction.sha256,
                     "url": f"https://pypi.org/project/torch/{release}/#files", "members": list(MEMBERS)})
        per_release[release] = messages(extraction)
    order = [r["release"] for r in read]
    entries = []
    for key in sorted({key for held in per_release.values() for key in held}):
        present = [r for r in order if key in per_release[r]]
        entries.append({"library": key[0], "text": key[1], "near": per_release[present[-1]][key]["near"],
                        "releases": spans(present, order)})
    return {"component": "c10d", "source": "https://github.com/pytorch/pytorch", "releases": read,
            "not_catalogued": missing, "messages": entries}


HEADER = comment(
    "What c10d's C++ can print, for each torch release the locks pin: the string literals of "
    "torch/lib/libtorch_cuda.so (ProcessGroupNCCL's watchdog and heartbeat monitor, NCCLUtils) and "
    "torch/lib/libtorch_cpu.so (TCPStore, its server and client sockets, Utils), read from the .rodata of "
    "the PyPI Linux x86_64 wheel (its file and sha256 under `releases`) and kept when the nearest "
    "compile-unit path string is under torch/csrc/distributed/c10d/ (`near`: that unit, a hint, not the "
    "source: the binary holds no file or line). A c10::str(...) message is several entries, one per fixed "
    "piece; fmt's {} is %s. `releases` the releases in which that exact piece exists. Generated by "
    "`envbuild matrix catalogue --c10d-wheels DIR` (see docs/doctor.md); do not edit. A release without its "
    "wheel or extraction in DIR is listed under `not_catalogued`.")


def render(data: dict) -> str:
    """One piece a line, so a refresh's diff shows the wordings that came or went."""
    return layout(HEADER, data, ("source",), ("releases", "not_catalogued", "messages"))


def summary(old: dict, new: dict) -> list[str]:
    return nccl_catalogue.summary(old, new, "c10d", lambda m: (m["library"], m["text"]))
