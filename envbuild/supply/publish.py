"""Push an image that passed its smoke test, both tags, then pull it back by digest and
compare: what the registry serves must be exactly what was tested. Pushes and pulls go through
the engine interface (:mod:`envbuild.engine`); the registry's HTTP API is read directly."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

from envbuild.base.errors import EnvbuildError
from envbuild.builds.verdict import require_passed
from envbuild.engine import Engine, RegistryError, get_engine
from envbuild.oci.artifacts import client as registry_client
from envbuild.oci.registry import (  # noqa: F401
    ANY_MANIFEST,
    DOCKER_LIST,
    DOCKER_MANIFEST,
    LIST_TYPES,
    MANIFEST_TYPES,
    OCI_INDEX,
    check_reachable,
    registry_open,
    remote_manifest,
    repo_of,
)

TRANSIENT = re.compile(r"\b(50[0234])\b|internal server error|bad gateway|service unavailable|gateway time"
                       r"|connection reset|broken pipe|\beof\b|i/o timeout|tls handshake timeout"
                       r"|toomanyrequests|\b429\b")
AUTH = re.compile(r"unauthorized|authentication required|no basic auth credentials|\bdenied\b"
                  r"|\b40[13]\b")


@dataclass
class PushResult:
    refs: list[str]
    digest: str
    attempts: int
    platform: str = "linux/amd64"
    image_id: str = ""


@dataclass(frozen=True)
class PlatformImage:
    """One image a tag serves: a manifest list entry, or the tag's single image."""

    platform: str  # linux/amd64, linux/arm64
    digest: str  # of its manifest
    config: str  # its config digest = the local image ID a smoke record is keyed by
    media_type: str
    size: int


def classify(message: str) -> str:
    """'auth', 'transient' or 'fatal' for a registry error message."""
    # Status codes only as whole words: "401" inside a sha256 digest is not an HTTP status.
    low = re.sub(r"sha256:[0-9a-f]+", "sha256:…", message.lower())
    if AUTH.search(low):
        return "auth"
    if TRANSIENT.search(low):
        return "transient"
    return "fatal"


def with_retries(action: Callable[[], str], what: str, attempts: int = 4, delay: float = 2.0,
                 sleep=time.sleep) -> tuple[str, int]:
    """Run `action`, retrying transient registry errors with exponential backoff."""
    for n in range(1, attempts + 1):
        try:
            return action(), n
        except RegistryError as e:
            kind = classify(e.message)
            if kind == "auth":
                raise EnvbuildError(f"{what}: the registry refused authentication ({e.message}); "
                                    f"run `docker login {e.registry}` with an account that may push.",
                                    exit_code=1) from None
            if kind == "fatal" or n == attempts:
                raise EnvbuildError(f"{what} failed after {n} attempt(s): {e.message}", exit_code=1) from None
            sleep(delay * 2 ** (n - 1))
    raise AssertionError("unreachable")


def per_platform_tag(tag: str, platform: str) -> str:
    """The per-platform tag an image is pushed under before the manifest list is merged.

    >>> per_platform_tag("torch2.15.0-cu132-py3.11-ds0.19.8-gh200", "linux/arm64")
    'torch2.15.0-cu132-py3.11-ds0.19.8-gh200-arm64'
    """
    return f"{tag}-{platform.split('/', 1)[1].replace('/', '')}"


