"""The OS lock: every Debian/Ubuntu package an image installs, dependencies included, at its
exact version with the sha256 of its ``.deb`` as the archive's index gives it, and the archive
snapshot it was resolved from.

The Python lock (:mod:`envbuild.knowledge.lock`) pins the venv; without this file the OS layers float: a
rebuild next month gets another g++, other verbs libraries, another libc patch release. The OS
lock closes that gap the way ``pip --require-hashes`` closes it for Python:

- **Resolved by apt itself, on the base itself.** ``envbuild lock --os`` runs apt's solver in a
  throwaway container of each stage's base image (steps/os-resolve.sh), so the answer is what a
  build on that base would install. It installs nothing. That driver is
  :mod:`envbuild.resolve.oslocking`; this module is the file's format, the parts a build reads,
  and the checks a build makes of the archive it names.
- **One set per stage, for every request.** A stage's packages depend on the request
  (``--no-compiler``, ``--fabric``, ops that need libaio), so the lock holds the closure of
  everything any request may ask of that stage (:func:`stage_inputs`); a build pins apt to those
  versions, and apt cannot choose anything else.
- **From a moment of the archive.** A build installs from the snapshot service at the lock's
  timestamp (bases.yaml ``apt.snapshot``), or from a lab's mirror of it (``--apt-snapshot``).
- **Checked twice.** Before installing, the build checks that the base is the one the lock was
  resolved on (its package set) and every downloaded ``.deb`` against the lock's sha256, before
  dpkg sees it; afterwards, that every installed package is the base's or the lock's.

A lock lives in ``<matrix>/locks/os/<stack>.<arch>.txt``:

>>> text = '''# envbuild os lock
... # stack: s1
... # arch: x86_64
... # family: debian12
... # snapshot: 20261126T000000Z
... # source: debian bookworm / main
...
... # [builder]
... # base: local/debian:bookworm
... # base-id: sha256:aa
... # inputs: g++
... base libc6 amd64 2.36-9
... deb g++ amd64 4:12.2.0-3 ''' + "ab" * 32 + ''' 1640 debian pool/main/g/gcc-defaults/g++_12.2.0-3_amd64.deb
... '''
>>> lock = parse_os_lock(text, "s1.x86_64.txt")
>>> lock.stages["builder"].debs[0].pin
'g++=4:12.2.0-3'
>>> lock.stages["builder"].base
(('libc6', 'amd64', '2.36-9'),)
"""


from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_text
from envbuild.base.grammar import redact, shown

OS_LOCK_DIR = "locks/os"
STAGES = ("builder", "runtime")
MAGIC = "# envbuild os lock"
TIMESTAMP = re.compile(r"^\d{8}T\d{6}Z\Z")  # the snapshot services' moment: YYYYMMDDTHHMMSSZ (UTC)


