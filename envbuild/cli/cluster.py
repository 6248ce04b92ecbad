"""`export` and `stage`: an image as the enroot squashfs a Slurm cluster starts without importing."""

from __future__ import annotations

from pathlib import Path

import click

from envbuild.cli.app import err, main, out
from envbuild.cli.options import trust_options

COMPRESSION = click.option("--compression", type=click.Choice(["zstd", "gzip", "none"]), default="zstd",
                           show_default=True, help="squashfs compression (enroot and squashfuse read all three).")


@main.command("export")
@click.argument("image")
@click.option("--enroot", "as_enroot", is_flag=True, required=True,
              help="Write the enroot squashfs (.sqsh) that `enroot import dockerd://IMAGE` would, reproducibly.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="File to write (default ./envbuild-<id>.sqsh).")
@COMPRESSION
def export_cmd(image, as_enroot, output, compression):
    """Write IMAGE (a local Docker image) as an enroot squashfs: its environment, entrypoint and
    volumes wired as `enroot import` does; the same image gives the same bytes (sha256)."""
    from envbuild.builds.enroot import export_sqsh
    from envbuild.builds.staging import staged_name

    target = Path(output) if output else Path(staged_name(_image_id(image)))
    sqsh = export_sqsh(image, target, compression, progress=lambda t: err.print(f"envbuild: {t}", markup=False))
    out.print(f"wrote {sqsh.path} ({sqsh.size / 2**20:.1f} MiB, sha256 {sqsh.sha256})", markup=False)
    out.print(f"next: envbuild stage {sqsh.path} --to /shared/containers   # then srun --container-image=<staged>",
              markup=False, soft_wrap=True)


@main.command()
@click.argument("source")
@click.option("--to", "directory", required=True, type=click.Path(file_okay=False),
              help="Shared directory the compute nodes mount (e.g. /shared/containers).")
@click.option("--platform", help="A published multi-arch tag: the platform to stage (default: this machine's).")
@trust_options("A published image (checked as `envbuild verify` does). ")
@click.option("--unverified", is_flag=True, help="A published image: stage what the registry serves without checking "
                                                 "any signature (said so on stderr).")
@COMPRESSION
def stage(source, directory, platform, key, identity, issuer, unverified, compression):
    """Put an image's .sqsh on shared storage once: SOURCE is a published image
    (REGISTRY/NAME:TAG or @DIGEST: the .sqsh whose digest its signed provenance lists is
    downloaded, after the signature is checked with --key or --certificate-identity-regexp as
    `envbuild verify` does; with --unverified, whatever .sqsh is attached, or the image pulled and
    exported here), a local image (exported as by `export --enroot`) or a .sqsh file. Named by
    the image ID, locked so two jobs staging at once export once, checked for free space first
    and by sha256 after; a partial or corrupt file there is refused."""
    from envbuild.base.errors import EnvbuildError
    from envbuild.builds.staging import check_stage_directory, source_kind, stage as stage_file, staging_source
    from envbuild.supply.verify import check_platform, signed_sqsh, trust_from

    say = lambda t: err.print(f"envbuild: {t}", markup=False, soft_wrap=True)  # noqa: E731
    kind = source_kind(source)  # every input before any registry, engine or file is touched
    check_platform("--platform", platform)
    check_stage_directory(Path(directory))
    verified = None
    if kind != "registry" and (key or identity or unverified):
        raise EnvbuildError(f"--key, --certificate-identity-regexp and --unverified are about a published image; "
                            f"SOURCE is a {'.sqsh file' if kind == 'file' else 'local image'}: drop them.")
    if kind == "registry" and unverified:
        if key or identity:
            raise EnvbuildError("--unverified stages without checking a signature, and --key or "
                                "--certificate-identity-regexp asks for the check; give one.")
        say(f"UNVERIFIED: staging {source} without checking any signature (--unverified): the file staged is "
            f"whatever the registry serves, which nobody may have signed.")
    elif kind == "registry":
        trust = trust_from(key, identity, issuer, unverified_hint=True)
        verified = lambda ref, plat: signed_sqsh(ref, trust, plat)  # noqa: E731
    name, size, produce = staging_source(source, compression, platform, progress=say, verified=verified)
    staged = stage_file(Path(directory), name, size, produce, progress=say)
    out.print(f"{'staged' if staged.copied else 'already staged'} {staged.path} (sha256 {staged.sha256})", markup=False)
    out.print(f"next: srun --container-image={staged.path} python /opt/envbuild/smoke.py", markup=False, soft_wrap=True)


def _image_id(image: str) -> str:
    from envbuild.builds.enroot import local_image

    return local_image(image)["Id"]


@main.command()
@click.option("--image", required=True,
              help="pyxis: a staged .sqsh, an enroot URI (ghcr.io#acme/envbuild:TAG) or dockerd://REF; apptainer: a .sif.")
@click.option("--runtime", type=click.Choice(["pyxis", "apptainer"]), default="pyxis", show_default=True,
              help="How the nodes start the image: pyxis/enroot (srun --container-image) or Apptainer.")
@click.option("--nodes", type=int, default=2, show_default=True, help="#SBATCH --nodes.")
@click.option("--gpus-per-node", type=int, default=8, show_default=True,
              help="0: a CPU job (the smoke test and torchrun with gloo).")
@click.option("--tasks-per-node", type=int, default=0,
              help="Smoke-test ranks per node (default: the GPUs, or 2 on CPU).")
@click.option("--time", "time_limit", default="24:00:00", show_default=True,
              help="#SBATCH --time: MINUTES, HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES[:SECONDS]] or UNLIMITED.")
@click.option("--train", default="train.py", show_default=True,
              help="The command torchrun starts, split into words as a shell would; each word arrives as "
                   "written (nothing in it is run or expanded).")
def job(image, runtime, nodes, gpus_per_node, tasks_per_node, time_limit, train):
    """Print the Slurm job script for an image: the multi-node smoke test as the first step, then
    one torchrun per node (c10d rendezvous on the first node), the image's environment in every
    step, for pyxis/enroot or Apptainer. The README's Slurm sections are this command's output."""
    from envbuild.render.jobs import Job, job_script

    click.echo(job_script(Job(image, runtime, nodes, gpus_per_node, tasks_per_node, time_limit, train)), nl=False)
