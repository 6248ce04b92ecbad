"""Derive matrices/catalogues/deepspeed.yaml and triton.yaml: what DeepSpeed and Triton can print,
per release the matrix ships.

The messages are read, never imported or run, from what PyPI serves for each release: DeepSpeed's
sdist (`pip download --no-deps --no-binary :all: deepspeed==0.19.8 -d DIR`) for each release
matrices/deepspeed.yaml lists, and Triton's wheel for each `triton==` the locks in matrices/locks/
pin (`pip download --no-deps --only-binary=:all: triton==3.6.0 ...`). An archive is used only if
its sha256 is one a lock pins (a release no lock pins, as some DeepSpeed releases of
deepspeed.yaml, is read from the one sdist PyPI serves, and recorded as not locked).

The Python is read by torch.distributed's rule (torch_catalogue.extract: each `raise`, logger
call and `warnings.warn` whose message is a literal, an f-string, `.format()` or `%`), with what
each package adds to it: DeepSpeed's op builders print their warnings (`print(f"{WARNING} ...")`,
`self.warning(...)`), Triton's exceptions word their message in `__str__` (OutOfResources). C
sources in a wheel (Triton's backends/nvidia/driver.c, compiled at run time) are read by the C
rule of the NCCL catalogue (nccl_catalogue.format_calls) for `PyErr_SetString`/`PyErr_Format`, and
gpuAssert's `Triton Error [CUDA]: ` prefix. The catalogues are collated and written like the
others: one wording an entry with its level, the exception, the file and line in the newest
release that has it and the releases in which that exact wording exists. Same archives, same bytes.
"""

from __future__ import annotations

import re
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from packaging.version import InvalidVersion, Version

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import sha256_file
from envbuild.refresh import nccl_catalogue, torch_catalogue
from envbuild.refresh.cuda_catalogue import pins
from envbuild.refresh.nccl_catalogue import collate, comment, format_calls, layout, line_finder

MAX_MEMBER = 4 << 20  # the largest file read (DeepSpeed's builder.py, Triton's compiler.py) is ~100 KB
C_RAISE = re.compile(r"(?<![\w#])PyErr_(?:SetString|Format)\s*\(\s*PyExc_(\w+)\s*,")
C_PREFIX = re.compile(r'const\s+char\s*\*\s*(\w+)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*;')


def c_extract(source: str, path: str) -> list[dict]:
    """What a C extension raises: each PyErr_SetString/PyErr_Format format string (the exception its
    level's `error`), and a prefix strcat'ed before another string and then raised (Triton's
    gpuAssert: `Triton Error [CUDA]: ` and cuGetErrorString's text, a `%s`)."""
    found = [{"level": "RAISE", "error": error, "text": text, "file": path, "line": line}
             for error, text, line in format_calls(source, C_RAISE, {})]
    line_of = line_finder(source)
    for prefix in C_PREFIX.finditer(source):
        after = source[prefix.end():prefix.end() + 400]
        joined = re.search(rf"strcat\(\s*(\w+)\s*,\s*{prefix.group(1)}\s*\)\s*;\s*strcat\(\s*\1\s*,\s*\w+\s*\)", after)
        raised = C_RAISE.search(source, prefix.end())
        if joined and raised and raised.start() - prefix.end() < 600:
            text = re.sub(r"\\(.)", r"\1", prefix.group(2)).replace("%", "%%") + "%s"
            found.append({"level": "RAISE", "error": raised.group(1), "text": text, "file": path,
                          "line": line_of(prefix.start())})
    return found


@dataclass(frozen=True)
class Package:
    """A package whose messages are catalogued from what PyPI serves: which archives, which files."""
    name: str
    title: str
    project: str  # on PyPI
    url: str  # its repository, for the source line at the release's tag
    kind: str  # "sdist" or "wheel"
    pin: re.Pattern  # its line in a lock: group 1 the name, group 2 the version
    wanted: Callable[[str], bool]  # an archive member (the sdist's top directory left out) whose messages are read
    rule: dict  # what it prints with, beyond torch.distributed's rule (torch_catalogue.extract)
    reads: str  # what is read, for the header
    fetch: str  # how to download one release
    paths: dict = field(default_factory=dict)  # member prefix -> its path in the repository