def is_moment(text: str) -> bool:
    """A snapshot moment that exists (20261399T999999Z has the shape and names no moment).

    >>> is_moment("20261126T093000Z"), is_moment("20261399T999999Z")
    (True, False)
    """
    try:
        return bool(TIMESTAMP.match(text)) and bool(dt.datetime.strptime(text, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        return False

# Debian's grammar for the parts of a line (deb-version(7), the archive's pool paths): what the
# build's shell reads as one word each; anything else in a lock is refused where it is read.
_NAME = r"[a-z0-9][a-z0-9+.-]+"
_ARCH = r"[a-z0-9][a-z0-9-]*"
_VERSION = r"(?:[0-9]+:)?[A-Za-z0-9][A-Za-z0-9.+~-]*"
_BASE = re.compile(rf"^base ({_NAME}) ({_ARCH}) ({_VERSION})$")
_DEB = re.compile(rf"^deb ({_NAME}) ({_ARCH}) ({_VERSION}) ([0-9a-f]{{64}}) ([0-9]{{1,12}}) ({_NAME}) "
                  r"(pool/[A-Za-z0-9._+~/-]+\.deb)$")
_SECTION = re.compile(r"^# \[(?P<name>[a-z]+)\]$")
_FIELD = re.compile(r"^# (?P<key>[a-z-]+): (?P<value>.*)$")
_WORDS = re.compile(rf"^{_NAME}(?: {_NAME})*$")  # archive, suites, components: apt's words


@dataclass(frozen=True)
class Deb:
    """One locked package: what apt installs, and the file it must be."""

    name: str
    arch: str
    version: str
    sha256: str
    size: int
    archive: str  # which of the lock's archives holds it (debian, debian-security, ubuntu)
    filename: str  # its path in that archive (pool/...)

    @property
    def pin(self) -> str:
        return f"{self.name}={self.version}"

    def line(self) -> str:
        return f"deb {self.name} {self.arch} {self.version} {self.sha256} {self.size} {self.archive} {self.filename}"


@dataclass(frozen=True)
class StageLock:
    """One stage's part: the base it was resolved on and the packages its steps may install."""

    base_ref: str  # the base image as the build names it (ref@digest where a digest is known)
    base_id: str  # the image ID (config digest) apt ran in
    inputs: tuple[str, ...]  # what was asked for: every package any request may install in this stage
    base: tuple[tuple[str, str, str], ...]  # (name, arch, version) the base had
    debs: tuple[Deb, ...]

    @property
    def digest(self) -> Optional[str]:
        return self.base_ref.split("@", 1)[1] if "@" in self.base_ref else None

    @property
    def base_name(self) -> str:
        """The base without its digest: what a matrix row or --base-image names."""
        return self.base_ref.split("@", 1)[0]


@dataclass(frozen=True)
class OsLock:
    path: str
    text: str
    header: dict[str, str]
    sources: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]  # (archive, suites, components)
    stages: dict[str, StageLock]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def snapshot(self) -> str:
        return self.header["snapshot"]

    def packages(self) -> int:
        return len({d.pin for s in self.stages.values() for d in s.debs})

    def snapshot_url(self, template: str) -> str:
        """The archive as of the lock's moment, {archive} left for each source to fill in."""
        return archive_url(template, "{archive}", self.snapshot)

    def stage_part(self, stage: str, snapshot_url: str, keyring: str, check_valid_until: bool) -> str:
        """What a build step reads (steps/os.sh): where the archive is, its sources, and the stage's
        base and packages, one item a line, each word of the lock's grammar."""
        s = self.stages[stage]
        lines = [f"# envbuild os lock part: stage {stage} of {self.header['stack']} ({self.header['arch']}), "
                 f"{self.path.rsplit('/', 1)[-1]} sha256 {self.sha256}",
                 f"snapshot {snapshot_url}", f"moment {self.snapshot}", f"keyring {keyring}",
                 f"valid-until {'yes' if check_valid_until else 'no'}"]
        lines += [f"source {archive} {suite} {' '.join(components)}"
                  for archive, suites, components in self.sources for suite in suites]
        lines += [f"base {n} {a} {v}" for n, a, v in s.base]
        lines += [d.line() for d in s.debs]
        return "\n".join(lines) + "\n"


def os_lock_path(matrix_dir: Path, stack_id: str, arch: str) -> Path:
    return Path(matrix_dir) / OS_LOCK_DIR / f"{stack_id}.{arch}.txt"


# ---------------------------------------------------------------- the file


def parse_os_lock(text: str, path: str = "<os lock>") -> OsLock:
    """Parse an OS lock; a line that is not of the grammar is an error naming it (the build
    hands these words to apt and the shell, so nothing else may pass)."""
    if not text.startswith(MAGIC):
        raise EnvbuildError(f"{path} is not an envbuild OS lock (it does not start with '{MAGIC}'); "
                            f"regenerate it with `envbuild lock --os`.")
    header, sources, stages = _read_lines(text, path)
    return _checked(path, text, header, sources, stages)


def _read_lines(text: str, path: str) -> tuple[dict, list, dict]:
    """The header fields, the sources and each stage's fields and lines, every line by its grammar."""
    header: dict[str, str] = {}
    sources: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []
    stages: dict[str, dict] = {}
    stage: Optional[dict] = None

    def bad(number: int, line: str, what: str) -> EnvbuildError:
        return EnvbuildError(f"{path}:{number}: {what}: {line.strip()[:120]!r}. An OS lock is written by "
                             f"`envbuild lock --os`; regenerate it rather than edit it.")

    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        section = _SECTION.match(line)
        if section:
            name = section.group("name")
            if name not in STAGES or name in stages:
                raise bad(number, line, f"unknown or repeated section (known: {', '.join(STAGES)})")
            stage = stages[name] = {"fields": {}, "base": [], "debs": []}
            continue
        field = _FIELD.match(line)
        if field:
            key, value = field.group("key"), field.group("value")
            if stage is not None:
                stage["fields"][key] = value
            elif key == "source":
                words = value.split(" / ")
                if len(words) != 2 or not all(_WORDS.match(w) for w in words) or len(words[0].split()) < 2:
                    raise bad(number, line, "a source is 'ARCHIVE SUITE... / COMPONENT...'")
                archive, *suites = words[0].split()
                sources.append((archive, tuple(suites), tuple(words[1].split())))
            else:
                header[key] = value
            continue
        if line.startswith("#"):
            continue
        if stage is None:
            raise bad(number, line, "a package line before any [stage] section")
        base, deb = _BASE.match(line), _DEB.match(line)
        if base:
            stage["base"].append(base.groups())
        elif deb:
            name, arch, version, sha, size, archive, filename = deb.groups()
            if ".." in filename.split("/"):
                raise bad(number, line, "a pool path may not climb out of the archive")
            stage["debs"].append(Deb(name, arch, version, sha, int(size), archive, filename))
        else:
            raise bad(number, line, "not 'base NAME ARCH VERSION' nor 'deb NAME ARCH VERSION SHA256 SIZE ARCHIVE "
                                    "POOL-PATH' (a sha256 is 64 lower-case hex digits)")
    return header, sources, stages


def _checked(path: str, text: str, header: dict, sources: list, stages: dict) -> OsLock:
    """The lock as a whole: its required fields, its snapshot's moment, each stage's base, and no
    package from an archive no source names."""
    for key in ("stack", "arch", "snapshot"):
        if key not in header:
            raise EnvbuildError(f"{path}: no '# {key}:' line; regenerate it with `envbuild lock --os`.")
    if not is_moment(header["snapshot"]):
        raise EnvbuildError(f"{path}: snapshot {header['snapshot']!r} is not a moment like 20261126T093000Z; "
                            f"regenerate it with `envbuild lock --os`.")
    if not sources:
        raise EnvbuildError(f"{path}: no '# source:' line; regenerate it with `envbuild lock --os`.")
    archives = {a for a, _, _ in sources}
    out = {}
    for name, s in stages.items():
        for key in ("base", "base-id"):
            if key not in s["fields"]:
                raise EnvbuildError(f"{path}: section [{name}] has no '# {key}:' line; regenerate it.")
        strays = sorted({d.archive for d in s["debs"]} - archives)
        if strays:
            raise EnvbuildError(f"{path}: [{name}] names archive {strays[0]}, which no '# source:' line has.")
        out[name] = StageLock(s["fields"]["base"], s["fields"]["base-id"],
                              tuple(s["fields"].get("inputs", "").split()), tuple(s["base"]), tuple(s["debs"]))
    return OsLock(path, text, header, tuple(sources), out)


def load_os_lock(matrix_dir: Path, stack_id: str, arch: str) -> Optional[OsLock]:
    path = os_lock_path(matrix_dir, stack_id, arch)
    if not path.is_file():
        return None
    return parse_os_lock(read_text(path, "OS lock", "matrix"), str(path))


def format_os_lock(header: dict[str, str], sources, stages: dict[str, StageLock]) -> str:
    """The lock's text: a header, then one section per stage (base lines, then deb lines, sorted)."""
    lines = [
        f"{MAGIC}: every Debian/Ubuntu package the image of stack {header['stack']} ({header['arch']})",
        "# installs, dependencies included, at its exact version with the sha256 of its .deb as the",
        "# archive's index gives it. The build installs these from the archive as of `snapshot` and checks",
        "# every .deb before dpkg sees it. Do not edit: `envbuild lock --os` writes it.",
        *(f"# {key}: {header[key]}" for key in header),
        *(f"# source: {archive} {' '.join(suites)} / {' '.join(components)}" for archive, suites, components in sources),
    ]
    for name in STAGES:
        if name not in stages:
            continue
        s = stages[name]
        lines += ["", f"# [{name}]", f"# base: {s.base_ref}", f"# base-id: {s.base_id}",
                  f"# inputs: {' '.join(s.inputs)}"]
        lines += [f"base {n} {a} {v}" for n, a, v in sorted(s.base)]
        lines += [d.line() for d in sorted(s.debs, key=lambda d: (d.name, d.arch))]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- what a stage may install


def stage_inputs(family, python: str, stage: str) -> tuple[str, ...]:
    """Every OS package any request may ask of `stage`: the stage's own, the compiler (the
    runtime drops it only with --no-compiler), and each capability's (libaio for async_io, the
    fabrics' user space; the builder also gets the runtime's, which --keep-toolchain installs there)."""
    python_pkg = family.python[python]
    own = family.builder_packages if stage == "builder" else family.runtime_packages
    wanted = [*own, *family.compiler_packages]
    for capability in family.capabilities.values():
        wanted += capability.get("builder", []) if stage == "builder" else []
        wanted += capability.get("runtime", [])
    return tuple(dict.fromkeys(p.replace("{python}", python_pkg) for p in wanted))


# ---------------------------------------------------------------- where the archive is


def archive_url(template: str, archive: str, timestamp: str) -> str:
    return template.replace("{archive}", archive).replace("{timestamp}", timestamp)


def check_snapshot_template(flag: str, value: Optional[str], live_ok: bool = False) -> None:
    """--apt-snapshot: an http(s) URL template holding {archive} (and, to install, {timestamp}
    or a mirror frozen at the lock's moment); `live` (lock only) means the live archive."""
    if value is None or (live_ok and value == "live"):
        return
    example = "http://mirror.example/snapshot/{archive}/{timestamp}"
    bad = sorted({c for c in value if c.isspace() or ord(c) < 32 or ord(c) == 127 or c in "'\"\\|&;$`<>#?"})
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018  (raises on a port no build can reach: 99999, 'x')
    except ValueError:
        raise EnvbuildError(f"{flag} {shown(redact(value))} has a port that is not a number from 1 to 65535; give the "
                            f"URL of the archive as of the lock's moment, e.g. {flag} '{example}'.") from None
    if "{archive}" in parts.netloc or "{timestamp}" in parts.netloc:
        raise EnvbuildError(f"{flag} {shown(redact(value))}: {{archive}} and {{timestamp}} go in the URL's path, not "
                            f"its host; e.g. {flag} '{example}'.")
    if bad or parts.scheme not in ("http", "https") or not parts.hostname or "{archive}" not in value:
        what = (f"contains {' '.join(repr(c) for c in bad)}" if bad else
                "is not an http(s) URL" if parts.scheme not in ("http", "https") or not parts.hostname else
                "has no {archive} (the archive's name: debian, debian-security, ubuntu)")
        raise EnvbuildError(f"{flag} {shown(redact(value))} {what}; give the URL of the archive as of the lock's moment "
                            f"with {{archive}} (and {{timestamp}}) where its name goes, e.g. {flag} '{example}'"
                            + (", or 'live' for the live archive" if live_ok else "") + ".")
    rest = value.replace("{archive}", "").replace("{timestamp}", "")
    if "{" in rest or "}" in rest:
        raise EnvbuildError(f"{flag} '{redact(value)}': the only placeholders are {{archive}} and {{timestamp}}; "
                            f"e.g. {flag} '{example}'.")


# ---------------------------------------------------------------- before a build


def check_reachable(lock: OsLock, snapshot_template: str, override: Optional[str] = None,
                    cafile: Optional[str] = None, timeout: float = 20) -> None:
    """Before a build: each suite's signed index at the lock's moment can be fetched from here
    (the build fetches it the same way, on the host's network). An archive that cannot be reached
    is exit 2 naming the URL, not a build that fails after minutes with every version "missing"."""
    import base64  # noqa: PLC0415  (only a build needs these)
    import ssl  # noqa: PLC0415
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    template = (override or snapshot_template).replace("{timestamp}", lock.snapshot)
    context = ssl.create_default_context()
    if cafile:
        context.load_verify_locations(cafile)
    for archive, suites, _ in lock.sources:
        for suite in suites:
            url = f"{archive_url(template, archive, lock.snapshot).rstrip('/')}/dists/{suite}/InRelease"
            parts = urlsplit(url)
            request = urllib.request.Request(url.replace(f"{parts.username}:{parts.password}@", "")
                                             if parts.username else url)
            if parts.username:
                token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
                request.add_header("Authorization", f"Basic {token}")
            try:
                with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                    response.read(1)
            except (urllib.error.URLError, OSError, ValueError) as e:
                reason = getattr(e, "reason", None) or e
                raise EnvbuildError(
                    f"the archive as of the OS lock's moment ({lock.snapshot}) cannot be reached from here: "
                    f"{redact(url)} ({reason}). The build installs {lock.header['stack']}'s locked OS packages "
                    f"from it: build where {'that mirror' if override else 'the snapshot service'} is reachable, "
                    f"or give --apt-snapshot a mirror of that moment ({{archive}} and {{timestamp}} in its URL).")
