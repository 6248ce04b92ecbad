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

from envbuild.base.errors import EnvbuildError
from envbuild.image import paths
from envbuild.knowledge.lock import unlocked_reason
from envbuild.knowledge.matrix import load_publish
from envbuild.oci.registry import LOCAL_REPO, check_image_repo, local_only, registry_host
from envbuild.plan.components.record import base_pinning
from envbuild.resolve.resolver import Resolution

DOCKER_RUN = "docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it"


def published_name(matrix_dir: Path) -> str:
    """The repository name CI publishes under (``image_repo`` of publish.yaml), else 'envbuild'."""
    return load_publish(matrix_dir).image_repo


def image_repo(repo: Optional[str], registry: Optional[str], matrix_dir: Path) -> str:
    """The repository the tag belongs to: --image-repo, else REGISTRY/<publish.yaml image_repo>,
    else the local name 'envbuild'."""
    if repo is not None:
        check_image_repo(repo)
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
        check_image_repo(composed)
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


def resolution_dict(r: Resolution, manifest: dict) -> dict:
    """The resolution as plain data (`render --json`, `--explain --json`): the facts of its
    manifest (one source: the build plan's, which the caller has), without the environment,
    plus where Apptainer pulls."""
    keys = ("tag", "image", "stack", "python", "cuda", "torch", "torchvision", "deepspeed", "nccl", "gpu",
            "gpu_cc", "torch_cuda_arch_list", "ds_ops", "ds_ops_dropped", "driver", "arch", "platform", "cpu_target",
            "fabric")
    out = {key: manifest[key] for key in keys}
    out["sm"] = r.gpu.sm
    if "nccl_override" in manifest:  # --nccl
        out["nccl_override"] = manifest["nccl_override"]
    out["lock"] = ({"locked": True, **manifest["lock"]} if manifest["lock"] else
                   {"locked": False, "why": unlocked_reason(r.stack.id, r.torch_index, r.locked_alternative),
                    "locked_alternative": r.locked_alternative})
    out["os_lock"] = ({"locked": True, **manifest["os_lock"]} if r.os_lock else {"locked": False, **manifest["os_lock"]})
    out["base_images"] = {stage: {"ref": ref, "pinned": manifest["base_pinning"][stage]}
                          for stage, ref in manifest["base_images"].items()}
    out["singularity_from"] = {"image": r.image_ref, "registry": registry_host(r.request.image_repo)}
    return out


def os_lock_line(r: Resolution) -> str:
    """The summary's `os lock` row: the lock, or why the OS packages float."""
    lock = r.os_lock
    if lock is None:
        return r.os_unlocked or "none"
    line = (f"{Path(lock.path).name} ({lock.packages()} packages, sha256 {lock.sha256[:12]}, archive as of "
            f"{lock.snapshot})")
    return line + (f"; {r.os_unlocked}" if r.os_unlocked else "")


def base_line(r: Resolution) -> str:
    """The summary's `base` row: each stage's base, and whether a digest pins it."""
    pins = base_pinning(r.base_images)
    shown = {}
    for stage, ref in r.base_images.items():
        shown.setdefault(ref, []).append(stage)
    return "; ".join(f"{ref} ({'by digest' if pins[stages[0]] == 'digest' else 'by tag only: no digest is known'})"
                     + ("" if len(shown) == 1 else f" for the {'/'.join(stages)}") for ref, stages in shown.items())
