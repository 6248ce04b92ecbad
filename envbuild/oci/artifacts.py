"""OCI artifacts attached to an image: an SBOM, a smoke record, a signed provenance, the enroot
.sqsh, each an OCI manifest whose `subject` is the image's manifest digest, found again through
the OCI referrers API (distribution-spec v1.1, "Listing Referrers") or, on registries without
it (Debian's docker-registry 2.8 answers 404 there), through the spec's fallback: an image index
under the tag ``sha256-<hex>`` that lists them ("Referrers Tag Schema").

Requests go through the `oras` library (its registry client: blob uploads, chunked for large
files, Docker's config.json credentials, Basic or Bearer token authentication, retries). TLS is
verified against the system's CA bundle (REQUESTS_CA_BUNDLE names another); plain HTTP is used
only for a registry on the loopback network, as Docker itself does.

The fallback index is read, changed and written back; two publishers attaching to one image at
the same moment could lose an entry (the spec says so too). envbuild attaches to one image from
one job at a time.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import oras.auth
import oras.container
import oras.oci
import oras.provider
import requests
from pydantic import BaseModel, ConfigDict, Field

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import escaped
from envbuild.base.untrusted import loads_json, validated
from envbuild.oci.registry import ANY_MANIFEST, LIST_TYPES, OCI_INDEX, OCI_MANIFEST, api_host

EMPTY_CONFIG = b"{}"  # application/vnd.oci.empty.v1+json: the config of an artifact that needs none
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
CHUNK = 64 << 20  # blobs above this go up in chunks of it (oras reads a monolithic upload into memory)
MANIFEST_LIMIT = 4 << 20  # the distribution spec lets registries refuse manifests above 4 MiB
TITLE = "org.opencontainers.image.title"


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    artifact_type: str = ""
    annotations: dict = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict:
        out = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.artifact_type:
            out["artifactType"] = self.artifact_type
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out

    @staticmethod
    def from_dict(d: dict) -> "Descriptor":
        return Descriptor(d.get("mediaType", ""), d.get("digest", ""), int(d.get("size") or 0),
                          d.get("artifactType", ""), dict(d.get("annotations") or {}))


# ---------------------------------------------------------------- what a registry serves, as envbuild reads it
#
# A registry's manifests, indexes and referrers are written by whoever may push there: each is
# parsed bounded (envbuild.base.untrusted) and checked against these models before a field is used.
# A digest is one the distribution spec allows (no newline, no path), a media type an RFC 6838
# name, a size a count of bytes, a platform's words letters and digits.

_MEDIA = r"^([A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126})?$"
_WORD = r"^[a-z0-9_.-]{1,32}$"
_DIGEST = r"^(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})$"  # registry.DIGEST_RE, as pydantic's regex writes it


class OciPlatform(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    os: str = Field("linux", pattern=_WORD)
    architecture: str = Field("unknown", pattern=_WORD)
    variant: str = Field("", pattern=r"^[a-z0-9]{0,16}$")

    def name(self) -> str:
        return f"{self.os}/{self.architecture}"


class OciDescriptor(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    mediaType: str = Field("", pattern=_MEDIA)
    digest: str = Field(pattern=_DIGEST)
    size: int = Field(ge=0, le=1 << 50)
    artifactType: str = Field("", pattern=_MEDIA)
    annotations: dict[str, str] = {}
    platform: Optional[OciPlatform] = None

    def descriptor(self) -> "Descriptor":
        return Descriptor(self.mediaType, self.digest, self.size, self.artifactType, dict(self.annotations))


class OciIndex(BaseModel):
    """An image index or manifest list (a tag's platforms, a referrers list)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    mediaType: str = Field("", pattern=_MEDIA)
    manifests: list[OciDescriptor] = []


class OciManifest(BaseModel):
    """One image's (or one attached artifact's) manifest."""

    model_config = ConfigDict(extra="ignore", strict=True)
    mediaType: str = Field("", pattern=_MEDIA)
    artifactType: str = Field("", pattern=_MEDIA)
    config: Optional[OciDescriptor] = None
    layers: list[OciDescriptor] = []


class _Head(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    mediaType: str = Field("", pattern=_MEDIA)


def parse_index(body: bytes, named: str) -> OciIndex:
    """An index a registry served, bounded and checked (exit 2 naming the field otherwise)."""
    return validated(OciIndex, loads_json(body, named, MANIFEST_LIMIT), named)


def parse_manifest(body: bytes, named: str) -> OciManifest:
    """A manifest a registry served, bounded and checked (exit 2 naming the field otherwise)."""
    return validated(OciManifest, loads_json(body, named, MANIFEST_LIMIT), named)


@dataclass(frozen=True)
class Blob:
    """A file (or bytes) to put in an artifact as one layer."""

    media_type: str
    title: str
    path: Optional[Path] = None
    data: Optional[bytes] = None


def fallback_tag(digest: str) -> str:
    """The referrers tag schema's tag for an image digest.

    >>> fallback_tag("sha256:" + "ab" * 32)[:15]
    'sha256-abababab'
    """
    return digest.replace(":", "-")[:128]


def loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0].strip("[]") if host.count(":") <= 1 or host.startswith("[") else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Registry:
    """One registry's API, authenticated as `docker login` left it; `name` arguments are
    repository paths inside it (acme/envbuild)."""

    def __init__(self, registry: str, timeout: float = 30):
        self.host = api_host(registry)
        self.timeout = timeout
        scheme, challenge = self._probe()
        backend = "basic" if challenge.lower().startswith("basic") else "token"
        self.client = oras.provider.Registry(self.host, insecure=scheme == "http", auth_backend=backend)
        self.base = f"{scheme}://{self.host}"
        self._auth_loaded = False

    def _probe(self) -> tuple[str, str]:
        """The scheme the registry answers on, and its authentication challenge. A certificate
        this machine does not trust is an error, never a reason to fall back to plain HTTP."""
        last: Exception = OSError("nothing tried")
        for scheme in ("https", "http") if loopback(self.host) else ("https",):
            try:
                r = requests.get(f"{scheme}://{self.host}/v2/", timeout=self.timeout)
                return scheme, r.headers.get("WWW-Authenticate", "")
            except requests.exceptions.SSLError as e:
                if "certificate" in str(e).lower():
                    raise EnvbuildError(f"registry {self.host}: its TLS certificate is not trusted here ({_reason(e)}); "
                                        f"add its CA to the bundle REQUESTS_CA_BUNDLE names (or the system's).",
                                        exit_code=1) from None
                last = e  # not TLS at all: a plain-HTTP registry on the loopback network
            except requests.exceptions.RequestException as e:
                last = e
        raise EnvbuildError(f"registry {self.host} cannot be reached ({_reason(last)}); check the registry address "
                            f"and that it is running.", exit_code=1)

    def _container(self, name: str) -> oras.container.Container:
        container = self.client.get_container(f"{self.host}/{name}")
        if not self._auth_loaded:  # the credentials `docker login` stored, where Docker itself reads them
            config = docker_config()
            self.client.auth.load_configs(container, configs=[config] if os.path.isfile(config) else None)
            if isinstance(self.client.auth, oras.auth.BasicAuth):
                basic = getattr(self.client.auth, "_basic_auth", None)
                if basic:  # sent up front: a chunk answered 401 half-way is a connection the registry drops
                    self.client.session.headers["Authorization"] = f"Basic {basic}"
                else:
                    self.client.auth = _NoCredentials()  # answer a 401 with a refusal, not with "Basic None"
            self._auth_loaded = True
        return container

    def request(self, method: str, name: str, path: str, what: str, ok=(200,), **kw) -> requests.Response:
        """One API request on /v2/NAME/PATH; a refusal becomes a one-paragraph error."""
        self._container(name)
        try:
            r = self.client.do_request(f"{self.base}/v2/{name}/{path}", method, **kw)
        except ValueError as e:  # oras: authentication could not be answered, or a 500 after its retries
            raise EnvbuildError(f"{what}: registry {self.host} refused it ({e}); run `docker login {self.host}` "
                                f"with an account that may push, or check the registry.", exit_code=1) from None
        except requests.exceptions.RequestException as e:
            raise EnvbuildError(f"{what}: registry {self.host} failed ({type(e).__name__}: {e}).",
                                exit_code=1) from None
        if r.status_code in (401, 403):
            raise EnvbuildError(f"{what}: registry {self.host} refused authentication (HTTP {r.status_code}); run "
                                f"`docker login {self.host}` with an account that may push.", exit_code=1)
        if r.status_code not in ok:
            raise EnvbuildError(f"{what}: registry {self.host} answered HTTP {r.status_code} "
                                f"({_errors(r)}).", exit_code=1)
        return r

    # ------------------------------------------------------------ manifests

    def manifest(self, name: str, reference: str, accept: str = ANY_MANIFEST) -> tuple[Descriptor, bytes]:
        """The manifest NAME:REFERENCE (tag or digest): its descriptor and exact bytes."""
        r = self.request("GET", name, f"manifests/{reference}", f"reading {name}@{reference}",
                         headers={"Accept": accept}, stream=True)
        body = _read_bounded(r, MANIFEST_LIMIT, f"manifest {name}@{reference}")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise EnvbuildError(f"registry {self.host} served {name}@{reference} with other bytes (sha256 "
                                f"{digest[7:19]}...); it cannot be trusted.", exit_code=1)
        head = validated(_Head, loads_json(body, f"manifest {name}@{reference}", MANIFEST_LIMIT),
                         f"manifest {name}@{reference}")
        media = head.mediaType or r.headers.get("Content-Type", "").split(";")[0]
        return Descriptor(media, digest, len(body)), body

    def exists(self, name: str, reference: str) -> bool:
        self._container(name)
        r = self.client.do_request(f"{self.base}/v2/{name}/manifests/{reference}", "HEAD",
                                   headers={"Accept": ANY_MANIFEST})
        return r.status_code == 200

    def put_manifest(self, name: str, reference: str, body: bytes, media_type: str) -> requests.Response:
        return self.request("PUT", name, f"manifests/{reference}", f"writing {name}:{reference}", ok=(200, 201),
                            data=body, headers={"Content-Type": media_type})

    def delete_manifest(self, name: str, digest: str) -> bool:
        """Remove a manifest by digest where the registry allows it (many do not); True if gone."""
        self._container(name)
        try:
            r = self.client.do_request(f"{self.base}/v2/{name}/manifests/{digest}", "DELETE")
        except (ValueError, requests.exceptions.RequestException):
            return False
        return r.status_code in (200, 202, 404)

    # ------------------------------------------------------------ blobs

    def upload(self, name: str, blob: Blob) -> Descriptor:
        """Upload one blob (a file in chunks above CHUNK); its descriptor."""
        container = self._container(name)
        with tempfile.TemporaryDirectory(prefix="envbuild-blob-") as tmp:
            path = blob.path
            if path is None:
                path = Path(tmp) / "blob"
                path.write_bytes(blob.data or b"")
            layer = oras.oci.NewLayer(str(path), media_type=blob.media_type)
            if blob.title:
                layer["annotations"] = {TITLE: blob.title}
            size = int(layer["size"])
            try:
                r = self.client.upload_blob(str(path), container, layer, do_chunked=size > CHUNK, chunk_size=CHUNK)
            except (ValueError, requests.exceptions.RequestException) as e:
                raise EnvbuildError(f"uploading {blob.title or blob.media_type} ({size} bytes) to {self.host}/{name} "
                                    f"failed: {e}.", exit_code=1) from None
            if r.status_code not in (200, 201, 202):
                raise EnvbuildError(f"uploading {blob.title or blob.media_type} to {self.host}/{name}: HTTP "
                                    f"{r.status_code} ({_errors(r)}).", exit_code=1)
        return Descriptor(blob.media_type, layer["digest"], size, annotations=layer.get("annotations") or {})

    def fetch(self, name: str, desc: Descriptor, dest: Optional[Path] = None,
              progress: Callable[[int], None] = lambda n: None) -> bytes:
        """A blob, checked against its descriptor as it streams: never more than `desc.size`
        bytes are read, and its sha256 must be the digest. Into `dest` (a new file) if given."""
        what = f"blob {desc.digest[:19]}... of {self.host}/{name}"
        r = self.request("GET", name, f"blobs/{desc.digest}", f"reading {what}", stream=True)
        declared = r.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > desc.size:
            r.close()
            raise EnvbuildError(f"{what} is {declared} bytes, larger than the {desc.size} its descriptor declares; "
                                f"refused before reading it.", exit_code=1)
        h, got, chunks = hashlib.sha256(), 0, []
        with (open(dest, "xb") if dest else _NoFile()) as out:
            for chunk in r.iter_content(1 << 20):
                got += len(chunk)
                if got > desc.size:
                    r.close()
                    raise EnvbuildError(f"{what} goes on past the {desc.size} bytes its descriptor declares; refused "
                                        f"after {got} bytes.", exit_code=1)
                h.update(chunk)
                if dest:
                    out.write(chunk)
                    progress(got)
                else:
                    chunks.append(chunk)
            if dest:
                out.flush()
                os.fsync(out.fileno())
        if got != desc.size or "sha256:" + h.hexdigest() != desc.digest:
            raise EnvbuildError(f"{what}: got {got} bytes with sha256 {h.hexdigest()[:16]}..., not the {desc.size} "
                                f"bytes and digest the descriptor declares; it is partial or altered.", exit_code=1)
        return b"".join(chunks)

    # ------------------------------------------------------------ referrers

    def attach(self, name: str, subject: Descriptor, artifact_type: str, blobs: list[Blob],
               annotations: Optional[dict] = None) -> Descriptor:
        """Push an artifact whose subject is `subject` (by digest, no tag of its own) and make
        it findable: the registry's referrers API, or the fallback tag's index."""
        layers = [self.upload(name, b) for b in blobs]
        config = self.upload(name, Blob(EMPTY_TYPE, "", data=EMPTY_CONFIG))
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
                    "config": {"mediaType": EMPTY_TYPE, "digest": config.digest, "size": config.size},
                    "layers": [layer.to_dict() for layer in layers],
                    "subject": {"mediaType": subject.media_type, "digest": subject.digest, "size": subject.size},
                    **({"annotations": annotations} if annotations else {})}
        body = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        r = self.put_manifest(name, digest, body, OCI_MANIFEST)
        desc = Descriptor(OCI_MANIFEST, digest, len(body), artifact_type, annotations or {})
        if not r.headers.get("OCI-Subject"):  # the registry does not index referrers itself
            self._add_to_fallback(name, subject.digest, desc)
        return desc

    def _fallback_index(self, name: str, subject_digest: str) -> dict:
        tag = fallback_tag(subject_digest)
        if not self.exists(name, tag):
            return {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
        _, body = self.manifest(name, tag, OCI_INDEX)
        named = f"the referrers index {name}:{tag}"
        index = loads_json(body, named, MANIFEST_LIMIT)  # kept whole: what another tool listed is written back
        validated(OciIndex, index, named)
        if index.get("mediaType") != OCI_INDEX:
            raise EnvbuildError(f"{self.host}/{name}:{tag} is not an OCI image index, so it is not a referrers "
                                f"fallback envbuild can extend; it was written by another tool.", exit_code=1)
        return index

    def _add_to_fallback(self, name: str, subject_digest: str, desc: Descriptor) -> None:
        index = self._fallback_index(name, subject_digest)
        index["manifests"] = [m for m in index.get("manifests", []) if m.get("digest") != desc.digest]
        index["manifests"].append(desc.to_dict())
        body = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
        self.put_manifest(name, fallback_tag(subject_digest), body, OCI_INDEX)

    def detach(self, name: str, subject_digest: str, digests: set[str]) -> None:
        """Take artifacts out of the fallback index (and delete them where the registry lets)."""
        if self.referrers_api(name, subject_digest) is None and self.exists(name, fallback_tag(subject_digest)):
            index = self._fallback_index(name, subject_digest)
            index["manifests"] = [m for m in index.get("manifests", []) if m.get("digest") not in digests]
            body = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
            self.put_manifest(name, fallback_tag(subject_digest), body, OCI_INDEX)
        for d in digests:
            self.delete_manifest(name, d)

    def referrers_api(self, name: str, subject_digest: str) -> Optional[list[Descriptor]]:
        """What the referrers API lists, or None where the registry has no such API (404)."""
        self._container(name)
        r = self.client.do_request(f"{self.base}/v2/{name}/referrers/{subject_digest}", "GET",
                                   headers={"Accept": OCI_INDEX}, stream=True)
        if r.status_code == 404 or not r.headers.get("Content-Type", "").startswith(OCI_INDEX):
            r.close()
            return None
        if r.status_code != 200:
            r.close()
            raise EnvbuildError(f"listing what is attached to {name}@{subject_digest}: registry {self.host} "
                                f"answered HTTP {r.status_code}.", exit_code=1)
        named = f"the referrers of {name}@{subject_digest}"
        body = _read_bounded(r, MANIFEST_LIMIT, named)
        return [m.descriptor() for m in parse_index(body, named).manifests]

    def referrers(self, name: str, subject_digest: str, artifact_type: str = "") -> list[Descriptor]:
        """Every artifact attached to the image `subject_digest`, of one type if given."""
        found = self.referrers_api(name, subject_digest)
        if found is None:
            index = OciIndex.model_validate(self._fallback_index(name, subject_digest))  # checked as it was read
            found = [m.descriptor() for m in index.manifests]
        return [d for d in found if not artifact_type or d.artifact_type == artifact_type]

    def layers(self, name: str, artifact: Descriptor) -> list[Descriptor]:
        """The layers of an attached artifact, read from its manifest (bytes checked by digest)."""
        _, body = self.manifest(name, artifact.digest, OCI_MANIFEST)
        return [d.descriptor() for d in parse_manifest(body, f"the artifact {name}@{artifact.digest}").layers]


@functools.lru_cache(maxsize=16)
def client(registry: str) -> Registry:
    """One client per registry for the process (the probe and the login happen once)."""
    return Registry(registry)


def is_index(media_type: str) -> bool:
    return media_type in LIST_TYPES


def docker_config() -> str:
    """Docker's client configuration: $DOCKER_CONFIG/config.json, else ~/.docker/config.json."""
    return os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")


class _NoCredentials:
    """oras's authentication interface with nothing to offer: a 401 stays a refusal."""

    token = None

    def get_auth_header(self) -> dict:
        return {}

    def authenticate_request(self, original, headers, refresh=False):
        return headers, False

    def load_configs(self, container, configs=None) -> None:
        pass


def _reason(e: Exception) -> str:
    text = str(e)
    for marker in ("CERTIFICATE_VERIFY_FAILED", "Connection refused", "Name or service not known", "timed out"):
        if marker in text:
            return marker.replace("_", " ").lower() if marker.isupper() else marker
    return f"{type(e).__name__}: {text[:160]}"


class _NoFile:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _read_bounded(r: requests.Response, limit: int, what: str) -> bytes:
    data = b""
    for chunk in r.iter_content(1 << 16):
        data += chunk
        if len(data) > limit:
            r.close()
            raise EnvbuildError(f"{what} is larger than {limit >> 20} MiB, which no manifest is; refused.", exit_code=1)
    return data


class _RegistryError(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str = ""
    message: str = ""


class _RegistryErrors(BaseModel):
    model_config = ConfigDict(extra="ignore")
    errors: list[_RegistryError] = []


def _errors(r: requests.Response) -> str:
    """The distribution spec's error body, as a message quotes it (bounded, control characters escaped)."""
    try:
        said = validated(_RegistryErrors, loads_json(r.content, "the registry's error", 1 << 16), "the registry's error")
    except EnvbuildError:
        return escaped(r.reason or "no detail")
    return escaped("; ".join(f"{e.code}: {e.message}" for e in said.errors)[:300]) or escaped(r.reason or "no detail")