def push(image: str, registry: str, on_event: Callable[[str], None] = lambda s: None,
         engine: Optional[Engine] = None, by_platform: bool = False) -> PushResult:
    """Push both envbuild tags of `image` to `registry`, pull back by digest, compare.

    `by_platform`: push only under the per-platform tag (``<tag>-arm64``), for a manifest list
    that :func:`merge` (or ``docker buildx imagetools create``) makes from the digests. A plain
    push never replaces a multi-platform tag by one image: the other platforms' nodes would
    lose it.
    """
    engine = engine or get_engine()
    info = engine.inspect(image)
    require_passed(info.id, image)
    check_reachable(registry)
    repo_tags = [t for t in info.tags if repo_of(t) == repo_of(image)] or [image]
    if by_platform:
        readable = [t for t in repo_tags if not CONTENT_TAG.search(t.rsplit(":", 1)[1])] or repo_tags[:1]
        repo_tags = [f"{readable[0].rsplit(':', 1)[0]}:{per_platform_tag(readable[0].rsplit(':', 1)[1], info.platform)}"]
    refs, digest, attempts = [], "", 0
    for rt in sorted(repo_tags):
        name, tag = rt.rsplit(":", 1)
        target = f"{registry}/{name.split('/')[-1]}"
        ref = f"{target}:{tag}"
        if CONTENT_TAG.search(tag):
            _refuse_to_move(registry, target, tag, info.id)
        elif not by_platform:
            _refuse_to_flatten(registry, target, tag, info.platform)
        engine.tag(info.id, ref)
        on_event(f"pushing {ref}")
        try:
            d, n = with_retries(lambda: engine.push(ref), f"push of {ref}")
        except EnvbuildError:
            engine.untag(ref)  # leave no tag for a failed push
            raise
        attempts += n
        if digest and d != digest:
            raise EnvbuildError(f"the two tags of {image} got different digests ({digest}, {d}).", exit_code=1)
        digest = d
        refs.append(ref)
    by_digest = f"{refs[0].rsplit(':', 1)[0]}@{digest}"
    on_event(f"pulling back {by_digest}")
    pulled_id, n = with_retries(lambda: engine.pull(by_digest), f"pull of {by_digest}")
    served = remote_manifest(registry, by_digest.split("/", 1)[1].split("@")[0], digest)
    served_config = served[1].get("config", {}).get("digest") if served else pulled_id
    if pulled_id != info.id or served_config != info.id:
        raise EnvbuildError(f"pulled {by_digest} back but the registry serves image {str(served_config)[:19]}, "
                            f"not the tested {info.id[:19]}.", exit_code=1)
    return PushResult(refs, digest, attempts + n, info.platform, info.id)


CONTENT_TAG = re.compile(r"-[0-9a-f]{12}$")


def _refuse_to_move(registry: str, target: str, tag: str, image_id: str) -> None:
    """A content tag is immutable: never re-point it at other bits."""
    served = remote_manifest(registry, target.split("/", 1)[1], tag)
    if served and served[1].get("config", {}).get("digest") not in (None, image_id):
        raise EnvbuildError(f"{target}:{tag} already exists in the registry for other bits (image "
                            f"{served[1]['config']['digest'][:19]}); content tags are immutable. Rebuilt "
                            f"images are not bit-identical: push the existing one, or change the inputs.",
                            exit_code=1)


def _refuse_to_flatten(registry: str, target: str, tag: str, platform: str) -> None:
    """A tag that serves a manifest list with other platforms is not replaced by one image."""
    name = target.split("/", 1)[1]
    try:
        with registry_open(registry, f"/v2/{name}/manifests/{tag}", {"Accept": ANY_MANIFEST}) as resp:
            served = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError):  # none there (404), or it cannot tell: a plain push
        return
    if served.get("mediaType") not in LIST_TYPES:
        return
    others = sorted({_platform(m.get("platform") or {}) for m in served.get("manifests", [])} - {platform})
    others = [o for o in others if o != "unknown/unknown"]
    if others:
        raise EnvbuildError(f"refusing to push {target}:{tag}: the registry serves it as a manifest list that also "
                            f"holds {', '.join(others)}; a single {platform} image there would cut those nodes off. "
                            f"Push with --by-platform and merge the digests (envbuild push --merge).", exit_code=1)


def _platform(entry: dict) -> str:
    """'linux/arm64' from an OCI platform object or an image config (variant ignored)."""
    return f"{entry.get('os') or 'linux'}/{entry.get('architecture') or 'unknown'}"


def _get_json(registry: str, name: str, kind: str, reference: str, accept: str = "") -> tuple[str, bytes, str]:
    """(digest, body, media type) of /v2/NAME/{manifests,blobs}/REFERENCE, authenticated as
    `docker login` left it (the artifacts client: TLS verified, Basic or token auth)."""
    client = registry_client(registry)
    if kind == "manifests":
        desc, body = client.manifest(name, reference, accept or ANY_MANIFEST)
        return desc.digest, body, desc.media_type
    r = client.request("GET", name, f"blobs/{reference}", f"reading {name}@{reference}")
    return reference, r.content, r.headers.get("Content-Type", "").split(";")[0]


