"""Read release facts from PyPI without downloading whole wheels.

Torch wheels are hundreds of MB, so members are read with HTTP range requests: the zip's
central directory from the end of the file, then one member's compressed bytes. Large
binaries are inflated as a stream and the read stops as soon as the wanted bytes appear.
Everything read from an artifact is cached on disk under its sha256 (artifacts on PyPI
never change), so a second run costs only the index pages.

fixtures.FixtureIndex serves the same interface from saved real files (offline tests).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import struct
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

from envbuild.base.errors import EnvbuildError

SIMPLE_URL = "https://pypi.org/simple/{project}/"
USER_AGENT = "envbuild-matrix-refresh (+https://pypi.org/project/envbuild)"
CHUNK = 1 << 20  # bytes per range request while stream-inflating a member


def default_cache_dir() -> Path:
    """Where downloaded index pages and sdists are kept between runs ($XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "envbuild" / "pypi"


@dataclass(frozen=True)
class DistFile:
    """One file of a release on the index (a wheel or an sdist)."""

    project: str
    filename: str
    url: str
    sha256: str
    size: int
    requires_python: Optional[str]
    yanked: bool

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")

    @property
    def version(self) -> Version:
        if self.is_wheel:
            return parse_wheel_filename(self.filename)[1]
        return parse_sdist_filename(self.filename)[1]

    @property
    def tags(self):
        return parse_wheel_filename(self.filename)[3] if self.is_wheel else frozenset()

    @property
    def build(self) -> tuple:
        return parse_wheel_filename(self.filename)[2] if self.is_wheel else ()

    @property
    def platforms(self) -> set[str]:
        return {t.platform for t in self.tags}


class Index(Protocol):
    """What the derivations need from a package index."""

    def files(self, project: str) -> list[DistFile]: ...
    def members(self, dist: DistFile) -> list[str]: ...
    def member(self, dist: DistFile, name: str) -> bytes: ...
    def search_member(self, dist: DistFile, name: str, pattern: bytes) -> Optional[bytes]: ...
    def sdist_files(self, dist: DistFile) -> dict[str, bytes]: ...


def _parse_files(project: str, data: dict, where: str) -> list[DistFile]:
    """PEP 691 JSON (`files` list) -> DistFile, skipping names packaging cannot parse."""
    out = []
    try:
        entries = data["files"]
    except (KeyError, TypeError):
        raise EnvbuildError(f"the index page {where} has no `files` list; the PEP 691 JSON format changed "
                            f"or the URL is not a simple index.") from None
    for f in entries:
        name = f.get("filename", "")
        try:
            if name.endswith(".whl"):
                parse_wheel_filename(name)
            elif name.endswith(".tar.gz"):
                parse_sdist_filename(name)
            else:
                continue
        except (InvalidWheelFilename, InvalidSdistFilename, ValueError):
            continue
        out.append(DistFile(project=project, filename=name, url=f.get("url", ""),
                            sha256=(f.get("hashes") or {}).get("sha256", ""), size=int(f.get("size") or 0),
                            requires_python=f.get("requires-python"), yanked=bool(f.get("yanked"))))
    return sorted(out, key=lambda d: d.filename)


# ---------------------------------------------------------------- zip structure


@dataclass(frozen=True)
class ZipEntry:
    name: str
    offset: int  # of the local file header
    compressed_size: int
    size: int
    method: int
    crc: int


def parse_central_directory(tail: bytes, tail_start: int, read) -> dict[str, ZipEntry]:
    """Parse a zip's central directory; `tail` holds the file's last bytes (from `tail_start`),
    `read(start, end)` fetches other ranges. Handles ZIP64 (torch wheels are > 4 GiB uncompressed)."""
    at = tail.rfind(b"PK\x05\x06")
    if at < 0:
        raise ValueError("no end-of-central-directory record")
    count, cd_size, cd_offset = struct.unpack("<HII", tail[at + 10:at + 20])
    z64 = tail.rfind(b"PK\x06\x06", 0, at)
    if z64 >= 0:
        count, cd_size, cd_offset = struct.unpack("<QQQ", tail[z64 + 32:z64 + 56])
    if cd_offset >= tail_start:
        cd = tail[cd_offset - tail_start:cd_offset - tail_start + cd_size]
    else:
        cd = read(cd_offset, cd_offset + cd_size)
    entries: dict[str, ZipEntry] = {}
    pos = 0
    while pos + 46 <= len(cd) and cd[pos:pos + 4] == b"PK\x01\x02":
        (method, crc, csize, usize, name_len, extra_len, comment_len, offset) = (
            struct.unpack("<H", cd[pos + 10:pos + 12])[0], *struct.unpack("<III", cd[pos + 16:pos + 28]),
            *struct.unpack("<HHH", cd[pos + 28:pos + 34]), struct.unpack("<I", cd[pos + 42:pos + 46])[0])
        name = cd[pos + 46:pos + 46 + name_len].decode("utf-8", "replace")
        extra = cd[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        if 0xFFFFFFFF in (csize, usize, offset):
            usize, csize, offset = _zip64_sizes(extra, usize, csize, offset)
        entries[name] = ZipEntry(name, offset, csize, usize, method, crc)
        pos += 46 + name_len + extra_len + comment_len
    if len(entries) != count:
        raise ValueError(f"central directory lists {len(entries)} of {count} entries")
    return entries


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[pos:pos + 4])
        body = extra[pos + 4:pos + 4 + length]
        if tag == 0x0001:
            values = list(struct.unpack(f"<{len(body) // 8}Q", body[:len(body) // 8 * 8]))
            if usize == 0xFFFFFFFF:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF:
                csize = values.pop(0)
            if offset == 0xFFFFFFFF:
                offset = values.pop(0)
        pos += 4 + length
    return usize, csize, offset


def sdist_text_files(data: bytes) -> dict[str, bytes]:
    """The .py/.txt/.cfg files of an sdist, keyed by path without the top directory."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for info in tar:
            if not info.isfile() or not info.name.endswith((".py", ".txt", ".cfg")):
                continue
            parts = info.name.split("/", 1)
            if len(parts) == 2:
                out[parts[1]] = tar.extractfile(info).read()
    return out


# ---------------------------------------------------------------- live index


class PyPI:
    """PyPI's simple JSON API plus range reads into files.pythonhosted.org, cached on disk."""

    def __init__(self, cache_dir: Path, simple_url: str = SIMPLE_URL, retries: int = 3,
                 unreachable_hint: str = " (or use --offline FIXTURE_DIR)"):
        self.unreachable_hint = unreachable_hint  # what the command reading PyPI can do instead
        self.cache = Path(cache_dir)
        self.simple_url = simple_url
        self.retries = retries
        self._files: dict[str, list[DistFile]] = {}
        self._dirs: dict[str, dict[str, ZipEntry]] = {}
        self.bytes_read = 0

    # HTTP ---------------------------------------------------------------
    def _get(self, url: str, headers: Optional[dict] = None) -> bytes:
        request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
        for attempt in range(self.retries):
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    body = response.read()
                    if headers and "Range" in headers and response.status != 206:
                        raise EnvbuildError(f"{url} ignored a range request (HTTP {response.status}); "
                                            f"refusing to download the whole file.")
                    self.bytes_read += len(body)
                    return body
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == self.retries - 1:
                    raise EnvbuildError(f"GET {url} failed: HTTP {e.code} {e.reason}.") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries - 1:
                    reason = getattr(e, "reason", e)
                    raise EnvbuildError(f"GET {url} failed: {reason}. PyPI must be reachable"
                                        f"{self.unreachable_hint}.") from None
            time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    def _range(self, dist: DistFile, start: int, end: int) -> bytes:
        data = self._get(dist.url, {"Range": f"bytes={start}-{end - 1}"})
        if len(data) != end - start:
            raise EnvbuildError(f"{dist.filename}: asked for {end - start} bytes at {start}, got {len(data)}.")
        return data

    # index ----------------------------------------------------------------
    def files(self, project: str) -> list[DistFile]:
        if project not in self._files:
            url = self.simple_url.format(project=project)
            body = self._get(url, {"Accept": "application/vnd.pypi.simple.v1+json"})
            try:
                data = json.loads(body)
            except ValueError:
                raise EnvbuildError(f"{url} did not answer PEP 691 JSON.") from None
            self._files[project] = _parse_files(project, data, url)
        return self._files[project]

    # cache ------------------------------------------------------------------
    def _cache_path(self, dist: DistFile, *parts: str) -> Path:
        key = dist.sha256 or hashlib.sha256(dist.url.encode()).hexdigest()
        return self.cache.joinpath(key[:2], key, *parts)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)

    # wheels ---------------------------------------------------------------
    def _directory(self, dist: DistFile) -> dict[str, ZipEntry]:
        if dist.filename in self._dirs:
            return self._dirs[dist.filename]
        cached = self._cache_path(dist, "central-directory.json")
        if cached.is_file():
            entries = {e[0]: ZipEntry(*e) for e in json.loads(cached.read_text())}
        else:
            tail_len = min(dist.size, 1 << 16)
            tail = self._range(dist, dist.size - tail_len, dist.size)
            try:
                entries = parse_central_directory(tail, dist.size - tail_len,
                                                  lambda a, b: self._range(dist, a, b))
            except (ValueError, struct.error) as e:
                raise EnvbuildError(f"{dist.filename} is not a readable zip ({e}).") from None
            self._write(cached, json.dumps([[e.name, e.offset, e.compressed_size, e.size, e.method, e.crc]
                                            for e in entries.values()]).encode())
        self._dirs[dist.filename] = entries
        return entries

    def members(self, dist: DistFile) -> list[str]:
        return sorted(self._directory(dist))

    def _entry(self, dist: DistFile, name: str) -> ZipEntry:
        try:
            return self._directory(dist)[name]
        except KeyError:
            raise EnvbuildError(f"{dist.filename} has no member {name}; the wheel layout changed.") from None

    def _data_start(self, dist: DistFile, entry: ZipEntry) -> int:
        header = self._range(dist, entry.offset, entry.offset + 30)
        if header[:4] != b"PK\x03\x04":
            raise EnvbuildError(f"{dist.filename}: no local header for {entry.name} at {entry.offset}.")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return entry.offset + 30 + name_len + extra_len

    def member(self, dist: DistFile, name: str) -> bytes:
        cached = self._cache_path(dist, "members", name)
        if cached.is_file():
            return cached.read_bytes()
        entry = self._entry(dist, name)
        start = self._data_start(dist, entry)
        raw = self._range(dist, start, start + entry.compressed_size) if entry.compressed_size else b""
        data = zlib.decompress(raw, -15) if entry.method == 8 else raw
        if zlib.crc32(data) != entry.crc:
            raise EnvbuildError(f"{dist.filename}: {name} failed its CRC check after a range read.")
        self._write(cached, data)
        return data

    def search_member(self, dist: DistFile, name: str, pattern: bytes) -> Optional[bytes]:
        """Inflate `name` chunk by chunk and return the first match of `pattern` (a regex),
        stopping there; None when the whole member holds no match."""
        key = hashlib.sha256(pattern).hexdigest()[:16]
        cached = self._cache_path(dist, "search", name + "." + key)
        if cached.is_file():
            data = cached.read_bytes()
            return data[1:] if data[:1] == b"+" else None
        entry = self._entry(dist, name)
        start = self._data_start(dist, entry)
        end = start + entry.compressed_size
        regex = re.compile(pattern)
        inflater = zlib.decompressobj(-15) if entry.method == 8 else None
        window = b""
        found = None
        for chunk_start in range(start, end, CHUNK):
            raw = self._range(dist, chunk_start, min(chunk_start + CHUNK, end))
            window += inflater.decompress(raw) if inflater else raw
            match = regex.search(window)
            if match:
                found = match.group(1) if regex.groups else match.group(0)
                break
            window = window[-4096:]
        self._write(cached, b"+" + found if found is not None else b"-")
        return found

    # sdists ---------------------------------------------------------------
    def sdist_files(self, dist: DistFile) -> dict[str, bytes]:
        cached = self._cache_path(dist, dist.filename)
        if cached.is_file():
            data = cached.read_bytes()
        else:
            data = self._get(dist.url)
            if dist.sha256 and hashlib.sha256(data).hexdigest() != dist.sha256:
                raise EnvbuildError(f"{dist.filename}: sha256 does not match the index.")
            self._write(cached, data)
        return sdist_text_files(data)