def _deepspeed_file(path: str) -> bool:
    if not path.endswith(".py"):
        return False
    return (path.startswith("deepspeed/launcher/") or re.fullmatch(r"op_builder/[^/]+\.py", path) is not None
            or path.startswith("deepspeed/ops/") and not path.startswith("deepspeed/ops/op_builder/"))


def _triton_file(path: str) -> bool:
    return (re.fullmatch(r"triton/(compiler|runtime|backends|backends/nvidia)/[^/]+\.py", path) is not None
            or path in ("triton/errors.py", "triton/backends/nvidia/driver.c"))


PACKAGES = {p.name: p for p in (
    Package("deepspeed", "DeepSpeed", "deepspeed", "https://github.com/deepspeedai/DeepSpeed", "sdist",
            re.compile(r"^(deepspeed)==([0-9][0-9.]*)\b"), _deepspeed_file, {"owners": ("self",), "prints": True},
            "its launcher (deepspeed/launcher/*.py: runner, launch, multinode_runner) and its op loading "
            "(op_builder/*.py: builder.py's JIT and compatibility checks and each op's builder; deepspeed/ops/**/*.py)",
            "pip download --no-deps --no-binary :all: deepspeed==VERSION -d DIR"),
    Package("triton", "Triton", "triton", "https://github.com/triton-lang/triton", "wheel",
            re.compile(r"^(triton)==([0-9][0-9.]*)\b"), _triton_file, {"exception_str": True},
            "its compiler and runtime (triton/compiler, triton/runtime, triton/backends and the NVIDIA backend's "
            "Python, triton/errors.py; an exception's __str__) and the NVIDIA driver's C (backends/nvidia/driver.c)",
            "pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 "
            "triton==VERSION -d DIR",
            {"triton/backends/nvidia/": "third_party/nvidia/backend/", "triton/": "python/triton/"}),
)}


def package(name: str) -> Package:
    if name not in PACKAGES:
        raise EnvbuildError(f"no package catalogue named {name!r}; known: {', '.join(PACKAGES)}.")
    return PACKAGES[name]


def shipped_releases(pkg: Package, matrix: Path) -> dict[str, set[str]]:
    """release -> the sha256 the locks accept for it ({} where no lock pins it), oldest first: DeepSpeed's
    from matrices/deepspeed.yaml (and the locks), Triton's from the locks."""
    pinned = {version: hashes for (_, version), hashes in pins(matrix / "locks", pkg.pin).items()}
    releases = set(pinned)
    if pkg.name == "deepspeed":
        path = matrix / "deepspeed.yaml"
        listed = nccl_catalogue.parse(path.read_text(encoding="utf-8"), path) if path.is_file() else {}
        releases |= {str(r.get("deepspeed")) for r in listed.get("releases") or [] if isinstance(r, dict)}
    try:
        ordered = sorted(releases, key=Version)
    except InvalidVersion as e:
        raise EnvbuildError(f"{matrix}: a {pkg.title} release is not a version ({e}); run `envbuild matrix refresh`.") from None
    return {r: pinned.get(r, set()) for r in ordered}


def _archive(pkg: Package, directory: Path, release: str, hashes: set[str]) -> tuple[Optional[Path], str]:
    """The downloaded archive of the release (one whose sha256 a lock pins, where one does), with its
    sha256; or (None, why)."""
    name = re.escape(pkg.project.replace("-", "_"))
    pattern = re.compile(rf"{name}-{re.escape(release)}\.tar\.gz" if pkg.kind == "sdist" else
                         rf"{name}-{re.escape(release)}(-\d+)?-[\w.]+-[\w.]+-[\w.]+\.whl")
    found = sorted(p for p in Path(directory).iterdir() if pattern.fullmatch(p.name) and p.is_file()
                   and not p.is_symlink())
    for path in found:
        digest = sha256_file(path)
        if not hashes or digest in hashes:
            return path, digest
    return None, f"no {pkg.kind} of it in the directory" if not found else f"no {pkg.kind} whose sha256 a lock pins"


