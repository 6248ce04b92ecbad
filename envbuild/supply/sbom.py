"""The SBOM of a built image: a CycloneDX 1.6 document made with cyclonedx-python-lib from what
the image really holds (read from its files by :mod:`envbuild.builds.contents`, nothing of it run), not
from what was meant to go in.

Why it is not inside the image: a file in the image changes the image, so an SBOM stored there
would describe an image that no longer exists (and its hash would be part of what it
describes). The image already carries its inputs (/opt/envbuild/manifest.json, the lock with
every hash, the extension build record); the SBOM is made from the built image, names it by its
image ID (the sha256 of its config, which no tag or push changes), and is attached to the pushed
image as an OCI artifact (:mod:`envbuild.oci.artifacts`) whose digest the signed provenance lists.

What it lists:
- every Python distribution the venv's Python sees (pkg:pypi purls), with the sha256 hashes the
  lock allowed for it (pip installed one of them, --require-hashes); the CUDA and NCCL wheels
  (nvidia-*) are among them on PyPI-toolchain stacks;
- every installed OS package (pkg:deb purls, dpkg's status), with its source package;
- each compiled CUDA extension: its wheel's sha256, its sdist's sha256 as the ancestor (pedigree)
  and the source patches applied, the arch list and cache key;
- the fabric's sources and vendored files (URL, sha256) and the DeepSpeed ops built.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from typing import Optional

from cyclonedx.model import (
    AttachedText,
    ExternalReference,
    ExternalReferenceType,
    HashAlgorithm,
    HashType,
    Property,
    XsUri,
)
from cyclonedx.model.bom import Bom, BomMetaData
from cyclonedx.model.component import Component, ComponentType, Diff, Patch, PatchClassification, Pedigree
from cyclonedx.model.tool import ToolRepository
from cyclonedx.output.json import JsonV1Dot6
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from packageurl import PackageURL
from packaging.utils import canonicalize_name

from envbuild import __version__
from envbuild.base.errors import EnvbuildError
from envbuild.base.untrusted import loads_json
from envbuild.builds.contents import inventory, read_contents
from envbuild.engine import Engine, get_engine
from envbuild.image import paths
from envbuild.knowledge.lock import parse_lock

MEDIA_TYPE = "application/vnd.cyclonedx+json"
FILE_NAME = "sbom.cdx.json"
IMAGE_ID = "envbuild:image-id"  # the property naming the image (config digest) the SBOM describes
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def read_inventory(image: str, engine: Optional[Engine] = None) -> dict:
    """What `image` holds, read from its filesystem (:func:`envbuild.builds.contents.inventory`): no
    container of it runs, so an image cannot misreport itself, whatever its CPU architecture."""
    engine = engine or get_engine()
    info = engine.inspect(image)
    with engine.export(info.id) as stream:
        data = inventory(read_contents(stream))
    data["image_id"], data["platform"] = info.id, info.platform
    return data


def _lock_pins(text: Optional[str]) -> dict[str, tuple[str, str, list[str]]]:
    """canonical name -> (version, lock section, sha256 hashes the lock allows)."""
    if not text:
        return {}
    lock = parse_lock(text, paths.LOCK)
    return {p.key: (p.version, section, _HASH.findall(p.block))
            for section, pkgs in lock.sections.items() for p in pkgs}


def _props(*pairs) -> list[Property]:
    return [Property(name=k, value=str(v)) for k, v in pairs if v not in (None, "", [])]


class _Refs:
    """Unique bom-refs: a package listed twice (two locations) gets '#2', '#3'."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, kind: str, name: str, version: str) -> str:
        base = f"{kind}:{name}@{version}"
        n, out = 1, base
        while out in self.seen:
            n += 1
            out = f"{base}#{n}"
        self.seen.add(out)
        return out


def make_bom(inv: dict, image_ref: str, timestamp: Optional[dt.datetime] = None) -> Bom:
    """The CycloneDX BOM of an image from its inventory (:func:`read_inventory`)."""
    records = inv.get("records") or {}
    manifest = json.loads(records["manifest"]) if records.get("manifest") else {}
    ref = _Refs()
    components = [*_python_components(inv, records, manifest.get("ds_ops") or [], ref),
                  *_deb_components(inv, ref), *_fabric_components(manifest.get("fabric") or {}, ref)]
    image = _image_component(inv, image_ref, manifest)
    tool = Component(name="envbuild", version=__version__, type=ComponentType.APPLICATION)
    metadata = BomMetaData(component=image, tools=ToolRepository(components=[tool]),
                           timestamp=timestamp or dt.datetime.now(dt.timezone.utc).replace(microsecond=0))
    bom = Bom(components=components, metadata=metadata,
              serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"envbuild:{inv['image_id']}"))
    bom.register_dependency(image, components)  # the image holds each of them (a flat graph: no edges inside)
    return bom


