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
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional

from securesystemslib.signer import SSlibKey

from . import sbom as sbom_mod
from .artifacts import Descriptor, Registry, is_index
from .engine import Engine, get_engine
from .enroot import SQSH_TYPE, host_platform
from .errors import EnvbuildError
from .grammar import shown
from .provenance import DSSE_MEDIA_TYPE, SLSA_PROVENANCE, byproduct, load_public_key, open_envelope, subject_digest
from .registry import ANY_MANIFEST, check_image_reference, registry_of, split_reference

SMOKE_TYPE = "application/vnd.envbuild.smoke-record.v1+json"
SBOM_TYPE = sbom_mod.MEDIA_TYPE
PREDICATE_ANNOTATION = "in-toto.io/predicate-type"
COSIGN_ISSUER = "https://token.actions.githubusercontent.com"
BYPRODUCTS = {SBOM_TYPE: sbom_mod.FILE_NAME, SMOKE_TYPE: "smoke.json", SQSH_TYPE: "image.sqsh"}


@dataclass(frozen=True)
class Trust:
    """Whom a signature must come from: a public key, or a Sigstore identity (keyless, cosign)."""

    key: Optional[SSlibKey] = None
    identity: Optional[str] = None  # a regular expression of the certificate's identity (the workflow)
    issuer: str = COSIGN_ISSUER

    def describe(self) -> str:
        return f"key {self.key.keyid[:16]}" if self.key else f"identity /{self.identity}/ from {self.issuer}"


def trust_from(key: Optional[str], identity: Optional[str], issuer: Optional[str],
               signer_key: Optional[SSlibKey] = None, keyless: bool = False) -> Trust:
    """--key / --certificate-identity-regexp (or, publishing, the signing key's public half, or
    keyless in GitHub Actions: this very workflow's identity)."""
    if key and identity:
        raise EnvbuildError("--key and --certificate-identity-regexp are two ways to trust a signature; give one.")
    if key:
        return Trust(key=load_public_key(key))
    if identity:
        return Trust(identity=identity, issuer=issuer or COSIGN_ISSUER)
    if signer_key is not None:
        return Trust(key=signer_key)
    if keyless and os.environ.get("GITHUB_WORKFLOW_REF"):
        server = os.environ.get("GITHUB_SERVER_URL", "https://github.com")
        return Trust(identity="^" + re.escape(f"{server}/{os.environ['GITHUB_WORKFLOW_REF']}") + "$")
    raise EnvbuildError("say whose signature to trust: --key FILE (the PEM public key the images were signed with) "
                        "or --certificate-identity-regexp RE (keyless: the publishing workflow, e.g. "
                        "'^https://github.com/acme/envbuild/.github/workflows/publish.yml@refs/heads/main$').")


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
    """The platform images `reference` serves (a manifest list's entries, or its one image)."""
    desc, body = client.manifest(name, reference, ANY_MANIFEST)
    doc = json.loads(body)
    tag = None if reference.startswith("sha256:") else reference
    entries = []
    if is_index(desc.media_type):
        for m in doc.get("manifests", []):
            p = m.get("platform") or {}
            plat = f"{p.get('os', 'linux')}/{p.get('architecture', 'unknown')}"
            if plat == "unknown/unknown":
                continue
            sub, sub_body = client.manifest(name, m["digest"])
            entries.append((plat, sub, json.loads(sub_body)))
    else:
        cfg_desc = Descriptor.from_dict(doc.get("config") or {})
        cfg = json.loads(client.fetch(name, cfg_desc)) if cfg_desc.digest else {}
        entries.append((f"{cfg.get('os', 'linux')}/{cfg.get('architecture', 'unknown')}", desc, doc))
    out = [Target(host, name, tag, plat, d, (doc_.get("config") or {}).get("digest", "")) for plat, d, doc_ in entries]
    if platform:
        out = [t for t in out if t.platform == platform]
        if not out:
            raise EnvbuildError(f"{host}/{name}:{reference} serves no {platform} image; it serves "
                                f"{', '.join(p for p, _, _ in entries)}.")
    return out


def _cosign_statements(target: Target, trust: Trust) -> list[dict]:
    """Keyless: the provenance statements cosign verifies for the workflow identity."""
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
                            f"{run.stderr.strip()[-300:]}", exit_code=1)
    statements = []
    for line in run.stdout.splitlines():
        if line.strip().startswith("{"):
            payload = json.loads(line).get("payload", "")
            statements.append(json.loads(base64.b64decode(payload)))
    return statements


def signed_statement(client: Registry, target: Target, trust: Trust) -> tuple[Optional[dict], str]:
    """The provenance statement attached to `target` that `trust` signed, or why there is none."""
    if trust.key is None:
        try:
            found = [s for s in _cosign_statements(target, trust) if s.get("predicateType") == SLSA_PROVENANCE]
        except EnvbuildError as e:
            return None, e.message
        good = [s for s in found if subject_digest(s) == target.manifest.digest]
        return (good[0], f"signed by {trust.describe()} (cosign)") if good else (None, "no provenance for this digest")
    attached = client.referrers(target.name, target.manifest.digest, DSSE_MEDIA_TYPE)
    if not attached:
        return None, f"no signed provenance is attached to {target.manifest.digest[:19]}... (unsigned image)"
    reasons = []
    for art in attached:
        for layer in client.layers(target.name, art):
            if layer.size > 16 << 20:
                reasons.append("an attestation larger than 16 MiB")
                continue
            try:
                doc = open_envelope(client.fetch(target.name, layer), trust.key)
            except EnvbuildError as e:
                reasons.append(e.message)
                continue
            if doc.get("predicateType") != SLSA_PROVENANCE:
                continue
            if subject_digest(doc) != target.manifest.digest:
                reasons.append(f"a provenance signed for another image ({subject_digest(doc)[:19]}...)")
                continue
            return doc, f"signed by {trust.describe()} ({trust.key.keytype})"
    return None, "; ".join(dict.fromkeys(reasons)) or "no provenance among the attestations"


