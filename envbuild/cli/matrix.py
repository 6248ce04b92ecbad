"""The matrix and what is generated from it: `matrix` (and `matrix refresh`), `gpus`, `fabrics`,
`ci`, `readme-tables`, and `doctor`, which reads logs against the matrix's known issues."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from envbuild.base.errors import EnvbuildError
from envbuild.cli.app import blocks, main, markers_note, notes, out, print_table, table
from envbuild.cli.options import matrix_dir_option
from envbuild.refresh import catalogue_command, refresh_command


@main.group("matrix", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--wide", is_flag=True, help="Every column (torchvision, OS, toolchain, base images).")
@matrix_dir_option
@click.pass_context
def matrix_cmd(ctx, as_json, wide, matrix_dir):
    """List the pinned stacks, with the oldest NVIDIA driver each one needs
    (`envbuild matrix refresh`: derive the release facts from PyPI)."""
    if ctx.invoked_subcommand:
        return
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.render.tables import STACK_HEADERS, STACK_NARROW, narrow, pinning, stack_notes, stack_rows

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if as_json:
        click.echo(json.dumps([s.model_dump() | {"torchvision": m.torch_release(s.torch).torchvision,
                                                 "min_driver": m.driver_floor(s.cuda).min_driver,
                                                 "cuda_arches": m.stack_arches(s)}
                               for s in m.stacks], indent=2))
        return
    headers = STACK_HEADERS if wide else STACK_NARROW
    print_table(table("envbuild stacks" + ("" if wide else " (--wide: every column)"), headers,
                     narrow(STACK_HEADERS, headers, stack_rows(m)), ids=(0,),
                     **({} if wide else {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True})))
    notes("notes:", stack_notes(m))
    out.print(f"\n{pinning(m)}\nmin driver: the oldest NVIDIA driver (Linux) the stack's CUDA runs on; older "
              "data-centre drivers need NVIDIA's forward-compatibility package (docs/matrix.md).", soft_wrap=False)
    markers_note([n for _, n in stack_notes(m)])


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with reasons and sources.")
@click.option("--wide", is_flag=True, help="Every column, and the defaults as wide tables.")
@matrix_dir_option
def gpus(as_json, wide, matrix_dir):
    """List the GPU profiles: compute capability, interconnect, NCCL defaults with reasons."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.render.tables import (ENV_HEADERS, GPU_HEADERS, GPU_NARROW, NOT_BAKED_HEADERS, env_blocks, env_rows,
                                        gpu_json, gpu_notes, gpu_rows, narrow, not_baked_blocks, not_baked_rows)

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if as_json:
        click.echo(json.dumps(gpu_json(m), indent=2))
        return
    env_title = "environment defaults baked into the images (override: docker run -e, apptainer --env, render --env)"
    if wide:
        print_table(table("envbuild GPU profiles", GPU_HEADERS, gpu_rows(m), ids=(0,)))
        print_table(table(env_title, ENV_HEADERS, env_rows(m), ids=(1,)))
        print_table(table("considered and not baked", NOT_BAKED_HEADERS, not_baked_rows(m), ids=(1,)))
    else:
        out.print(table("envbuild GPU profiles (--wide: aliases and defaults as tables)", GPU_NARROW,
                         narrow(GPU_HEADERS, GPU_NARROW, gpu_rows(m)), ids=(0,), box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True))
        notes("notes:", gpu_notes(m))
        blocks(env_title, env_blocks(m))
        blocks("considered and not baked", not_baked_blocks(m))
    texts = [t for _, _, fields in env_blocks(m) + not_baked_blocks(m) for _, t in fields]
    markers_note(texts + [n for _, n in gpu_notes(m)])


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with reasons and sources.")
@matrix_dir_option
def fabrics(as_json, matrix_dir):
    """List the fabric profiles (render --fabric): what each puts in the image and the NCCL net it pins."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.render.tables import FABRIC_HEADERS, fabric_env_rows, fabric_json, fabric_rows

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if as_json:
        click.echo(json.dumps(fabric_json(m), indent=2))
        return
    for row, f in zip(fabric_rows(m), m.fabrics):
        out.print(f"\n[bold]{escape(row[0])}[/bold]  {escape(f.description)}", soft_wrap=True)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        fields = [*zip(FABRIC_HEADERS[1:], row[1:]), ("source", f.source)]
        fields += [(var, f"{why} Cost: {cost}. Source: {src}.") for _, var, why, cost, src in
                   fabric_env_rows(m) if any(e.name == var.split("=")[0] for e in f.env)]
        fields += [("note", n) for n in f.notes]
        for label, text in fields:
            grid.add_row(f"  {label}", escape(text))
        out.print(grid)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with every fact's source.")
@matrix_dir_option
def extensions(as_json, matrix_dir):
    """List the CUDA extensions `--ext` pre-builds: the GPUs and stacks each fits, and why not the others."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.render.tables import extension_fields, extension_json

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    data = extension_json(m)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    if not data:
        out.print(f"no CUDA extensions: {m.directory} has no extensions.yaml")
    for e in data:
        _fields(f"{e['name']} {e['version']}", e["description"], extension_fields(e))
    if m.extensions_file.not_prebuilt:
        _fields("not pre-built", "refused by --ext and `envbuild extend`, rule ext-not-prebuilt",
                [(f"{n.name} {n.version}", n.why) for n in m.extensions_file.not_prebuilt])


