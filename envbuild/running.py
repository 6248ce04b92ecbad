"""From a build directory to a running job: where the image lives, what Singularity.def
bootstraps from, and the exact next commands the CLI prints after `render` and `build`.

Examples
--------
>>> registry_host("ghcr.io/acme/envbuild"), registry_host("envbuild"), registry_host("acme/envbuild")
('ghcr.io', None, None)
>>> local_only("localhost:5000/envbuild"), local_only("envbuild")
(False, True)
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import yaml

from . import validate
from .errors import EnvbuildError
from .image import paths
from .resolve import Resolution

LOCAL_REPO = "envbuild"
DOCKER_RUN = "docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it"


def registry_host(repo: str) -> Optional[str]:
    """The registry host of a repository, or None when it names none.

    Docker's own rule: the first path component is a host only if it holds a '.' or a ':'
    or is 'localhost'; otherwise the name is resolved on Docker Hub (``envbuild`` means
    ``docker.io/library/envbuild``, an official image that is not ours).
    """
    host, _ = validate._split_domain(repo)
    return host or None


def local_only(repo: str) -> bool:
    """True when no registry serves `repo`: Singularity.def's From: cannot be pulled (the
    renderer hands this to the template, which only prints the comment)."""
    return registry_host(repo) is None


def check_image_repo(repo: str, flag: str, suffix: str = "") -> str:
    """Validate a repository name (no tag), naming the nearest valid spelling.

    `suffix` is appended before checking (a --registry is checked as REGISTRY/NAME).
    """
    if "$" in repo:
        raise EnvbuildError(
            f"{flag} '{repo}' holds a shell variable: `$OWNER` in matrices/publish.yaml is filled in by CI "
            f"(the GitHub owner, lower-cased); give the real name, e.g. ghcr.io/acme"
            f"{'/' + LOCAL_REPO if flag == '--image-repo' else ''}.")
    if validate.valid_repository(repo + suffix):
        return repo
    guess = validate.sanitize_repository(repo + suffix).removesuffix(suffix)  # the OCI grammar: validate.py
    hint = f"; nearest valid: {guess}" if validate.valid_repository(guess + suffix) else ""
    what = "registry" if suffix else "image repository"
    shape = "HOST[:PORT][/NAMESPACE]" if suffix else "[HOST[:PORT]/]NAME[/NAME...]"
    raise EnvbuildError(
        f"{flag} '{repo}' is not a valid {what}: expected {shape} with lower-case names (letters, digits, "
        f"'.', '_', '-') and no tag{hint}.")


def published_name(matrix_dir: Path) -> str:
    """The repository name CI publishes under (``image_repo`` of publish.yaml), else 'envbuild'."""
    path = Path(matrix_dir) / "publish.yaml"
    if not path.is_file():
        return LOCAL_REPO
    try:
        name = (yaml.safe_load(path.read_text()) or {}).get("image_repo", LOCAL_REPO)
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise EnvbuildError(f"{path} cannot be read for its `image_repo` ({e}); fix it or pass --image-repo.") from None
    return str(name)


def image_repo(repo: Optional[str], registry: Optional[str], matrix_dir: Path) -> str:
    """The repository the tag belongs to: --image-repo, else REGISTRY/<publish.yaml image_repo>,
    else the local name 'envbuild'."""
    if repo is not None:
        if "$" in repo:
            check_image_repo(repo, "--image-repo")  # names the CI placeholder
        validate.check_image_repo(repo)
        return repo
    if registry is not None and not registry.strip():
        raise EnvbuildError("--registry (or ENVBUILD_REGISTRY) is empty; give where the images are pushed, e.g. "
                            "ghcr.io/acme, or leave it out for the local name envbuild.")
    if registry:
        registry = check_image_repo(registry.strip().rstrip("/"), "--registry", suffix="/x")
        if not registry_host(registry + "/x"):
            raise EnvbuildError(
                f"--registry '{registry}' names no registry host (a host has a '.' or a ':', or is localhost); "
                f"give where the images are pushed, e.g. ghcr.io/{registry.lower()} or "
                f"registry.example.com:5000/{registry.lower()}.")
        composed = f"{registry}/{published_name(matrix_dir)}"
        validate.check_image_repo(composed)
        return composed
    return LOCAL_REPO


def local_bootstrap_warning(r: Resolution) -> Optional[str]:
    """One paragraph when Singularity.def would bootstrap from a name no registry serves."""
    repo = r.request.image_repo
    if not local_only(repo):
        return None
    hub = f"docker.io/{repo}" if "/" in repo else f"docker.io/library/{repo}"
    return (f"Singularity.def bootstraps from {r.image_ref}, but '{repo}' names no registry host (a pull would "
            f"look for {hub}), so `apptainer build` cannot pull it. Pass --registry HOST[/NAMESPACE] (or set "
            f"ENVBUILD_REGISTRY), where CI or `envbuild push` publishes the image, e.g. --registry "
            f"ghcr.io/<owner>; or --image-repo HOST/NAME. On the machine that ran `envbuild build`, "
            f"docker-daemon:// works (the `next:` lines).")


def next_commands(r: Resolution, path: Path, build_command: Optional[str] = None) -> list[str]:
    """The exact commands after `render` (build_command given) or after `build` (None)."""
    image = shlex.quote(r.image_ref)
    sif = shlex.quote(f"{r.tag}.sif")
    lines = []
    if build_command:
        lines.append(build_command)
    if registry_host(r.request.image_repo):  # push refuses an image whose smoke test did not pass
        registry = shlex.quote(r.request.image_repo.rsplit("/", 1)[0])
        lines.append(f"envbuild smoke {image} && envbuild push {image} --registry {registry}")
    else:
        lines.append(f"envbuild smoke {image}  # add --gpus all on a GPU node")
    lines.append(f"{DOCKER_RUN} {image}" + (f"  # an {r.arch} image: on {r.gpu.name}'s nodes (elsewhere only "
                                              f"under qemu emulation)" if r.arch != "x86_64" else ""))
    if local_only(r.request.image_repo):  # no %test: run the smoke test by hand
        lines.append(f"apptainer build {sif} docker-daemon://{image}"
                     f" && apptainer exec --nv {sif} {paths.VENV_PYTHON} {paths.SMOKE}")
    else:
        lines.append(f"apptainer build {sif} {shlex.quote(str(Path(path) / 'Singularity.def'))}"
                     f" && apptainer test --nv {sif}")
    return lines


def resolution_dict(r: Resolution) -> dict:
    """The resolution as plain data (`render --json`, `--explain --json`): the manifest's
    facts (one source: the build plan), without the environment, plus where Apptainer pulls."""
    from .plan import build_plan

    manifest = build_plan(r).manifest
    keys = ("tag", "image", "stack", "python", "cuda", "torch", "torchvision", "deepspeed", "nccl", "gpu",
            "gpu_cc", "torch_cuda_arch_list", "ds_ops", "ds_ops_dropped", "driver", "arch", "platform", "cpu_target",
            "fabric")
    out = {key: manifest[key] for key in keys}
    out["sm"] = r.gpu.sm
    out["singularity_from"] = {"image": r.image_ref, "registry": registry_host(r.request.image_repo)}
    return out