def _python_components(inv: dict, records: dict, ops: list, ref: _Refs) -> list[Component]:
    """Each installed distribution, with the lock (and section) that pinned it and its hashes;
    a CUDA extension compiled in the builder carries its wheel's hash and the sdist as pedigree."""
    pins = _lock_pins(records.get("lock"))
    extend = _lock_pins(records.get("extend_lock"))
    extensions = {canonicalize_name(e["name"]): e for e in json.loads(records.get("extensions") or "[]")}
    components = []
    for d in inv.get("python", []):
        key = canonicalize_name(d["name"])
        version, section, hashes = pins.get(key) or extend.get(key) or ("", "", [])
        props = [*_props(("envbuild:location", d.get("location")),
                         ("envbuild:lock", "lock.txt" if key in pins else "extend-lock.txt" if key in extend else ""),
                         ("envbuild:lock-section", section)),
                 *[Property(name="envbuild:lock-sha256", value=h) for h in (hashes if version == d["version"] else [])]]
        if key == "deepspeed":
            props += [Property(name="envbuild:ds-op", value=op) for op in ops]
        hashes_out, pedigree = [], None
        ext = extensions.get(key)
        if ext and ext.get("version") == d["version"]:
            hashes_out = [HashType(alg=HashAlgorithm.SHA_256, content=ext["sha256"])]
            props += _props(("envbuild:wheel", ext.get("wheel")), ("envbuild:arch-list", ext.get("arch_list")),
                            ("envbuild:cache-key", ext.get("cache_key")), ("envbuild:built", "compiled from source"))
            pedigree = _built_pedigree(d, key, ext.get("determines") or {})
        components.append(Component(
            name=d["name"], version=d["version"], type=ComponentType.LIBRARY,
            bom_ref=ref("pypi", key, d["version"]), purl=PackageURL("pypi", name=key, version=d["version"]),
            hashes=hashes_out, properties=props, pedigree=pedigree))
    return components


def _built_pedigree(d: dict, key: str, determines: dict) -> Pedigree:
    """Where a wheel compiled in the builder came from: its sdist (by hash), or the GitHub archives
    it was compiled from (FA3: each commit, by the sha256 of its uncompressed tar stream), and
    the patches applied."""
    sdist = Component(name=d["name"], version=d["version"], type=ComponentType.LIBRARY,
                      purl=PackageURL("pypi", name=key, version=d["version"], qualifiers={"type": "sdist"}),
                      hashes=[HashType(alg=HashAlgorithm.SHA_256, content=determines["sdist_sha256"])]
                      if determines.get("sdist_sha256") else [])
    archives = [Component(name=f"{d['name']} {path}" if path != "." else d["name"], version=a["commit"],
                          type=ComponentType.LIBRARY,
                          hashes=[HashType(alg=HashAlgorithm.SHA_256, content=a["tar_sha256"])] if a.get("tar_sha256") else [],
                          properties=_props(("envbuild:hash-of", "the uncompressed tar stream (git archive of the commit)")))
                for path, a in (determines.get("archives") or {}).items()]
    patches = [Patch(type=PatchClassification.UNOFFICIAL,
                     diff=Diff(text=AttachedText(content=json.dumps(p, sort_keys=True),
                                                 content_type="application/json")))
               for p in determines.get("patches") or []]
    if archives:
        return Pedigree(ancestors=archives, patches=patches, notes="compiled from pinned GitHub archives in the image's builder stage")
    return Pedigree(ancestors=[sdist], patches=patches, notes="compiled from the sdist in the image's builder stage")


def _deb_components(inv: dict, ref: _Refs) -> list[Component]:
    """Each Debian package dpkg lists, as a deb purl of the image's distribution."""
    os_info = inv.get("os") or {}
    distro = f"{os_info.get('id', '')}-{os_info.get('version_id', '')}".strip("-")
    components = []
    for p in inv.get("dpkg", []):
        qualifiers = {"arch": p["architecture"], **({"distro": distro} if distro else {})}
        components.append(Component(
            name=p["package"], version=p["version"], type=ComponentType.LIBRARY,
            bom_ref=ref("deb", p["package"], f"{p['version']}:{p['architecture']}"),
            purl=PackageURL("deb", namespace=os_info.get("id") or None, name=p["package"], version=p["version"],
                            qualifiers=qualifiers),
            properties=_props(("envbuild:source-package", p["source"] if p["source"] != p["package"] else ""))))
    return components


