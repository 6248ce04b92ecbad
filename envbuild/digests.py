"""Base images pinned by digest where a digest can be known.

A tag moves (debian:bookworm-slim is rebuilt every few weeks); a digest does not. When the
user names a base image (`--base-image`, `--builder-image`, an extension's stack image) and
this machine can learn its digest -- its own Docker pulled it from a registry, or the image's
registry answers the registry API -- the rendered FROM becomes `ref@sha256:...` and
manifest.json records it. A name no registry is known for (`local/debian:bookworm`, imported)
stays a tag, and the render says so. Nothing here ever pulls an image.

>>> registry_parts("127.0.0.1:5000/envbuild/debian:bookworm")
('127.0.0.1:5000', 'envbuild/debian', 'bookworm')
>>> registry_parts("debian:bookworm-slim") is None
True
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Optional

from .engine import registry_of
from .validate import split_reference


def registry_parts(ref: str) -> Optional[tuple[str, str, str]]:
    """(registry host, repository, tag) for a reference that names its registry, else None."""
    host = registry_of(ref)  # docker.io when the name carries no registry host
    if "@" in ref or not ref.startswith(host + "/"):
        return None
    name, tag, _ = split_reference(ref)
    return host, name[len(host) + 1:], tag or "latest"


def local_digest(ref: str) -> Optional[str]:
    """The registry digest this machine's engine recorded for `ref`'s repository, if any."""
    from .engine import get_engine
    from .errors import EnvbuildError
    from .publish import repo_of

    try:
        info = get_engine().inspect(ref)
    except EnvbuildError:  # no engine here, or no such image: nothing is known
        return None
    repo = repo_of(ref)
    return next((digest for name, _, digest in (entry.partition("@") for entry in info.repo_digests)
                 if name == repo and digest.startswith("sha256:")), None)


def remote_digest(ref: str, timeout: float = 10) -> Optional[str]:
    """The digest `ref`'s registry serves for its tag (anonymous registry API), if it answers."""
    from .publish import ANY_MANIFEST, registry_open

    parts = registry_parts(ref)
    if parts is None:
        return None
    host, name, tag = parts
    try:
        with registry_open(host, f"/v2/{name}/manifests/{tag}", {"Accept": ANY_MANIFEST}, timeout=timeout,
                           method="HEAD") as response:
            digest = response.headers.get("Docker-Content-Digest", "")
            return digest if digest.startswith("sha256:") else None
    except (urllib.error.URLError, OSError, ValueError):  # an answer without the tag, or none at all
        return None


def pin(ref: str) -> tuple[str, Optional[str]]:
    """(`ref@digest` or `ref`, the digest or None): what a FROM should say."""
    if "@" in ref:
        return ref, ref.split("@", 1)[1]
    digest = local_digest(ref) or remote_digest(ref)
    return (f"{ref}@{digest}", digest) if digest else (ref, None)


# ---------------------------------------------------------------- the matrix's own bases

BASE_DIGESTS = "base-digests.yaml"  # in the matrix directory, written by `envbuild lock --bases`
HUB_TOKEN = "https://auth.docker.io/token?service=registry.docker.io&scope=repository:{name}:pull"
HUB_REGISTRY = "https://registry-1.docker.io"


def hub_name(ref: str) -> tuple[str, str]:
    """Docker Hub repository and tag of a reference without a registry.

    >>> hub_name("debian:bookworm-slim"), hub_name("nvidia/cuda:13.0.2-devel-ubuntu24.04")
    (('library/debian', 'bookworm-slim'), ('nvidia/cuda', '13.0.2-devel-ubuntu24.04'))
    """
    name, _, tag = ref.partition(":")
    return (name if "/" in name else f"library/{name}"), (tag or "latest")


def hub_digest(ref: str, timeout: float = 15) -> Optional[str]:
    """The digest Docker Hub serves for `ref` (anonymous pull token), or None if it does not answer."""
    from .publish import ANY_MANIFEST

    name, tag = hub_name(ref)
    try:
        with urllib.request.urlopen(HUB_TOKEN.format(name=name), timeout=timeout) as response:
            token = json.load(response)["token"]
        request = urllib.request.Request(f"{HUB_REGISTRY}/v2/{name}/manifests/{tag}", method="HEAD",
                                         headers={"Accept": ANY_MANIFEST, "Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            digest = response.headers.get("Docker-Content-Digest", "")
            return digest if digest.startswith("sha256:") else None
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None


def published_digest(ref: str) -> Optional[str]:
    """The digest a base's registry (Docker Hub when the name has none) serves for its tag."""
    return remote_digest(ref) if registry_parts(ref) else hub_digest(ref)


def load_base_digests(matrix_dir) -> dict[str, str]:
    """ref -> digest recorded by `envbuild lock --bases` (empty when none were reachable)."""
    import yaml
    from pathlib import Path

    path = Path(matrix_dir) / BASE_DIGESTS
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    return {ref: entry["digest"] for ref, entry in (data.get("bases") or {}).items()}


def record_base_digests(matrix_dir, refs, today: str) -> tuple[dict[str, str], list[str]]:
    """Look up each base's published digest and write base-digests.yaml; an unreachable
    registry keeps what was recorded before. Returns (recorded, unreachable refs)."""
    import yaml
    from pathlib import Path

    path = Path(matrix_dir) / BASE_DIGESTS
    old = (yaml.safe_load(path.read_text()) or {}).get("bases", {}) if path.is_file() else {}
    entries, unreachable = dict(old), []
    for ref in sorted(set(refs)):
        digest = published_digest(ref)
        if digest is None:
            unreachable.append(ref)
        elif old.get(ref, {}).get("digest") != digest:
            entries[ref] = {"digest": digest, "checked": today}
    if entries != old:
        header = ("# The digests the matrix's base images had when `envbuild lock --bases` last reached their\n"
                  "# registries (the publishing CI); a render pins FROM to them. Generated: do not edit.\n")
        path.write_text(header + yaml.safe_dump({"bases": entries}, sort_keys=True))
    return {ref: entry["digest"] for ref, entry in entries.items()}, unreachable
