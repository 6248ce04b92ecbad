"""`envbuild verify IMAGE`: is the tag a researcher pulled the image CI built and tested?

For every platform image the tag serves, one line per check:
- signature: a provenance attestation attached to exactly this image digest, signed by the
  expected key (DSSE, securesystemslib) or, keyless, by the expected Sigstore identity (cosign);
- provenance: its subject is this digest, it was made for this tag and platform, and the
  manifest.json inside the image is the one it records;
- sbom: the SBOM attached is the one the provenance signs (sha256), and it lists exactly the
  Python distributions and dpkg packages the image holds (read inside the pulled image);
- smoke: the smoke record attached is the one the provenance signs, it passed, and it was
  recorded for this image's config digest and platform;
- sqsh: the enroot .sqsh attached is the one the provenance signs (its bytes are checked by
  `envbuild stage`, which downloads it).
A check that cannot run because an earlier one failed says so ("not checked"), never passes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field
from securesystemslib.signer import SSlibKey

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import escaped, shown
from envbuild.base.untrusted import loads_json, validated
from envbuild.builds.staging import SQSH_TYPE, Published, host_platform
from envbuild.engine import Engine, get_engine
from envbuild.oci.artifacts import Descriptor, OciPlatform, Registry, is_index, parse_index, parse_manifest
from envbuild.oci.artifacts import client as registry_client
from envbuild.oci.registry import ANY_MANIFEST, check_image_reference, registry_of, split_reference
from envbuild.supply import sbom as sbom_mod
from envbuild.supply.provenance import (
    DSSE_MEDIA_TYPE,
    ENVELOPE_LIMIT,
    SLSA_PROVENANCE,
    byproduct,
    load_public_key,
    open_envelope,
    parse_statement,
    subject_digest,
)
from envbuild.supply.publish import per_platform_tag

SMOKE_TYPE = "application/vnd.envbuild.smoke-record.v1+json"
SBOM_TYPE = sbom_mod.MEDIA_TYPE
PREDICATE_ANNOTATION = "in-toto.io/predicate-type"
COSIGN_ISSUER = "https://token.actions.githubusercontent.com"
BYPRODUCTS = {SBOM_TYPE: sbom_mod.FILE_NAME, SMOKE_TYPE: "smoke.json", SQSH_TYPE: "image.sqsh"}
PLATFORM_RE = re.compile(r"[a-z0-9_]{1,32}/[a-z0-9_]{1,32}(/[a-z0-9]{1,16})?")
CONFIG_LIMIT = 16 << 20  # an image's config blob: a few KiB


class SmokeRecord(BaseModel):
    """The smoke record attached beside an image (envbuild.builds.verdict writes it), as verify reads it."""

    model_config = ConfigDict(extra="ignore", strict=True)
    ok: bool = False
    image_id: str = Field("", pattern=r"^(sha256:[0-9a-f]{64})?$")
    platform: str = Field("", pattern=r"^([a-z0-9_]{1,32}/[a-z0-9_]{1,32}(/[a-z0-9]{1,16})?)?$")
    mode: str = Field("?", pattern=r"^[\x20-\x7e]{0,64}$")
    checked_at: str = Field("?", pattern=r"^[\x20-\x7e]{0,64}$")


def check_platform(flag: str, value: Optional[str]) -> None:
    """--platform as OCI writes a platform (os/architecture[/variant]), before any registry is asked."""
    if value is not None and not PLATFORM_RE.fullmatch(value):
        raise EnvbuildError(f"{flag} {shown(value)} is not a platform (os/architecture, as OCI writes it); give "
                            f"linux/amd64 or linux/arm64.")


@dataclass(frozen=True)
class Trust:
    """Whom a signature must come from: a public key, or a Sigstore identity (keyless, cosign)."""

    key: Optional[SSlibKey] = None
    identity: Optional[str] = None  # a regular expression of the certificate's identity (the workflow)
    issuer: str = COSIGN_ISSUER

    def describe(self) -> str:
        return f"key {self.key.keyid[:16]}" if self.key else f"identity /{self.identity}/ from {self.issuer}"


def trust_from(key: Optional[str], identity: Optional[str], issuer: Optional[str],
               signer_key: Optional[SSlibKey] = None, keyless: bool = False, unverified_hint: bool = False) -> Trust:
    """--key / --certificate-identity-regexp (or, publishing, the signing key's public half, or
    keyless in GitHub Actions: this very workflow's identity); `unverified_hint`: the refusal
    names `stage --unverified` too."""
    if key and identity:
        raise EnvbuildError("--key and --certificate-identity-regexp are two ways to trust a signature; give one.")
    if issuer is not None and not re.fullmatch(r"https://[\x21-\x7e]{1,500}", issuer):
        raise EnvbuildError(f"--certificate-oidc-issuer {shown(issuer)} is not an https:// URL; give the OIDC issuer, "
                            f"such as {COSIGN_ISSUER}.")
    if key:
        return Trust(key=load_public_key(key))
    if identity:
        try:
            re.compile(identity)
        except re.error as e:
            raise EnvbuildError(f"--certificate-identity-regexp {shown(identity)} is not a regular expression "
                                f"({e}); give one such as '^https://github.com/acme/envbuild/'.") from None
        if escaped(identity) != identity:
            raise EnvbuildError(f"--certificate-identity-regexp {shown(identity)} holds a control character; no "
                                f"certificate identity does: give one such as '^https://github.com/acme/envbuild/'.")
        return Trust(identity=identity, issuer=issuer or COSIGN_ISSUER)
    if signer_key is not None:
        return Trust(key=signer_key)
    if keyless and os.environ.get("GITHUB_WORKFLOW_REF"):
        server = os.environ.get("GITHUB_SERVER_URL", "https://github.com")
        return Trust(identity="^" + re.escape(f"{server}/{os.environ['GITHUB_WORKFLOW_REF']}") + "$")
    raise EnvbuildError("say whose signature to trust: --key FILE (the PEM public key the images were signed with) "
                        "or --certificate-identity-regexp RE (keyless: the publishing workflow, e.g. "
                        "'^https://github.com/acme/envbuild/.github/workflows/publish.yml@refs/heads/main$')"
                        + ("; or --unverified to stage bytes no signature vouches for." if unverified_hint else "."))


@dataclass
class Check:
    name: str
    platform: str
    ok: Optional[bool]  # None: not checked (said why)
    detail: str

    def line(self) -> str:
        word = {True: "ok", False: "FAIL", None: "--"}[self.ok]
        return f"{word:<5}{self.name:<11}{self.platform:<14}{self.detail}"

    def to_dict(self) -> dict:
        return {"check": self.name, "platform": self.platform, "ok": self.ok, "detail": self.detail}


@dataclass
class Target:
    """One platform image a reference serves."""

    registry: str
    name: str
    tag: Optional[str]
    platform: str
    manifest: Descriptor
    config: str
    checks: list[Check] = field(default_factory=list)


def parse_image(ref: str) -> tuple[str, str, str]:
    """(registry host, repository, tag or digest) of REGISTRY/NAME:TAG or REGISTRY/NAME@DIGEST."""
    check_image_reference("IMAGE", ref)  # a newline in the host is no unreachable registry (exit 1)
    host = registry_of(ref)
    name, tag, digest = split_reference(ref)
    if host == "docker.io" and not ref.startswith("docker.io/"):
        raise EnvbuildError(f"IMAGE {shown(ref)} names no registry; give the published reference, such as "
                            f"ghcr.io/acme/envbuild:TAG or 127.0.0.1:5000/envbuild@sha256:<digest>.")
    path = name[len(host) + 1:] if name.startswith(host + "/") else name
    reference = digest or tag
    if not reference:
        raise EnvbuildError(f"IMAGE {shown(ref)} has no tag or digest; give the tag you pulled (NAME:TAG) or a digest.")
    return host, path, reference


def targets(client: Registry, host: str, name: str, reference: str, platform: Optional[str] = None) -> list[Target]:
    """The platform images `reference` serves (a manifest list's entries, or its one image); each
    document the registry serves is checked before a field of it is used."""
    desc, body = client.manifest(name, reference, ANY_MANIFEST)
    tag = None if reference.startswith("sha256:") else reference
    where = f"{host}/{name}{'@' if tag is None else ':'}{reference}"
    entries = []
    if is_index(desc.media_type):
        for m in parse_index(body, f"the manifest list {where}").manifests:
            plat = m.platform.name() if m.platform else "linux/unknown"
            if plat == "unknown/unknown":
                continue
            sub, sub_body = client.manifest(name, m.digest)
            entries.append((plat, sub, parse_manifest(sub_body, f"the image manifest {host}/{name}@{m.digest}")))
    else:
        doc = parse_manifest(body, f"the image manifest {where}")
        cfg = OciPlatform()
        if doc.config is not None:
            named = f"the image config {host}/{name}@{doc.config.digest}"
            if doc.config.size > CONFIG_LIMIT:
                raise EnvbuildError(f"{named} declares {doc.config.size} bytes, over the {CONFIG_LIMIT >> 20} MiB an "
                                    f"image config can be; give an image a registry serves as pushed.")
            cfg = validated(OciPlatform, loads_json(client.fetch(name, doc.config), named, CONFIG_LIMIT), named)
        entries.append((cfg.name(), desc, doc))
    out = [Target(host, name, tag, plat, d, doc.config.digest if doc.config else "") for plat, d, doc in entries]
    if platform:
        out = [t for t in out if t.platform == platform]
        if not out:
            raise EnvbuildError(f"{where} serves no {platform} image; it serves "
                                f"{', '.join(p for p, _, _ in entries) or 'none'}.")
    return out


def _cosign_statements(target: Target, trust: Trust) -> list[str]:
    """Keyless: the payloads (base64) of the provenance statements cosign verifies for the workflow identity."""
    cosign = shutil.which("cosign")
    if not cosign:
        raise EnvbuildError("keyless verification (--certificate-identity-regexp) runs cosign; install it "
                            "(https://docs.sigstore.dev/cosign/system_config/installation/) or verify with --key.")
    ref = f"{target.registry}/{target.name}@{target.manifest.digest}"
    run = subprocess.run([cosign, "verify-attestation", "--type", "slsaprovenance1", "--certificate-identity-regexp",
                          trust.identity or "", "--certificate-oidc-issuer", trust.issuer, ref],
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise EnvbuildError(f"cosign found no attestation of {ref} signed by {trust.describe()}: "
                            f"{escaped(run.stderr.strip()[-300:])}", exit_code=1)
    return [line for line in run.stdout.splitlines() if line.strip().startswith("{")]


def _cosign_payload(line: str) -> dict:
    """One statement cosign printed (its envelope's payload), bounded and checked."""
    named = "the statement cosign verified"
    envelope = loads_json(line, named, ENVELOPE_LIMIT)
    payload = envelope.get("payload") if isinstance(envelope, dict) else None
    try:
        data = base64.b64decode(payload if isinstance(payload, str) else "", validate=True)
    except (binascii.Error, ValueError):
        raise EnvbuildError(f"{named}: field 'payload' is not base64; give the document cosign wrote.") from None
    return parse_statement(data, named)


def signed_statement(client: Registry, target: Target, trust: Trust) -> tuple[Optional[dict], str]:
    """The provenance statement attached to `target` that `trust` signed, or why there is none."""
    docs, why = signed_statements(client, target, trust)
    return (docs[0] if docs else None), why


def signed_statements(client: Registry, target: Target, trust: Trust) -> tuple[list[dict], str]:
    """Every provenance statement attached to `target` that `trust` signed for its digest (an
    image published twice carries two), or why there is none. An attestation that is no DSSE
    envelope or statement at all is input nobody can have meant: exit 2 naming its field."""
    if trust.key is None:
        try:
            lines = _cosign_statements(target, trust)
        except EnvbuildError as e:
            return [], e.message
        found = [d for d in map(_cosign_payload, lines) if d.get("predicateType") == SLSA_PROVENANCE]
        good = [d for d in found if subject_digest(d) == target.manifest.digest]
        return good, (f"signed by {trust.describe()} (cosign)" if good else "no provenance for this digest")
    attached = client.referrers(target.name, target.manifest.digest, DSSE_MEDIA_TYPE)
    if not attached:
        return [], f"no signed provenance is attached to {target.manifest.digest[:19]}... (unsigned image)"
    reasons, good = [], []
    for art in attached:
        for layer in client.layers(target.name, art):
            if layer.size > ENVELOPE_LIMIT:
                reasons.append("an attestation larger than 16 MiB")
                continue
            try:
                doc = open_envelope(client.fetch(target.name, layer), trust.key)
            except EnvbuildError as e:
                if e.exit_code != 1:
                    raise
                reasons.append(e.message)
                continue
            if doc.get("predicateType") != SLSA_PROVENANCE:
                continue
            if subject_digest(doc) != target.manifest.digest:
                reasons.append(f"a provenance signed for another image ({subject_digest(doc)[:19]}...)")
                continue
            good.append(doc)
    if good:
        return good, f"signed by {trust.describe()} ({trust.key.keytype})"
    return [], "; ".join(dict.fromkeys(reasons)) or "no provenance among the attestations"


def attached_byproduct(client: Registry, target: Target, doc: dict, artifact_type: str,
                       signed: tuple = ()) -> tuple[Optional[Descriptor], str]:
    """The attached layer of `artifact_type` whose sha256 the provenance `doc` lists, or why none.

    Chosen by that digest alone, never by its place in the referrers list: every attached layer
    of the type is a candidate, and a candidate no signed statement of this image lists (`doc`,
    or `signed`: the other statements `trust` signed for it, an earlier publish of the same
    bytes) is a failure naming it, even beside the signed one: `stage` must not be offered it."""
    name = BYPRODUCTS[artifact_type]
    listed = byproduct(doc, name)
    if not listed:
        return None, f"the provenance lists no {name}"
    want = "sha256:" + listed["digest"]["sha256"]
    vouched = {want} | {"sha256:" + b["digest"]["sha256"] for b in (byproduct(d, name) for d in signed) if b}
    candidates: dict[str, Descriptor] = {}
    for art in client.referrers(target.name, target.manifest.digest, artifact_type):
        for layer in client.layers(target.name, art):
            candidates.setdefault(layer.digest, layer)
    unsigned = [d for d in candidates if d not in vouched]
    if unsigned and want in candidates:
        return None, (f"{len(candidates)} {name} are attached: {want} (the one the provenance signs) and "
                      f"{', '.join(unsigned)} (no signature vouches for {'them' if len(unsigned) > 1 else 'it'}); "
                      f"remove what was attached beside the signed one")
    if unsigned:
        return None, (f"the {name} attached ({', '.join(unsigned)}) is not the one the provenance signs "
                      f"({want}): it was replaced or altered")
    if want not in candidates:
        return None, f"no {name} is attached (the provenance signs {want})"
    return candidates[want], ""


def verify_target(client: Registry, target: Target, trust: Trust, content: bool = True,
                  engine: Optional[Engine] = None) -> list[Check]:
    """Every check of one platform image."""
    return vouched(client, target, trust, content, engine)[0]


def vouched(client: Registry, target: Target, trust: Trust, content: bool = True,
            engine: Optional[Engine] = None) -> tuple[list[Check], Optional[dict]]:
    """Every check of one platform image, and the signed statement they were made against
    (None: no provenance `trust` signed)."""
    p = target.platform
    checks = []
    docs, why = signed_statements(client, target, trust)
    doc = docs[0] if docs else None
    checks.append(Check("signature", p, doc is not None, why if doc is None else f"{target.manifest.digest[:19]}... {why}"))
    if doc is None:
        for name in ("provenance", "sbom", "smoke", "sqsh"):
            checks.append(Check(name, p, None, "not checked: no verified provenance"))
        return checks, None
    others = tuple(docs[1:])
    check, inv = _provenance_check(target, doc, content, engine)
    checks.append(check)
    checks.append(_sbom_check(client, target, doc, inv, others))
    checks.append(_smoke_check(client, target, doc, others))
    layer, why = attached_byproduct(client, target, doc, SQSH_TYPE, others)
    checks.append(Check("sqsh", p, layer is not None, why if layer is None else
                        f"{layer.size / 2**20:.0f} MiB, sha256 {layer.digest[7:19]}... (envbuild stage checks its bytes)"))
    return checks, doc


def recorded_manifest(doc: dict) -> str:
    """The sha256 of the image's /opt/envbuild/manifest.json a signed statement records ('' if none):
    the manifest holds the digest of every rendered file, so this names the build's inputs."""
    return next((d["digest"].get("sha256", "") for d in doc["predicate"]["buildDefinition"].get(
        "resolvedDependencies", []) if d.get("name") == "image:/opt/envbuild/manifest.json"), "")


def signed_tags(tag: Optional[str], platform: Optional[str]) -> list[str]:
    """The tags a provenance vouches for: the tag it records and the per-platform tag `publish`
    pushed the image under for the platform it records (publish.per_platform_tag), nothing else:
    a sibling variant's tag (TAG-efa, TAG-fa2.8.3.post2) is another image's.

    >>> signed_tags("torch2.15-h20", "linux/arm64")
    ['torch2.15-h20', 'torch2.15-h20-arm64']
    """
    if not tag:
        return []
    return [tag, per_platform_tag(tag, platform)] if platform else [tag]


def _provenance_check(target: Target, doc: dict, content: bool,
                      engine: Optional[Engine]) -> tuple[Check, Optional[dict]]:
    """The signed statement is for this tag and platform and, where the image can be pulled and
    read here (`content`, the host's platform), records the manifest.json the image holds; the
    image's inventory when it was read (the SBOM is then compared with it)."""
    p = target.platform
    ext = doc["predicate"]["buildDefinition"]["externalParameters"]
    internal = doc["predicate"]["buildDefinition"].get("internalParameters") or {}
    problems = []
    allowed = signed_tags(ext.get("tag"), internal.get("platform"))
    if target.tag and target.tag not in allowed:
        problems.append(f"it was made for tag {' or '.join(allowed) or '(none)'}, not {target.tag}")
    if internal.get("platform") and internal["platform"] != p:
        problems.append(f"it was made for {internal['platform']}")
    if not content:
        return Check("provenance", p, not problems, "; ".join(problems) or f"for tag {ext.get('tag')}"), None
    engine = engine or get_engine()
    here = host_platform()
    if p != here:
        return Check("provenance", p, not problems, "; ".join(problems) or
                     f"for tag {ext.get('tag')} (manifest not compared: a {p} image on a {here} host)"), None
    image_id = engine.pull(f"{target.registry}/{target.name}@{target.manifest.digest}")
    inv = sbom_mod.read_inventory(image_id, engine)
    real = hashlib.sha256((inv.get("records") or {}).get("manifest", "").encode()).hexdigest()
    recorded = recorded_manifest(doc)
    if real != recorded:
        problems.append(f"the image's manifest.json (sha256 {real[:12]}) is not the one it records "
                        f"({recorded[:12]})")
    return Check("provenance", p, not problems, "; ".join(problems) or
                 f"for tag {ext.get('tag')}, stack {internal.get('stack')}, manifest.json matches"), inv


def _sbom_check(client: Registry, target: Target, doc: dict, inv: Optional[dict], others: tuple = ()) -> Check:
    """The signed SBOM is attached and describes this image: compared with its content where
    it was read, else by image id alone."""
    p = target.platform
    layer, why = attached_byproduct(client, target, doc, SBOM_TYPE, others)
    if layer is None:
        return Check("sbom", p, False, why)
    data = client.fetch(target.name, layer)
    if inv is None:
        said = sbom_mod.describe(data)
        ok = said["image_id"] == target.config
        return Check("sbom", p, ok, f"signed, {len(said['pypi'])} Python and {len(said['deb'])} dpkg "
                                    f"packages (content not compared)" if ok else
                     f"it describes image {said['image_id'][:19]}, not {target.config[:19]}")
    diff = sbom_mod.differences(data, inv)
    return Check("sbom", p, not diff, "; ".join(diff) or
                 f"matches the image: {len(inv['python'])} Python and {len(inv['dpkg'])} dpkg packages")


def _smoke_check(client: Registry, target: Target, doc: dict, others: tuple = ()) -> Check:
    """The signed smoke record is attached, passed, and was recorded for this image and platform."""
    p = target.platform
    layer, why = attached_byproduct(client, target, doc, SMOKE_TYPE, others)
    if layer is None:
        return Check("smoke", p, False, why)
    named = f"the smoke record {layer.digest[:19]}... of {target.name}"
    if layer.size > CONFIG_LIMIT:
        return Check("smoke", p, False, f"{named} declares {layer.size} bytes; no smoke record is that large")
    record = validated(SmokeRecord, loads_json(client.fetch(target.name, layer), named, CONFIG_LIMIT), named)
    bad = []
    if not record.ok:
        bad.append("the recorded smoke test failed")
    if record.image_id != target.config:
        bad.append(f"it was recorded for image {record.image_id[:19]}, not {target.config[:19]}")
    if record.platform and record.platform != p:
        bad.append(f"it ran as {record.platform}")
    return Check("smoke", p, not bad, "; ".join(bad) or f"passed ({record.mode} mode, {record.checked_at})")


def verify(ref: str, trust: Trust, platform: Optional[str] = None, content: bool = True,
           engine: Optional[Engine] = None) -> list[Check]:
    """Every check of every platform image `ref` serves."""
    check_platform("--platform", platform)
    host, name, reference = parse_image(ref)
    client = Registry(host)
    checks = []
    for target in targets(client, host, name, reference, platform):
        checks += verify_target(client, target, trust, content, engine)
    return checks


def signed_sqsh(ref: str, trust: Trust, platform: Optional[str] = None) -> Published:
    """The .sqsh `envbuild stage` may stage for `ref`: the one whose digest the provenance `trust`
    signed for the platform image (this host's, of a multi-platform tag) lists, that provenance
    made for this tag. Anything else is a refusal (exit 1) saying why; nothing is exported instead."""
    check_platform("--platform", platform)
    host, name, reference = parse_image(ref)
    client = registry_client(host)
    found = targets(client, host, name, reference, platform)
    if len(found) > 1:
        found = [t for t in found if t.platform == host_platform()] or found
        if len(found) > 1:
            raise EnvbuildError(f"{ref} serves {', '.join(t.platform for t in found)}; give --platform.")
    target = found[0]
    docs, why = signed_statements(client, target, trust)
    refusal = f"not staging {ref} ({target.platform}): "
    hint = "; stage a tag that `envbuild verify` passes, or give --unverified to stage bytes nobody vouches for"
    if not docs:
        raise EnvbuildError(f"{refusal}{why}{hint}.", exit_code=1)
    check, _ = _provenance_check(target, docs[0], content=False, engine=None)
    layer, why = attached_byproduct(client, target, docs[0], SQSH_TYPE, tuple(docs[1:]))
    if not check.ok or layer is None or not target.config:
        raise EnvbuildError(f"{refusal}{check.detail if not check.ok else why or 'its manifest names no config'}"
                            f"{hint}.", exit_code=1)
    return Published(host, name, target.manifest.digest, target.config, layer)


