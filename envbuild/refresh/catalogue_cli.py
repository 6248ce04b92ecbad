"""The `envbuild matrix catalogue` command: derive the message catalogues from fetched sources,
diff them against matrices/catalogues/, and (with --write) write them, like `matrix refresh`."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Optional

import click

from envbuild.base.errors import EnvbuildError
from envbuild.base.resources import CATALOGUES, matrices_dir
from envbuild.refresh import (
    container_catalogue,
    cuda_catalogue,
    launcher_catalogue,
    nccl_catalogue,
    package_catalogue,
    torch_catalogue,
    writer,
    xid_catalogue,
)
from envbuild.refresh.cli import _not_empty


def _old(path: Path) -> str:
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise EnvbuildError(f"{path} is not a regular file (a link or a device?); envbuild replaces only the "
                            f"catalogue it wrote. Move it away and run again.")
    return writer.read(path) if path.exists() else ""


def refresh_catalogue(source: Path, directory: Path, progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """The NCCL catalogue derived from `source` for the releases `directory`/nccl.yaml ships, nothing
    written; and a line per release added or removed and per release whose wordings changed."""
    nccl = nccl_catalogue.parse(writer.read(directory / "nccl.yaml"), directory / "nccl.yaml")
    path = directory / CATALOGUES / "nccl.yaml"
    old_text = _old(path)
    old = nccl_catalogue.parse(old_text, path)
    new = nccl_catalogue.derive(nccl_catalogue.open_sources(source), nccl_catalogue.shipped_releases(nccl), progress)
    return writer.FileChange(path, old_text, nccl_catalogue.render(new)), nccl_catalogue.summary(old, new)


def refresh_cuda(wheels: Path, directory: Path) -> tuple[writer.FileChange, list[str]]:
    """The CUDA catalogue from the downloaded runtime wheels the locks in `directory`/locks pin."""
    path = directory / CATALOGUES / "cuda.yaml"
    old_text = _old(path)
    new = cuda_catalogue.derive(wheels, directory / "locks")
    if not new["releases"]:
        raise EnvbuildError(f"--cuda-wheels {wheels} holds none of the CUDA runtime wheels the locks in "
                            f"{directory / 'locks'} pin (with their sha256): `pip download --no-deps "
                            f"nvidia-cuda-runtime-cu12==VERSION -d {wheels}` for each pinned version.")
    return (writer.FileChange(path, old_text, cuda_catalogue.render(new)),
            cuda_catalogue.summary(nccl_catalogue.parse(old_text, path), new))


def refresh_torch(wheels: Path, directory: Path, progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """The torch.distributed catalogue from the torch wheels in `wheels`, for the releases `directory`/torch.yaml ships."""
    if not (directory / "torch.yaml").is_file():
        raise EnvbuildError(f"--matrix-dir {directory} has no torch.yaml; point it at a matrix directory such as matrices/.")
    torch = torch_catalogue.parse(writer.read(directory / "torch.yaml"), directory / "torch.yaml")
    path = directory / CATALOGUES / "torch.yaml"
    old_text = _old(path)
    new = torch_catalogue.derive(wheels, torch_catalogue.shipped_releases(torch), progress)
    if not new["releases"]:
        raise EnvbuildError(f"--torch-wheels {wheels} holds no torch wheel of a release {directory / 'torch.yaml'} "
                            f"ships: `pip download --no-deps --only-binary=:all: --platform macosx_11_0_arm64 "
                            f"torch==VERSION -d {wheels}` (the smallest wheel; the Python is the same in all).")
    return (writer.FileChange(path, old_text, torch_catalogue.render(new)),
            torch_catalogue.summary(torch_catalogue.parse(old_text, path), new))


def refresh_c10d(wheels: Path, directory: Path, progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """c10d's C++ catalogue from the Linux torch wheels (or their saved extractions) the locks pin."""
    from envbuild.refresh import c10d_catalogue  # noqa: PLC0415  (its extraction model is pydantic's: loaded here only)
    if not (directory / "locks").is_dir():
        raise EnvbuildError(f"--matrix-dir {directory} has no locks/; point it at a matrix directory such as matrices/.")
    path = directory / CATALOGUES / "c10d.yaml"
    old_text = _old(path)
    new = c10d_catalogue.derive(wheels, c10d_catalogue.shipped_releases(directory), progress)
    if not new["releases"]:
        raise EnvbuildError(f"--c10d-wheels {wheels} holds no torch wheel (or extraction) whose sha256 a lock in "
                            f"{directory / 'locks'} pins: {c10d_catalogue.FETCH}.")
    return (writer.FileChange(path, old_text, c10d_catalogue.render(new)),
            c10d_catalogue.summary(nccl_catalogue.parse(old_text, path), new))


