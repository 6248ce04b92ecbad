"""Push an image that passed its smoke test, both tags, then pull it back by digest and
compare: what the registry serves must be exactly what was tested."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from .errors import EnvbuildError
from .smoke import docker_client, get_image, require_passed

TRANSIENT = ("500 internal server error", "502 bad gateway", "503 service unavailable", "504 gateway",
             "connection reset", "broken pipe", "eof", "i/o timeout", "tls handshake timeout",
             "toomanyrequests", "429")
AUTH = ("unauthorized", "authentication required", "no basic auth credentials", "denied", "401", "403")


@dataclass
class PushResult:
    refs: list[str]
    digest: str
    attempts: int


def classify(message: str) -> str:
    """'auth', 'transient' or 'fatal' for a registry error message."""
    low = message.lower()
    if any(w in low for w in AUTH):
        return "auth"
    if any(w in low for w in TRANSIENT):
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


class RegistryError(Exception):
    def __init__(self, message: str, registry: str):
        super().__init__(message)
        self.message = message
        self.registry = registry


def check_reachable(registry: str, timeout: float = 10) -> None:
    """Fail fast, clearly, when nothing answers at the registry address."""
    last = ""
    for scheme in ("https", "http"):
        try:
            urllib.request.urlopen(f"{scheme}://{registry}/v2/", timeout=timeout)
            return
        except urllib.error.HTTPError:
            return  # it answered (401 means: log in; that is reported on push)
        except (urllib.error.URLError, OSError) as e:
            last = str(getattr(e, "reason", e))
    raise EnvbuildError(f"registry {registry} cannot be reached ({last}); check --registry HOST[:PORT] "
                        f"and that the registry is running.", exit_code=1)


def _push_tag(client, repo: str, tag: str, registry: str) -> str:
    digest = ""
    for event in client.images.push(repo, tag=tag, stream=True, decode=True):
        if "error" in event:
            raise RegistryError(event.get("error", ""), registry)
        aux = event.get("aux") or {}
        digest = aux.get("Digest", digest)
    if not digest:
        raise RegistryError("push finished without a digest", registry)
    return digest


def repo_of(ref: str) -> str:
    """'localhost:5000/envbuild:tag' -> 'localhost:5000/envbuild' (a port is not a tag)."""
    head, _, last = ref.rpartition("/")
    name = last.split("@")[0].split(":")[0]
    return f"{head}/{name}" if head else name


def push(image: str, registry: str, on_event: Callable[[str], None] = lambda s: None) -> PushResult:
    """Push both envbuild tags of `image` to `registry`, pull back by digest, compare."""
    client = docker_client()
    img = get_image(client, image)
    require_passed(img.id, image)
    check_reachable(registry)
    repo_tags = [t for t in img.tags if repo_of(t) == repo_of(image)] or [image]
    refs, digest, attempts = [], "", 0
    for rt in sorted(repo_tags):
        name, tag = rt.rsplit(":", 1)
        target = f"{registry}/{name.split('/')[-1]}"
        img.tag(target, tag)
        on_event(f"pushing {target}:{tag}")
        d, n = with_retries(lambda: _push_tag(client, target, tag, registry), f"push of {target}:{tag}")
        attempts += n
        if digest and d != digest:
            raise EnvbuildError(f"the two tags of {image} got different digests ({digest}, {d}).", exit_code=1)
        digest = d
        refs.append(f"{target}:{tag}")
    by_digest = f"{refs[0].rsplit(':', 1)[0]}@{digest}"
    on_event(f"pulling back {by_digest}")

    def pull():
        try:
            return client.images.pull(by_digest).id
        except Exception as e:  # docker.errors.APIError carries the registry's words
            raise RegistryError(str(e), registry) from None

    pulled_id, n = with_retries(pull, f"pull of {by_digest}")
    if pulled_id != img.id:
        raise EnvbuildError(f"pulled {by_digest} back but got image {pulled_id[:19]}, not the pushed "
                            f"{img.id[:19]}: the registry does not serve what was tested.", exit_code=1)
    return PushResult(refs, digest, attempts + n)
