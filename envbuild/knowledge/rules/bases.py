"""The OS an image stands on: a --base-image or --builder-image a user names (rules base-pinned,
base-os, base-cuda, read from the reference alone, no pull), and the archive its packages come
from (--apt-mirror, --apt-snapshot against the OS lock)."""

from __future__ import annotations

import re
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.oci.registry import split_reference

UBUNTU_CODENAMES = {"bionic": "18.04", "focal": "20.04", "jammy": "22.04", "kinetic": "22.10", "lunar": "23.04",
                    "mantic": "23.10", "noble": "24.04", "oracular": "24.10", "plucky": "25.04",
                    "questing": "25.10"}
DEBIAN_CODENAMES = {"buster": "10", "bullseye": "11", "bookworm": "12", "trixie": "13", "forky": "14"}
OTHER_DISTROS = ("rockylinux", "almalinux", "centos", "ubi", "rhel", "oraclelinux", "amazonlinux", "fedora",
                 "alpine", "opensuse", "archlinux")
_RELEASE_TOKEN = re.compile(rf"^(ubuntu|debian|{'|'.join(OTHER_DISTROS)})(\d[\d.]*)?$")


def image_release(ref: str) -> Optional[tuple[str, str]]:
    """(distro, version) named by an image reference, e.g. ('ubuntu', '22.04'), or None
    when the name and tag say nothing about it (no pull: private names are not guessed)."""
    name, tag, _ = split_reference(ref)
    last = name.rsplit("/", 1)[-1]
    tokens = re.split(r"[-_]", tag) if tag else []
    if last == "ubuntu" and tokens and re.fullmatch(r"\d\d\.\d\d", tokens[0]):
        return "ubuntu", tokens[0]
    if last == "debian" and tokens and re.fullmatch(r"\d+(\.\d+)*", tokens[0]):
        return "debian", tokens[0].split(".")[0]
    for token in tokens:
        if token in UBUNTU_CODENAMES:
            return "ubuntu", UBUNTU_CODENAMES[token]
        if token in DEBIAN_CODENAMES:
            return "debian", DEBIAN_CODENAMES[token]
        found = _RELEASE_TOKEN.match(token)
        if found and found.group(2):
            version = found.group(2)
            return found.group(1), (version.split(".")[0] if found.group(1) == "debian" else version)
    if last in OTHER_DISTROS:
        return last, tokens[0] if tokens else ""
    return None


def _family_release(family: str) -> Optional[tuple[str, str]]:
    """'ubuntu24.04' -> ('ubuntu', '24.04'); 'debian12' -> ('debian', '12')."""
    found = re.fullmatch(r"([a-z]+)(\d[\d.]*)", family)
    return (found.group(1), found.group(2)) if found else None


def _retag(ref: str, want: tuple[str, str]) -> Optional[str]:
    """The same image name with the release in its tag changed to `want` (same spelling)."""
    name, tag, _ = split_reference(ref)
    if not tag:
        return None
    distro, version = want
    codenames = {v: k for k, v in (UBUNTU_CODENAMES if distro == "ubuntu" else DEBIAN_CODENAMES).items()}
    out = []
    for token in re.split(r"([-_])", tag):
        if token in UBUNTU_CODENAMES or token in DEBIAN_CODENAMES:
            token = codenames.get(version, f"{distro}{version}")
        elif _RELEASE_TOKEN.match(token) and _RELEASE_TOKEN.match(token).group(2):
            token = f"{distro}{version}"
        out.append(token)
    if name.rsplit("/", 1)[-1] in ("ubuntu", "debian") and re.fullmatch(r"\d+(\.\d+)*", out[0]):
        if name.rsplit("/", 1)[-1] != distro:
            return None
        out[0] = version
    new = "".join(out)
    return f"{name}:{new}" if new != tag else None


def unpinned(ref: str) -> Optional[str]:
    """Why image `ref` may be another image tomorrow (rule base-pinned), or None: it names no tag
    (Docker reads `latest`) or the tag `latest`, and no digest. hadolint refuses both in a
    FROM line (DL3006, DL3007)."""
    _, tag, digest = split_reference(ref)
    if digest:
        return None
    if tag is None:
        return "names no tag, so a build takes whatever `latest` is that day"
    if tag == "latest":
        return "names the tag `latest`, which moves"
    return None


