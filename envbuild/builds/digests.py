"""Base images pinned by digest where a digest can be known.

A tag moves (debian:bookworm-slim is rebuilt every few weeks); a digest does not. When the
user names a base image (`--base-image`, `--builder-image`, the stack image an `envbuild extend` layer goes on) and
this machine can learn its digest -- its own Docker pulled it from a registry, or the image's
registry answers the registry API -- the rendered FROM becomes `ref@sha256:...` and
manifest.json records it. A name no registry is known for (`local/debian:bookworm`, imported)
stays a tag, and the render says so. Nothing here ever pulls an image. (Reading the
registry API: registry.py; reading the recorded digests: the matrix loader.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import yaml

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_yaml
from envbuild.engine import get_engine
from envbuild.knowledge.matrix import BASE_DIGESTS
from envbuild.oci.registry import published_digest, remote_digest, repo_of


def local_digest(ref: str) -> Optional[str]:
    """The registry digest this machine's engine recorded for `ref`'s repository, if any."""
    try:
        info = get_engine().inspect(ref)
    except EnvbuildError:  # no engine here, or no such image: nothing is known
        return None
    repo = repo_of(ref)
    return next((digest for name, _, digest in (entry.partition("@") for entry in info.repo_digests)
                 if name == repo and digest.startswith("sha256:")), None)


def pin(ref: str) -> tuple[str, Optional[str]]:
    """(`ref@digest` or `ref`, the digest or None): what a FROM should say."""
    if "@" in ref:
        return ref, ref.split("@", 1)[1]
    digest = local_digest(ref) or remote_digest(ref)
    return (f"{ref}@{digest}", digest) if digest else (ref, None)


# ---------------------------------------------------------------- the matrix's own bases

def record_base_digests(matrix_dir, refs, today: str) -> tuple[dict[str, str], list[str]]:
    """Look up each base's published digest and write base-digests.yaml; an unreachable
    registry keeps what was recorded before. Returns (recorded, unreachable refs)."""
    path = Path(matrix_dir) / BASE_DIGESTS
    data = (read_yaml(path, "matrix file") if os.path.lexists(path) else None) or {}
    old = (data.get("bases") or {}) if isinstance(data, dict) else None
    if not isinstance(old, dict) or not all(isinstance(e, dict) for e in old.values()):
        raise EnvbuildError(f"matrix file {path} is malformed: it needs a `bases:` mapping of image references to "
                            f"{{digest, checked}}; remove it and run `envbuild lock --bases` again.")
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
