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

from envbuild.image import paths

DPKG_STATUS = "var/lib/dpkg/status"
OS_RELEASE = ("etc/os-release", "usr/lib/os-release")
PYVENV_CFG = paths.VENV.lstrip("/") + "/pyvenv.cfg"
# The records envbuild copies into an image, by the key the inventory gives each.
RECORDS = {"manifest": paths.MANIFEST, "lock": paths.LOCK, "extend_lock": paths.EXTEND_LOCK,
           "extensions": paths.EXTENSIONS_RECORD, "os_lock": paths.OS_LOCK}
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
    packages: list[dict] = field(default_factory=list)  # dpkg's installed packages (parse_dpkg_status)
    dists: dict[str, Dist] = field(default_factory=dict)  # canonical name (or name@location) -> Dist
    texts: dict[str, str] = field(default_factory=dict)  # path -> text of the small files read whole

    @property
    def debs(self) -> dict[str, str]:
        """name:arch -> version of each installed OS package."""
        return {f"{p['package']}:{p['architecture']}": p["version"] for p in self.packages}


def _normalize(name: str) -> str:
    return posixpath.normpath("/" + name).lstrip("/")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_dpkg_status(text: str) -> list[dict]:
    """The installed packages of dpkg's status file: package, version, architecture, and the
    source package (a `Source: name (version)` field keeps only its name).

    >>> parse_dpkg_status("Package: libc6\\nStatus: install ok installed\\nArchitecture: amd64\\n"
    ...                   "Source: glibc\\nVersion: 2.36-9\\nDescription: x\\n more\\n")
    [{'package': 'libc6', 'version': '2.36-9', 'architecture': 'amd64', 'source': 'glibc'}]
    """
    out = []
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", stanza, re.M))  # continuation lines start with a space
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            out.append({"package": fields["Package"], "version": fields.get("Version", ""),
                        "architecture": fields.get("Architecture", ""),
                        "source": fields.get("Source", fields["Package"]).split(" ")[0]})
    return sorted(out, key=lambda p: (p["package"], p["architecture"]))


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
                keep = path in _WHOLE or _DIST_INFO.match("/" + path)
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
    contents.texts = {path: captured[path].decode("utf-8", errors="replace") for path in _WHOLE if path in captured}
    contents.packages = parse_dpkg_status(contents.texts.get(DPKG_STATUS, ""))
    contents.dists = _dists(captured, contents.files)
    return contents


_WHOLE = {DPKG_STATUS, *OS_RELEASE, PYVENV_CFG, *(p.lstrip("/") for p in RECORDS.values())}


def inventory(contents: ImageContents) -> dict:
    """What the SBOM is made from and `envbuild verify` compares with: the OS packages, the Python
    distributions with where they live, the OS release, the venv's Python and envbuild's records,
    all read from the image's files (nothing in the image runs, so what it holds cannot lie
    about itself, and an image of any CPU architecture can be read)."""
    release = next((contents.texts[p] for p in OS_RELEASE if p in contents.texts), "")
    fields = dict(re.findall(r'^([A-Z_]+)="?([^"\n]*)"?$', release, re.M))
    venv = dict(re.findall(r"^([\w-]+) *= *(.*)$", contents.texts.get(PYVENV_CFG, ""), re.M))
    return {"schema": 1,
            "os": {"id": fields.get("ID", ""), "version_id": fields.get("VERSION_ID", ""),
                   "pretty_name": fields.get("PRETTY_NAME", "")},
            "dpkg": contents.packages,
            "python": sorted(({"name": d.name, "version": d.version, "location": "/" + d.location}
                              for d in contents.dists.values()), key=lambda d: (d["name"].lower(), d["version"],
                                                                                d["location"])),
            "python_version": venv.get("version_info") or venv.get("version", ""),
            "records": {key: contents.texts.get(path.lstrip("/")) for key, path in RECORDS.items()}}


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
