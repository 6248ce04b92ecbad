"""The manifest job (`envbuild publish --manifest TAG`): once the publish job of each of the
tag's platforms has handed on its digest, the digests merged into the tag's manifest list, each
only if its signed provenance verifies and the SBOM, smoke record and .sqsh it lists are attached
beside it; keyless, the list is signed too. A digest missing (its job failed or was cancelled)
publishes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.knowledge.matrix import Matrix
from envbuild.oci.artifacts import Registry
from envbuild.supply import sbom
from envbuild.supply.ci import publish_plan
from envbuild.supply.jobplan import repository
from envbuild.supply.publish import merge
from envbuild.supply.signing import Signing, cosign
from envbuild.supply.verify import SMOKE_TYPE, SQSH_TYPE, Trust, attached_byproduct, signed_statement, targets


def manifest_sources(m: Matrix, tag: str) -> dict:
    """The manifest job of `tag` (its digest files, platforms)."""
    merges = publish_plan(m)[3]
    found = next((j for j in merges if j["tag"] == tag), None)
    if found is None:
        raise EnvbuildError(f"--manifest {grammar.shown(tag)}: no published tag of that name in {m.directory}'s publish plan; "
                            f"nearest: {', '.join(nearest(tag, [j['tag'] for j in merges])) or 'none'}.")
    return found


def publish_manifest(m: Matrix, registry: str, image_repo: str, tag: str, digests: Path, trust: Trust,
                     signing: Signing, say: Callable[[str], None] = lambda _: None) -> tuple[str, list]:
    """Merge the tag's digests into its manifest list, each only if its signed provenance, SBOM,
    smoke record and .sqsh are attached and verify; then (keyless) sign the list."""
    job = manifest_sources(m, tag)
    name = repository(image_repo)
    refs = []
    for file in job["digests"].split():
        path = Path(digests) / file
        if not path.is_file() or not path.read_text().strip():
            raise EnvbuildError(f"no published image for {file} (its job failed or was cancelled): not publishing "
                                f"{tag}.", exit_code=1)
        refs.append(path.read_text().strip())
    client = Registry(registry)
    for digest in refs:
        for target in targets(client, client.host, name, digest):
            doc, why = signed_statement(client, target, trust)
            if doc is None:
                raise EnvbuildError(f"refusing to publish {tag}: {name}@{digest[:19]}... is not signed as it must be "
                                    f"({why}).", exit_code=1)
            missing = [w for w in (sbom.MEDIA_TYPE, SMOKE_TYPE, SQSH_TYPE)
                       if attached_byproduct(client, target, doc, w)[0] is None]
            if missing:
                raise EnvbuildError(f"refusing to publish {tag}: {name}@{digest[:19]}... lacks what its provenance "
                                    f"lists ({', '.join(missing)}).", exit_code=1)
            say(f"{target.platform} {digest}: {why}")
    index_digest, images = merge(registry, name, tag, refs, on_event=say, vouch=lambda image, what: None)
    if signing.keyless:
        cosign("sign", "--yes", f"{image_repo}@{index_digest}")
    return index_digest, images