@main.command()
@click.option("--stack", "stack_ids", multiple=True, metavar="ID", help="Only this stack (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@matrix_dir_option
def nccl(stack_ids, as_json, matrix_dir):
    """List the NCCL releases `--nccl` accepts for each stack: torch's own pin, and every newer 2.x
    of its wheel family with a wheel for the image (a fabric may narrow them further)."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.resolve.nccl import nccl_choices

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    for stack_id in stack_ids:
        m.stack(stack_id)  # an unknown one is refused with the nearest ids
    rows = [c for c in nccl_choices(m) if not stack_ids or c.stack.id in stack_ids]
    if as_json:
        click.echo(json.dumps([{"stack": c.stack.id, "arch": c.arch, "torch": c.stack.torch, "package": c.package,
                                "pin": c.pin, "accepted": list(c.accepted), "unusable": c.unusable}
                               for c in rows], indent=2))
        return
    for c in rows:
        title = f"{c.stack.id} ({c.arch})"
        if c.unusable:
            _fields(title, f"torch {c.stack.torch}", [("--nccl", f"cannot be used: {c.unusable}")])
        else:
            _fields(title, f"torch {c.stack.torch} pins {c.package} {c.pin}",
                    [("accepted", ", ".join(c.accepted) or "none but torch's pin")])


def _fields(title: str, description: str, rows) -> None:
    out.print(f"\n[bold]{escape(title)}[/bold]  {escape(description)}", soft_wrap=True)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(overflow="fold")
    for label, text in rows:
        grid.add_row(f"  {label}", escape(text))
    out.print(grid)


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=".github/workflows/publish.yml",
              show_default=True, help="Workflow file to write.")
@click.option("--check", is_flag=True, help="Exit 1 if the file differs from what would be generated.")
@matrix_dir_option
def ci(output, check, matrix_dir):
    """Generate the GitHub Actions workflows: the one that builds, smoke-tests and publishes
    the matrix, and beside it the weekly one that refreshes the matrix from PyPI."""
    from envbuild.base.files import read_bytes
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.supply.ci import is_generated_workflow, workflows_for, write_workflows

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    workflows = workflows_for(m, output)
    if check:
        present = {p: read_bytes(p, "workflow", "workflow") for p in workflows if os.path.lexists(p)}
        foreign = [str(p) for p, data in present.items() if not is_generated_workflow(data)]
        if foreign:  # the user's own file: not envbuild's to call missing or stale
            raise EnvbuildError(f"{', '.join(foreign)} exists and envbuild did not write it (its first line does not "
                                f"say `envbuild ci` generated it), so --check has no workflow of envbuild's there to "
                                f"compare; give -o the file `envbuild ci` writes (default .github/workflows/publish.yml, "
                                f"with matrix-refresh.yml beside it).")
        missing = [str(p) for p in workflows if p not in present]
        stale = [str(p) for p, text in workflows.items() if p in present and present[p] != text.encode()]
        if missing or stale:
            said = [f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {state}"
                    for names, state in ((missing, "missing"), (stale, "stale")) if names]
            raise EnvbuildError(f"{'; '.join(said)}; run `envbuild ci -o {output}`.", 1)
        out.print(f"{', '.join(map(str, workflows))} are current")
        return
    changed = write_workflows(workflows)
    for path in workflows:
        out.print(f"{'wrote' if path in changed else 'unchanged'} {path}")


@main.command()
@click.argument("paths", nargs=-1, required=True, metavar="LOG|DIR...")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: findings, ranks, flight recorder.")
@click.option("--max-bytes", default="16G", show_default=True, metavar="SIZE",
              help="Stop reading after this much text (after decompression), over all inputs: 1 to 1024T.")
@click.option("--max-seconds", type=click.FloatRange(min=1, max=604800), default=600, show_default=True, metavar="SECONDS",
              help="Stop reading after this many seconds.")
@click.option("--manifest", metavar="PATH",
              help="The manifest.json of the image the job ran (default: the image's own, when run inside one): "
                   "the log's NCCL version is compared with the image's.")
@matrix_dir_option
def doctor(paths, as_json, max_bytes, max_seconds, manifest, matrix_dir):
    """Recognise known hang/failure signatures in training logs and say what to do.

    Each LOG is a file (text, gzip, bzip2 or xz; UTF-8 or UTF-16) or - for standard input; a DIR
    holds a job's per-rank logs (`srun --output=%x-%t.out`) and/or torch's flight-recorder dumps.
    Exit status: 0 nothing known found, 3 something found, 2 an input cannot be read, nothing was
    read at all, or nothing was found while a flight-recorder dump could not be read.
    """
    from envbuild.base.resources import matrices_dir
    from envbuild.doctor import examine, find_image, load_catalogue, render_json, render_text
    from envbuild.doctor.reading import run_budget
    from envbuild.doctor.run import unread_dumps

    budget = run_budget(max_bytes, max_seconds)
    issues, families = load_catalogue(Path(matrix_dir) if matrix_dir else matrices_dir())
    report = examine(list(paths), issues, families, budget, find_image(manifest))
    click.echo(render_json(report) if as_json else render_text(report))
    if report.found():
        sys.exit(3)
    unread_dumps(report)


@main.command("readme-tables", hidden=True)
@click.argument("readme", type=click.Path(exists=True, dir_okay=False))
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the tables differ from the matrix.")
def readme_tables(readme, check):
    """Refresh (or --check) the generated matrix tables of a Markdown page (README.md, docs/*.md)."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.render.tables import refresh_readme

    if not refresh_readme(Path(readme), load_matrix(), check):
        if check:
            raise EnvbuildError(f"{readme}'s generated tables are stale; run `envbuild readme-tables {readme}`.", 1)
        out.print(f"updated {readme}")


matrix_cmd.add_command(refresh_command)  # `envbuild matrix refresh`
matrix_cmd.add_command(catalogue_command)  # `envbuild matrix catalogue`
