"""How two images differ, in the terms a user cares about: Python distributions (version, and
a hash of their files), OS packages (version), files by content (not mtime), environment,
labels, entrypoint and command, and each layer's size. Two builds of the same inputs that wrote
the same bytes compare equal even though their image IDs differ (the engine stamps times into
layers and the config).

>>> a = ImageRecord("a", "sha256:1", ImageConfig("sha256:1", ("A=1",), (), ("/e",), (), "", "", (("RUN x", 3),)),
...                 ImageContents())
>>> b = ImageRecord("b", "sha256:2", ImageConfig("sha256:2", ("A=2",), (), ("/e",), (), "", "", (("RUN x", 3),)),
...                 ImageContents())
>>> [(d.section, d.key, d.a, d.b) for d in compare(a, b)]
[('env', 'A', '1', '2')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import shown
from envbuild.builds.contents import ImageContents, read_contents
from envbuild.engine import ImageConfig, RegistryError, get_engine
from envbuild.oci.registry import check_image_reference, split_reference

SECTIONS = ("python", "os", "files", "env", "labels", "config", "layers")
ABSENT = "(absent)"


@dataclass(frozen=True)
class ImageRecord:
    ref: str
    id: str
    config: ImageConfig
    contents: ImageContents


@dataclass(frozen=True)
class Difference:
    section: str  # one of SECTIONS
    key: str  # what differs: a package, a path, a variable, a label, a layer
    a: str
    b: str


def pullable(ref: str) -> bool:
    """Whether `ref` names where to pull it from: a repository path (``ghcr.io/acme/x:t``,
    ``127.0.0.1:5000/x:t``, ``nvidia/cuda:t``) or a digest. The name is split by the OCI grammar
    (envbuild/oci/registry.py), so a registry's port is no tag.

    >>> pullable("127.0.0.1:5000/envbuild:t"), pullable("envbuild:t"), pullable("debian@sha256:" + "0" * 64)
    (True, False, True)
    """
    name, _, digest = split_reference(ref)
    return "/" in name or digest is not None


def check_source(ref: str, what: str = "IMAGE") -> str:
    """`ref` by the image-reference grammar, before the engine or a registry is asked anything."""
    check_image_reference(what, ref)
    return ref


def find_or_pull(ref: str, engine, not_here: str, pulled: Optional[list] = None):
    """The engine's ImageInfo of `ref`, pulled first when this engine does not have it and it
    names a registry (and said in `pulled`)."""
    try:
        return engine.inspect(ref)
    except EnvbuildError:
        if not pullable(ref):
            raise EnvbuildError(f"{shown(ref)} {not_here} and names no registry to pull it from; give a local image "
                                f"(`docker images` lists them) or REGISTRY/NAME:TAG.") from None
        try:
            engine.pull(ref)
        except RegistryError as e:
            raise EnvbuildError(f"image {shown(ref)} is not on this machine and could not be pulled: {e.message}",
                                exit_code=1) from None
        if pulled is not None:
            pulled.append(ref)
        return engine.inspect(ref)


def read_image(ref: str, engine=None, pulled: Optional[list] = None) -> ImageRecord:
    """Everything :func:`compare` needs of one image; a registry reference this engine does not
    have is pulled first (and said in `pulled`)."""
    engine = engine or get_engine()
    find_or_pull(ref, engine, "does not exist on this machine's engine", pulled)
    config = engine.config(ref)
    with engine.export(ref) as stream:
        contents = read_contents(stream)
    return ImageRecord(ref, config.id, config, contents)


def _pairs(a: dict, b: dict, section: str, show=str) -> list[Difference]:
    return [Difference(section, key, show(a[key]) if key in a else ABSENT, show(b[key]) if key in b else ABSENT)
            for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def _env(config: ImageConfig) -> dict[str, str]:
    return dict(entry.split("=", 1) if "=" in entry else (entry, "") for entry in config.env)


def compare(a: ImageRecord, b: ImageRecord) -> list[Difference]:
    """Every difference between two images, section by section (empty: the same content)."""
    out = _pairs({k: d.version for k, d in a.contents.dists.items()}, {k: d.version for k, d in b.contents.dists.items()},
                 "python")
    for key in sorted(set(a.contents.dists) & set(b.contents.dists)):
        da, db = a.contents.dists[key], b.contents.dists[key]
        if da.version == db.version and da.files != db.files:
            out.append(Difference("python", key, f"{da.version}, files {da.files[:12]}", f"{db.version}, files {db.files[:12]}"))
    out += _pairs(a.contents.debs, b.contents.debs, "os")
    out += _pairs(a.contents.files, b.contents.files, "files", lambda e: e.describe())
    out += _pairs(_env(a.config), _env(b.config), "env")
    out += _pairs(dict(a.config.labels), dict(b.config.labels), "labels")
    for name in ("entrypoint", "cmd", "workdir", "user"):
        if getattr(a.config, name) != getattr(b.config, name):
            out.append(Difference("config", name, str(getattr(a.config, name)), str(getattr(b.config, name))))
    la, lb = a.config.layers, b.config.layers
    for i in range(max(len(la), len(lb))):
        sa = f"{la[i][1]} bytes" if i < len(la) else ABSENT
        sb = f"{lb[i][1]} bytes" if i < len(lb) else ABSENT
        if sa != sb or (i < len(la) and i < len(lb) and la[i][0] != lb[i][0]):
            what = (la[i] if i < len(la) else lb[i])[0]
            out.append(Difference("layers", f"{i + 1}: {_short(what)}", sa, sb))
    return out


def _short(created_by: str, width: int = 70) -> str:
    text = " ".join(created_by.replace("/bin/sh -c #(nop) ", "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def summary(a: ImageRecord, b: ImageRecord, diffs: list[Difference]) -> dict:
    """Counts per section and what was compared, for the table's heading and --json."""
    counts = {section: sum(1 for d in diffs if d.section == section) for section in SECTIONS}
    return {"a": {"ref": a.ref, "id": a.id}, "b": {"ref": b.ref, "id": b.id}, "equal": not diffs,
            "compared": {"files": len(set(a.contents.files) | set(b.contents.files)),
                         "python": len(set(a.contents.dists) | set(b.contents.dists)),
                         "os": len(set(a.contents.debs) | set(b.contents.debs)),
                         "env": len(set(_env(a.config)) | set(_env(b.config))),
                         "layers": max(len(a.config.layers), len(b.config.layers))},
            "differing": counts,
            "differences": [{"section": d.section, "key": d.key, "a": d.a, "b": d.b} for d in diffs]}
