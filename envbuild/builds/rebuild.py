"""`envbuild rebuild`: build an image again from its own record, and compare.

Every stack image carries /opt/envbuild/manifest.json: the request as given, the envbuild
that rendered it, a digest of the matrix it met and a digest of the files it rendered. A rebuild
re-renders that request, and proceeds only when the files come out the same; otherwise it says
what to install (another envbuild) or which matrix to give, and stops before building anything.
The rebuilt image is tagged under ``<repo>-rebuild`` (the original keeps its tags) and compared
with :mod:`envbuild.builds.imagediff`.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator

from envbuild import __version__
from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_bytes
from envbuild.base.grammar import one_line, shown
from envbuild.base.untrusted import loads_json, validated
from envbuild.builds.build import BuildResult, build_image
from envbuild.builds.imagediff import Difference, ImageRecord, check_source, compare, find_or_pull, read_image
from envbuild.engine import BuildSecrets, get_engine
from envbuild.image import paths
from envbuild.knowledge.matrix import load_matrix
from envbuild.knowledge.oslock import check_reachable
from envbuild.knowledge.request import DEFAULT_OPS
from envbuild.oci.registry import LOCAL_REPO, TAG_RE, check_image_repo, reference_problems
from envbuild.render.builddir import render_digest, render_files
from envbuild.render.output import write_build_dir
from envbuild.resolve.resolver import Request, resolve

RECORD_LIMIT = 16 << 20
REBUILD_SUFFIX = "-rebuild"
_PEP440 = re.compile(r"^[0-9A-Za-z.!+_-]{1,64}\Z")  # the characters a PEP 440 version may hold, before packaging parses it


def _version_field(v: str) -> str:
    if not _PEP440.match(v):
        raise ValueError(f"{shown(v)} is not a PEP 440 version (digits, letters and '.!+-_' only)")
    try:
        Version(v)
    except InvalidVersion:
        raise ValueError(f"{shown(v)} is not a PEP 440 version, such as {__version__}") from None
    return v


def _reference_field(v: str) -> str:
    problems = reference_problems(v)
    if problems or not v:
        raise ValueError(f"{shown(v)} is not an image reference: {'; '.join(problems) or 'it is empty'}")
    return v


def _sha256_field(v: str) -> str:
    if not re.match(r"^[0-9a-f]{64}\Z", v):
        raise ValueError(f"{shown(v)} is not a sha256 (64 lower-case hex digits)")
    return v


class _Doc(BaseModel):
    """A part of a record: every field this envbuild reads typed (no coercion), the others ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


class _Digest(_Doc):
    sha256: str
    _s = field_validator("sha256")(_sha256_field)


class _Header(_Doc):
    """What says which envbuild wrote the record: checked first, so another version's record is
    named as such rather than as a malformed one."""
    envbuild: str
    tag: str
    _v = field_validator("envbuild")(_version_field)

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not TAG_RE.match(v):
            raise ValueError(f"{shown(v)} is not an image tag")
        return v


class _Request(_Doc):
    """The request as `render` recorded it (envbuild/knowledge/request.py's fields); an unknown field is ignored."""
    gpu: str
    python: Optional[str] = None
    cuda: Optional[str] = None
    torch: Optional[str] = None
    deepspeed: Optional[str] = None
    stack: Optional[str] = None
    ds_ops: str = DEFAULT_OPS
    base_image: Optional[str] = None
    builder_image: Optional[str] = None
    env: list[Annotated[list[str], Field(min_length=2, max_length=2)]] = []
    cpu_target: Optional[str] = None
    keep_toolchain: bool = False
    no_compiler: bool = False
    qemu: bool = False
    image_repo: str = LOCAL_REPO
    fabric: Optional[str] = None
    extensions: list[str] = []
    nccl: Optional[str] = None

    @field_validator("*", mode="after")
    @classmethod
    def _one_line(cls, v):
        """No value of a request spans lines: every field becomes a word or a line of a rendered file."""
        for text in (v if isinstance(v, list) else [v]):
            for word in (text if isinstance(text, list) else [text]):
                if isinstance(word, str):
                    one_line(word, "a request's field")
        return v


