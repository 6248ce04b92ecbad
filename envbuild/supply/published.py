"""Is a variant already published from exactly the files rendered now? Then it is not built again.

A republish of an unchanged job (the scheduled run, a re-run after one variant failed) used to
build, smoke-test, export and push every variant again: minutes each with every cache warm,
hours across the matrix. The registry holds the answer. The variant's per-platform tag serves
an image; the provenance attached to it, signed by the key (or workflow identity) this job signs
with, records the sha256 of the image's manifest.json; that manifest records the digest of every
other rendered file (render.render_digest). When that record equals the manifest.json rendered
now, and everything the provenance lists is attached (the SBOM, a smoke record that passed for
exactly that image and platform, the .sqsh: verify's checks), the image is what this run would
publish, as the two-clean-builds comparison shows, and its digest is handed on as it is. Anything
less (no image, another key, other rendered files, a registry that cannot say) builds, and the
reason is printed.

The vulnerability gate still runs: the signed SBOM's Python pins are audited against today's
advisories, so an image that was clean when it was published is not handed on again if it is not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import requests

from envbuild.base.errors import EnvbuildError
from envbuild.oci.artifacts import Registry
from envbuild.oci.registry import api_host
from envbuild.supply import sbom
from envbuild.supply.verify import SBOM_TYPE, Trust, attached_byproduct, recorded_manifest, targets, vouched


@dataclass(frozen=True)
class Earlier:
    """An image published before from the same rendered files, every signed check passed."""

    ref: str        # REGISTRY/NAME:TAG (the per-platform tag)
    digest: str     # of its manifest: what the job hands on
    config: str     # its config digest (the image ID)
    pins: dict      # name -> version of its Python distributions, from the signed SBOM


def find(image_repo: str, tag: str, platform: str, manifest: bytes,
         trust: Optional[Trust]) -> tuple[Optional[Earlier], str]:
    """The image IMAGE_REPO:TAG serves for `platform` if it was published from the rendered
    `manifest` (manifest.json's bytes) with provenance `trust` signed, else None; and why."""
    ref = f"{image_repo}:{tag}"
    if trust is None:
        return None, "no key or workflow identity here to check an earlier publish's signature with"
    registry = api_host(image_repo)
    name = image_repo[len(registry) + 1:]
    try:
        client = Registry(registry)
        if not client.exists(name, tag):
            return None, f"{ref} is not published yet"
        found = targets(client, registry, name, tag, platform)
        checks, doc = vouched(client, found[0], trust, content=False)
        failed = next((c for c in checks if not c.ok), None)
        if failed is not None or doc is None:
            return None, f"{ref} is there, but its {failed.name if failed else 'signature'} check failed: " \
                         f"{failed.detail if failed else 'no provenance'}"
        now, then = hashlib.sha256(manifest).hexdigest(), recorded_manifest(doc)
        if now != then:
            return None, (f"{ref} was published from other rendered files (manifest.json sha256 {then[:12]}, "
                          f"now {now[:12]})")
        layer, why = attached_byproduct(client, found[0], doc, SBOM_TYPE)
        if layer is None or layer.size > sbom.SBOM_LIMIT:
            return None, f"{ref}: {why or f'its SBOM declares {layer.size} bytes, over {sbom.SBOM_LIMIT >> 20} MiB'}"
        pins = dict(sbom.describe(client.fetch(name, layer))["pypi"])
    except EnvbuildError as e:  # a registry that cannot say, or serves what no publish wrote: built
        return None, f"{ref} could not be checked ({e.message})"
    except (requests.RequestException, OSError) as e:
        return None, f"{ref} could not be checked ({type(e).__name__})"
    target = found[0]
    return Earlier(ref, target.manifest.digest, target.config, pins), (
        f"{ref} was published from the same rendered files (manifest.json sha256 {now[:12]}), signed by "
        f"{trust.describe()}, its smoke test passed")


__all__ = ["Earlier", "find"]