def attached_byproduct(client: Registry, target: Target, doc: dict, artifact_type: str) -> tuple[Optional[Descriptor], str]:
    """The attached layer of `artifact_type` whose sha256 the provenance lists, or why none."""
    name = BYPRODUCTS[artifact_type]
    listed = byproduct(doc, name)
    if not listed:
        return None, f"the provenance lists no {name}"
    want = "sha256:" + (listed.get("digest") or {}).get("sha256", "")
    seen = []
    for art in client.referrers(target.name, target.manifest.digest, artifact_type):
        for layer in client.layers(target.name, art):
            if layer.digest == want:
                return layer, ""
            seen.append(layer.digest[:19])
    if seen:
        return None, (f"the {name} attached ({', '.join(seen)}...) is not the one the provenance signs "
                      f"({want[:19]}...): it was replaced or altered")
    return None, f"no {name} is attached"


def verify_target(client: Registry, target: Target, trust: Trust, content: bool = True,
                  engine: Optional[Engine] = None) -> list[Check]:
    """Every check of one platform image."""
    p = target.platform
    checks = []
    doc, why = signed_statement(client, target, trust)
    checks.append(Check("signature", p, doc is not None, why if doc is None else f"{target.manifest.digest[:19]}... {why}"))
    if doc is None:
        for name in ("provenance", "sbom", "smoke", "sqsh"):
            checks.append(Check(name, p, None, "not checked: no verified provenance"))
        return checks
    check, inv = _provenance_check(target, doc, content, engine)
    checks.append(check)
    checks.append(_sbom_check(client, target, doc, inv))
    checks.append(_smoke_check(client, target, doc))
    layer, why = attached_byproduct(client, target, doc, SQSH_TYPE)
    checks.append(Check("sqsh", p, layer is not None, why if layer is None else
                        f"{layer.size / 2**20:.0f} MiB, sha256 {layer.digest[7:19]}... (envbuild stage checks its bytes)"))
    return checks


def _provenance_check(target: Target, doc: dict, content: bool,
                      engine: Optional[Engine]) -> tuple[Check, Optional[dict]]:
    """The signed statement is for this tag and platform and, where the image can be pulled and
    read here (`content`, the host's platform), records the manifest.json the image holds; the
    image's inventory when it was read (the SBOM is then compared with it)."""
    p = target.platform
    ext = doc["predicate"]["buildDefinition"]["externalParameters"]
    internal = doc["predicate"]["buildDefinition"].get("internalParameters") or {}
    problems = []
    if target.tag and target.tag != ext.get("tag") and not target.tag.startswith(f"{ext.get('tag')}-"):
        problems.append(f"it was made for tag {ext.get('tag')}, not {target.tag}")
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
    recorded = next((d["digest"]["sha256"] for d in doc["predicate"]["buildDefinition"]["resolvedDependencies"]
                     if d.get("name") == "image:/opt/envbuild/manifest.json"), "")
    if real != recorded:
        problems.append(f"the image's manifest.json (sha256 {real[:12]}) is not the one it records "
                        f"({recorded[:12]})")
    return Check("provenance", p, not problems, "; ".join(problems) or
                 f"for tag {ext.get('tag')}, stack {internal.get('stack')}, manifest.json matches"), inv


def _sbom_check(client: Registry, target: Target, doc: dict, inv: Optional[dict]) -> Check:
    """The signed SBOM is attached and describes this image: compared with its content where
    it was read, else by image id alone."""
    p = target.platform
    layer, why = attached_byproduct(client, target, doc, SBOM_TYPE)
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


def _smoke_check(client: Registry, target: Target, doc: dict) -> Check:
    """The signed smoke record is attached, passed, and was recorded for this image and platform."""
    p = target.platform
    layer, why = attached_byproduct(client, target, doc, SMOKE_TYPE)
    if layer is None:
        return Check("smoke", p, False, why)
    record = json.loads(client.fetch(target.name, layer))
    bad = []
    if not record.get("ok"):
        bad.append("the recorded smoke test failed")
    if record.get("image_id") != target.config:
        bad.append(f"it was recorded for image {str(record.get('image_id'))[:19]}, not {target.config[:19]}")
    if record.get("platform") and record["platform"] != p:
        bad.append(f"it ran as {record['platform']}")
    return Check("smoke", p, not bad, "; ".join(bad) or
                 f"passed ({record.get('mode', '?')} mode, {record.get('checked_at', '?')})")


def verify(ref: str, trust: Trust, platform: Optional[str] = None, content: bool = True,
           engine: Optional[Engine] = None) -> list[Check]:
    """Every check of every platform image `ref` serves."""
    host, name, reference = parse_image(ref)
    client = Registry(host)
    checks = []
    for target in targets(client, host, name, reference, platform):
        checks += verify_target(client, target, trust, content, engine)
    return checks