class _BaseImages(_Doc):
    builder: str
    runtime: str
    _r = field_validator("builder", "runtime")(_reference_field)


class _Extend(_Doc):
    from_: Optional[str] = Field(None, alias="from")
    _r = field_validator("from_")(_reference_field)


class RecordFile(_Header):
    """/opt/envbuild/manifest.json as far as a rebuild reads it."""
    image: Optional[str] = None
    request: Optional[_Request] = None
    matrix: Optional[_Digest] = None
    render: Optional[_Digest] = None
    base_images: Optional[_BaseImages] = None
    extend: Optional[_Extend] = None
    _r = field_validator("image")(_reference_field)


@dataclass(frozen=True)
class Record:
    manifest: dict
    source: str  # what it was read from: an image, or a manifest.json file
    image_id: Optional[str]  # the image it came from (None: a manifest.json file)

    @property
    def named(self) -> str:
        return f"the record {shown(self.source)}"


def read_record(source: str, engine=None) -> Record:
    """The envbuild record of an image (local, or pulled from its registry) or of a manifest.json file."""
    path = Path(source)
    if source.endswith(".json") or path.exists():
        data = read_bytes(path, "the record", "record")
        return Record(_parse(data, source), source, None)
    check_source(source)
    engine = engine or get_engine()
    info = find_or_pull(source, engine, "is neither a manifest.json file nor an image on this machine")
    data = engine.read_file(source, paths.MANIFEST, RECORD_LIMIT)
    if data is None:
        raise EnvbuildError(f"image '{source}' has no envbuild record ({paths.MANIFEST}): it was not built by envbuild, "
                            f"so there is nothing to rebuild it from. Rebuild what made it instead.")
    return Record(_parse(data, f"{source}:{paths.MANIFEST}"), source, info.id)


def _parse(data: bytes, where: str) -> dict:
    try:
        manifest = loads_json(data, "its content", RECORD_LIMIT)
    except EnvbuildError as e:
        raise EnvbuildError(f"{shown(where)} is not an envbuild record: {e.message}") from None
    if not isinstance(manifest, dict) or "envbuild" not in manifest or "tag" not in manifest:
        raise EnvbuildError(f"{shown(where)} is not an envbuild record (it has no `envbuild` and `tag` fields).")
    return manifest


def recorded(record: Record) -> RecordFile:
    """The record checked field by field (exit 2 naming the field), after its envbuild version:
    a record another envbuild wrote is named as such, with the command that installs that one."""
    made_by = validated(_Header, record.manifest, record.named).envbuild
    if made_by != __version__:
        newer = _newer(made_by, __version__)
        raise EnvbuildError(f"{record.source} was made by envbuild {made_by}; this is envbuild {__version__}"
                            f"{' (older)' if newer else ''}, whose templates and rules may render other files. Install "
                            f"the one that made it and run this again: pip install {shlex.quote(f'envbuild=={made_by}')}.")
    return validated(RecordFile, record.manifest, record.named)


def check_record(record: Record, matrix) -> Request:
    """The request to re-render, checked as the command line's would be, or why this envbuild
    cannot reproduce the record (exit 2)."""
    doc = recorded(record)
    if doc.request is None or doc.matrix is None:
        raise EnvbuildError(f"{record.source} was made by an envbuild that did not record its request and matrix, so "
                            f"it cannot be re-rendered exactly; render it again with the options it was made with.")
    if record.manifest.get("extend"):
        base = doc.extend.from_ if doc.extend and doc.extend.from_ else "its base"
        raise EnvbuildError(f"{record.source} is an `envbuild extend` layer; rebuild the stack image it starts from "
                            f"({base}), then extend it again with the same requirements.")
    if doc.matrix.sha256 != matrix.sha256:
        raise EnvbuildError(f"{record.source} was rendered from a matrix with sha256 {doc.matrix.sha256[:16]}..., and "
                            f"the matrix here ({matrix.directory}) has sha256 {matrix.sha256[:16]}...: its stacks, locks "
                            f"or OS locks differ. Pass --matrix-dir with the matrix it was made from (envbuild "
                            f"{doc.envbuild}'s own, or the lab's directory at the commit that built it).")
    given = doc.request.model_dump()
    request = Request(**{**given, "env": tuple(tuple(pair) for pair in given["env"]),
                         "extensions": tuple(given["extensions"])})
    try:
        check_image_repo(request.image_repo)
        for name in request.extensions:
            matrix.extension(name)
        resolve(matrix, request)  # every check the command line's request passes (validate.check_request)
    except EnvbuildError as e:
        raise EnvbuildError(f"{record.named}: field `request` is refused as the command line would refuse it: "
                            f"{e.message}") from None
    return request


