"""`smoke` and `push`: an image proves itself, and only then is published."""

from __future__ import annotations

import json
import sys

import click

from envbuild.base.errors import EnvbuildError
from envbuild.cli.app import err, main, out, table


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
    from envbuild.builds.verdict import record_path, run_smoke, table_rows

    rep = run_smoke(image, gpus=gpus, timeout=timeout, qemu=qemu)
    if as_json:
        click.echo(json.dumps(rep.raw, indent=2))
    else:
        out.print(table(f"smoke test of {image} ({rep.mode} mode)", ("check", "result", "time", "detail"),
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
    from envbuild.supply.publish import push as do_push

    if sum(map(bool, (by_platform, merge_digests, verify))) > 1:
        raise EnvbuildError("--by-platform, --merge and --verify are different steps; give one of them.")
    if merge_digests or verify:
        _publish_list(image, registry, merge_digests, verify)
        return
    res = do_push(image, registry, on_event=lambda s: err.print(f"  {s}", markup=False), by_platform=by_platform)
    for ref in res.refs:
        out.print(f"pushed {ref}", markup=False)
    out.print(f"digest {res.digest}", markup=False)
    if by_platform:
        out.print(f"platform {res.platform}", markup=False)


def _publish_list(image, registry, merge_digests, verify) -> None:
    """--merge (publish one manifest list of smoke-tested platform images) or --verify."""
    from envbuild.supply.publish import merge, verify_published

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
