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

from .engine import Engine, RegistryError, get_engine
from .errors import EnvbuildError
from .verdict import require_passed

TRANSIENT = re.compile(r"\b(50[0234])\b|internal server error|bad gateway|service unavailable|gateway time"
                       r"|connection reset|broken pipe|\beof\b|i/o timeout|tls handshake timeout"
                       r"|toomanyrequests|\b429\b")
AUTH = re.compile(r"unauthorized|authentication required|no basic auth credentials|\bdenied\b"
                  r"|\b40[13]\b")
MANIFEST_TYPES = ", ".join(["application/vnd.docker.distribution.manifest.v2+json",
                            "application/vnd.oci.image.manifest.v1+json"])


@dataclass
class PushResult:
    refs: list[str]
    digest: str
    attempts: int


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


def api_host(registry: str) -> str:
    """The host[:port] of a --registry that may carry a namespace: the API lives at its root.

    >>> api_host("ghcr.io/acme/team"), api_host("127.0.0.1:5000")
    ('ghcr.io', '127.0.0.1:5000')
    """
    return registry.split("/", 1)[0]


def _registry_open(registry: str, path: str, headers: dict | None = None, timeout: float = 30):
    """Open https://HOST/PATH, falling back to http (local registries on 127.0.0.0/8).

    An HTTPError passes through (the registry answered); otherwise the last connection
    error is raised.
    """
    last: Exception = OSError("no scheme tried")
    for scheme in ("https", "http"):
        req = urllib.request.Request(f"{scheme}://{api_host(registry)}{path}", headers=headers or {})
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError) as e:
            last = e
    raise last


def check_reachable(registry: str, timeout: float = 10) -> None:
    """Fail fast, clearly, when nothing answers at the registry address."""
    try:
        _registry_open(registry, "/v2/", timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # it answered (401 means: log in; that is reported on push)
    except (urllib.error.URLError, OSError) as e:
        raise EnvbuildError(f"registry {registry} cannot be reached ({getattr(e, 'reason', e)}); check "
                            f"--registry HOST[:PORT][/NAMESPACE] and that the registry is running.",
                            exit_code=1) from None


def remote_manifest(registry: str, name: str, reference: str) -> tuple[str, dict] | None:
    """(digest, manifest) the registry serves for name:reference, via the registry API.

    None when it cannot tell without credentials (401) or has no such reference (404):
    then the pull-back by digest is the check.
    """
    try:
        with _registry_open(registry, f"/v2/{name}/manifests/{reference}", {"Accept": MANIFEST_TYPES}) as resp:
            return resp.headers.get("Docker-Content-Digest", ""), json.load(resp)
    except (urllib.error.URLError, OSError, ValueError):  # HTTPError is a URLError
        return None


def repo_of(ref: str) -> str:
    """'localhost:5000/envbuild:tag' -> 'localhost:5000/envbuild' (a port is not a tag)."""
    head, _, last = ref.rpartition("/")
    name = last.split("@")[0].split(":")[0]
    return f"{head}/{name}" if head else name


def push(image: str, registry: str, on_event: Callable[[str], None] = lambda s: None,
         engine: Optional[Engine] = None) -> PushResult:
    """Push both envbuild tags of `image` to `registry`, pull back by digest, compare."""
    engine = engine or get_engine()
    info = engine.inspect(image)
    require_passed(info.id, image)
    check_reachable(registry)
    repo_tags = [t for t in info.tags if repo_of(t) == repo_of(image)] or [image]
    refs, digest, attempts = [], "", 0
    for rt in sorted(repo_tags):
        name, tag = rt.rsplit(":", 1)
        target = f"{registry}/{name.split('/')[-1]}"
        ref = f"{target}:{tag}"
        if CONTENT_TAG.search(tag):
            _refuse_to_move(registry, target, tag, info.id)
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
    return PushResult(refs, digest, attempts + n)


CONTENT_TAG = re.compile(r"-[0-9a-f]{12}$")


def _refuse_to_move(registry: str, target: str, tag: str, image_id: str) -> None:
    """A content tag is immutable: never re-point it at other bits."""
    served = remote_manifest(registry, target.split("/", 1)[1], tag)
    if served and served[1].get("config", {}).get("digest") not in (None, image_id):
        raise EnvbuildError(f"{target}:{tag} already exists in the registry for other bits (image "
                            f"{served[1]['config']['digest'][:19]}); content tags are immutable. Rebuilt "
                            f"images are not bit-identical: push the existing one, or change the inputs.",
                            exit_code=1)
