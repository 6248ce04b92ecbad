"""`diff` and `rebuild`: how two images differ, and an image built again from its own record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from envbuild.cli.app import err, main, out, table
from envbuild.cli.options import matrix_dir_option, secret_options

SHOWN = 20  # rows per section in the table (--all: every row)


@main.command()
@click.argument("image_a", metavar="A")
@click.argument("image_b", metavar="B")
@click.option("--json", "as_json", is_flag=True, help="Every difference as JSON, with what was compared.")
@click.option("--all", "show_all", is_flag=True, help=f"Every differing row (the table shows {SHOWN} per section).")
def diff(image_a, image_b, as_json, show_all):
    """How two images differ: Python distributions (version, files), OS packages, files by
    content (not mtime), environment, labels, entrypoint and each layer's size.

    A and B are local images or registry references (pulled when not here). Exit 0: the same
    content; 1: they differ; 2: an image cannot be read."""
    from envbuild.builds.imagediff import SECTIONS, check_source, compare, read_image, summary

    check_source(image_a, "A"), check_source(image_b, "B")  # both, before the engine or a registry is asked
    pulled: list[str] = []
    a, b = read_image(image_a, pulled=pulled), read_image(image_b, pulled=pulled)
    for ref in pulled:
        err.print(f"envbuild: pulled {ref}", markup=False)
    differences = compare(a, b)
    print_differences(summary(a, b, differences), as_json, show_all, SECTIONS)
    sys.exit(1 if differences else 0)


@main.command()
@click.argument("source", metavar="IMAGE|MANIFEST")
@click.option("-o", "--output", type=click.Path(file_okay=False),
              help="Build directory (default: build/<tag>-rebuild).")
@click.option("--json", "as_json", is_flag=True, help="The comparison with the original as JSON.")
@click.option("--cache", "use_cache", is_flag=True,
              help="Let the engine reuse its build cache (faster; a step served from it was not built again, "
                   "and when every step was, nothing was rebuilt and nothing is compared).")
@secret_options
@matrix_dir_option
def rebuild(source, output, as_json, use_cache, matrix_dir, **kw):
    """Build an image again from its own record and compare the two.

    IMAGE (local, or a registry reference) or its manifest.json records the request, the
    envbuild that rendered it, its matrix and its files' digest. The request is rendered
    again; only when the files come out the same is it built (tagged <repo>-rebuild:<tag>, the
    original keeps its tags), every step again (--cache reuses the build cache), then compared
    as `envbuild diff` compares. Exit 0: the same content; 1: they differ, or (--cache) every step
    came from the cache, so nothing was rebuilt; 2: the record is malformed, or this envbuild or
    matrix cannot reproduce it (it says which)."""
    from envbuild.builds.imagediff import SECTIONS, summary
    from envbuild.builds.rebuild import rebuild as run_rebuild
    from envbuild.cli.options import secrets_from

    secrets = secrets_from(kw)
    done = run_rebuild(source, Path(matrix_dir) if matrix_dir else None, secrets, Path(output) if output else None,
                       progress=lambda text: err.print(f"envbuild: {text}", markup=False), use_cache=use_cache)
    for tag in done.result.tags:
        err.print(f"envbuild: tagged {tag}", markup=False)
    if not done.rebuilt:
        _not_rebuilt(done, as_json)
    if done.original is None:
        out.print(f"built {done.result.image_id[:19]} from {source}; no original image here to compare with",
                  markup=False)
        return
    doc = {**summary(done.original, done.again, done.differences), "rebuilt": True, "cached_steps": done.cached}
    print_differences(doc, as_json, False, SECTIONS)
    sys.exit(1 if done.differences else 0)


def _not_rebuilt(done, as_json: bool) -> None:
    """--cache and every step served from the cache: say so, claim nothing, exit 1."""
    said = (f"not rebuilt: served from cache. Every one of the {done.cached} build steps of {done.record.source} "
            f"came from this machine's build cache, so the image is the cached one and comparing it with the "
            f"original proves nothing about reproducibility; run `envbuild rebuild` without --cache to build "
            f"every step again.")
    if as_json:
        click.echo(json.dumps({"rebuilt": False, "cached_steps": done.cached, "image": done.result.image_id,
                               "message": said}, indent=2))
    else:
        out.print(said, markup=False)
    sys.exit(1)


def print_differences(doc: dict, as_json: bool, show_all: bool, sections) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    compared = ", ".join(f"{n} {what}" for what, n in doc["compared"].items())
    out.print(f"A {doc['a']['ref']} ({doc['a']['id'][:19]})\nB {doc['b']['ref']} ({doc['b']['id'][:19]})\n"
              f"compared: {compared}", markup=False)
    for section in sections:
        rows = [(d["key"], d["a"], d["b"]) for d in doc["differences"] if d["section"] == section]
        if not rows:
            continue
        shown = rows if show_all else rows[:SHOWN]
        out.print(table(f"{section}: {len(rows)} differ" + ("" if len(shown) == len(rows) else
                                                             f" (first {len(shown)}; --all for every one)"),
                        (section, "A", "B"), shown))
    out.print("the same content" if doc["equal"] else
              "different: " + ", ".join(f"{n} {s}" for s, n in doc["differing"].items() if n), markup=False)
