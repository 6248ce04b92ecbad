"""The `envbuild` command line: parses options and delegates; no logic lives here."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import EnvbuildError
from .resolve import DEFAULT_CPU_TARGET
from .rules import DEFAULT_OPS

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _table(title, headers, rows, ids=(), **table_options) -> Table:
    """A rich table; the columns in `ids` hold names to copy (stack ids, GPU names, tags) and
    are never wrapped or folded, whatever the terminal width."""
    t = Table(title=title, title_justify="left", show_lines=False, **table_options)
    for i, h in enumerate(headers):
        if i in ids:
            t.add_column(h, no_wrap=True, min_width=max([len(str(r[i])) for r in rows] + [len(h)]))
        else:
            t.add_column(h, overflow="fold")
    for r in rows:
        t.add_row(*[escape(str(c)) for c in r])
    return t


def matrix_dir_option(f):
    """--matrix-dir, declared once for every command that reads the matrix."""
    return click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR",
                        help="Use another matrix directory instead of the built-in one. Env: ENVBUILD_MATRIX_DIR.")(f)


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
                     help=f"Ops to pre-build: training (the default), all, none, or a comma list "
                          f"(cpu_adam,fused_adam)."),
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
        click.option("--fabric", default=None, metavar="NAME",
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
        click.option("--pip-index-url", help="Package index mirror for pip (a BuildKit secret at build time)."),
        click.option("--torch-index-url", help="Mirror of PyTorch's CUDA-variant index (a BuildKit secret)."),
        click.option("--apt-mirror", help="Replaces the distro mirror host, e.g. https://mirror.example (a secret)."),
        click.option("--source-mirror", help="Replaces https://github.com in a fabric's source URLs, e.g. "
                                             "http://127.0.0.1:8765 (scripts/fabric-sources.sh serves one; the "
                                             "pinned sha256 is checked all the same; a secret)."),
        click.option("--ca-cert", type=click.Path(dir_okay=False), help="Extra CA certificate (PEM) for TLS proxies (a secret)."),
        matrix_dir_option,
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _resolve(kw):
    from .matrix import load_matrix
    from .resolve import Request, parse_env_pairs

    from .running import image_repo

    m = load_matrix(Path(kw["matrix_dir"]) if kw.get("matrix_dir") else None)
    repo = image_repo(kw.get("image_repo"), kw.get("registry"), m.directory)
    req = Request(gpu=kw["gpu"], python=kw["python"], cuda=kw["cuda"], torch=kw["torch"],
                  deepspeed=kw["deepspeed"], stack=kw["stack_id"], ds_ops=DEFAULT_OPS if kw["ds_ops"] is None else kw["ds_ops"],
                  base_image=kw["base_image"], builder_image=kw["builder_image"],
                  env=parse_env_pairs(kw["env_pairs"]), cpu_target=kw["cpu_target"],
                  keep_toolchain=kw["keep_toolchain"], no_compiler=kw["no_compiler"], image_repo=repo,
                  qemu=kw.get("qemu", False), fabric=kw.get("fabric"))
    return m, req


def _render_to(kw, output, show=True):
    """Resolve the request and write its build directory (shared by render and build).

    Returns the resolution, the secrets, the directory and the files written; with `show`,
    prints the resolution; a local-only bootstrap is warned about on stderr either way.
    """
    from .output import RECORD, write_build_dir
    from .render import render_files
    from .resolve import resolve
    from .running import local_bootstrap_warning
    from .validate import env_warnings

    if output is not None and not output.strip():
        raise EnvbuildError("-o/--output is empty; give a directory, or leave it out for ./build/<tag>.")
    m, req = _resolve(kw)
    secrets = _secrets(kw)  # validated before anything is written
    r = resolve(m, req)
    for warning in env_warnings(r):
        err.print(f"envbuild: warning: {warning}", markup=False)
    r = _pin_named_bases(r)
    files = render_files(r)
    path = write_build_dir(files, Path(output) if output else Path("build") / r.tag)
    if output and Path(output).is_symlink():
        err.print(f"envbuild: note: -o {output} is a symlink; rendered into its target {path}", markup=False)
    if show:
        _print_resolution(r, path)
    warning = local_bootstrap_warning(r)
    if warning:
        err.print(f"envbuild: warning: {warning}", markup=False, soft_wrap=False)
    return r, secrets, path, sorted([*files, RECORD])


def _pin_named_bases(r):
    """A base image the user named is pinned by digest when this machine can learn it (its
    Docker pulled it from a registry, or its registry answers); the matrix's own bases stay
    tags (a render does not contact Docker Hub)."""
    from .digests import pin

    named = {"runtime": r.request.base_image, "builder": r.request.builder_image or (
        r.request.base_image if r.base_images["builder"] == r.request.base_image else None)}
    pinned = {ref: pin(ref) for ref in set(named.values()) if ref}
    for ref in sorted(ref for ref, (_, digest) in pinned.items() if not digest):
        err.print(f"envbuild: note: {ref} is pinned by tag only: no registry digest is known for it on "
                  f"this machine", markup=False, soft_wrap=True)
    return dataclasses.replace(r, base_images={stage: pinned[named[stage]][0] if named.get(stage) else ref
                                               for stage, ref in r.base_images.items()})


def _command_line(ctx: click.Context, skip=()) -> str:
    """The command as typed (the options given on the command line), for the `next:` block."""
    from click.core import ParameterSource

    words = ["envbuild", ctx.command.name]
    for p in ctx.command.params:
        if p.name in skip or ctx.get_parameter_source(p.name) is not ParameterSource.COMMANDLINE:
            continue
        flag, value = max(p.opts, key=len), ctx.params[p.name]
        if p.name in ("pip_index_url", "torch_index_url", "apt_mirror", "source_mirror"):  # never print a password
            from .validate import _redact
            value = _redact(value)
        if getattr(p, "is_flag", False):
            words += [flag] if value else []
        elif p.multiple:
            for v in value:
                words += [flag, str(v)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _print_next(lines):
    """The `next:` block: commands on lines of their own, never wrapped (copy and paste)."""
    out.print("next (README \"Running it\": Slurm, multi-node, per-job caches):", markup=False)
    for line in lines:
        out.print(f"  {line}", markup=False, soft_wrap=True)



def _secrets(kw):
    from .build import BuildSecrets
    from .resolve import ca_file
    from .validate import check_mirror_options

    check_mirror_options(kw)
    return BuildSecrets(ca_cert=ca_file(kw.get("ca_cert")), pip_index_url=kw.get("pip_index_url"),
                        torch_index_url=kw.get("torch_index_url"), apt_mirror=kw.get("apt_mirror"),
                        source_mirror=kw.get("source_mirror"))


def _print_resolution(r, path=None):
    s = r.stack
    rows = [("stack", s.id), ("python", s.python), ("cuda", s.cuda), ("torch", f"{s.torch} (torchvision {r.torchvision})"),
            ("deepspeed", s.deepspeed), ("gpu", f"{r.gpu.name} ({r.gpu.sm})"),
            ("platform", f"{r.platform} ({r.arch}), CPU code built for {r.cpu_target}"),
            ("fabric", _fabric_line(r)), ("ds ops", ", ".join(r.ops) or "none"),
            ("driver", f">= {r.driver.min_driver} ({r.driver.branch}+) on the nodes, for CUDA {s.cuda}"),
            ("tag", r.tag), ("image", r.image_ref)]
    rows.insert(-2, ("lock", f"{Path(r.lock.path).name} ({len(r.lock.sections['venv'])} packages, sha256 "
                             f"{r.lock.sha256[:12]}, as of {r.lock.header.get('exclude-newer', '?')[:10]})" if r.lock
                     else f"none: packages below torch/DeepSpeed float; `envbuild lock --stack {s.id}` makes one"))
    if r.dropped_ops:
        after_ops = [key for key, _ in rows].index("ds ops") + 1
        rows.insert(after_ops, ("ops left out", "; ".join(why for _, why in r.dropped_ops)))  # each names its op
    if path:
        rows.append(("output", str(path)))
    for k, v in rows:  # plain lines: a tag or a path is never folded mid-name
        out.print(f"[bold]{k:<12}[/bold] {escape(v)}", soft_wrap=True)


def _fabric_line(r) -> str:
    """`ib: NCCL net IB (libibverbs1, ...), pinned on nodes with RDMA devices` for the summary."""
    from .plan import fabric_packages

    f = r.fabric
    what = ", ".join(fabric_packages(r)) or ("from the host: " + ", ".join(f.host_paths) if f.host_paths else "nothing")
    pinned = [d for d in f.env if d.node and d.name in f.net_env]
    how = (f"; {', '.join(f'{d.name}={d.value}' for d in pinned)} on nodes with its devices" if pinned else "")
    return f"{f.name}: NCCL net {f.transport} ({what}){how}"


def _explain_candidates(m, req) -> list[dict]:
    """Every candidate stack with its verdict, driver floor and the rules that rejected it."""
    from .resolve import candidates, explain_rows

    rows = explain_rows(m, req)  # validates the request first
    rejections = {c.stack.id: c.rejections for c in candidates(m, req, m.gpu(req.gpu))}
    return [{"stack": stack_id, "verdict": verdict, "min_driver": m.driver_floor(m.stack(stack_id).cuda).min_driver,
             "why": why, "rejections": [{"rule": x.rule, "message": x.message} for x in rejections[stack_id]]}
            for stack_id, verdict, why in rows]


def _explain(m, req, as_json=False):
    """--explain: every candidate, then the chosen stack (or the reason none fits)."""
    from .resolve import resolve
    from .running import resolution_dict

    cands = _explain_candidates(m, req)
    if not as_json:
        out.print(_table(f"candidates for {req.describe()}", ("stack", "verdict", "min driver", "why"),
                         [(c["stack"], c["verdict"], c["min_driver"], c["why"]) for c in cands], ids=(0, 2),
                         box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True))
        _markers_note([c["why"] for c in cands])
        _print_resolution(resolve(m, req))
        return
    doc = {"request": req.describe(), "candidates": [{k: v for k, v in c.items() if k != "why"} for c in cands]}
    try:
        doc["chosen"] = resolution_dict(resolve(m, req))
    except EnvbuildError:
        doc["chosen"] = None
        click.echo(json.dumps(doc, indent=2))
        raise
    click.echo(json.dumps(doc, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="envbuild")
def main():
    """Reproducible GPU training images: pinned torch/CUDA/DeepSpeed stacks with pre-built
    DeepSpeed ops, per-GPU NCCL defaults and a built-in smoke test."""


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
    from .running import next_commands, resolution_dict

    if print_tag and (explain or as_json):
        raise EnvbuildError("--print-tag prints only the tag; leave out --explain and --json "
                            "(`render --json` holds the tag too, as \"tag\").")
    if print_tag:
        from .resolve import resolve

        click.echo(resolve(*_resolve(kw)).tag)
        return
    if explain:
        _explain(*_resolve(kw), as_json=as_json)
        return
    r, _, path, files = _render_to(kw, output, show=not as_json)
    commands = next_commands(r, path, _command_line(ctx, skip={"explain", "as_json", "print_tag"})
                             .replace("envbuild render", "envbuild build", 1))
    if as_json:
        click.echo(json.dumps(resolution_dict(r) | {"output": str(path), "files": files, "next": commands},
                              indent=2))
        return
    _print_next(commands)


@main.command()
@request_options
@click.option("-o", "--output", type=click.Path(), help="Build directory (default ./build/<tag>).")
def build(output, **kw):
    """Render, then build the image with BuildKit and tag it (readable + content tag)."""
    from rich.live import Live
    from rich.text import Text

    from .build import build_image

    from .running import next_commands

    r, secrets, path, _ = _render_to(kw, output)
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
    _print_built(result)
    _print_next(next_commands(r, path))


def _print_built(result) -> None:
    out.print(f"built {result.image_id[:19]} in {result.seconds:.0f} s")
    for tag in result.tags:
        out.print(f"  tagged {tag}", markup=False)
    out.print(f"  log {result.log}", markup=False)


@main.command()
@request_options(gpu_required=False)
@click.option("-r", "--requirements", "requirements_file", type=click.Path(dir_okay=False),
              help="The packages to add, one requirement per line (pip's format, no URLs or paths).")
@click.option("-f", "--file", "project_file", type=click.Path(dir_okay=False),
              help="A project file (envbuild.yaml: gpu, stack, requirements, name, image); options given here win.")
@click.option("--name", help="Names the extension in the tag (<stack tag>-ext-NAME); default: the requirements file's name.")
@click.option("--from", "from_image", help="The stack image to start from (default: the stack's own reference).")
@click.option("--as-of", help="Resolve as of this UTC date (YYYY-MM-DD; uv --exclude-newer) to reproduce an extension.")
@click.option("--build", "do_build", is_flag=True, help="Build the image after rendering (as `envbuild build`).")
@click.option("-o", "--output", type=click.Path(), help="Build directory (default ./build/<tag>).")
def extend(requirements_file, project_file, name, from_image, as_of, do_build, output, **kw):
    """Add your own packages to a stack image as one more layer.

    Your requirements are resolved by uv with the stack's lock as constraints before anything
    is built: a conflict is exit 2 with the stacks where they would fit. The layer installs
    from the resulting lock with hash checking, then runs pip check and imports each package."""
    from .build import build_image
    from .digests import pin
    from .extend import load_project, read_requirements_file, resolve_extension
    from .output import write_build_dir
    from .plan import extension_plan
    from .render import render
    from .resolve import resolve

    if bool(requirements_file) == bool(project_file):
        raise EnvbuildError("envbuild extend needs the packages to add: give -r requirements.txt, or -f envbuild.yaml "
                            "(a project file with gpu and requirements), not both and not neither.")
    project = None
    if project_file:
        project, requirements, source = load_project(Path(project_file))
        for key in ("gpu", "stack", "python", "cuda", "torch", "deepspeed"):
            option = "stack_id" if key == "stack" else key
            if kw.get(option) is None and getattr(project, key) is not None:
                kw[option] = getattr(project, key)
        if kw.get("ds_ops") is None:  # an option given on the command line wins, the default too
            kw["ds_ops"] = project.ds_ops
        name = name or project.name
        from_image = from_image or project.image
    else:
        requirements, source = read_requirements_file(Path(requirements_file)), requirements_file
    if not kw.get("gpu"):
        raise EnvbuildError("envbuild extend: no GPU: give --gpu (e.g. --gpu h100), or `gpu:` in the project file; "
                            "`envbuild gpus` lists them.")
    if as_of and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", as_of):
        raise EnvbuildError(f"--as-of {as_of}: not a date; write it as YYYY-MM-DD (e.g. 2026-11-22).")
    if output is not None and not output.strip():
        raise EnvbuildError("-o/--output is empty; give a directory, or leave it out for ./build/<tag>.")
    m, req = _resolve(kw)
    secrets = _secrets(kw)
    r = resolve(m, req)
    extension = resolve_extension(m, r, requirements, source, name=name,
                                  exclude_newer=f"{as_of}T00:00:00Z" if as_of else None)
    base, digest = pin(from_image or r.image_ref)
    plan = extension_plan(r, extension, base)
    files, tag = render(plan), plan.tag
    path = write_build_dir(files, Path(output) if output else Path("build") / tag)
    for key, value in [("stack", f"{r.stack.id} ({r.tag})"), ("from", base + ("" if digest else "  (no digest known here: pinned by tag)")),
                       ("adds", f"{len(extension.lock.sections['venv'])} packages for {', '.join(extension.requirements)}"),
                       ("lock", f"{Path(path, 'envbuild/extend-lock.txt')} (as of {extension.exclude_newer[:10]})"),
                       ("tag", tag), ("output", str(path))]:
        out.print(f"[bold]{key:<12}[/bold] {escape(value)}", soft_wrap=True)
    if do_build:
        _print_built(build_image(path, tag, r.request.image_repo, secrets))
        _print_next([f"envbuild smoke {r.request.image_repo}:{tag}", f"envbuild push {r.request.image_repo}:{tag}"])
    else:
        _print_next([f"docker build --network host -t {r.request.image_repo}:{tag} {path}   # or: envbuild extend ... --build"])


@main.command()
@click.argument("image")
@click.option("--gpus", help="Pass GPUs to the container (all, or a count), as docker run --gpus.")
@click.option("--json", "as_json", is_flag=True, help="Print the smoke test's JSON result.")
@click.option("--timeout", default=900, show_default=True, help="Seconds before a hung smoke test is killed.")
@click.option("--qemu", is_flag=True, help="An arm64 image on an x86-64 machine under qemu-user: bind the stub "
                                            "CPU sysfs torch needs there (see envbuild build --qemu).")
def smoke(image, gpus, as_json, timeout, qemu):
    """Run the image's built-in smoke test; non-zero exit on any failed check.

    The image's own checks (versions, ops load with no JIT even with stale locks planted,
    numerics, environment, collectives, and on GPU nodes the transport) run in a container
    with no network; the result is recorded per image ID, and `envbuild push` refuses an image
    without a passing record."""
    if gpus is not None and not (gpus == "all" or gpus.isdigit()):
        raise EnvbuildError(f"--gpus '{gpus}' is not 'all' or a count; give --gpus all (every GPU), or --gpus 2. "
                            f"To pick devices, set CUDA_VISIBLE_DEVICES inside, or use docker run --gpus directly.")
    from .verdict import record_path, run_smoke, table_rows

    rep = run_smoke(image, gpus=gpus, timeout=timeout, qemu=qemu)
    if as_json:
        click.echo(json.dumps(rep.raw, indent=2))
    else:
        out.print(_table(f"smoke test of {image} ({rep.mode} mode)", ("check", "result", "time", "detail"),
                         table_rows(rep)))
        out.print(("PASSED" if rep.ok else "FAILED") + f" in {rep.seconds:.0f} s; recorded in {record_path(rep.image_id)}",
                  markup=False)
    if not rep.ok:
        sys.exit(1)


@main.command()
@click.argument("image")
@click.option("--registry", required=True,
              help="Registry HOST[:PORT][/NAMESPACE] to push to (the image keeps its last name component).")
@click.option("--by-platform", is_flag=True,
              help="Push only under the per-platform tag (<tag>-amd64, <tag>-arm64) and print its digest, "
                   "for a multi-arch manifest list merged afterwards.")
@click.option("--merge", "merge_digests", multiple=True, metavar="DIGEST",
              help="Publish IMAGE (NAME:TAG) as one manifest list of these single-platform digests of NAME, "
                   "each of which must have passed its smoke test as that platform. Repeat per platform.")
@click.option("--verify", is_flag=True,
              help="Only check that every platform the registry serves for IMAGE passed its smoke test.")
def push(image, registry, by_platform, merge_digests, verify):
    """Push an image whose smoke test passed (both tags), pull it back by digest, compare.

    Multi-arch: push each platform's image with --by-platform, then --merge their digests into
    the one tag x86 and Grace nodes pull (the manifest list)."""
    from .publish import merge, push as do_push, verify_published

    if sum(map(bool, (by_platform, merge_digests, verify))) > 1:
        raise EnvbuildError("--by-platform, --merge and --verify are different steps; give one of them.")
    if merge_digests or verify:
        name, sep, tag = image.rpartition(":")
        if not sep or "/" in tag or not name:
            raise EnvbuildError(f"IMAGE '{image}' must be NAME:TAG (e.g. envbuild:torch2.15.0-cu132-py3.12-ds0.19.8"
                                f"-h100) with --merge/--verify: the tag the manifest list is published under.")
        name = name.split("/")[-1]
        if verify:
            images = verify_published(registry, name, tag)
        else:
            digest, images = merge(registry, name, tag, list(merge_digests),
                                   on_event=lambda s: err.print(f"  {s}", markup=False))
            out.print(f"pushed {registry}/{name}:{tag} (manifest list)", markup=False)
            out.print(f"digest {digest}", markup=False)
        for i in images:
            out.print(f"{i.platform} {i.digest} smoke-tested as image {i.config}", markup=False)
        return
    res = do_push(image, registry, on_event=lambda s: err.print(f"  {s}", markup=False), by_platform=by_platform)
    for ref in res.refs:
        out.print(f"pushed {ref}", markup=False)
    out.print(f"digest {res.digest}", markup=False)
    if by_platform:
        out.print(f"platform {res.platform}", markup=False)


@main.command()
@click.option("--stack", "stack_ids", multiple=True, metavar="ID", help="Lock this stack (repeatable); default: every stack.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a lock is missing or resolving again gives another file.")
@click.option("--upgrade", is_flag=True, help="Resolve as of today instead of the lock's own date (newer packages).")
@click.option("--bases", is_flag=True,
              help="Also record the digest each stack's base image has on its registry (matrices/base-digests.yaml; "
                   "renders then pin FROM to it). For the publishing CI: Docker Hub must be reachable.")
@matrix_dir_option
def lock(stack_ids, check, upgrade, bases, matrix_dir):
    """Hash-lock stacks: every Python distribution each image installs, == with its sha256
    hashes, resolved by uv for the image's Python, CPU and glibc into matrices/locks/.

    A lock keeps its date (uv --exclude-newer) while it agrees with its stack row, so running
    this again gives the same file; --upgrade moves the date to today."""
    from .lock import lock_stacks
    from .matrix import load_matrix

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if bases and not check:
        from .digests import record_base_digests
        from .lock import today

        refs = [ref for s in m.stacks if not stack_ids or s.id in stack_ids
                for ref in (s.base_images.builder, s.base_images.runtime)]
        recorded, unreachable = record_base_digests(m.directory, refs, today()[:10])
        for ref in sorted(set(refs)):
            state = "unreachable (kept what was recorded)" if ref in unreachable else recorded.get(ref, "")
            out.print(f"base      {ref}  {state}", markup=False, soft_wrap=True)
    outcomes = lock_stacks(m, tuple(stack_ids), check=check, upgrade=upgrade,
                           progress=lambda text: err.print(f"envbuild: {text}", markup=False))
    for o in outcomes:
        line = f"{o.state:<9} {o.stack}  {o.path}" + (f"\n          {o.detail}" if o.detail else "")
        out.print(line, markup=False, soft_wrap=True)
    bad = [o for o in outcomes if o.state in ("failed", "stale")]
    if bad:
        hint = ("" if not check else
                f"\nRefresh with: envbuild lock {' '.join('--stack ' + o.stack for o in bad)}")
        err.print(f"envbuild: {len(bad)} of {len(outcomes)} locks {'failed' if not check else 'are not current'}."
                  + hint, markup=False)
        sys.exit(1)


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=".github/workflows/publish.yml",
              show_default=True, help="Workflow file to write.")
@click.option("--check", is_flag=True, help="Exit 1 if the file differs from what would be generated.")
@matrix_dir_option
def ci(output, check, matrix_dir):
    """Generate the GitHub Actions workflows: the one that builds, smoke-tests and publishes
    the matrix, and beside it the weekly one that refreshes the matrix from PyPI."""
    from .ci import render_refresh_workflow, render_workflow
    from .matrix import load_matrix

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    workflows = {Path(output): render_workflow(m),
                 Path(output).parent / "matrix-refresh.yml": render_refresh_workflow()}
    if check:
        stale = [str(p) for p, text in workflows.items() if not p.is_file() or p.read_text() != text]
        if stale:
            missing = [s for s in stale if not Path(s).is_file()]
            what = f"{', '.join(stale)} {'is' if len(stale) == 1 else 'are'} " + ("missing" if missing else "stale")
            raise EnvbuildError(f"{what}; run `envbuild ci -o {output}`.", 1)
        out.print(f"{', '.join(map(str, workflows))} are current")
        return
    for path, text in workflows.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        out.print(f"wrote {path}")


@main.command()
@click.argument("log")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: a list of findings.")
@matrix_dir_option
def doctor(log, as_json, matrix_dir):
    """Recognise known hang/failure signatures in a training log and say what to do.

    LOG is a file (text, gzip, bzip2 or xz; UTF-8 or UTF-16) or - for standard input.
    Exit status: 0 nothing known found, 3 something found, 2 the log cannot be read.
    """
    from .doctor import diagnose_log, load_issues, render_json, render_text
    from .resources import matrices_dir

    findings = diagnose_log(log, load_issues(Path(matrix_dir) if matrix_dir else matrices_dir()))
    click.echo(render_json(findings) if as_json else render_text(findings))
    if findings:
        sys.exit(3)


def _notes(title, notes):
    """`key  text` lines under a table; the text wraps with a hanging indent, the key never."""
    if not notes:
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for key, text in notes:
        grid.add_row(escape(key), escape(text))
    out.print(f"\n{title}")
    out.print(grid)


def _blocks(title, blocks):
    """One block per default: its VAR=VALUE on a line of its own, then labelled, wrapped text."""
    out.print(f"\n[bold]{escape(title)}[/bold]", soft_wrap=False)
    for head, where, fields in blocks:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        for label, text in [("gpus" if "not" in fields[0][0] else "gpu", where), *fields]:
            grid.add_row(f"  {label}", escape(text))
        out.print(f"\n[bold]{escape(head)}[/bold]", soft_wrap=True)
        out.print(grid)


def _markers_note(texts):
    """Explain [V]/[S]/[U] and "field report N" when any shown text holds one."""
    from .tables import MARKERS

    if any(w in t for t in texts for w in ("[V", "[S", "[U", "field report")):
        out.print(f"\n{MARKERS}", markup=False, soft_wrap=False)


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
    from .matrix import load_matrix
    from .tables import STACK_HEADERS, STACK_NARROW, narrow, stack_notes, stack_rows

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if as_json:
        click.echo(json.dumps([s.model_dump() | {"torchvision": m.torch_release(s.torch).torchvision,
                                                 "min_driver": m.driver_floor(s.cuda).min_driver,
                                                 "cuda_arches": m.stack_arches(s)}
                               for s in m.stacks], indent=2))
        return
    headers = STACK_HEADERS if wide else STACK_NARROW
    out.print(_table("envbuild stacks" + ("" if wide else " (--wide: every column)"), headers,
                     narrow(STACK_HEADERS, headers, stack_rows(m)), ids=(0,),
                     **({} if wide else {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True})))
    _notes("notes:", stack_notes(m))
    out.print("\nmin driver: the oldest NVIDIA driver (Linux) the stack's CUDA runs on; older data-centre "
              "drivers need NVIDIA's forward-compatibility package (README: The matrix).", soft_wrap=False)
    _markers_note([n for _, n in stack_notes(m)])


from .refresh import refresh_command  # noqa: E402  (registered under `matrix`)

matrix_cmd.add_command(refresh_command)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with reasons and sources.")
@click.option("--wide", is_flag=True, help="Every column, and the defaults as wide tables.")
@matrix_dir_option
def gpus(as_json, wide, matrix_dir):
    """List the GPU profiles: compute capability, interconnect, NCCL defaults with reasons."""
    from .matrix import load_matrix
    from .tables import (ENV_HEADERS, GPU_HEADERS, GPU_NARROW, NOT_BAKED_HEADERS, env_blocks, env_rows, gpu_json,
                         gpu_notes, gpu_rows, narrow, not_baked_blocks, not_baked_rows)

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if as_json:
        click.echo(json.dumps(gpu_json(m), indent=2))
        return
    env_title = "environment defaults baked into the images (override: docker run -e, apptainer --env, render --env)"
    if wide:
        out.print(_table("envbuild GPU profiles", GPU_HEADERS, gpu_rows(m), ids=(0,)))
        out.print(_table(env_title, ENV_HEADERS, env_rows(m), ids=(1,)))
        out.print(_table("considered and not baked", NOT_BAKED_HEADERS, not_baked_rows(m), ids=(1,)))
    else:
        out.print(_table("envbuild GPU profiles (--wide: aliases and defaults as tables)", GPU_NARROW,
                         narrow(GPU_HEADERS, GPU_NARROW, gpu_rows(m)), ids=(0,), box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True))
        _notes("notes:", gpu_notes(m))
        _blocks(env_title, env_blocks(m))
        _blocks("considered and not baked", not_baked_blocks(m))
    texts = [t for _, _, fields in env_blocks(m) + not_baked_blocks(m) for _, t in fields]
    _markers_note(texts + [n for _, n in gpu_notes(m)])


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with reasons and sources.")
@matrix_dir_option
def fabrics(as_json, matrix_dir):
    """List the fabric profiles (render --fabric): what each puts in the image and the NCCL net it pins."""
    from .matrix import load_matrix
    from .tables import FABRIC_HEADERS, fabric_env_rows, fabric_json, fabric_rows

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


@main.command("readme-tables", hidden=True)
@click.argument("readme", type=click.Path(exists=True, dir_okay=False))
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the tables differ from the matrix.")
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
