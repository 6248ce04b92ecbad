"""`extend`: a researcher's own packages as one more layer on a stack image."""

from __future__ import annotations

import re
from pathlib import Path

import click
from rich.markup import escape

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError
from envbuild.cli.app import main, out, print_next
from envbuild.cli.options import request_from, request_options, secrets_from
from envbuild.cli.stack import print_built


@main.command()
@request_options(gpu_required=False)
@click.option("-r", "--requirements", "requirements_file", type=click.Path(dir_okay=False),
              help="The packages to add, one requirement per line (pip's format, no URLs or paths).")
@click.option("-f", "--file", "project_file", type=click.Path(dir_okay=False),
              help="A project file (envbuild.yaml: gpu, stack, requirements, name, image); options given here win.")
@click.option("--name", help="Names the layer in the tag (<stack tag>-ext-NAME); default: the requirements file's name.")
@click.option("--from", "from_image", help="The stack image to start from (default: the stack's own reference).")
@click.option("--as-of", help="Resolve as of this UTC date (YYYY-MM-DD; uv --exclude-newer) to reproduce a layer's lock.")
@click.option("--build", "do_build", is_flag=True, help="Build the image after rendering (as `envbuild build`).")
@click.option("-o", "--output", type=click.Path(), help="Build directory (default ./build/<tag>).")
def extend(requirements_file, project_file, name, from_image, as_of, do_build, output, **kw):
    """Add your own packages to a stack image as one more layer.

    Your requirements are resolved by uv with the stack's lock as constraints before anything
    is built: a conflict is exit 2 with the stacks where they would fit. The layer installs
    from the resulting lock with hash checking, then runs pip check and imports each package."""
    from envbuild.builds.build import build_image
    from envbuild.knowledge.rules import check_apt_mirror
    from envbuild.resolve.extend import resolve_layer, with_cuda_extensions
    from envbuild.resolve.resolver import resolve

    _check_as_of(as_of)
    requirements, source, name, from_image = _packages(requirements_file, project_file, name, from_image, kw)
    _check_inputs(output, from_image, kw)
    m, req = request_from(kw)
    req, requirements = with_cuda_extensions(m, req, requirements, source)  # flash-attn: built in the stack image
    secrets = secrets_from(kw)
    r = _check_from(from_image, resolve(m, req))
    check_apt_mirror(r.os_locked, secrets.apt_mirror, secrets.apt_snapshot)
    if not requirements:  # only CUDA extensions: the stack image with --ext is the whole answer
        return _stack_image_only(r, source, output, do_build, secrets)
    layer = resolve_layer(m, r, requirements, source, name=name,
                                  exclude_newer=f"{as_of}T00:00:00Z" if as_of else None)
    plan, path = _write_layer(r, layer, from_image, output)
    ref = f"{r.request.image_repo}:{plan.tag}"
    if do_build:
        print_built(build_image(path, plan.tag, r.request.image_repo, secrets))
        print_next([f"envbuild smoke {ref}", f"envbuild push {ref}"])
    else:
        print_next([f"docker build --network host -t {ref} {path}   # or: envbuild extend ... --build"])


def _write_layer(r, layer, from_image, output):
    """The layer layer's build directory, FROM the stack image by digest where known."""
    from envbuild.builds.digests import pin
    from envbuild.plan import layer_plan
    from envbuild.render.builddir import render
    from envbuild.render.output import write_build_dir

    base, digest = pin(from_image or r.image_ref)
    plan = layer_plan(r, layer, base)
    path = write_build_dir(render(plan), Path(output) if output else Path("build") / plan.tag)
    _print_layer(r, layer, base, digest, plan.tag, path)
    return plan, path


def _check_from(from_image, r):
    """The image named by --from, where this machine's engine has it, must be the stack's image;
    returns the resolution."""
    from envbuild.engine import get_engine
    from envbuild.resolve.extend import check_stack_image, check_stack_image_name

    if from_image:
        try:
            info = get_engine().inspect(from_image)
        except EnvbuildError:  # no engine here, or the image is only in a registry: its name must say it
            check_stack_image_name(from_image, r)
            return r
        check_stack_image(from_image, dict(info.labels), r)
    return r


