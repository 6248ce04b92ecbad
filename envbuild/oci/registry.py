"""Image references and registries, in one room: the OCI name grammar (repository, tag,
digest), which registry a name lives in, and the registry's HTTP API (read directly; pushes
and pulls go through the engine). Nothing here pulls an image.

>>> split_reference("127.0.0.1:5000/envbuild/debian:bookworm@sha256:" + "0" * 64)[:2]
('127.0.0.1:5000/envbuild/debian', 'bookworm')
>>> registry_of("envbuild:t"), registry_host("envbuild"), repo_of("localhost:5000/envbuild:tag")
('docker.io', None, 'localhost:5000/envbuild')
>>> registry_parts("127.0.0.1:5000/envbuild/debian:bookworm")
('127.0.0.1:5000', 'envbuild/debian', 'bookworm')
>>> registry_parts("debian:bookworm-slim") is None
True
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Optional

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError

LOCAL_REPO = "envbuild"  # the repository of an image no --image-repo or --registry names

# ---------------------------------------------------------------- OCI names
# github.com/opencontainers/distribution-spec spec.md ("<name> MUST match") and
# github.com/distribution/reference regexp.go for the registry host, tag and digest.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH = rf"{_COMPONENT}(?:/{_COMPONENT})*"
TAG_MAX = 128  # Docker's and the distribution spec's limit on a tag
def _shown(value: str) -> str:
    """A value quoted in a message, its control characters escaped (one paragraph)."""
    return grammar.shown(value, limit=300)


TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")  # [a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}
DIGEST_RE = re.compile(r"^(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})\Z")
NAME_MAX = 255
CONTENT_TAG_DIGITS = 12  # the content tag: the readable tag, '-', 12 hex digits of the rendered files
READABLE_TAG_MAX = TAG_MAX - 1 - CONTENT_TAG_DIGITS


def check_readable_tag(tag: str, what: str) -> str:
    """The one tag rule: a readable tag is a valid tag with room left for its content tag.

    >>> check_readable_tag("torch2.15.0-cu132-py3.11-ds0.19.8-h20", "the stack tag")
    'torch2.15.0-cu132-py3.11-ds0.19.8-h20'
    """
    if not TAG_RE.match(tag) or len(tag) > READABLE_TAG_MAX:
        raise EnvbuildError(f"{what} {_shown(tag)} is not a usable image tag: it needs letters, digits, '_', '.' and '-' "
                            f"only, not starting with '.' or '-', and at most {READABLE_TAG_MAX} characters (Docker's "
                            f"limit is {TAG_MAX}, and the content tag adds {CONTENT_TAG_DIGITS + 1}); it has "
                            f"{len(tag)}.")
    return tag


def _split_domain(name: str) -> tuple[str, str]:
    """('registry:5000', 'team/app') or ('', 'library/app'): the first component is a
    registry host when it has a '.' or ':' or is 'localhost' (docker's rule)."""
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, rest
    return "", name


def valid_repository(name: str) -> bool:
    """An OCI repository name: [host[:port]/]path, at most 255 characters, a port a TCP port."""
    domain, path = _split_domain(name)
    return (len(name) <= NAME_MAX and bool(re.fullmatch(_PATH, path))
            and (not domain or (bool(re.fullmatch(_HOST, domain)) and bad_port(domain) is None)))


def bad_port(host: str) -> Optional[str]:
    """The port of `host` ('registry:99999') when it is no TCP port (1 to 65535), else None.

    >>> bad_port("127.0.0.1:5000"), bad_port("localhost:99999")
    (None, '99999')
    """
    port = host.rpartition(":")[2] if re.search(r":[0-9]+$", host) else None
    return port if port is not None and not 0 < int(port) < 65536 else None


def split_reference(ref: str) -> tuple[str, Optional[str], Optional[str]]:
    """'host:5000/a/b:tag@sha256:...' -> ('host:5000/a/b', 'tag', 'sha256:...')."""
    name, _, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, (digest if "@" in ref else None)


def sanitize_repository(text: str, default: str = "envbuild") -> str:
    """The nearest valid repository name: lower-case, other characters -> '-'."""
    name, _, _ = split_reference(text.strip())
    domain, path = _split_domain(name)
    parts = []
    for comp in path.lower().split("/"):
        comp = re.sub(r"[^a-z0-9._-]+", "-", comp)
        comp = re.sub(r"[._-]*([._-])[._-]*", lambda m: "__" if m.group(0) == "__" else m.group(1), comp)
        comp = comp.strip("._-")
        if comp:
            parts.append(comp)
    if not parts:
        parts = [default]
    if domain and bad_port(domain):
        domain = domain.rpartition(":")[0] + ":5000"
    if domain and re.fullmatch(_HOST, domain):
        parts.insert(0, domain)
    return "/".join(parts)


_GRAMMAR = ("path components are lower-case letters and digits separated by '.', '_', '__' or '-', joined by "
            "'/', with an optional registry host[:port]/ in front")


def check_image_repo(repo: Optional[str], flag: str = "--image-repo", suffix: str = "") -> Optional[str]:
    """A repository name only (envbuild writes the readable and content tags), naming the
    nearest valid spelling. `suffix` is appended before checking: a --registry is checked as
    REGISTRY/NAME."""
    if repo is None:
        return None
    if not repo.strip():
        raise EnvbuildError(f"{flag} is empty; give a repository such as envbuild (the default) or "
                            "registry.example.com/team/envbuild.")
    if "$" in repo:
        raise EnvbuildError(
            f"{flag} {_shown(repo)} holds a shell variable: `$OWNER` in matrices/publish.yaml is filled in by CI "
            f"(the GitHub owner, lower-cased); give the real name, e.g. ghcr.io/acme"
            f"{'/' + LOCAL_REPO if flag == '--image-repo' else ''}.")
    port = bad_port(_split_domain(repo + (suffix or "/x"))[0])
    if port:
        raise EnvbuildError(f"{flag} {_shown(repo)}: the port {port} is not a TCP port (1 to 65535), so nothing can listen "
                            f"there; nearest valid choice: {flag} {repo.replace(':' + port, ':5000', 1)} (a local "
                            f"registry's usual port), or the host without a port for 443.")
    if suffix:
        if valid_repository(repo + suffix):
            return repo
        guess = sanitize_repository(repo + suffix).removesuffix(suffix)
        hint = f"; nearest valid: {guess}" if valid_repository(guess + suffix) else ""
        raise EnvbuildError(
            f"{flag} {_shown(repo)} is not a valid registry: expected HOST[:PORT][/NAMESPACE] with lower-case names "
            f"(letters, digits, '.', '_', '-') and no tag{hint}.")
    name, tag, digest = split_reference(repo)
    if (tag is not None or digest is not None) and valid_repository(name):
        if digest is None and tag and tag.isdigit() and "/" not in name:  # 'localhost:5000': a registry
            raise EnvbuildError(f"{flag} {_shown(repo)} is a registry host:port without a repository; "
                                f"nearest valid choice: {flag} {repo}/envbuild.")
        what = f"a digest (@{digest})" if digest is not None else f"a tag (:{tag})"
        raise EnvbuildError(f"{flag} {_shown(repo)} carries {what}; it takes a repository only, envbuild writes the "
                            f"tags itself (the readable tag and a content tag). Nearest valid choice: "
                            f"{flag} {name}.")
    if not valid_repository(repo):
        raise EnvbuildError(f"{flag} {_shown(repo)} is not a valid OCI repository name ({_GRAMMAR}; at most "
                            f"{NAME_MAX} characters); nearest valid choice: {flag} {sanitize_repository(repo)}.")
    return repo


def reference_problems(ref: str) -> list[str]:
    """What makes `ref` no image reference (name[:tag][@digest]); empty when it is one."""
    name, tag, digest = split_reference(ref)
    problems = []
    domain = _split_domain(name)[0]
    if domain and bad_port(domain):
        problems.append(f"the registry port {bad_port(domain)} is not a TCP port (1 to 65535)")
    elif not name or not valid_repository(name):
        problems.append(f"the name {_shown(name)} is not a valid repository ({_GRAMMAR})")
    if tag is not None and not TAG_RE.match(tag):
        problems.append(f"the tag {_shown(tag)} is not valid (letters, digits, '_', '.', '-', not starting with '.' or "
                        f"'-', at most 128)")
    if digest is not None and not DIGEST_RE.match(digest):
        problems.append(f"the digest {_shown(digest)} is not sha256:<64 lower-case hex digits> (or sha512:<128>)")
    return problems


def check_image_reference(flag: str, ref: Optional[str]) -> None:
    """--base-image / --builder-image: name[:tag][@sha256:digest] as Docker and Apptainer take it."""
    if ref is None:
        return
    if not ref.strip():
        raise EnvbuildError(f"{flag} is empty; give an image reference such as ubuntu:24.04 or "
                            f"registry.example.com/mirror/ubuntu:24.04@sha256:<64 hex digits>.")
    name, tag, digest = split_reference(ref)
    problems = reference_problems(ref)
    if problems:
        fixed = sanitize_repository(name, default="ubuntu")
        if tag is not None:
            clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", tag).strip(".-")[:TAG_MAX]  # a stray newline is no "-" to keep
            fixed += f":{clean}" if clean else ""
        if digest is not None and DIGEST_RE.match(digest):
            fixed += f"@{digest}"
        raise EnvbuildError(f"{flag} {_shown(ref)} is not a valid image reference: {'; '.join(problems)}. Nearest "
                            f"valid choice: {flag} {fixed}.")


def registry_of(ref: str) -> str:
    """'127.0.0.1:5000/envbuild:t' -> '127.0.0.1:5000'; 'envbuild:t' -> 'docker.io' (Docker's rule)."""
    head, sep, _ = ref.partition("/")
    if sep and ("." in head or ":" in head or head == "localhost"):
        return head
    return "docker.io"


def registry_host(repo: str) -> Optional[str]:
    """The registry host of a repository, or None when it names none.

    Docker's own rule: the first path component is a host only if it holds a '.' or a ':'
    or is 'localhost'; otherwise the name is resolved on Docker Hub (``envbuild`` means
    ``docker.io/library/envbuild``, an official image that is not ours).
    """
    host, _ = _split_domain(repo)
    return host or None


def local_only(repo: str) -> bool:
    """True when no registry serves `repo`: Singularity.def's From: cannot be pulled (the
    renderer hands this to the template, which only prints the comment)."""
    return registry_host(repo) is None


# ---------------------------------------------------------------- the registry API
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST_TYPES = ", ".join([DOCKER_MANIFEST, OCI_MANIFEST])
LIST_TYPES = (DOCKER_LIST, OCI_INDEX)
ANY_MANIFEST = ", ".join([DOCKER_MANIFEST, OCI_MANIFEST, *LIST_TYPES])


def api_host(registry: str) -> str:
    """The host[:port] of a --registry that may carry a namespace: the API lives at its root.

    >>> api_host("ghcr.io/acme/team"), api_host("127.0.0.1:5000")
    ('ghcr.io', '127.0.0.1:5000')
    """
    return registry.split("/", 1)[0]


def registry_open(registry: str, path: str, headers: dict | None = None, timeout: float = 30,
                   method: str = "GET", data: bytes | None = None):
    """Open https://HOST/PATH, falling back to http (local registries on 127.0.0.0/8).

    An HTTPError passes through (the registry answered); otherwise the last connection
    error is raised.
    """
    last: Exception = OSError("no scheme tried")
    for scheme in ("https", "http"):
        req = urllib.request.Request(f"{scheme}://{api_host(registry)}{path}", headers=headers or {},
                                     method=method, data=data)
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
        registry_open(registry, "/v2/", timeout=timeout).close()
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
        with registry_open(registry, f"/v2/{name}/manifests/{reference}", {"Accept": MANIFEST_TYPES}) as resp:
            return resp.headers.get("Docker-Content-Digest", ""), json.load(resp)
    except (urllib.error.URLError, OSError, ValueError):  # HTTPError is a URLError
        return None


def repo_of(ref: str) -> str:
    """'localhost:5000/envbuild:tag' -> 'localhost:5000/envbuild' (a port is not a tag)."""
    head, _, last = ref.rpartition("/")
    name = last.split("@")[0].split(":")[0]
    return f"{head}/{name}" if head else name




def registry_parts(ref: str) -> Optional[tuple[str, str, str]]:
    """(registry host, repository, tag) for a reference that names its registry, else None."""
    host = registry_of(ref)  # docker.io when the name carries no registry host
    if "@" in ref or not ref.startswith(host + "/"):
        return None
    name, tag, _ = split_reference(ref)
    return host, name[len(host) + 1:], tag or "latest"


def remote_digest(ref: str, timeout: float = 10) -> Optional[str]:
    """The digest `ref`'s registry serves for its tag (anonymous registry API), if it answers."""
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
