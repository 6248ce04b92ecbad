"""`ext-cache save|load`: the compiled CUDA extension wheels, carried between machines (a CI
runner's BuildKit starts empty)."""

from __future__ import annotations

from pathlib import Path

import click

from envbuild.cli.app import main, out
from envbuild.cli.options import matrix_dir_option, not_empty


@main.group("ext-cache")
def ext_cache():
    """Carry the compiled CUDA extension wheels between machines: `save` copies them out of this
    machine's build cache into one file, `load` puts them into another's (CI caches the file, so
    a workflow run does not compile flash-attn again). Waits while a build on this machine holds
    the cache."""


def _image_options(f):
    f = click.option("--stack", "stack_id", callback=not_empty,
                     help="The stack whose builder base image runs the copy (default: the newest stack); it needs "
                          "only sh, cp and tar.")(f)
    f = click.option("--base-image", callback=not_empty,
                     help="Run the copy on this image instead (any with sh, GNU cp and tar; wins over --stack), e.g. "
                          "a local mirror of the stack's base.")(f)
    return matrix_dir_option(f)


def _image(stack_id, base_image, matrix_dir) -> str:
    from envbuild.builds.extcache import copy_image
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.oci.registry import check_image_reference

    if base_image:
        check_image_reference("--base-image", base_image)  # before Docker is asked anything
        return base_image
    return copy_image(load_matrix(Path(matrix_dir) if matrix_dir else None), stack_id)


@ext_cache.command("save")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--for", "build_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Only the wheels the build rendered in DIR uses (repeatable); default: every finished wheel.")
@_image_options
def save_cmd(file, build_dirs, stack_id, base_image, matrix_dir):
    """Write the finished extension wheels of this machine's build cache, each under its cache
    key with its sha256, into FILE (a tar). A FILE envbuild did not write is not replaced."""
    from envbuild.builds.extcache import keys_of, save

    keys = keys_of(build_dirs) if build_dirs else None
    done = save(Path(file), _image(stack_id, base_image, matrix_dir), keys)
    out.print(f"saved {len(done.wheels)} wheel(s) into {done.file}: {', '.join(done.wheels) or 'none'}",
              markup=False)


@ext_cache.command("load")
@click.argument("file", type=click.Path(dir_okay=False))
@_image_options
def load_cmd(file, stack_id, base_image, matrix_dir):
    """Put the wheels of FILE (written by `ext-cache save`) into this machine's build cache; a
    cache key that has a wheel here already keeps it. The next build takes them instead of
    compiling."""
    from envbuild.builds.extcache import load, wheels_in

    wheels_in(Path(file))  # the file first: a wrong one is refused before the matrix or Docker is read
    done = load(Path(file), _image(stack_id, base_image, matrix_dir))
    out.print(f"loaded {done.moved} of {len(done.wheels)} wheel(s) from {done.file} (a key with a wheel here "
              f"already keeps it)", markup=False)