def members(path: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, str]]:
    """(path, text) of each wanted file of a wheel or an sdist (its top directory left out), by path."""
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as wheel:
            chosen = sorted((i for i in wheel.infolist() if wanted(i.filename)), key=lambda i: i.filename)
            for info in chosen:
                _check_size(path, info.filename, info.file_size)
                yield info.filename, wheel.read(info).decode("utf-8", "replace")
        return
    with tarfile.open(path, "r:gz") as sdist:
        chosen = sorted((m for m in sdist.getmembers() if m.isfile() and "/" in m.name
                         and wanted(m.name.split("/", 1)[1])), key=lambda m: m.name)
        for member in chosen:
            _check_size(path, member.name, member.size)
            yield member.name.split("/", 1)[1], sdist.extractfile(member).read().decode("utf-8", "replace")


def _check_size(path: Path, name: str, size: int):
    if size > MAX_MEMBER:
        raise EnvbuildError(f"{path}: {name} is over {MAX_MEMBER >> 20} MiB; no source file of it is. Give the "
                            f"archives `pip download` fetched.")


def messages_of(pkg: Package, path: Path) -> dict[tuple[str, str, str], dict]:
    """Each (level, error, text) of one release's archive, at its first place in file order."""
    found: dict[tuple[str, str, str], dict] = {}
    try:
        for name, text in members(path, pkg.wanted):
            said = c_extract(text, name) if name.endswith(".c") else torch_catalogue.extract(text, name, **pkg.rule)
            for message in said:
                found.setdefault((message["level"], message["error"], message["text"]), message)
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as e:
        raise EnvbuildError(f"--{pkg.name}-{pkg.kind}s: {path} cannot be read as a {pkg.kind} ({e}); download it "
                            f"again with `{pkg.fetch}`.") from None
    return found


def derive(pkg: Package, directory: Path, releases: dict[str, set[str]], progress=lambda _: None) -> dict:
    """The catalogue's data for these releases (oldest first) from the archives in `directory`."""
    read, missing, per_release = [], [], {}
    for release, hashes in releases.items():
        path, digest = _archive(pkg, directory, release, hashes)
        if path is None:
            missing.append({"release": release, "why": digest})
            continue
        progress(f"{pkg.title} {path.name}")
        read.append({"release": release, "file": path.name, "sha256": digest, "locked": bool(hashes),
                     "url": f"https://pypi.org/project/{pkg.project}/{release}/"})
        per_release[release] = messages_of(pkg, path)
    messages = collate(per_release, [r["release"] for r in read], ("level", "error", "text"))
    return {"component": pkg.name, "source": pkg.url, "paths": pkg.paths, "releases": read,
            "not_catalogued": missing, "messages": messages}


def header(pkg: Package) -> str:
    text = (f"What {pkg.title} can print, for each release the matrix ships: {pkg.reads}: the message of each "
            f"raise, logger call and warning, as a printf format (an f-string's {{...}} is %s), read from the "
            f"PyPI {pkg.kind} of the release (its file and sha256 under `releases`; `locked`: a lock in "
            f"matrices/locks/ pins that sha256). `level` is RAISE, ERROR, WARNING or PRINT and `error` the "
            f"exception raised; `file` and `line` are where the newest release that has the wording prints it, "
            f"`paths` where such a file is in {pkg.url}; `releases` the releases in which that exact wording "
            f"exists. Generated by `envbuild matrix catalogue --{pkg.name}-{pkg.kind}s DIR` (see docs/doctor.md); "
            f"do not edit. A release without its {pkg.kind} in DIR is listed under `not_catalogued`.")
    return comment(text)


def render(pkg: Package, data: dict) -> str:
    """One message a line, so a refresh's diff shows the wordings that came or went."""
    return layout(header(pkg), data, ("source", "paths"), ("releases", "not_catalogued", "messages"))


def summary(pkg: Package, old: dict, new: dict) -> list[str]:
    """Per release, what came or went (as the NCCL catalogue's summary says it)."""
    return nccl_catalogue.summary(old, new, pkg.name, lambda m: (m["level"], m.get("error"), m["text"]))