def check_base_images(m, stack, req) -> None:
    """A --base-image/--builder-image must be the stack's distro release (the venv is built
    with that release's Python and copied between the stages); a named CUDA builder must be
    a devel image of the stack's CUDA (DeepSpeed checks nvcc against torch's CUDA)."""
    want = _family_release(stack.os)
    images = [("--base-image", req.base_image, stack.base_images.runtime),
              ("--builder-image", req.builder_image, stack.base_images.builder)]
    for flag, ref, own in images:
        if not ref:
            continue
        why = unpinned(ref)
        if why:
            name = split_reference(ref)[0]
            raise EnvbuildError(f"{flag} {ref!r} {why} (rule base-pinned: the image built would not be the one "
                                f"rendered, and hadolint refuses such a FROM line). Nearest valid choices: {flag} "
                                f"{name}:<release tag> or {name}@sha256:<digest>, or leave it out for the stack's {own}.")
        have = image_release(ref)
        if want and have and have != want:
            same_release = sorted(s.id for s in m.stacks if _family_release(s.os) == have)
            retagged = _retag(ref, want) if have[0] == want[0] else None  # never 'debian:noble'
            choices = [c for c in (retagged, own) if c]
            other = (f", or a stack built on {have[0]}{have[1]}: --stack {', '.join(same_release)}"
                     if same_release else f"; no stack in the matrix is built on {have[0]}{have[1]}")
            raise EnvbuildError(
                f"{flag} '{ref}' is {have[0]} {have[1]}, but stack {stack.id} is built on {stack.os} (rule base-os: "
                f"its Python {stack.python} and the venv copied between the stages come from that release). Nearest "
                f"valid choices: {flag} {' or '.join(dict.fromkeys(choices))}{other}.")
        if flag == "--builder-image" and not m.bases.toolchains[stack.toolchain].install:
            _check_cuda_image(ref, stack, flag, own, need_nvcc=True)
        elif flag == "--base-image":
            _check_cuda_image(ref, stack, flag, own, need_nvcc=False)


def _check_cuda_image(ref: str, stack, flag: str, own: str, need_nvcc: bool) -> None:
    """An NVIDIA CUDA image by name must be the stack's CUDA (its NVIDIA_REQUIRE_CUDA lets
    an older driver start the container otherwise), and a devel one where nvcc is needed."""
    name, tag, _ = split_reference(ref)
    if name.rsplit("/", 1)[-1] != "cuda" or not tag:
        return  # not an NVIDIA CUDA image by name: nothing to check without a pull
    found = re.match(r"^(\d+)\.(\d+)(?:\.\d+)?-(.*)$", tag)
    if not found:
        return
    cuda, flavour = f"{found.group(1)}.{found.group(2)}", found.group(3)
    if cuda != stack.cuda:
        why = ("DeepSpeed checks nvcc against it (rule toolchain)" if need_nvcc else
               "the image's NVIDIA_REQUIRE_CUDA would let a driver too old for the stack start the container")
        raise EnvbuildError(f"{flag} '{ref}' is CUDA {cuda}, but stack {stack.id}'s torch is built for CUDA "
                            f"{stack.cuda} and {why} (rule base-cuda). Nearest valid choice: {flag} {own}.")
    if need_nvcc and "devel" not in flavour.split("-"):
        raise EnvbuildError(f"{flag} '{ref}' is a {flavour.split('-')[0]} image without nvcc; the builder "
                            f"compiles DeepSpeed's CUDA ops (rule base-cuda). Nearest valid choice: a devel image such as "
                            f"{flag} {own}.")


def check_apt_mirror(os_locked: tuple[str, ...], apt_mirror: Optional[str], apt_snapshot: Optional[str]) -> None:
    """--apt-mirror replaces the live archive's host; a stage the OS lock pins installs from the
    archive as of the lock's moment, which a live mirror no longer serves. --apt-snapshot without
    an OS lock has nothing to serve."""
    if os_locked and apt_mirror:
        raise EnvbuildError(f"--apt-mirror replaces the live archive's host, but this stack's OS lock pins the "
                            f"{' and '.join(os_locked)} stage's packages to the archive as of the lock's moment, "
                            f"which a live mirror no longer serves. Give a mirror of that moment as --apt-snapshot "
                            f"'URL/{{archive}}/{{timestamp}}' (or leave both out: the snapshot service has it).")
    if apt_snapshot and not os_locked:
        raise EnvbuildError("--apt-snapshot serves an OS lock's moment of the archive, and this build has no OS "
                            "lock (the summary's `os lock` line says why); leave it out, or use --apt-mirror for the "
                            "live archive.")
