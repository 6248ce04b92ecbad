"""The `envbuild matrix refresh` command: derive, merge, diff, and (with --write) write."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import click
from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.base.resources import matrices_dir
from envbuild.refresh import ds_history, nccl_facts, torch_facts, writer
from envbuild.refresh.fixtures import FixtureIndex
from envbuild.refresh.pypi import Index, PyPI, default_cache_dir


def refresh(index: Index, matrix_dir: Path, progress: Callable[[str], None] = lambda _: None
            ) -> tuple[list[writer.FileChange], list[str], list[writer.PinMove]]:
    """The refreshed torch.yaml, deepspeed.yaml and (where the directory has them) stacks.yaml
    and nccl.yaml, nothing written; a line per changed fact; the stack pins moved with their torch release."""
    torch_path, ds_path = matrix_dir / "torch.yaml", matrix_dir / "deepspeed.yaml"
    torch_text, torch_data = writer.load(torch_path)
    ds_text, ds_data = writer.load(ds_path)
    derived = []
    for version in torch_facts.tracked_releases(index):
        progress(f"torch {version}")
        derived.append(torch_facts.derive_release(index, version))
    new_torch = writer.merge_torch(torch_data, derived, torch_path)
    versions = [str(r.get("deepspeed")) for r in ds_data["releases"] if isinstance(r, dict)]
    progress(f"deepspeed {', '.join(versions)} and the ops table")
    history = ds_history.derive(index, versions)
    new_ds = writer.merge_deepspeed(ds_data, history, ds_path)
    changes = [writer.FileChange(torch_path, torch_text, writer.render_torch(new_torch)),
               writer.FileChange(ds_path, ds_text, writer.render_deepspeed(new_ds))]
    facts = writer.summary(torch_data, new_torch, "torch") + writer.summary(ds_data, new_ds, "deepspeed")
    nccl_path = matrix_dir / "nccl.yaml"
    if nccl_path.is_file():
        progress(f"NCCL wheels of {', '.join(sorted({f.nccl_package for f in derived}))}")
        nccl_text = writer.read(nccl_path)
        new_nccl = nccl_facts.derive(index, derived)
        changes.append(writer.FileChange(nccl_path, nccl_text, nccl_facts.render(new_nccl)))
        facts += nccl_facts.summary(nccl_facts.parse(nccl_text, nccl_path), new_nccl)
    moves = []
    stacks_path = matrix_dir / "stacks.yaml"
    if stacks_path.is_file():
        stacks_text = writer.read(stacks_path)
        new_stacks, moves = writer.move_stack_pins(stacks_text, torch_data, new_torch, stacks_path)
        changes.append(writer.FileChange(stacks_path, stacks_text, new_stacks))
    return changes, facts, moves


def pin_summary(moves: list[writer.PinMove]) -> str:
    """'; 2 stack pins in stacks.yaml follow torch 2.14.0 -> 2.14.1', or '' when none moved."""
    if not moves:
        return ""
    replaced = sorted({(m.old, m.new) for m in moves if m.field == "torch"}, key=lambda pair: Version(pair[0]))
    releases = [f"{old} -> {new}" for old, new in replaced]
    noun = "pin" if len(moves) == 1 else "pins"
    return f"; {len(moves)} stack {noun} in stacks.yaml follow torch {', '.join(releases)}"


def _not_empty(flag: str, value: Optional[str]) -> Optional[str]:
    """'' is refused: the command would read it as the default matrix, silently."""
    if value is not None and not value.strip():
        raise EnvbuildError(f"{flag} is empty; give a matrix directory, or leave the option out for the built-in one.")
    return value


@click.command("refresh")
@click.option("--write", is_flag=True, help="Write the refreshed files (atomically) instead of only showing the diff.")
@click.option("--offline", "offline", type=click.Path(file_okay=False),
              help="Read saved fixtures from this directory instead of PyPI (tests).")
@click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR",
              callback=lambda ctx, param, value: _not_empty("--matrix-dir", value),
              help="Matrix directory to refresh (default: the built-in one).")
@click.option("--cache-dir", type=click.Path(file_okay=False),
              help="Where artifact reads are cached (default ~/.cache/envbuild/pypi).")
@click.option("--facts", "show_facts", is_flag=True, help="Also list every changed fact, one per line, on stderr.")
def refresh_command(write: bool, offline: Optional[str], matrix_dir: Optional[str], cache_dir: Optional[str],
                    show_facts: bool):
    """Derive the matrix's release facts from PyPI and show (or --write) the diff; stacks
    pinned to a torch release that another patch of its minor replaces follow that patch.

    Exit 0: the matrix is current (or was written); 1: it differs and --write was not given;
    2: a source changed shape or an input is bad."""
    directory = Path(matrix_dir) if matrix_dir else matrices_dir()
    for name in ("torch.yaml", "deepspeed.yaml"):
        if not (directory / name).is_file():
            raise EnvbuildError(f"--matrix-dir {directory} has no {name}; point it at a matrix directory "
                                f"such as matrices/.")
    index = FixtureIndex(Path(offline)) if offline else PyPI(Path(cache_dir) if cache_dir else default_cache_dir())
    changes, facts, moves = refresh(index, directory, progress=lambda s: click.echo(f"  reading {s}", err=True))
    changed = [c for c in changes if c.changed]
    for change in changed:
        click.echo(change.diff(f"{directory.name}/{change.path.name}"), nl=False)
    if show_facts:
        for line in [*facts, *map(str, moves)]:
            click.echo(f"  {line}", err=True)
    if not changed:
        click.echo("the matrix is current with PyPI", err=True)
        return
    derived_in = ", ".join(c.path.name for c in changed if c.path.name != "stacks.yaml")
    counts = f"{len(facts)} derived facts differ in {derived_in}{pin_summary(moves)}"
    if write:
        writer.write_all(changed)
        click.echo(f"wrote {', '.join(str(c.path) for c in changed)} ({counts})", err=True)
        return
    click.echo(f"{counts}; run `envbuild matrix refresh --write` to apply", err=True)
    sys.exit(1)
