"""The `envbuild` command line: parses options and delegates; no logic lives here."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import EnvbuildError
from .resolve import DEFAULT_CPU_TARGET

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _table(title, headers, rows) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for h in headers:
        t.add_column(h, overflow="fold")
    for r in rows:
        t.add_row(*[escape(str(c)) for c in r])
    return t


def request_options(f):
    """The options shared by `render` and `build`: what to resolve and how to render it."""
    opts = [
        click.option("--gpu", required=True, help="GPU profile or alias (h20, H100, nvidia-a100, ...)."),
        click.option("--python", help="Python version or PEP 440 specifier."),
        click.option("--cuda", help="CUDA version or specifier (13.0, '>=12.6')."),
        click.option("--torch", help="torch version or specifier ('>=2.5,<2.8')."),
        click.option("--deepspeed", help="DeepSpeed version or specifier."),
        click.option("--stack", "stack_id", help="Pick a matrix row by id (see `envbuild matrix`)."),
        click.option("--ds-ops", default="training", show_default=True,
                     help="Ops to pre-build: training, all, none, or a comma list (cpu_adam,fused_adam)."),
        click.option("--base-image", help="Replace the OS base image (same distro release), e.g. a private mirror."),
        click.option("--builder-image", help="Replace the builder stage's base image (needs nvcc for NVIDIA stacks)."),
        click.option("--cpu-target", default=DEFAULT_CPU_TARGET, show_default=True,
                     help="x86-64 level the CPU ops are compiled for (not the build machine's -march=native)."),
        click.option("--keep-toolchain", is_flag=True, help="Keep compilers in the final image (larger)."),
        click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
                     help="Add or override an environment default baked into the image (repeatable)."),
        click.option("--image-repo", default="envbuild", show_default=True,
                     help="Image repository the tag belongs to (Singularity.def bootstraps from it)."),
        click.option("--pip-index-url", help="Package index mirror for pip (a BuildKit secret at build time)."),
        click.option("--torch-index-url", help="Mirror of PyTorch's CUDA-variant index (a BuildKit secret)."),
        click.option("--apt-mirror", help="Replaces the distro mirror host, e.g. https://mirror.example (a secret)."),
        click.option("--ca-cert", type=click.Path(dir_okay=False), help="Extra CA certificate (PEM) for TLS proxies (a secret)."),
        click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR",
                     help="Use another matrix directory instead of the built-in one."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _resolve(kw):
    from .matrix import load_matrix
    from .resolve import Request, parse_env_pairs, resolve

    m = load_matrix(Path(kw["matrix_dir"]) if kw.get("matrix_dir") else None)
    req = Request(gpu=kw["gpu"], python=kw["python"], cuda=kw["cuda"], torch=kw["torch"],
                  deepspeed=kw["deepspeed"], stack=kw["stack_id"], ds_ops=kw["ds_ops"],
                  base_image=kw["base_image"], builder_image=kw["builder_image"],
                  env=parse_env_pairs(kw["env_pairs"]), cpu_target=kw["cpu_target"],
                  keep_toolchain=kw["keep_toolchain"], image_repo=kw["image_repo"])
    return m, req


def _render_to(kw, output):
    """Resolve the request and write its build directory (shared by render and build)."""
    from .output import write_build_dir
    from .render import render_files
    from .resolve import resolve
    from .validate import env_warnings

    if output is not None and not output.strip():
        raise EnvbuildError("-o/--output is empty; give a directory, or leave it out for ./build/<tag>.")
    m, req = _resolve(kw)
    secrets = _secrets(kw)  # validated before anything is written
    r = resolve(m, req)
    for warning in env_warnings(r):
        err.print(f"envbuild: warning: {warning}", markup=False)
    path = write_build_dir(render_files(r), Path(output) if output else Path("build") / r.tag)
    if output and Path(output).is_symlink():
        err.print(f"envbuild: note: -o {output} is a symlink; rendered into its target {path}", markup=False)
    _print_resolution(r, path)
    return r, secrets, path


def _secrets(kw):
    from .build import BuildSecrets
    from .resolve import ca_file
    from .validate import check_mirror_options

    check_mirror_options(kw)
    return BuildSecrets(ca_cert=ca_file(kw.get("ca_cert")), pip_index_url=kw.get("pip_index_url"),
                        torch_index_url=kw.get("torch_index_url"), apt_mirror=kw.get("apt_mirror"))


def _print_resolution(r, path=None):
    s = r.stack
    rows = [("stack", s.id), ("python", s.python), ("cuda", s.cuda), ("torch", f"{s.torch} (torchvision {r.torchvision})"),
            ("deepspeed", s.deepspeed), ("gpu", f"{r.gpu.name} ({r.gpu.sm})"), ("ds ops", ", ".join(r.ops) or "none"),
            ("driver", f">= {r.driver.min_driver} ({r.driver.branch}+) on the nodes, for CUDA {s.cuda}"),
            ("tag", r.image_ref)]
    if r.dropped_ops:
        rows.insert(7, ("ops left out", "; ".join(f"{op}: {why}" for op, why in r.dropped_ops)))
    if path:
        rows.append(("output", str(path)))
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(k, escape(v))
    out.print(t)


def _explain(m, req):
    from .resolve import explain_rows

    out.print(_table(f"candidates for {req.describe()}", ("stack", "verdict", "why"), explain_rows(m, req)))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="envbuild")
def main():
    """Reproducible GPU training images: pinned torch/CUDA/DeepSpeed stacks with pre-built
    DeepSpeed ops, per-GPU NCCL defaults and a built-in smoke test."""


@main.command()
@request_options
@click.option("-o", "--output", type=click.Path(), help="Build directory (default ./build/<tag>).")
@click.option("--explain", is_flag=True, help="Show every candidate stack and the rule that rejected it; write nothing.")
def render(output, explain, **kw):
    """Render Dockerfile, Singularity definitions and manifest.json for one GPU."""
    if explain:
        from .resolve import resolve

        m, req = _resolve(kw)
        _explain(m, req)
        _print_resolution(resolve(m, req))
        return
    _render_to(kw, output)


@main.command()
@request_options
@click.option("-o", "--output", type=click.Path(), help="Build directory (default ./build/<tag>).")
def build(output, **kw):
    """Render, then build the image with BuildKit and tag it (readable + content tag)."""
    from rich.live import Live
    from rich.text import Text

    from .build import build_image

    r, secrets, path = _render_to(kw, output)
    start = time.monotonic()
    current = {"step": "starting"}

    def line():
        return Text(f"  {time.monotonic() - start:6.0f}s  {current['step']}"[:160], style="cyan")

    with Live(line(), console=err, refresh_per_second=2, transient=True) as live:
        def on_step(event, name):
            if event == "start":
                current["step"] = name
            elif event == "done":
                err.print(f"  done  {name}"[:160], markup=False)
            live.update(line())
        result = build_image(path, r.tag, r.request.image_repo, secrets, on_step=on_step)
    out.print(f"built {result.image_id[:19]} in {result.seconds:.0f} s")
    for t in result.tags:
        out.print(f"  tagged {t}", markup=False)
    out.print(f"  log {result.log}", markup=False)
    out.print(f"next: envbuild smoke {result.tags[0]}", markup=False)


@main.command()
@click.argument("image")
@click.option("--gpus", help="Pass GPUs to the container (all, or a count), as docker run --gpus.")
@click.option("--json", "as_json", is_flag=True, help="Print the smoke test's JSON result.")
@click.option("--timeout", default=900, show_default=True, help="Seconds before a hung smoke test is killed.")
def smoke(image, gpus, as_json, timeout):
    """Run the image's built-in smoke test; non-zero exit on any failed check."""
    from .smoke import record_path, run_smoke

    rep = run_smoke(image, gpus=gpus, timeout=timeout)
    if as_json:
        click.echo(json.dumps(rep.raw, indent=2))
    else:
        rows = [(c.get("name"), "ok" if c.get("ok") else "FAIL", f"{c.get('seconds', 0):.1f}s", c.get("detail", ""))
                for c in rep.checks]
        out.print(_table(f"smoke test of {image} ({rep.mode} mode)", ("check", "result", "time", "detail"), rows))
        out.print(("PASSED" if rep.ok else "FAILED") + f" in {rep.seconds:.0f} s; recorded in {record_path(rep.image_id)}",
                  markup=False)
    if not rep.ok:
        sys.exit(1)