def refresh_launcher(name: str, source: Path, directory: Path, progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """A launcher's catalogue (Slurm, enroot or pyxis) from its fetched sources, for the release lines
    launcher_catalogue names."""
    component = launcher_catalogue.component(name)
    path = directory / CATALOGUES / f"{name}.yaml"
    old_text = _old(path)
    new = launcher_catalogue.derive(component, launcher_catalogue.open_sources(component, source), progress)
    if not new["releases"]:
        raise EnvbuildError(f"--{name}-source {source} holds no release tag of the {component.title} release lines "
                            f"{', '.join(component.lines)}: give a clone of {component.url} with its tags.")
    return (writer.FileChange(path, old_text, launcher_catalogue.render(component, new)),
            launcher_catalogue.summary(component, nccl_catalogue.parse(old_text, path), new))


def refresh_container(name: str, source: Path, directory: Path, toolkit: Optional[str],
                      progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """The container toolkit's, libnvidia-container's or Apptainer's catalogue from fetched sources
    (libnvidia-container's at the commits the toolkit's releases pin, read from `toolkit`)."""
    spec = container_catalogue.component(name)
    path = directory / CATALOGUES / f"{name}.yaml"
    old_text = _old(path)
    sources = container_catalogue.open_sources(name, source, Path(toolkit) if toolkit else None)
    new = container_catalogue.derive(spec, sources, progress)
    if not new["releases"]:
        raise EnvbuildError(f"--{name}-source {source} holds no release of the {spec.title} release lines "
                            f"{', '.join(spec.lines)}: give a clone of {spec.url} with its tags"
                            + (" (and the commits the toolkit's releases pin)." if name == "libnvidia-container" else "."))
    return (writer.FileChange(path, old_text, container_catalogue.render(spec, new)),
            container_catalogue.summary(spec, nccl_catalogue.parse(old_text, path), new))


def refresh_xid(source: Path, directory: Path, progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """The Xid catalogue from the open GPU kernel modules' nverror.h at the driver branches xid_catalogue names."""
    path = directory / CATALOGUES / "xid.yaml"
    old_text = _old(path)
    new = xid_catalogue.derive(xid_catalogue.open_sources(source), progress)
    return (writer.FileChange(path, old_text, xid_catalogue.render(new)),
            xid_catalogue.summary(nccl_catalogue.parse(old_text, path), new))


def refresh_package(name: str, archives: Path, directory: Path, progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """A package's catalogue (DeepSpeed from its sdists, Triton from its wheels) for the releases the matrix ships."""
    pkg = package_catalogue.package(name)
    if not (directory / "locks").is_dir():
        raise EnvbuildError(f"--matrix-dir {directory} has no locks/; point it at a matrix directory such as matrices/.")
    path = directory / CATALOGUES / f"{name}.yaml"
    old_text = _old(path)
    new = package_catalogue.derive(pkg, archives, package_catalogue.shipped_releases(pkg, directory), progress)
    if not new["releases"]:
        raise EnvbuildError(f"--{name}-{pkg.kind}s {archives} holds no {pkg.title} {pkg.kind} of a release the matrix "
                            f"in {directory} ships (with the sha256 its locks pin): `{pkg.fetch}` for each.")
    return (writer.FileChange(path, old_text, package_catalogue.render(pkg, new)),
            package_catalogue.summary(pkg, nccl_catalogue.parse(old_text, path), new))


def refresh_all(source: Optional[str], wheels: Optional[str], directory: Path, progress,
                torch_wheels: Optional[str] = None, launchers: Optional[dict] = None,
                packages: Optional[dict] = None, containers: Optional[dict] = None, xid: Optional[str] = None,
                c10d: Optional[str] = None) -> list:
    launchers = {name: path for name, path in (launchers or {}).items() if path}
    containers = containers or {}
    packages = {name: path for name, path in (packages or {}).items() if path}
    if not source and not wheels and not torch_wheels and not launchers and not packages and not any(containers.values()) \
            and not xid and not c10d:
        raise EnvbuildError("give --source (NCCL's sources), --cuda-wheels (the CUDA runtime wheels), --torch-wheels "
                            "(torch wheels), --slurm-source, --enroot-source, --pyxis-source, --deepspeed-sdists, "
                            "--triton-wheels, --container-toolkit-source, --libnvidia-container-source, --apptainer-source, "
                            "--xid-source, --c10d-wheels, or several.")
    if (source or wheels) and not (directory / "nccl.yaml").is_file():
        raise EnvbuildError(f"--matrix-dir {directory} has no nccl.yaml; point it at a matrix directory such as matrices/.")
    done = [refresh_catalogue(Path(source), directory, progress)] if source else []
    done += [refresh_cuda(Path(wheels), directory)] if wheels else []
    done += [refresh_torch(Path(torch_wheels), directory, progress)] if torch_wheels else []
    done += [refresh_launcher(name, Path(path), directory, progress) for name, path in launchers.items()]
    done += [refresh_xid(Path(xid), directory, progress)] if xid else []
    done += [refresh_c10d(Path(c10d), directory, progress)] if c10d else []
    done += [refresh_container(name, Path(path), directory, containers.get("container-toolkit"), progress)
             for name, path in containers.items() if path]
    return done + [refresh_package(name, Path(path), directory, progress) for name, path in packages.items()]


def _launcher_sources(command):
    """--slurm-source, --enroot-source, --pyxis-source: one per launcher_catalogue component, its
    repository named as the component records it."""
    for c in reversed(list(launcher_catalogue.COMPONENTS.values())):
        command = click.option(
            f"--{c.name}-source", type=click.Path(file_okay=False, exists=True),
            help=f"{c.title}'s sources: a git clone (or mirror) of {c.url.removeprefix('https://')} with its tags, "
                 f"or saved sources with a tags.txt.")(command)
    return command


def _container_sources(command):
    """--container-toolkit-source, --libnvidia-container-source and --apptainer-source (container_catalogue's
    components)."""
    for c in reversed(list(container_catalogue.COMPONENTS.values())):
        command = click.option(
            f"--{c.name}-source", type=click.Path(file_okay=False, exists=True),
            help=f"{c.title}'s sources: a git clone (or mirror) of {c.url.removeprefix('https://')} with its tags"
                 + (", or saved sources with a tags.txt." if c.name != "libnvidia-container" else
                    " (a fork holding upstream's commits will do) read at the commits the toolkit's releases pin "
                    "(give --container-toolkit-source too), or saved sources with a tags.txt."))(command)
    return command


@click.command("catalogue")
@click.option("--source", "source", type=click.Path(file_okay=False, exists=True),
              help="NCCL's sources: a git clone (or mirror) of github.com/NVIDIA/nccl with its tags, or a "
                   "directory of saved sources with a tags.txt (tests).")
@click.option("--cuda-wheels", "wheels", type=click.Path(file_okay=False, exists=True),
              help="A directory of the CUDA runtime wheels the locks pin (pip download --no-deps).")
@click.option("--torch-wheels", "torch_wheels", type=click.Path(file_okay=False, exists=True),
              help="A directory of torch wheels, one per release the matrix ships (pip download --no-deps): the "
                   "Python of their torch/distributed.")
@_launcher_sources
@click.option("--deepspeed-sdists", type=click.Path(file_okay=False, exists=True),
              help="A directory of DeepSpeed's sdists, one per release matrices/deepspeed.yaml lists (pip download "
                   "--no-deps --no-binary :all:): its launcher and op loading.")
@click.option("--triton-wheels", type=click.Path(file_okay=False, exists=True),
              help="A directory of Triton wheels, one per release the locks pin, with a sha256 they pin (pip download "
                   "--no-deps): its compiler and runtime.")
@_container_sources
@click.option("--xid-source", type=click.Path(file_okay=False, exists=True),
              help="The NVIDIA open GPU kernel modules' sources: a git clone (or mirror) of "
                   "github.com/NVIDIA/open-gpu-kernel-modules with its tags (the driver's Xids, from nverror.h), or "
                   "saved sources with a tags.txt.")
@click.option("--c10d-wheels", type=click.Path(file_okay=False, exists=True),
              help="A directory of Linux x86_64 torch wheels the locks pin, or the WHEEL.c10d.json extractions "
                   "reading one leaves beside it (the wheel can then go): c10d's C++ strings.")
@click.option("--write", is_flag=True, help="Write the catalogues (atomically) instead of only showing the diff.")
@click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR",
              callback=lambda ctx, param, value: _not_empty("--matrix-dir", value),
              help="Matrix directory whose nccl.yaml and locks name the releases (default: the built-in one).")
def catalogue_command(source: Optional[str], wheels: Optional[str], torch_wheels: Optional[str],
                      slurm_source: Optional[str], enroot_source: Optional[str], pyxis_source: Optional[str],
                      deepspeed_sdists: Optional[str], triton_wheels: Optional[str], container_toolkit_source: Optional[str],
                      libnvidia_container_source: Optional[str], apptainer_source: Optional[str],
                      xid_source: Optional[str], c10d_wheels: Optional[str], write: bool, matrix_dir: Optional[str]):
    """Derive every message NCCL can print (WARN and INFO format strings, ncclResult_t messages)
    per release the matrix ships from NCCL's sources, and every cudaError_t and CUresult from the
    pinned CUDA runtime wheels, and what torch.distributed's Python raises or logs as an error
    from torch wheels, what Slurm (srun, slurmstepd, PMI/PMIx), enroot and pyxis print from
    their sources, and what DeepSpeed's launcher and op loading and Triton's compiler and runtime
    raise from their PyPI sdists and wheels, and what the NVIDIA Container Toolkit and
    libnvidia-container print from their sources, and Apptainer's run path from its, and the NVIDIA
    driver's Xid numbers and names from its open kernel modules, and the pieces of c10d's C++
    messages from the torch wheels' libraries; show the diff, or --write it.

    Exit 0: the catalogues are current (or were written); 1: one differs and --write was not
    given; 2: a source cannot be read or an input is bad."""
    directory = Path(matrix_dir) if matrix_dir else matrices_dir()
    launchers = {"slurm": slurm_source, "enroot": enroot_source, "pyxis": pyxis_source}
    done = refresh_all(source, wheels, directory, lambda s: click.echo(f"  reading {s}", err=True), torch_wheels,
                       launchers, {"deepspeed": deepspeed_sdists, "triton": triton_wheels},
                       {"container-toolkit": container_toolkit_source, "libnvidia-container": libnvidia_container_source,
                        "apptainer": apptainer_source}, xid_source, c10d_wheels)
    for line in [line for _, facts in done for line in facts]:
        click.echo(f"  {line}", err=True)
    changed = [change for change, _ in done if change.changed]
    for change in changed:
        click.echo(change.diff(f"{directory.name}/catalogues/{change.path.name}"), nl=False)
    if not changed:
        click.echo("the catalogues are current with their sources", err=True)
        return
    if write:
        changed[0].path.parent.mkdir(exist_ok=True)
        writer.write_all(changed)
        click.echo(f"wrote {', '.join(str(c.path) for c in changed)}", err=True)
        return
    click.echo("run `envbuild matrix catalogue ... --write` to apply", err=True)
    sys.exit(1)