def _newer(a: str, b: str) -> bool:
    try:
        return Version(a) > Version(b)
    except InvalidVersion:
        return False


@dataclass(frozen=True)
class Rebuilt:
    record: Record
    build_dir: Path
    result: BuildResult
    original: Optional[ImageRecord]
    again: ImageRecord
    differences: list[Difference]
    cached: int = 0  # steps the engine served from its build cache (only with use_cache)
    ran: int = 1     # steps the engine ran (a FROM is no step that runs)

    @property
    def rebuilt(self) -> bool:
        """False when no step ran, every one came from the build cache: then nothing was built
        again and the comparison is of the image with itself, which proves nothing."""
        return self.ran > 0


def _render_again(record: Record, matrix, request: Request):
    """The resolution and files of the record's request with its own bases; exit 2 unless they
    are the files the record says it was built from."""
    doc = recorded(record)
    r = resolve(matrix, request)
    if doc.base_images is not None:
        r = dataclasses.replace(r, base_images={"builder": doc.base_images.builder, "runtime": doc.base_images.runtime})
    files = render_files(r)
    wanted = doc.render.sha256 if doc.render else None
    if render_digest(files) != wanted:
        raise EnvbuildError(f"re-rendering {record.source}'s request gives other files than the ones it was built from "
                            f"(sha256 {render_digest(files)[:16]}..., recorded {str(wanted)[:16]}...), though the "
                            f"envbuild version and the matrix are the same: this envbuild's code or templates were "
                            f"changed. Install the release that made it: pip install {shlex.quote(f'envbuild=={__version__}')}.")
    return r, files


def rebuild(source: str, matrix_dir: Optional[Path], secrets: BuildSecrets, output: Optional[Path],
            progress: Callable[[str], None] = lambda _: None, on_step=None, use_cache: bool = False) -> Rebuilt:
    """Re-render `source`'s record, build it (every step again unless `use_cache`), compare it
    with the original (when there is one). Every input is checked before the engine builds."""
    matrix = load_matrix(matrix_dir)
    if not (source.endswith(".json") or Path(source).exists()):
        check_source(source)
    engine = get_engine()
    record = read_record(source, engine)
    request = check_record(record, matrix)
    r, files = _render_again(record, matrix, request)
    progress(f"re-rendered {record.source}: the same files (sha256 {recorded(record).render.sha256[:16]}...)")
    if r.os_lock:
        check_reachable(r.os_lock, r.facts.family.apt.snapshot, secrets.apt_snapshot, secrets.ca_cert)
    path = write_build_dir(files, output or Path("build") / f"{r.tag}{REBUILD_SUFFIX}")
    events: list[str] = []

    def step(event: str, name: str) -> None:
        if not re.match(r"^\[[^]]*\] FROM ", name):
            events.append(event)
        if on_step:
            on_step(event, name)

    result = build_image(path, r.tag, f"{r.request.image_repo}{REBUILD_SUFFIX}", secrets, on_step=step,
                         extra_args=() if use_cache else ("--no-cache",), engine=engine)
    progress(f"built {result.image_id[:19]}; comparing")
    again = read_image(result.image_id, engine)
    original = _original(record, engine, progress)
    return Rebuilt(record, path, result, original, again, compare(original, again) if original else [],
                   cached=events.count("cached"), ran=events.count("done"))


def _original(record: Record, engine, progress) -> Optional[ImageRecord]:
    """The image the record came from, or the one it names when it is on this machine."""
    if record.image_id:
        return read_image(record.image_id, engine)
    named = recorded(record).image
    try:
        return read_image(named, engine) if named and engine.inspect(named) else None
    except EnvbuildError:
        progress(f"{named} is not on this machine: built, nothing to compare with")
        return None