def _stack_image_only(r, source, output, do_build, secrets) -> None:
    from envbuild.builds.build import build_image
    from envbuild.plan import stack_plan
    from envbuild.render.builddir import render
    from envbuild.render.output import write_build_dir

    plan = stack_plan(r)
    compiled = [e.name for e in r.extensions]
    path = write_build_dir(render(plan), Path(output) if output else Path("build") / plan.tag)
    out.print(f"{escape(source)} names only CUDA extensions ({', '.join(compiled)}): they are compiled into the stack "
              f"image (as `envbuild build --ext {','.join(compiled)}`), so there is no layer to add.", soft_wrap=True)
    for key, value in (("stack", r.stack.id), ("tag", r.tag), ("output", str(path))):
        out.print(f"[bold]{key:<12}[/bold] {escape(value)}", soft_wrap=True)
    if do_build:
        print_built(build_image(path, plan.tag, r.request.image_repo, secrets))
    else:
        print_next([f"envbuild build {r.request.describe()} -o {path}"])


def _packages(requirements_file, project_file, name, from_image, kw):
    """(requirements, where they came from, name, image to start from); a project file fills in
    the request options the command line left out (the command line wins, a default included)."""
    from envbuild.knowledge.request import flags
    from envbuild.oci.registry import check_image_reference
    from envbuild.resolve.extend import load_project, read_requirements_file

    if bool(requirements_file) == bool(project_file):
        raise EnvbuildError("envbuild extend needs the packages to add: give -r requirements.txt, or -f envbuild.yaml "
                            "(a project file with gpu and requirements), not both and not neither.")
    if not project_file:
        return read_requirements_file(Path(requirements_file)), requirements_file, name, from_image
    project, requirements, source = load_project(Path(project_file))
    for name, flag in flags().items():  # the project file's keys are the options' names (ds_ops, ext)
        if flag.project and kw.get(name) is None:
            kw[name] = getattr(project, flag.key)
    if not from_image:  # refused in the project file's words, not as a --from the user never gave
        check_image_reference(f"-f {grammar.escaped(project_file)}: image", project.image)
    return requirements, source, name or project.name, from_image or project.image


def _check_inputs(output, from_image, kw) -> None:
    from envbuild.oci.registry import check_image_reference

    check_image_reference("--from", from_image)
    if not kw.get("gpu"):
        raise EnvbuildError("envbuild extend: no GPU: give --gpu (e.g. --gpu h100), or `gpu:` in the project file; "
                            "`envbuild gpus` lists them.")
    if output is not None and not output.strip():
        raise EnvbuildError("-o/--output is empty; give a directory, or leave it out for ./build/<tag>.")


def _check_as_of(as_of) -> None:
    """A calendar date, not after today (a lock as of a future day cannot be reproduced)."""
    if as_of is not None:
        import datetime

        today = datetime.datetime.now(datetime.timezone.utc).date()
        try:
            day = datetime.date.fromisoformat(as_of) if re.fullmatch(r"\d{4}-\d{2}-\d{2}", as_of) else None
        except ValueError:
            day = None
        if day is None:
            raise EnvbuildError(f"--as-of {grammar.shown(as_of)} is not a calendar date; write it as YYYY-MM-DD, e.g. --as-of "
                                f"{today.isoformat()}.")
        if day > today:
            raise EnvbuildError(f"--as-of {as_of} is in the future (today is {today.isoformat()} UTC): a lock "
                                f"resolved as of a day that has not come cannot be reproduced; nearest valid "
                                f"choice: --as-of {today.isoformat()}, or leave it out.")


def _print_layer(r, layer, base, digest, tag, path) -> None:
    rows = [("stack", f"{r.stack.id} ({r.tag})"),
            ("from", base + ("" if digest else "  (no digest known here: pinned by tag)")),
            ("adds", f"{len(layer.lock.sections['venv'])} packages for {', '.join(layer.requirements)}"),
            *((("compiled", f"{', '.join(e.name for e in r.extensions)} in the stack image (build it first: "
                            f"envbuild build {r.request.describe()})"),) if r.extensions else ()),
            ("lock", f"{Path(path, 'envbuild/extend-lock.txt')} (as of {layer.exclude_newer[:10]})"),
            ("tag", tag), ("output", str(path))]
    for key, value in rows:
        out.print(f"[bold]{key:<12}[/bold] {escape(value)}", soft_wrap=True)
