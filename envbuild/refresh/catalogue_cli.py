"""The `envbuild matrix catalogue` command: derive the message catalogues from fetched sources,
diff them against matrices/catalogues/, and (with --write) write them, like `matrix refresh`."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Optional

import click

from ..errors import EnvbuildError
from ..resources import matrices_dir
from . import nccl_catalogue, writer


def catalogue_path(directory: Path) -> Path:
    return directory / "catalogues" / "nccl.yaml"


def refresh_catalogue(source: Path, directory: Path, progress=lambda _: None) -> tuple[writer.FileChange, list[str]]:
    """The NCCL catalogue derived from `source` for the releases `directory`/nccl.yaml ships, nothing
    written; and a line per release added or removed and per release whose wordings changed."""
    nccl = nccl_catalogue.parse(writer.read(directory / "nccl.yaml"), directory / "nccl.yaml")
    path = catalogue_path(directory)
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise EnvbuildError(f"{path} is not a regular file (a link or a device?); envbuild replaces only the "
                            f"catalogue it wrote. Move it away and run again.")
    old_text = writer.read(path) if path.exists() else ""
    old = nccl_catalogue.parse(old_text, path)
    new = nccl_catalogue.derive(nccl_catalogue.open_sources(source), nccl_catalogue.shipped_releases(nccl), progress)
    return writer.FileChange(path, old_text, nccl_catalogue.render(new)), nccl_catalogue.summary(old, new)


@click.command("catalogue")
@click.option("--source", "source", required=True, type=click.Path(file_okay=False, exists=True),
              help="NCCL's sources: a git clone (or mirror) of github.com/NVIDIA/nccl with its tags, or a "
                   "directory of saved sources with a tags.txt (tests).")
@click.option("--write", is_flag=True, help="Write the catalogue (atomically) instead of only showing the diff.")
@click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR",
              help="Matrix directory whose nccl.yaml names the releases (default: the built-in one).")
def catalogue_command(source: str, write: bool, matrix_dir: Optional[str]):
    """Derive every message NCCL can print (WARN and INFO format strings, ncclResult_t messages),
    per release the matrix ships, from NCCL's sources; show the diff, or --write it.

    Exit 0: the catalogue is current (or was written); 1: it differs and --write was not given;
    2: a source cannot be read or an input is bad."""
    directory = Path(matrix_dir) if matrix_dir else matrices_dir()
    if not (directory / "nccl.yaml").is_file():
        raise EnvbuildError(f"--matrix-dir {directory} has no nccl.yaml; point it at a matrix directory such as matrices/.")
    change, facts = refresh_catalogue(Path(source), directory, progress=lambda s: click.echo(f"  reading {s}", err=True))
    for line in facts:
        click.echo(f"  {line}", err=True)
    if not change.changed:
        click.echo("the NCCL catalogue is current with its sources", err=True)
        return
    click.echo(change.diff(f"{directory.name}/catalogues/{change.path.name}"), nl=False)
    if write:
        change.path.parent.mkdir(exist_ok=True)
        writer.write_all([change])
        click.echo(f"wrote {change.path}", err=True)
        return
    click.echo("run `envbuild matrix catalogue --source ... --write` to apply", err=True)
    sys.exit(1)