def _fabric_components(fabric: dict, ref: _Refs) -> list[Component]:
    """The fabric's sources built from pinned tarballs, and its vendored files, each by URL and sha256."""
    components = []
    for s in fabric.get("sources") or []:
        components.append(Component(
            name=s["name"], version=s.get("version"), type=ComponentType.LIBRARY,
            bom_ref=ref("source", s["name"], s.get("version") or ""),
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=s["tar_sha256"])],
            external_references=[ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(s["url"]))],
            properties=_props(("envbuild:fabric", fabric.get("name")), ("envbuild:built", "compiled from source"))))
    for f in fabric.get("files") or []:
        components.append(Component(
            name=f["path"], type=ComponentType.FILE, bom_ref=ref("file", f["path"], ""),
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=f["sha256"])],
            external_references=[ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(f["url"]))],
            properties=_props(("envbuild:fabric", fabric.get("name")))))
    return components


def _image_component(inv: dict, image_ref: str, manifest: dict) -> Component:
    """The image itself: the BOM's subject, named by its reference and identified by its image id."""
    os_info = inv.get("os") or {}
    repo, _, tag = image_ref.rpartition(":") if ":" in image_ref.rsplit("/", 1)[-1] else (image_ref, "", "")
    return Component(
        name=repo or image_ref, version=tag or None, type=ComponentType.CONTAINER, bom_ref="image",
        hashes=[HashType(alg=HashAlgorithm.SHA_256, content=inv["image_id"].split(":", 1)[1])],
        properties=_props((IMAGE_ID, inv["image_id"]), ("envbuild:platform", inv.get("platform")),
                          ("envbuild:tag", manifest.get("tag")), ("envbuild:stack", manifest.get("stack")),
                          ("envbuild:gpu", manifest.get("gpu")), ("envbuild:os", os_info.get("pretty_name")),
                          ("envbuild:python", inv.get("python_version")),
                          *((f"envbuild:base:{stage}", ref_) for stage, ref_ in
                            sorted((manifest.get("base_images") or {}).items()))))


def to_json(bom: Bom) -> bytes:
    """The BOM as CycloneDX 1.6 JSON, checked against the CycloneDX schema before it leaves."""
    text = JsonV1Dot6(bom).output_as_string(indent=None)
    problem = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if problem is not None:
        raise EnvbuildError(f"the SBOM envbuild made is not valid CycloneDX 1.6 ({problem}); this is a bug.",
                            exit_code=70)
    return text.encode()


SBOM_LIMIT = 64 << 20  # a CUDA image's SBOM is about 1 MiB; one declared or sent larger is not read


def describe(sbom: bytes) -> dict:
    """What an SBOM says, read with the library: the image ID it names and its packages."""
    doc = loads_json(sbom, "the SBOM", SBOM_LIMIT)  # bounded first: nesting, values, size
    try:
        bom = Bom.from_json(doc)  # type: ignore[attr-defined]
    except Exception as e:  # the library raises many kinds for a document that is not a BOM
        raise EnvbuildError(f"the SBOM is not a CycloneDX document the library can read ({type(e).__name__}: "
                            f"{str(e)[:200]}).", exit_code=1) from None
    image = bom.metadata.component
    image_id = next((p.value for p in (image.properties if image else []) if p.name == IMAGE_ID), "")
    pypi, deb = set(), set()
    for c in bom.components:
        if c.purl is None or c.purl.qualifiers.get("type") == "sdist":
            continue
        if c.purl.type == "pypi":
            pypi.add((canonicalize_name(c.purl.name), c.purl.version))
        elif c.purl.type == "deb":
            deb.add((c.purl.name, c.purl.version, c.purl.qualifiers.get("arch", "")))
    return {"image_id": image_id, "pypi": pypi, "deb": deb}


def differences(sbom: bytes, inv: dict) -> list[str]:
    """How an SBOM disagrees with what the image holds (empty: it describes exactly this image)."""
    said = describe(sbom)
    out = []
    if said["image_id"] != inv["image_id"]:
        out.append(f"it describes image {said['image_id'][:19] or '(none named)'}, not {inv['image_id'][:19]}")
    real_pypi = {(canonicalize_name(d["name"]), d["version"]) for d in inv.get("python", [])}
    real_deb = {(p["package"], p["version"], p["architecture"]) for p in inv.get("dpkg", [])}
    for kind, real, listed in (("Python", real_pypi, said["pypi"]), ("dpkg", real_deb, said["deb"])):
        missing, extra = sorted(real - listed), sorted(listed - real)
        if missing:
            out.append(f"{len(missing)} {kind} packages in the image are not in it ({_names(missing)})")
        if extra:
            out.append(f"{len(extra)} {kind} packages it lists are not in the image ({_names(extra)})")
    return out


def _names(items) -> str:
    shown = ", ".join(f"{i[0]} {i[1]}" for i in items[:4])
    return shown + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def python_pins(inv: dict) -> dict[str, str]:
    """name -> version of what the image's Python sees (what the vulnerability gate audits)."""
    return {canonicalize_name(d["name"]): d["version"] for d in inv.get("python", [])}
