"""`publish` and `verify`: the publish job as one command, and a published tag checked by
whoever pulls it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import escaped, redact
from envbuild.cli.app import err, main, out
from envbuild.cli.options import SERVICE, deepspeed_key, matrix_dir_option, secret_options, trust_options, variant_kw
from envbuild.knowledge.request import flags

BASE_FLAGS = ("base_image", "builder_image")  # the request options a publish job takes, as `envbuild build` does


def _say(text: str) -> None:
    err.print(f"envbuild: {redact(text)}", markup=False, soft_wrap=True)


def _build_options(f):
    """As `envbuild build`: the bases, and the mirrors, CA and keys (declared once, in options.py)."""
    f = secret_options(f)
    for name in reversed(BASE_FLAGS):
        flag = flags()[name]
        f = click.option(flag.name, name, help=f"As `envbuild build`: {flag.help}")(f)
    return f


@main.command()
@click.option("--job", "job_id", metavar="ID", help="Run this job of the publish plan (the `id` of the workflow's "
                                                   "image matrix): build, smoke-test, SBOM, audit, .sqsh, push, "
                                                   "attach, sign each of its variants.")
@click.option("--manifest", "manifest_tag", metavar="TAG", help="Merge this published tag's digests (--digests) "
                                                               "into its manifest list, each verified first.")
@click.option("--list", "list_jobs", is_flag=True, help="Print the plan's job ids and tags, one per line.")
@click.option("--registry", envvar="ENVBUILD_REGISTRY", metavar="HOST[/NAMESPACE]",
              help="The registry to publish to (publish.yaml's, with $OWNER filled in). Env: ENVBUILD_REGISTRY.")
@click.option("--signing-key", type=click.Path(dir_okay=False), help="PEM private key the provenance is signed "
                                                                     "with (DSSE).")
@click.option("--keyless", is_flag=True, help="Sign keyless with cosign (Sigstore; GitHub Actions' OIDC identity).")
@click.option("--key", type=click.Path(dir_okay=False), help="--manifest: the public key the digests must be "
                                                             "signed with (default: --signing-key's).")
@click.option("--certificate-identity-regexp", "identity", help="--manifest --keyless: the workflow identity "
                                                                "(default, in GitHub Actions: this workflow's).")
@click.option("--digests", type=click.Path(file_okay=False), default="digests", show_default=True,
              help="--manifest: the directory of digest files the jobs handed on.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="publish-out", show_default=True,
              help="--job: where build directories, logs, digests, attestations and report.json go.")
@click.option("--ext-cache", type=click.Path(dir_okay=False),
              help="--job: a compiled-extension cache file (ext-cache save/load): loaded before the builds if it "
                   "exists, saved after with this run's wheels; its cache key goes beside it (FILE.key).")
@click.option("--keep-images", is_flag=True, help="--job: keep the local images after pushing (CI frees the disk).")
@click.option("--layer-cache", "cache_repo", metavar="REPO|off",
              help="--job: the registry repository the builder stages' layer cache is pushed to and imported from "
                   "(default: REGISTRY/envbuild-cache; the published images carry their own stage's cache inline); "
                   "'off' builds without it.")
@click.option("--plan", "show_plan", is_flag=True, help="--job: print what the job would build and what its caches "
                                                         "already hold, per variant; build nothing.")
@click.option("--republish", is_flag=True, help="--job: build, test and push every variant, even one the registry "
                                                 "already serves from the same rendered files with provenance this "
                                                 "job's key or identity signed (default: that one is handed on).")
@click.option("--variant", "variant_ids", multiple=True, metavar="GPU[:FABRIC][:EXT]",
              help="--job: publish only this variant of the job (repeatable; a part left out matches any, and "
                   "each value must name one variant). Default: every variant.")
@SERVICE
@_build_options
@matrix_dir_option
def publish(job_id, manifest_tag, list_jobs, registry, signing_key, keyless, key, identity, digests, out_dir,
            ext_cache, keep_images, cache_repo, show_plan, republish, variant_ids, service, matrix_dir, **build_flags):
    """Publish the matrix the way its CI does: one job of the publish plan (--job), or one tag's
    manifest list (--manifest). The generated workflow runs exactly these commands.

    A variant that fails at any step publishes nothing of itself and the others go on; exit 1
    names each failed variant and its step."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.supply.ci import publish_plan
    from envbuild.supply.jobplan import cache_repo_from, job_plan

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    _one_mode(job_id, manifest_tag, list_jobs, variant_ids or show_plan)
    cfg, _, jobs, merges = publish_plan(m)
    if list_jobs:
        for line in [f"job {j['id']}  {j['gpus']}" for j in jobs] + [f"tag {t['tag']}  {t['platforms']}" for t in merges]:
            out.print(line, markup=False)
        return
    image_repo = _image_repo(registry, cfg.image_repo)
    if manifest_tag:
        _manifest(m, registry, image_repo, manifest_tag, Path(digests), signing_key, keyless, key, identity)
        return
    cache = cache_repo_from(cache_repo, registry)
    if show_plan:
        for line in job_plan(m, job_id, variant_ids, registry, image_repo, cache, ext_cache, Path(out_dir),
                             deepspeed_key(m, image_repo, build_flags)):
            out.print(line, markup=False, soft_wrap=True)
        return
    _run_job(m, job_id, variant_ids, registry, image_repo, (signing_key, keyless), service, Path(out_dir), ext_cache,
             (keep_images, republish), cache, build_flags)