def platform_image(registry: str, name: str, digest: str) -> PlatformImage:
    """A single-platform image by its manifest digest: its config and the platform the config says."""
    served_digest, body, media_type = _get_json(registry, name, "manifests", digest, MANIFEST_TYPES)
    manifest = json.loads(body)
    media_type = manifest.get("mediaType") or media_type
    if media_type in LIST_TYPES:
        raise EnvbuildError(f"{name}@{digest} is itself a manifest list; merge single-platform images.", exit_code=1)
    config = manifest.get("config", {}).get("digest", "")
    _, config_body, _ = _get_json(registry, name, "blobs", config)
    return PlatformImage(_platform(json.loads(config_body)), served_digest or digest, config, media_type, len(body))


def served_images(registry: str, name: str, reference: str) -> list[PlatformImage]:
    """Every image NAME:REFERENCE serves: the entries of a manifest list, or its one image."""
    digest, body, media_type = _get_json(registry, name, "manifests", reference, ANY_MANIFEST)
    manifest = json.loads(body)
    if (manifest.get("mediaType") or media_type) not in LIST_TYPES:
        return [platform_image(registry, name, digest or reference)]
    out = []
    for entry in manifest.get("manifests", []):
        if _platform(entry.get("platform") or {}) == "unknown/unknown":
            continue  # BuildKit's attestation manifests
        image = platform_image(registry, name, entry["digest"])
        if image.platform != _platform(entry.get("platform") or {}):
            raise EnvbuildError(f"{name}:{reference} lists {entry['digest'][:19]} as "
                                f"{_platform(entry.get('platform') or {})}, but its config says {image.platform}.",
                                exit_code=1)
        out.append(image)
    return out


def verify_published(registry: str, name: str, reference: str) -> list[PlatformImage]:
    """Every platform NAME:REFERENCE serves has a passed smoke record for exactly its bits."""
    images = served_images(registry, name, reference)
    for image in images:
        require_passed(image.config, f"{registry}/{name}:{reference} ({image.platform})", image.platform)
    return images


def merge(registry: str, name: str, tag: str, digests: list[str],
          on_event: Callable[[str], None] = lambda s: None,
          vouch: Callable[[PlatformImage, str], object] = lambda i, what: require_passed(i.config, what, i.platform)
          ) -> tuple[str, list[PlatformImage]]:
    """Publish NAME:TAG as one manifest list of the single-platform images `digests` (pushed
    with ``--by-platform``), only if each is vouched for: by default a passed smoke record on
    this machine for that platform (the manifest job on another machine vouches with each
    digest's signed provenance instead, :mod:`envbuild.supply.manifestjob`); then read the list back and
    check it serves exactly those images."""
    check_reachable(registry)
    images = [platform_image(registry, name, d) for d in digests]
    seen: dict[str, str] = {}
    for image in images:
        if image.platform in seen:
            raise EnvbuildError(f"two images for {image.platform} ({seen[image.platform][:19]}, {image.digest[:19]}); "
                                f"a manifest list holds one image per platform.", exit_code=1)
        seen[image.platform] = image.digest
        vouch(image, f"{registry}/{name}@{image.digest}")
    images.sort(key=lambda i: i.platform)
    media = DOCKER_LIST if all(i.media_type == DOCKER_MANIFEST for i in images) else OCI_INDEX
    body = json.dumps({"schemaVersion": 2, "mediaType": media, "manifests": [
        {"mediaType": i.media_type, "size": i.size, "digest": i.digest,
         "platform": {"architecture": i.platform.split("/")[1], "os": i.platform.split("/")[0]}}
        for i in images]}, indent=2).encode()
    on_event(f"merging {', '.join(i.platform for i in images)} into {registry}/{name}:{tag}")
    digest = registry_client(registry).put_manifest(name, tag, body, media).headers.get("Docker-Content-Digest", "")
    served = served_images(registry, name, tag)
    if sorted((i.platform, i.digest) for i in served) != sorted((i.platform, i.digest) for i in images):
        raise EnvbuildError(f"{registry}/{name}:{tag} does not serve the merged images after the merge.", exit_code=1)
    return digest, images
