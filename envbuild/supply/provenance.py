"""Who made an image, from what: an in-toto Statement (v1) with a SLSA provenance v1 predicate,
signed into a DSSE envelope.

The statement's subject is the image's manifest digest. The predicate records the source
(repository and commit), envbuild's version, the matrix digest, the lock's digest, the base
images, the build request (stack, GPU, fabric, extensions, ops, platform), the image's own
manifest.json digest, the builder, and as byproducts the SBOM, the smoke record and the .sqsh
attached beside the image (each by sha256): one signature vouches for all of them.

Signing with a key goes through securesystemslib (in-toto's crypto library: its DSSE envelope
and its pyca/cryptography signer), the statement's shape is checked with in-toto-attestation's
own Statement and Provenance definitions. Keyless signing (Sigstore) is cosign's, in CI
(:mod:`envbuild.supply.signing`): it needs an OIDC identity, Fulcio and Rekor.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform as host_platform
import subprocess
from pathlib import Path
from typing import Optional

from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_pem_public_key
from google.protobuf import json_format
from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.statement import Statement
from pydantic import BaseModel, ConfigDict, Field
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError
from securesystemslib.signer import CryptoSigner, SSlibKey

from envbuild import __version__
from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_bytes
from envbuild.base.untrusted import loads_json, validated

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
BUILD_TYPE = "urn:envbuild:build-type:image:v1"  # docs/publishing.md says what it means
PASSWORD_ENV = "ENVBUILD_SIGNING_KEY_PASSWORD"
ENVELOPE_LIMIT = 16 << 20


# ---------------------------------------------------------------- keys


def load_signer(path: str) -> CryptoSigner:
    """A private key (PEM: PKCS#8, or the key types openssl writes) to sign with; ed25519,
    ECDSA P-256/384 or RSA. A passphrase, if the key has one, comes from $ENVBUILD_SIGNING_KEY_PASSWORD."""
    data = read_bytes(path, "--signing-key", "key")
    password = os.environ.get(PASSWORD_ENV)
    try:
        key = load_pem_private_key(data, password.encode() if password else None)
        return CryptoSigner(key)
    except TypeError as e:  # encrypted without a password, or a password for a plain key
        raise EnvbuildError(f"--signing-key {path}: {e}; set {PASSWORD_ENV} for an encrypted key.") from None
    except (ValueError, Exception) as e:  # noqa: B014 - cryptography raises UnsupportedAlgorithm too
        raise EnvbuildError(f"--signing-key {path} is not a private key envbuild can sign with "
                            f"({type(e).__name__}: {str(e)[:120]}); make one with `openssl genpkey -algorithm "
                            f"ed25519 -out envbuild.key` and give `openssl pkey -in envbuild.key -pubout` to "
                            f"those who verify.") from None


def load_public_key(path: str) -> SSlibKey:
    """A public key (PEM SubjectPublicKeyInfo, as `openssl pkey -pubout` writes it)."""
    data = read_bytes(path, "--key", "key")
    try:
        return SSlibKey.from_crypto(load_pem_public_key(data))
    except (ValueError, Exception) as e:  # noqa: B014
        hint = " (that is a private key: give its public half, `openssl pkey -in KEY -pubout`)" \
            if b"PRIVATE KEY" in data else ""
        raise EnvbuildError(f"--key {path} is not a PEM public key{hint} ({type(e).__name__}).") from None


# ---------------------------------------------------------------- what went in


def matrix_digest(directory: Path) -> str:
    """sha256 over the matrix directory's files (relative path and sha256 of each, sorted)."""
    h = hashlib.sha256()
    base = Path(directory)
    for p in sorted(x for x in base.rglob("*") if x.is_file() and "__pycache__" not in x.parts):
        h.update(f"{p.relative_to(base).as_posix()}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def source_info(cwd: Optional[Path] = None) -> dict:
    """The source the build came from: GitHub Actions' variables, else the git checkout here."""
    env = os.environ
    if env.get("GITHUB_REPOSITORY") and env.get("GITHUB_SHA"):
        server = env.get("GITHUB_SERVER_URL", "https://github.com")
        return {"uri": f"git+{server}/{env['GITHUB_REPOSITORY']}@{env.get('GITHUB_REF', '')}",
                "digest": {"gitCommit": env["GITHUB_SHA"]}}

    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    remote = git("config", "--get", "remote.origin.url") or str(Path(git("rev-parse", "--show-toplevel")).resolve())
    out = {"uri": f"git+{remote}", "digest": {"gitCommit": commit}}
    if git("status", "--porcelain", "--untracked-files=no"):
        out["annotations"] = {"dirty": "the checkout had uncommitted changes"}
    return out


def builder_info() -> dict:
    """Who ran the build: the GitHub workflow run, or this host."""
    env = os.environ
    if env.get("GITHUB_RUN_ID") and env.get("GITHUB_REPOSITORY"):
        server = env.get("GITHUB_SERVER_URL", "https://github.com")
        return {"id": f"{server}/{env['GITHUB_REPOSITORY']}/actions/runs/{env['GITHUB_RUN_ID']}"
                      f"/attempts/{env.get('GITHUB_RUN_ATTEMPT', '1')}",
                "version": {"envbuild": __version__, "workflow": env.get("GITHUB_WORKFLOW_REF", "")}}
    return {"id": f"urn:envbuild:host:{host_platform.node() or 'unknown'}", "version": {"envbuild": __version__}}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def statement(subject_name: str, subject_digest: str, request: dict, image_manifest: bytes, matrix_dir: Path,
              byproducts: list[dict], started: str, lock: Optional[dict] = None) -> dict:
    """The provenance statement of one pushed image (subject: its manifest digest)."""
    manifest = json.loads(image_manifest)
    deps = []
    source = source_info()
    if source:
        deps.append(source)
    deps.append({"name": "matrix", "digest": {"sha256": matrix_digest(matrix_dir)}})
    if lock:
        deps.append({"name": f"lock:{lock['name']}", "digest": {"sha256": lock["sha256"]}})
    deps.append({"name": "image:/opt/envbuild/manifest.json",
                 "digest": {"sha256": hashlib.sha256(image_manifest).hexdigest()}})
    for stage, ref in sorted((manifest.get("base_images") or {}).items()):
        digest = ref.split("@", 1)[1] if "@sha256:" in ref else ""
        deps.append({"name": f"base:{stage}", "uri": f"oci://{ref.split('@')[0]}",
                     **({"digest": {"sha256": digest.split(':', 1)[1]}} if digest else
                        {"annotations": {"pinned": "by tag only: no registry digest was known"}})})
    predicate = {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {"request": request, "tag": manifest.get("tag"), "image": manifest.get("image")},
            "internalParameters": {"envbuild": __version__, "stack": manifest.get("stack"),
                                   "platform": manifest.get("platform")},
            "resolvedDependencies": deps},
        "runDetails": {"builder": builder_info(),
                       "metadata": {"invocationId": os.environ.get("GITHUB_RUN_ID", f"pid-{os.getpid()}"),
                                    "startedOn": started, "finishedOn": _now()},
                       "byproducts": byproducts}}
    doc = {"_type": STATEMENT_TYPE,
           "subject": [{"name": subject_name, "digest": {"sha256": subject_digest.split(":", 1)[1]}}],
           "predicateType": SLSA_PROVENANCE, "predicate": predicate}
    check_shape(doc)
    return doc


def check_shape(doc: dict) -> None:
    """The statement and its SLSA predicate as in-toto-attestation defines them (unknown fields
    and wrong types refused), and the Statement's own rules (a subject with a digest)."""
    try:
        pb = json_format.ParseDict(doc, statement_pb2.Statement())
        Statement.copy_from_pb(pb).validate()
        if doc.get("predicateType") == SLSA_PROVENANCE:
            json_format.ParseDict(doc["predicate"], provenance_pb2.Provenance())
    except (json_format.ParseError, ValueError) as e:
        raise EnvbuildError(f"the provenance is not an in-toto Statement with a SLSA v1 predicate ({e}).",
                            exit_code=1) from None


# ---------------------------------------------------------------- what verify reads of an envelope and a statement
#
# An attestation attached to an image is written by whoever may push there, and even a signed
# statement is parsed bounded and checked before a field is used: the fields verify and stage
# read have the grammar of what they are (a sha256, a tag, a platform), the rest may be any JSON.

_HEX = r"^[0-9a-f]{64}$"
_PRINTABLE = r"^[\x20-\x7e]{0,256}$"  # a keyid, a name: one line a message can quote
_BASE64 = r"^[A-Za-z0-9+/=_-]*$"
_PLATFORM = r"^[a-z0-9_]{1,32}/[a-z0-9_]{1,32}(/[a-z0-9]{1,16})?$"
_TAG = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"  # registry.TAG_RE


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Signature(_Open):
    keyid: str = Field("", pattern=_PRINTABLE)
    sig: str = Field(pattern=_BASE64, max_length=1 << 16)


class EnvelopeDoc(_Open):
    """A DSSE envelope (https://github.com/secure-systems-lab/dsse/blob/master/envelope.md)."""

    payload: str = Field(pattern=_BASE64, max_length=ENVELOPE_LIMIT)
    payloadType: str = Field(pattern=_PRINTABLE)
    signatures: list[_Signature] = Field(max_length=64)


class _Sha256(_Open):
    sha256: str = Field(pattern=_HEX)


class _Named(_Open):
    name: str = Field("", pattern=_PRINTABLE)


class _Dependency(_Named):
    digest: dict[str, str] = {}


class _Byproduct(_Named):
    digest: _Sha256


class _External(_Open):
    tag: Optional[str] = Field(None, pattern=_TAG)


class _Internal(_Open):
    platform: Optional[str] = Field(None, pattern=_PLATFORM)
    stack: Optional[str] = Field(None, pattern=_PRINTABLE)


class _BuildDefinition(_Open):
    externalParameters: _External
    internalParameters: Optional[_Internal] = None
    resolvedDependencies: list[_Dependency] = []


class _RunDetails(_Open):
    byproducts: list[_Byproduct] = []


class _Predicate(_Open):
    buildDefinition: _BuildDefinition
    runDetails: _RunDetails = _RunDetails()


class _Subject(_Named):
    digest: _Sha256


class _StatementHead(_Open):
    predicateType: str = Field(pattern=_PRINTABLE)
    subject: list[_Subject] = Field(min_length=1, max_length=64)


class ProvenanceDoc(_StatementHead):
    """The SLSA v1 provenance statement envbuild signs, as far as verify and stage read it."""

    predicate: _Predicate


def parse_statement(data: bytes | str, named: str) -> dict:
    """A statement (the payload of an envelope, or cosign's), bounded and, when it is a SLSA
    provenance, checked field by field (exit 2 naming the field); the document as parsed."""
    doc = loads_json(data, named, ENVELOPE_LIMIT)
    head = validated(_StatementHead, doc, named)
    if head.predicateType == SLSA_PROVENANCE:
        validated(ProvenanceDoc, doc, named)
    return doc


# ---------------------------------------------------------------- DSSE


def sign(doc: dict, signer: CryptoSigner) -> bytes:
    """The statement in a DSSE envelope signed with `signer`."""
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    envelope = Envelope(payload=payload, payload_type=PAYLOAD_TYPE, signatures={})
    envelope.sign(signer)
    return json.dumps(envelope.to_dict(), sort_keys=True).encode()


def open_envelope(data: bytes, key: SSlibKey) -> dict:
    """The statement inside a DSSE envelope that `key` signed; an error naming what is wrong."""
    if len(data) > ENVELOPE_LIMIT:
        raise EnvbuildError("the attestation is larger than 16 MiB, which no envbuild provenance is.", exit_code=1)
    raw = loads_json(data, "the attestation (a DSSE envelope)", ENVELOPE_LIMIT)
    validated(EnvelopeDoc, raw, "the attestation (a DSSE envelope)")
    try:
        envelope = Envelope.from_dict(raw)
    except (ValueError, KeyError, TypeError):
        raise EnvbuildError("the attestation is not a DSSE envelope.", exit_code=1) from None
    if envelope.payload_type != PAYLOAD_TYPE:
        raise EnvbuildError(f"the envelope holds {envelope.payload_type}, not an in-toto statement.", exit_code=1)
    signed_by = sorted(envelope.signatures)
    if key.keyid not in signed_by:
        raise EnvbuildError(f"it is signed by key {', '.join(k[:16] for k in signed_by) or '(none)'}, not by the "
                            f"given key {key.keyid[:16]}.", exit_code=1)
    try:
        envelope.verify([key], 1)
    except VerificationError:
        raise EnvbuildError(f"its signature by key {key.keyid[:16]} does not verify: the statement was changed "
                            f"after it was signed.", exit_code=1) from None
    doc = parse_statement(envelope.payload, "the signed statement")
    check_shape(doc)
    return doc


def subject_digest(doc: dict) -> str:
    return "sha256:" + ((doc.get("subject") or [{}])[0].get("digest") or {}).get("sha256", "")


def byproduct(doc: dict, name: str) -> Optional[dict]:
    """The byproduct `name` a (checked) statement lists, or None."""
    return next((b for b in (doc["predicate"].get("runDetails") or {}).get("byproducts", []) if b.get("name") == name),
                None)
