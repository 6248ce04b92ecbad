"""`render` and `build`: a stack image's build directory, and the image built from it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich import box
from rich.markup import escape

from envbuild.base.errors import EnvbuildError
from envbuild.cli.app import command_line, err, main, markers_note, out, print_next, table
from envbuild.cli.options import pin_named_bases, request_from, request_options, secrets_from


@main.command()
@request_options
@click.option("-o", "--output", type=click.Path(), help="Build directory (default ./build/<tag>).")
@click.option("--explain", is_flag=True, help="Show every candidate stack and the rule that rejected it; write nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the resolution as JSON on stdout (tag, image, versions, ops, driver floor, output, "
                   "files); with --explain, every candidate too.")
@click.option("--print-tag", is_flag=True, help="Resolve only and print the readable tag (for scripts); write nothing.")
@click.pass_context
def render(ctx, output, explain, as_json, print_tag, **kw):
    """Render Dockerfile, Singularity definitions and manifest.json for one GPU."""
    from envbuild.plan import MANIFEST_NAME
    from envbuild.render.running import next_commands, resolution_dict

    if print_tag and (explain or as_json):
        raise EnvbuildError("--print-tag prints only the tag; leave out --explain and --json "
                            "(`render --json` holds the tag too, as \"tag\").")
    if print_tag:
        from envbuild.resolve.resolver import resolve

        click.echo(resolve(*request_from(kw)).tag)
        return
    if explain:
        _explain(*request_from(kw), as_json=as_json)
        return
    r, _, path, files = render_to(kw, output, show=not as_json)
    commands = next_commands(r, path, command_line(ctx, skip={"explain", "as_json", "print_tag"})
                             .replace("envbuild render", "envbuild build", 1))
    if as_json:
        manifest = json.loads((path / MANIFEST_NAME).read_bytes())  # the plan's, as just written
        click.echo(json.dumps(resolution_dict(r, manifest) | {"output": str(path), "files": files, "next": commands},
                              indent=2))
        return
    print_next(commands)


@main.command()
@request_options
@click.option("-o", "--output", type=click.Path(), help="Build directory (default ./build/<tag>).")
def build(output, **kw):
    """Render, then build the image with BuildKit and tag it (readable + content tag)."""
    from rich.live import Live
    from rich.text import Text

    from envbuild.builds.build import build_image
    from envbuild.render.running import next_commands

    r, secrets, path, _ = render_to(kw, output, reach_archive=True)
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
    print_built(result)
    print_next(next_commands(r, path))


def render_to(kw, output, show=True, reach_archive=False):
    """Resolve the request and write its build directory (shared by render and build).

    Returns the resolution, the secrets, the directory and the files written; with `show`,
    prints the resolution; a local-only bootstrap is warned about on stderr either way. With
    `reach_archive` (a build), an OS lock's archive must answer before anything is written.
    """
    from envbuild.builds.build import check_compile_cache
    from envbuild.knowledge.oslock import check_reachable
    from envbuild.knowledge.rules import check_apt_mirror
    from envbuild.knowledge.validate import env_warnings
    from envbuild.render.builddir import render_files
    from envbuild.render.output import RECORD, write_build_dir
    from envbuild.render.running import local_bootstrap_warning
    from envbuild.resolve.resolver import resolve

    if output is not None and not output.strip():
        raise EnvbuildError("-o/--output is empty; give a directory, or leave it out for ./build/<tag>.")
    m, req = request_from(kw)
    secrets = secrets_from(kw)  # validated before anything is written
    r = resolve(m, req)
    check_apt_mirror(r.os_locked, secrets.apt_mirror, secrets.apt_snapshot)
    if reach_archive and r.os_lock:
        check_reachable(r.os_lock, r.facts.family.apt.snapshot, secrets.apt_snapshot, secrets.ca_cert)
    if reach_archive:
        check_compile_cache(secrets)
    for warning in env_warnings(r):
        err.print(f"envbuild: warning: {warning}", markup=False)
    r = pin_named_bases(r)
    files = render_files(r)
    path = write_build_dir(files, Path(output) if output else Path("build") / r.tag)
    if output and Path(output).is_symlink():
        err.print(f"envbuild: note: -o {output} is a symlink; rendered into its target {path}", markup=False)
    if show:
        print_resolution(r, path)
    warning = local_bootstrap_warning(r)
    if warning:
        err.print(f"envbuild: warning: {warning}", markup=False, soft_wrap=False)
    return r, secrets, path, sorted([*files, RECORD])


def print_resolution(r, path=None):
    from envbuild.knowledge.lock import unlocked_reason
    from envbuild.render.running import base_line, os_lock_line

    s = r.stack
    rows = [("stack", s.id), ("python", s.python), ("cuda", s.cuda), ("torch", f"{s.torch} (torchvision {r.torchvision})"),
            ("deepspeed", s.deepspeed), ("gpu", f"{r.gpu.name} ({r.gpu.sm})"),
            ("platform", f"{r.platform} ({r.arch}), CPU code built for {r.cpu_target}"),
            ("fabric", fabric_line(r)), ("ds ops", ", ".join(r.ops) or "none"),
            ("driver", f">= {r.driver.min_driver} ({r.driver.branch}+) on the nodes, for CUDA {s.cuda}"
                       + (f" and {r.gpu.generation} ({r.gpu.name})" if r.gpu.generation in r.driver.source else "")),
            ("tag", r.tag), ("image", r.image_ref)]
    rows.insert(-2, ("lock", f"{Path(r.lock.path).name} ({len(r.lock.sections['venv'])} packages, sha256 "
                             f"{r.lock.sha256[:12]}, as of {r.lock.header.get('exclude-newer', '?')[:10]})" if r.lock
                     else unlocked_reason(s.id, r.torch_index, r.locked_alternative)))
    rows.insert(-2, ("os lock", os_lock_line(r)))
    rows.insert(-2, ("base", base_line(r)))
    if r.nccl_override:
        o = r.nccl_override
        rows.insert([key for key, _ in rows].index("fabric") + 1,
                    ("nccl", f"{o.package} {o.version} in place of torch's pin {o.replaced} (--nccl; the lock's "
                             f"[nccl] section, hash-checked)"))
    if r.dropped_ops:
        after_ops = [key for key, _ in rows].index("ds ops") + 1
        rows.insert(after_ops, ("ops left out", "; ".join(why for _, why in r.dropped_ops)))  # each names its op
    if path:
        rows.append(("output", str(path)))
    for k, v in rows:  # plain lines: a tag or a path is never folded mid-name
        out.print(f"[bold]{k:<12}[/bold] {escape(v)}", soft_wrap=True)


def fabric_line(r) -> str:
    """`ib: NCCL net IB (libibverbs1, ...), pinned on nodes with RDMA devices` for the summary."""
    from envbuild.plan import fabric_packages

    f = r.fabric
    what = ", ".join(fabric_packages(r)) or ("from the host: " + ", ".join(f.host_paths) if f.host_paths else "nothing")
    pinned = [d for d in f.env if d.node and d.name in f.net_env]
    how = (f"; {', '.join(f'{d.name}={d.value}' for d in pinned)} on nodes with its devices" if pinned else "")
    return f"{f.name}: NCCL net {f.transport} ({what}){how}"


def explain_candidates(m, req) -> list[dict]:
    """Every candidate stack with its verdict, driver floor and the rules that rejected it."""
    from envbuild.resolve.resolver import candidates, explain_rows

    rows = explain_rows(m, req)  # validates the request first
    rejections = {c.stack.id: c.rejections for c in candidates(m, req, m.gpu(req.gpu))}
    gpu = m.gpu(req.gpu)
    return [{"stack": stack_id, "verdict": verdict, "min_driver": m.driver_floor(m.stack(stack_id).cuda, gpu).min_driver,
             "why": why, "rejections": [{"rule": x.rule, "message": x.message} for x in rejections[stack_id]]}
            for stack_id, verdict, why in rows]


def _explain(m, req, as_json=False):
    """--explain: every candidate, then the chosen stack (or the reason none fits)."""
    from envbuild.plan import stack_plan
    from envbuild.render.running import resolution_dict
    from envbuild.resolve.resolver import resolve

    cands = explain_candidates(m, req)
    if not as_json:
        out.print(table(f"candidates for {req.describe()}", ("stack", "verdict", "min driver", "why"),
                         [(c["stack"], c["verdict"], c["min_driver"], c["why"]) for c in cands], ids=(0, 2),
                         box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True))
        markers_note([c["why"] for c in cands])
        print_resolution(resolve(m, req))
        return
    doc = {"request": req.describe(), "candidates": [{k: v for k, v in c.items() if k != "why"} for c in cands]}
    try:
        r = resolve(m, req)
        doc["chosen"] = resolution_dict(r, stack_plan(r).manifest)
    except EnvbuildError:
        doc["chosen"] = None
        click.echo(json.dumps(doc, indent=2))
        raise
    click.echo(json.dumps(doc, indent=2))


def print_built(result) -> None:
    out.print(f"built {result.image_id[:19]} in {result.seconds:.0f} s")
    for tag in result.tags:
        out.print(f"  tagged {tag}", markup=False)
    out.print(f"  log {result.log}", markup=False)
