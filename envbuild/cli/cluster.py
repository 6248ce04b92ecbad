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


K8S_ONLY = ("k8s", "fabric", "name", "namespace", "cluster_domain", "queue", "node_selector", "toleration",
            "fabric_resource", "shm_size", "socket_ifname", "output")
SLURM_ONLY = ("runtime", "tasks_per_node", "time_limit")
MANY = {"multiple": True, "metavar": "VALUE"}


@main.command()
@click.option("--image", help="pyxis: a staged .sqsh, an enroot URI (ghcr.io#acme/envbuild:TAG) or dockerd://REF; apptainer: "
                              "a .sif; --k8s: the published image by digest (REGISTRY/REPO@sha256:...).")
@click.option("--runtime", type=click.Choice(["pyxis", "apptainer"]), default="pyxis", show_default=True,
              help="How the nodes start the image: pyxis/enroot (srun --container-image) or Apptainer.")
@click.option("--nodes", type=int, default=2, show_default=True, help="#SBATCH --nodes; --k8s: the pods (one per node).")
@click.option("--gpus-per-node", type=int, default=8, show_default=True,
              help="0: a CPU job (the smoke test and torchrun with gloo).")
@click.option("--tasks-per-node", type=int, default=0,
              help="Smoke-test ranks per node (default: the GPUs, or 2 on CPU).")
@click.option("--time", "time_limit", default="24:00:00", show_default=True,
              help="#SBATCH --time: MINUTES, HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES[:SECONDS]] or UNLIMITED.")
@click.option("--train", default="train.py", show_default=True,
              help="The command torchrun starts, split into words as a shell would; each word arrives as "
                   "written (nothing in it is run or expanded).")
@click.option("--k8s", is_flag=False, flag_value="", metavar="[indexed|jobset|trainjob]",
              help="Write a Kubernetes manifest instead: an Indexed Job and its headless Service, a JobSet, or a "
                   "Kubeflow TrainJob with its TrainingRuntime (docs/running.md); `--k8s --check FILE` checks one.")
@click.option("--check", type=click.Path(dir_okay=False), metavar="FILE",
              help="Check a Kubernetes manifest (anyone's) for the mistakes that leave NCCL on TCP or hang a job.")
@click.option("--fabric", help="--k8s: the image's fabric profile (envbuild fabrics; default: the matrix's).")
@click.option("--name", default="envbuild-train", show_default=True, help="--k8s: the job's name (a DNS-1123 label).")
@click.option("--namespace", default="default", show_default=True, help="--k8s: the namespace.")
@click.option("--cluster-domain", default="cluster.local", show_default=True, help="--k8s: the cluster's DNS domain.")
@click.option("--queue", help="--k8s: a Kueue LocalQueue (the kueue.x-k8s.io/queue-name label; created suspended).")
@click.option("--node-selector", **MANY, help="--k8s: KEY=VALUE a node must carry (repeatable).")
@click.option("--toleration", **MANY, help="--k8s: KEY[=VALUE]:EFFECT the pods tolerate (repeatable).")
@click.option("--fabric-resource", **MANY, help="--k8s: NAME=COUNT replacing the fabric profile's device-plugin "
                                                "resources (repeatable), e.g. rdma/shared_ib=1.")
@click.option("--shm-size", help="--k8s: the memory-backed /dev/shm (default 8Gi per GPU).")
@click.option("--socket-ifname", default="eth0", show_default=True, help="--k8s: NCCL's and gloo's bootstrap interface.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="--k8s: write the manifest to FILE.")
@click.pass_context
def job(ctx, image, runtime, nodes, gpus_per_node, tasks_per_node, time_limit, train, k8s, check, **kube):
    """Print the Slurm job script for an image: the multi-node smoke test as the first step, then
    one torchrun per node (c10d rendezvous on the first node), the image's environment in every
    step, for pyxis/enroot or Apptainer. The README's Slurm sections are this command's output.
    With --k8s, the Kubernetes manifest instead; with --check FILE, a manifest checked."""
    from envbuild.base.errors import EnvbuildError
    from envbuild.render.jobs import Job, job_script

    _misplaced(ctx, k8s, check)
    if check:
        from envbuild.render.kubecheck import check_file

        out.print(f"{check}: {check_file(check)} pod template(s) checked: GPUs and fabric resources in one container, "
                  f"IPC_LOCK, a memory-backed /dev/shm, full-name rendezvous addresses.", markup=False, soft_wrap=True)
        return
    if image is None:
        raise EnvbuildError("--image is missing; give the image the nodes run (envbuild job --help says which forms).")
    if k8s:
        from envbuild.render.kube import job_from_options

        return _kube(job_from_options(k8s, image, nodes, gpus_per_node, train, **kube), kube["output"])
    click.echo(job_script(Job(image, runtime, nodes, gpus_per_node, tasks_per_node, time_limit, train)), nl=False)


def _misplaced(ctx, k8s, check) -> None:
    """Refuse an option of the other path: a Slurm option with --k8s, a --k8s option without it."""
    from click.core import ParameterSource

    from envbuild.base.errors import EnvbuildError

    given = {p.name: p.opts[-1] for p in ctx.command.params if ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE}
    if k8s == "" and not check:
        raise EnvbuildError("--k8s needs the kind of manifest: --k8s indexed, --k8s jobset or --k8s trainjob.")
    wrong = [given[n] for n in (given if check else SLURM_ONLY if k8s is not None else K8S_ONLY)
             if n in given and n not in ("check", "k8s")]
    if wrong:
        many = len(wrong) > 1
        path = ("--check FILE takes no other option" if check else
                f"{'they are' if many else 'it is'} for the Slurm script, not --k8s" if k8s else
                f"{'they are' if many else 'it is'} for --k8s (the Kubernetes manifest)")
        raise EnvbuildError(f"{', '.join(wrong)}: {path}; drop {'them' if many else 'it'}.")


def _kube(kube_job, output) -> None:
    from envbuild.render.kube import manifest, write_manifest

    text = manifest(kube_job)
    if output:
        write_manifest(Path(output), text)
        out.print(f"wrote {output} ({kube_job.kind}); next: envbuild job --k8s --check {output} && kubectl apply -f "
                  f"{output}", markup=False, soft_wrap=True)
    else:
        click.echo(text, nl=False)
