"""What an image holds, read from its filesystem as one tar stream (`docker export`): every
file by content hash, the OS packages dpkg recorded, and the Python distributions with a hash
of their files. No container runs and nothing is unpacked to disk; mtimes are not read, so two
builds of the same content compare equal whenever the engine wrote them.

>>> import io, tarfile
>>> buf = io.BytesIO()
>>> with tarfile.open(fileobj=buf, mode="w") as tar:
...     for name, data in [("var/lib/dpkg/status", b"Package: libc6\\nStatus: install ok installed\\n"
...                         b"Architecture: amd64\\nVersion: 2.36-9\\n\\n"),
...                        ("opt/venv/lib/python3.11/site-packages/six.py", b"x = 1\\n"),
...                        ("opt/venv/lib/python3.11/site-packages/six-1.16.0.dist-info/METADATA",
...                         b"Name: six\\nVersion: 1.16.0\\n"),
...                        ("opt/venv/lib/python3.11/site-packages/six-1.16.0.dist-info/RECORD",
...                         b"six.py,,\\nsix-1.16.0.dist-info/METADATA,,\\n")]:
...         info = tarfile.TarInfo(name); info.size = len(data); tar.addfile(info, io.BytesIO(data))
>>> c = read_contents(io.BytesIO(buf.getvalue()))
>>> c.debs, c.dists["six"].version, len(c.files)
({'libc6:amd64': '2.36-9'}, '1.16.0', 4)
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import tarfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from typing import BinaryIO, Optional

DPKG_STATUS = "var/lib/dpkg/status"
_DIST_INFO = re.compile(r"^(?P<site>.*/(?:site|dist)-packages)/(?P<dir>[^/]+\.dist-info)/(?P<file>METADATA|RECORD)$")
_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink",
          tarfile.DIRTYPE: "dir", tarfile.FIFOTYPE: "fifo", tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block"}
CAPTURE_LIMIT = 64 << 20  # dpkg's status file and a dist's RECORD: far below this in any image


@dataclass(frozen=True)
class FileEntry:
    kind: str  # file, symlink, hardlink, dir, ...
    mode: int
    owner: str  # uid:gid
    content: str  # sha256 of a file, the target of a link, "" otherwise
    size: int = 0

    def describe(self) -> str:
        what = {"file": f"sha256 {self.content[:12]}, {self.size} bytes",
                "symlink": f"-> {self.content}", "hardlink": f"=> {self.content}"}.get(self.kind, self.kind)
        return f"{what}, mode {self.mode:o}, owner {self.owner}"


@dataclass(frozen=True)
class Dist:
    """A Python distribution as installed: its name and version, and one hash of every file its
    RECORD lists (so a rebuilt wheel of the same version with other bytes is not 'the same')."""

    name: str
    version: str
    files: str  # sha256 over the RECORD's paths and the hashes of those files in the image
    location: str  # its site-packages directory


@dataclass
class ImageContents:
    files: dict[str, FileEntry] = field(default_factory=dict)
    debs: dict[str, str] = field(default_factory=dict)  # name:arch -> version (installed)
    dists: dict[str, Dist] = field(default_factory=dict)  # canonical name (or name@location) -> Dist


def _normalize(name: str) -> str:
    return posixpath.normpath("/" + name).lstrip("/")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_dpkg_status(text: str) -> dict[str, str]:
    """name:arch -> version of every installed package in dpkg's status file."""
    out = {}
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", stanza, re.M))
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            out[f"{fields['Package']}:{fields.get('Architecture', '')}"] = fields.get("Version", "")
    return out


def read_contents(stream: BinaryIO) -> ImageContents:
    """Read an image filesystem tar (as `docker export` streams it) in one pass."""
    contents = ImageContents()
    captured: dict[str, bytes] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            path = _normalize(member.name)
            kind = _KINDS.get(member.type, "other")
            content, size = "", 0
            if member.isfile():
                reader = tar.extractfile(member)
                digest = hashlib.sha256()
                keep = path == DPKG_STATUS or _DIST_INFO.match("/" + path)
                chunks = []
                while True:
                    block = reader.read(1 << 20)
                    if not block:
                        break
                    digest.update(block)
                    if keep and sum(map(len, chunks)) < CAPTURE_LIMIT:
                        chunks.append(block)
                content, size = digest.hexdigest(), member.size
                if keep:
                    captured[path] = b"".join(chunks)
            elif member.issym() or member.islnk():
                content = _normalize(member.linkname) if member.islnk() else member.linkname
            contents.files[path] = FileEntry(kind, member.mode & 0o7777, f"{member.uid}:{member.gid}", content, size)
    if DPKG_STATUS in captured:
        contents.debs = parse_dpkg_status(captured[DPKG_STATUS].decode("utf-8", errors="replace"))
    contents.dists = _dists(captured, contents.files)
    return contents


def _dists(captured: dict[str, bytes], files: dict[str, FileEntry]) -> dict[str, Dist]:
    out: dict[str, Dist] = {}
    for path in sorted(captured):
        match = _DIST_INFO.match("/" + path)
        if not match or match.group("file") != "METADATA":
            continue
        site, directory = match.group("site").lstrip("/"), match.group("dir")
        headers = HeaderParser().parsestr(captured[path].decode("utf-8", errors="replace"))
        name, version = headers.get("Name", directory), headers.get("Version", "")
        record = captured.get(f"{site}/{directory}/RECORD", b"").decode("utf-8", errors="replace")
        digest = hashlib.sha256()
        for listed in sorted({line.split(",", 1)[0] for line in record.splitlines() if line.strip()}):
            where = _normalize(posixpath.join(site, listed))
            entry: Optional[FileEntry] = files.get(where)
            digest.update(f"{listed}\0{entry.content if entry else 'missing'}\n".encode())
        key = canonical(name)
        if key in out:  # the same name in two environments (the venv and the OS's Python)
            key = f"{key}@{site}"
        out[key] = Dist(name, version, digest.hexdigest(), site)
    return out
