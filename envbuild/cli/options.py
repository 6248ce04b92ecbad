"""The options many commands share, declared once, and the request, secrets and pinned bases
they become."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import click

from ..errors import EnvbuildError
from ..rules import DEFAULT_CPU_TARGET, DEFAULT_OPS
from .app import err


def not_empty(ctx, param, value):
    """An option given as '' is refused: click would hand the command an empty string, which the
    command's `if value:` then reads as the default, silently (`--matrix-dir ''`, `--fabric ''`)."""
    if value is not None and not str(value).strip():
        flag = max(param.opts, key=len)
        command = " ".join(["envbuild", *ctx.command_path.split()[1:]])
        raise EnvbuildError(f"{flag} is empty; give a value (`{command} --help` says what it takes), or leave the "
                            f"option out for its default.")
    return value


def matrix_dir_option(f):
    """--matrix-dir, declared once for every command that reads the matrix."""
    return click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR",
                        callback=not_empty,
                        help="Use another matrix directory instead of the built-in one. Env: ENVBUILD_MATRIX_DIR.")(f)


def secret_options(f):
    """The mirrors, their CA and key: what a build is handed as BuildKit secrets, never in a file
    it renders (`render`, `build`, `rebuild`)."""
    opts = [
        click.option("--pip-index-url", help="Package index mirror for pip (a BuildKit secret at build time)."),
        click.option("--torch-index-url", help="Mirror of PyTorch's CUDA-variant index (a BuildKit secret)."),
        click.option("--apt-mirror", help="Replaces the distro mirror host, e.g. https://mirror.example (a secret)."),
        click.option("--apt-snapshot", metavar="URL",
                     help="Where a stack with an OS lock installs its OS packages from instead of the snapshot "
                          "service: a mirror of the lock's moment, {archive} and {timestamp} in the URL (a secret)."),
        click.option("--apt-key", type=click.Path(dir_okay=False), callback=not_empty,
                     help="The public key that signs --apt-snapshot's Release files, when not the distro's (a secret)."),
        click.option("--source-mirror", help="Replaces https://github.com in a fabric's source URLs, e.g. "
                                             "http://127.0.0.1:8765 (scripts/fabric-sources.sh serves one; the "
                                             "pinned sha256 is checked all the same; a secret)."),
        click.option("--ca-cert", type=click.Path(dir_okay=False), help="Extra CA certificate (PEM) for TLS proxies (a secret)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def request_options(f=None, gpu_required=True):
    """The options shared by `render` and `build`: what to resolve and how to render it."""
    if f is None:
        return functools.partial(request_options, gpu_required=gpu_required)
    opts = [
        click.option("--gpu", required=gpu_required, help="GPU profile or alias (h20, H100, nvidia-a100, ...)."),
        click.option("--python", help="Python version or PEP 440 specifier."),
        click.option("--cuda", help="CUDA version or specifier (13.0, '>=12.6')."),
        click.option("--torch", help="torch version or specifier ('>=2.5,<2.8')."),
        click.option("--deepspeed", help="DeepSpeed version or specifier."),
        click.option("--stack", "stack_id", help="Pick a matrix row by id (see `envbuild matrix`)."),
        click.option("--ds-ops", default=None,
                     help="Ops to pre-build: training (the default), all, none, or a comma list "
                          "(cpu_adam,fused_adam)."),
        click.option("--ext", "ext", default=None, metavar="NAME[,NAME]",
                     help="CUDA extensions to pre-build from source for the GPU's arches, verified like the ops: "
                          "flash-attn, causal-conv1d (`envbuild extensions` lists them and what each fits)."),
        click.option("--nccl", metavar="VERSION", callback=not_empty,
                     help="Install this NCCL release (its nvidia-nccl-cuXX wheel, hash-locked) in place of the one "
                          "torch pins: a 2.x of the same CUDA major, not older than torch's pin (matrices/nccl.yaml lists "
                          "PyPI's releases; a refused one is named with the nearest accepted). The tag gets "
                          "-ncclVERSION."),
        click.option("--base-image", help="Replace the OS base image (same distro release), e.g. a private mirror."),
        click.option("--builder-image", help="Replace the builder stage's base image (needs nvcc for NVIDIA stacks)."),
        click.option("--cpu-target", default=None,
                     help=f"CPU the CPU ops are compiled for instead of the build machine's -march=native: "
                          f"x86-64, x86-64-v2, x86-64-v3 (default on x86_64: {DEFAULT_CPU_TARGET}), x86-64-v4; "
                          f"armv8-a, armv9-a, neoverse-v2 (aarch64 default: the GPU's host CPU, e.g. Grace's "
                          f"neoverse-v2 where the OS's GCC knows it)."),
        click.option("--keep-toolchain", is_flag=True, help="Keep compilers in the final image (larger)."),
        click.option("--qemu", is_flag=True,
                     help="An arm64 image built under qemu-user emulation on an x86-64 machine: bind a stub CPU "
                          "sysfs into the build steps (torch crashes at import without it there). Not for real "
                          "arm64 builders."),
        click.option("--no-compiler", is_flag=True,
                     help="Leave the C compiler and Python headers out of the final image (smaller; "
                          "torch.compile then cannot run)."),
        click.option("--fabric", default=None, metavar="NAME", callback=not_empty,
                     help="How NCCL reaches other nodes: ib (default: InfiniBand/RoCE verbs user space in every "
                          "image), none, or a cloud fabric (`envbuild fabrics` lists them with what each adds)."),
        click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
                     help="Add or override an environment default baked into the image (repeatable)."),
        click.option("--registry", envvar="ENVBUILD_REGISTRY", metavar="HOST[/NAMESPACE]",
                     help="Where the image is published (as `envbuild push --registry`, e.g. ghcr.io/acme): "
                          "the image becomes REGISTRY/envbuild:TAG and Singularity.def pulls it from there. "
                          "Env: ENVBUILD_REGISTRY."),
        click.option("--image-repo", envvar="ENVBUILD_IMAGE_REPO", metavar="[HOST/]NAME",
                     help="The whole image repository instead (wins over --registry). Default: the local name "
                          "envbuild, which no registry serves (render warns). Env: ENVBUILD_IMAGE_REPO."),
        secret_options,
        matrix_dir_option,
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def request_from(kw):
    from ..matrix import load_matrix
    from ..resolve import Request, parse_env_pairs

    from ..running import image_repo
    from ..validate import parse_extensions

    m = load_matrix(Path(kw["matrix_dir"]) if kw.get("matrix_dir") else None)
    repo = image_repo(kw.get("image_repo"), kw.get("registry"), m.directory)
    req = Request(gpu=kw["gpu"], python=kw["python"], cuda=kw["cuda"], torch=kw["torch"],
                  deepspeed=kw["deepspeed"], stack=kw["stack_id"], ds_ops=DEFAULT_OPS if kw["ds_ops"] is None else kw["ds_ops"],
                  base_image=kw["base_image"], builder_image=kw["builder_image"],
                  env=parse_env_pairs(kw["env_pairs"]), cpu_target=kw["cpu_target"],
                  keep_toolchain=kw["keep_toolchain"], no_compiler=kw["no_compiler"], image_repo=repo,
                  qemu=kw.get("qemu", False), fabric=kw.get("fabric"),
                  extensions=parse_extensions(m, kw.get("ext")), nccl=kw.get("nccl"))
    return m, req


def secrets_from(kw):
    from ..build import BuildSecrets
    from ..oslock import check_snapshot_template
    from ..resolve import apt_key_file, ca_file
    from ..validate import check_mirror_options

    check_mirror_options(kw)
    check_snapshot_template("--apt-snapshot", kw.get("apt_snapshot"))
    return BuildSecrets(ca_cert=ca_file(kw.get("ca_cert")), pip_index_url=kw.get("pip_index_url"),
                        torch_index_url=kw.get("torch_index_url"), apt_mirror=kw.get("apt_mirror"),
                        source_mirror=kw.get("source_mirror"), apt_snapshot=kw.get("apt_snapshot"),
                        apt_key=apt_key_file(kw.get("apt_key")))


def pin_named_bases(r):
    """A base image the user named is pinned by digest when this machine can learn it (its
    Docker pulled it from a registry, or its registry answers); the matrix's own bases stay
    tags (a render does not contact Docker Hub)."""
    from ..digests import pin

    named = {"runtime": r.request.base_image, "builder": r.request.builder_image or (
        r.request.base_image if r.base_images["builder"] == r.request.base_image else None)}
    pinned = {ref: pin(ref) for ref in set(named.values()) if ref}
    for ref in sorted(ref for ref, (_, digest) in pinned.items() if not digest):
        err.print(f"envbuild: note: {ref} is pinned by tag only: no registry digest is known for it on "
                  f"this machine", markup=False, soft_wrap=True)
    return dataclasses.replace(r, base_images={stage: pinned[named[stage]][0] if named.get(stage) else ref
                                               for stage, ref in r.base_images.items()})