@main.command()
@click.argument("image")
@click.option("--registry", required=True, help="Registry HOST[:PORT] to push to.")
def push(image, registry):
    """Push an image whose smoke test passed (both tags), pull it back by digest, compare."""
    from .publish import push as do_push

    res = do_push(image, registry, on_event=lambda s: err.print(f"  {s}", markup=False))
    for ref in res.refs:
        out.print(f"pushed {ref}", markup=False)
    out.print(f"digest {res.digest}", markup=False)


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=".github/workflows/publish.yml",
              show_default=True, help="Workflow file to write.")
@click.option("--check", is_flag=True, help="Exit 1 if the file differs from what would be generated.")
@click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR")
def ci(output, check, matrix_dir):
    """Generate the GitHub Actions workflow that builds, smoke-tests and publishes the matrix."""
    from .ci import render_workflow, write_workflow
    from .matrix import load_matrix

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if check:
        current = Path(output).read_text() if Path(output).is_file() else ""
        if current != render_workflow(m):
            raise EnvbuildError(f"{output} is stale; run `envbuild ci -o {output}`.", 1)
        out.print(f"{output} is current")
        return
    out.print(f"wrote {write_workflow(m, Path(output))}")


@main.command()
@click.argument("log", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR")
def doctor(log, matrix_dir):
    """Recognise known hang/failure signatures in a training log and say what to do."""
    from .doctor import diagnose, load_issues
    from .resources import matrices_dir

    try:
        text = sys.stdin.read() if log == "-" else Path(log).read_text(errors="replace")
    except OSError as e:
        raise EnvbuildError(f"log file {log} cannot be read: {e.strerror}.") from None
    findings = diagnose(text, load_issues(Path(matrix_dir) if matrix_dir else matrices_dir()))
    if not findings:
        out.print("no known signature found in the log (known: `matrices/known_issues.yaml`).")
        return
    for f in findings:
        out.print(f"[bold]{escape(f.issue.title)}[/bold] ({f.issue.id}), line {f.line_no}"
                  + (f", {f.count} times" if f.count > 1 else ""))
        out.print(f"  > {f.line[:200]}", markup=False)
        out.print(f"  cause: {f.issue.cause}", markup=False)
        out.print(f"  fix:   {f.issue.fix}", markup=False)
        out.print(f"  source: {f.issue.source}\n", markup=False)
    sys.exit(3)


@main.group("matrix", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR")
@click.pass_context
def matrix_cmd(ctx, as_json, matrix_dir):
    """List the pinned stacks (`envbuild matrix refresh`: derive the release facts from PyPI)."""
    if ctx.invoked_subcommand:
        return
    from .matrix import load_matrix
    from .tables import STACK_HEADERS, stack_rows

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if as_json:
        click.echo(json.dumps([s.model_dump() | {"torchvision": m.torch_release(s.torch).torchvision}
                               for s in m.stacks], indent=2))
        return
    out.print(_table("envbuild stacks", STACK_HEADERS, stack_rows(m)))


from .refresh import refresh_command  # noqa: E402  (registered under `matrix`)

matrix_cmd.add_command(refresh_command)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with reasons and sources.")
@click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR")
def gpus(as_json, matrix_dir):
    """List the GPU profiles: compute capability, interconnect, NCCL defaults with reasons."""
    from .matrix import load_matrix
    from .tables import ENV_HEADERS, GPU_HEADERS, NOT_BAKED_HEADERS, env_rows, gpu_json, gpu_rows, not_baked_rows

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if as_json:
        click.echo(json.dumps(gpu_json(m), indent=2))
        return
    out.print(_table("envbuild GPU profiles", GPU_HEADERS, gpu_rows(m)))
    out.print(_table("environment defaults (override: docker run -e / apptainer --env / render --env)",
                     ENV_HEADERS, env_rows(m)))
    out.print(_table("considered and not baked", NOT_BAKED_HEADERS, not_baked_rows(m)))


@main.command("readme-tables", hidden=True)
@click.argument("readme", type=click.Path(exists=True, dir_okay=False))
@click.option("--check", is_flag=True)
def readme_tables(readme, check):
    """Refresh (or --check) the README's generated matrix tables."""
    from .matrix import load_matrix
    from .tables import refresh_readme

    if not refresh_readme(Path(readme), load_matrix(), check):
        if check:
            raise EnvbuildError(f"{readme}'s generated tables are stale; run `envbuild readme-tables {readme}`.", 1)
        out.print(f"updated {readme}")


def run():
    """Console entry point: one-paragraph errors, never a traceback for bad input."""
    try:
        main.main(standalone_mode=False)
    except EnvbuildError as e:
        err.print(f"envbuild: error: {e.message}", markup=False)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        err.print("envbuild: aborted", markup=False)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("envbuild: interrupted", markup=False)
        sys.exit(130)
    except Exception as e:  # a bug: say so plainly; ENVBUILD_DEBUG=1 shows the traceback
        if os.environ.get("ENVBUILD_DEBUG"):
            raise
        err.print(f"envbuild: internal error: {type(e).__name__}: {e} (set ENVBUILD_DEBUG=1 for a traceback)",
                  markup=False)
        sys.exit(70)


if __name__ == "__main__":
    run()