def _one_mode(job_id, manifest_tag, list_jobs, about_a_job) -> None:
    if sum(map(bool, (job_id, manifest_tag, list_jobs))) != 1:
        raise EnvbuildError("give one of --job ID (a job of the plan), --manifest TAG (a published tag) or --list.")
    if about_a_job and not job_id:
        raise EnvbuildError("--variant and --plan are about one job's variants: give --job ID too (`envbuild publish "
                            "--list` prints the jobs).")


def _image_repo(registry, name) -> str:
    from envbuild.oci.registry import check_image_repo

    if not registry:
        raise EnvbuildError("--registry is needed: the registry to publish to, such as ghcr.io/acme (CI passes "
                            "publish.yaml's with $OWNER filled in).")
    check_image_repo(registry, "--registry", suffix="/envbuild")
    return f"{registry}/{name}"


def _manifest(m, registry, image_repo, tag, digests, signing_key, keyless, key, identity) -> None:
    from envbuild.supply.manifestjob import manifest_sources, publish_manifest
    from envbuild.supply.signing import signing_from
    from envbuild.supply.verify import trust_from

    signing = signing_from(signing_key, keyless, required=False)
    trust = trust_from(key, identity, None, signing.signer.public_key if signing.signer else None, keyless)
    manifest_sources(m, tag)  # an unknown tag first: the digests are looked for by its name
    if not digests.is_dir():  # not "its job failed" (exit 1): the option names no directory
        raise EnvbuildError(f"--digests {escaped(str(digests))} is not a directory; give the directory the publish "
                            f"jobs' digest files were downloaded into (the workflow's `digests`).")
    digest, images = publish_manifest(m, registry, image_repo, tag, digests, trust, signing, _say)
    out.print(f"pushed {image_repo}:{tag} (manifest list)", markup=False)
    out.print(f"digest {digest}", markup=False)
    for i in images:
        out.print(f"{i.platform} {i.digest}", markup=False)


def _run_job(m, job_id, variant_ids, registry, image_repo, signing_args, service, out_dir, ext_cache, switches,
             cache_repo, build_flags):
    from envbuild.builds.build import build_image
    from envbuild.cli.stack import render_to
    from envbuild.supply.audit import service_from
    from envbuild.supply.heartbeat import build_hooks
    from envbuild.supply.jobcache import ext_cache_load, ext_cache_save
    from envbuild.supply.jobplan import find_job, layer_cache, next_commands, outcome_lines, select_variants
    from envbuild.supply.release import JobContext, check_tools, run_job
    from envbuild.supply.signing import publish_trust, signing_from

    signing = signing_from(*signing_args)
    job, variants, _ = find_job(m, job_id)
    variants = select_variants(m, job, variants, variant_ids)
    service = service_from(service)  # before anything is written
    cache = Path(ext_cache) if ext_cache else None
    check_tools(signing, cache)  # and a file of the user's at --ext-cache: refused before anything runs
    activity: dict = {}  # the BuildKit step now running, for the heartbeat
    rendered: dict = {}  # variant -> what render_to gave, when it rendered before building

    def render(variant: dict, build_dir: Path) -> Path:
        kw = variant_kw(m, variant, image_repo, build_flags)
        rendered[variant["variant"]] = render_to(kw, str(build_dir), show=False, reach_archive=True)
        return rendered[variant["variant"]][2]

    def build(variant: dict, build_dir: Path) -> str:
        if variant["variant"] not in rendered:
            render(variant, build_dir)
        r, secrets, path, _ = rendered.pop(variant["variant"])
        build_image(path, r.tag, r.request.image_repo, secrets,
                    **build_hooks(variant, activity, layer_cache(cache_repo, image_repo, variant), _say))
        return f"{r.request.image_repo}:{r.tag}"

    out_dir.mkdir(parents=True, exist_ok=True)
    if cache:
        ext_cache_load(m, job, cache, build_flags.get("base_image"), _say)
    ctx = JobContext(m, registry, image_repo, out_dir, signing, service, build, switches[0], _say, activity, cache_repo,
                     render, publish_trust(signing), switches[1])
    outcomes = run_job(ctx, job, variants)
    if cache:
        ext_cache_save(m, job, cache, out_dir, build_flags.get("base_image"), _say)
    for line in [*outcome_lines(outcomes, image_repo), f"report {out_dir / 'report.json'}",
                 *next_commands(m, outcomes, variants, registry, out_dir, signing_args)]:
        out.print(line, markup=False, soft_wrap=True)
    if not all(o.ok for o in outcomes):
        sys.exit(1)


@main.command()
@click.argument("image")
@trust_options()
@click.option("--platform", help="Check only this platform of a multi-arch tag (linux/amd64, linux/arm64).")
@click.option("--no-pull", is_flag=True, help="Do not pull the image: check signatures and records, not the SBOM "
                                              "against the image's content.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def verify(image, key, identity, issuer, platform, no_pull, as_json):
    """Check a published tag: its signed provenance (the expected key or identity), the SBOM
    against the image's real content (pip and dpkg inside it), the provenance against the tag
    and the image's manifest, the smoke record, the .sqsh beside it. One line per check; exit
    0 when every check passed, 1 when one failed, 2 for unusable input."""
    from envbuild.supply.verify import trust_from
    from envbuild.supply.verify import verify as run_verify

    trust = trust_from(key, identity, issuer)
    checks = run_verify(image, trust, platform=platform, content=not no_pull)
    passed = all(c.ok for c in checks)
    if as_json:
        click.echo(json.dumps({"image": image, "trust": trust.describe(), "ok": passed,
                               "checks": [c.to_dict() for c in checks]}, indent=2))
    else:
        for c in checks:
            out.print(c.line(), markup=False, soft_wrap=True)
        out.print(f"{'VERIFIED' if passed else 'NOT VERIFIED'}: {image} ({trust.describe()})", markup=False)
    if not passed:
        sys.exit(1)
