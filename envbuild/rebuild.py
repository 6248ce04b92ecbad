"""`envbuild rebuild`: build an image again from its own record, and compare.

Every stack image carries /opt/envbuild/manifest.json: the request as given, the envbuild
that rendered it, a digest of the matrix it met and a digest of the files it rendered. A rebuild
re-renders that request, and proceeds only when the files come out the same; otherwise it says
what to install (another envbuild) or which matrix to give, and stops before building anything.
The rebuilt image is tagged under ``<repo>-rebuild`` (the original keeps its tags) and compared
with :mod:`envbuild.imagediff`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from packaging.version import InvalidVersion, Version

from . import __version__
from .build import BuildResult, build_image
from .engine import BuildSecrets, RegistryError, get_engine
from .errors import EnvbuildError
from .files import read_bytes
from .image import paths
from .imagediff import Difference, ImageRecord, compare, read_image
from .matrix import load_matrix
from .oslock import check_reachable
from .output import write_build_dir
from .render import render_digest, render_files
from .resolve import Request, resolve

RECORD_LIMIT = 16 << 20
REBUILD_SUFFIX = "-rebuild"


@dataclass(frozen=True)
class Record:
    manifest: dict
    source: str  # what it was read from: an image, or a manifest.json file
    image_id: Optional[str]  # the image it came from (None: a manifest.json file)


def read_record(source: str, engine=None) -> Record:
    """The envbuild record of an image (local, or pulled from its registry) or of a manifest.json file."""
    path = Path(source)
    if source.endswith(".json") or path.exists():
        data = read_bytes(path, "the record", "record")
        return Record(_parse(data, source), source, None)
    engine = engine or get_engine()
    try:
        info = engine.inspect(source)
    except EnvbuildError:
        if "/" not in source.split(":", 1)[0] and "@" not in source:
            raise EnvbuildError(f"'{source}' is neither a manifest.json file nor an image on this machine "
                                f"(`docker images` lists them); give one, or REGISTRY/NAME:TAG to pull.") from None
        try:
            engine.pull(source)
        except RegistryError as e:
            raise EnvbuildError(f"image '{source}' is not on this machine and could not be pulled: {e.message}") from None
        info = engine.inspect(source)
    data = engine.read_file(source, paths.MANIFEST, RECORD_LIMIT)
    if data is None:
        raise EnvbuildError(f"image '{source}' has no envbuild record ({paths.MANIFEST}): it was not built by envbuild, "
                            f"so there is nothing to rebuild it from. Rebuild what made it instead.")
    return Record(_parse(data, f"{source}:{paths.MANIFEST}"), source, info.id)


def _parse(data: bytes, where: str) -> dict:
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EnvbuildError(f"{where} is not an envbuild record (not JSON: {e}).") from None
    if not isinstance(manifest, dict) or "envbuild" not in manifest or "tag" not in manifest:
        raise EnvbuildError(f"{where} is not an envbuild record (it has no `envbuild` and `tag` fields).")
    return manifest


def check_record(record: Record, matrix) -> Request:
    """The request to re-render, or why this envbuild cannot reproduce the record (exit 2)."""
    manifest = record.manifest
    made_by = str(manifest.get("envbuild"))
    if made_by != __version__:
        newer = _newer(made_by, __version__)
        raise EnvbuildError(f"{record.source} was made by envbuild {made_by}; this is envbuild {__version__}"
                            f"{' (older)' if newer else ''}, whose templates and rules may render other files. Install "
                            f"the one that made it and run this again: pip install 'envbuild=={made_by}'.")
    if "request" not in manifest or "matrix" not in manifest:
        raise EnvbuildError(f"{record.source} was made by an envbuild that did not record its request and matrix, so "
                            f"it cannot be re-rendered exactly; render it again with the options it was made with.")
    if manifest.get("extend"):
        raise EnvbuildError(f"{record.source} is an `envbuild extend` layer; rebuild the stack image it starts from "
                            f"({manifest['extend'].get('from', 'its base')}), then extend it again with the same "
                            f"requirements.")
    recorded = manifest["matrix"].get("sha256")
    if recorded != matrix.sha256:
        raise EnvbuildError(f"{record.source} was rendered from a matrix with sha256 {str(recorded)[:16]}..., and the "
                            f"matrix here ({matrix.directory}) has sha256 {matrix.sha256[:16]}...: its stacks, locks or "
                            f"OS locks differ. Pass --matrix-dir with the matrix it was made from (envbuild "
                            f"{made_by}'s own, or the lab's directory at the commit that built it).")
    try:
        fields = {f.name for f in dataclasses.fields(Request)}
        given = {k: tuple(tuple(x) for x in v) if k == "env" else tuple(v) if isinstance(v, list) else v
                 for k, v in manifest["request"].items() if k in fields}
        return Request(**given)
    except TypeError as e:
        raise EnvbuildError(f"{record.source}: its recorded request is malformed ({e}).") from None


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


def rebuild(source: str, matrix_dir: Optional[Path], secrets: BuildSecrets, output: Optional[Path],
            progress: Callable[[str], None] = lambda _: None, on_step=None) -> Rebuilt:
    """Re-render `source`'s record, build it, compare it with the original (when there is one)."""
    engine = get_engine()
    record = read_record(source, engine)
    matrix = load_matrix(matrix_dir)
    request = check_record(record, matrix)
    r = resolve(matrix, request)
    r = dataclasses.replace(r, base_images=dict(record.manifest.get("base_images") or r.base_images))
    files = render_files(r)
    recorded = (record.manifest.get("render") or {}).get("sha256")
    if render_digest(files) != recorded:
        raise EnvbuildError(f"re-rendering {record.source}'s request gives other files than the ones it was built from "
                            f"(sha256 {render_digest(files)[:16]}..., recorded {str(recorded)[:16]}...), though the "
                            f"envbuild version and the matrix are the same: this envbuild's code or templates were "
                            f"changed. Install the release that made it: pip install 'envbuild=={__version__}'.")
    progress(f"re-rendered {record.source}: the same files (sha256 {recorded[:16]}...)")
    if r.os_lock:
        check_reachable(r.os_lock, r.facts.family.apt.snapshot, secrets.apt_snapshot, secrets.ca_cert)
    path = write_build_dir(files, output or Path("build") / f"{r.tag}{REBUILD_SUFFIX}")
    result = build_image(path, r.tag, f"{r.request.image_repo}{REBUILD_SUFFIX}", secrets, on_step=on_step, engine=engine)
    progress(f"built {result.image_id[:19]}; comparing")
    again = read_image(result.image_id, engine)
    original = None
    if record.image_id:
        original = read_image(record.image_id, engine)
    else:
        named = record.manifest.get("image")
        try:
            original = read_image(named, engine) if named and engine.inspect(named) else None
        except EnvbuildError:
            progress(f"{named} is not on this machine: built, nothing to compare with")
    return Rebuilt(record, path, result, original, again, compare(original, again) if original else [])
