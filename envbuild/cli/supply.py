"""`publish`, `verify` and `audit`: the publish job as one command, a published tag checked by
whoever pulls it, and the vulnerability gate on the locks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import EnvbuildError
from .app import err, main, out
from .options import matrix_dir_option

SERVICE = click.option("--vulnerability-service", "service", metavar="pypi|osv|URL",
                       help="Where pip-audit looks up advisories: pypi (PyPI's vulnerability data, the default), osv "
                            "(api.osv.dev), or an OSV-compatible query URL (a mirror). Env: "
                            "ENVBUILD_VULNERABILITY_SERVICE.")
BUILD_FLAGS = ("base_image", "builder_image", "pip_index_url", "torch_index_url", "apt_mirror", "source_mirror",
               "ca_cert")


def _say(text: str) -> None:
    err.print(f"envbuild: {text}", markup=False, soft_wrap=True)


def _signing(signing_key, keyless):
    from ..provenance import load_signer
    from ..release import Signing

    if signing_key and keyless:
        raise EnvbuildError("--signing-key and --keyless are two ways to sign; give one (CI: --keyless, with cosign "
                            "and the job's OIDC token; elsewhere: --signing-key).")
    if not signing_key and not keyless:
        raise EnvbuildError("nothing would sign the provenance: give --signing-key FILE (a PEM private key: openssl "
                            "genpkey -algorithm ed25519 -out envbuild.key) or, in GitHub Actions with cosign, "
                            "--keyless. envbuild does not publish unsigned images.")
    return Signing(signer=load_signer(signing_key) if signing_key else None, keyless=keyless)


def _trust(key, identity, issuer, signing=None):
    from ..provenance import load_public_key
    from ..verify import COSIGN_ISSUER, Trust

    if key and identity:
        raise EnvbuildError("--key and --certificate-identity-regexp are two ways to trust a signature; give one.")
    if key:
        return Trust(key=load_public_key(key))
    if identity:
        return Trust(identity=identity, issuer=issuer or COSIGN_ISSUER)
    if signing is not None and signing.signer is not None:
        return Trust(key=signing.signer.public_key)
    if signing is not None and signing.keyless:  # in GitHub Actions: this very workflow signed the digests
        import os
        import re

        if os.environ.get("GITHUB_WORKFLOW_REF"):
            server = os.environ.get("GITHUB_SERVER_URL", "https://github.com")
            return Trust(identity="^" + re.escape(f"{server}/{os.environ['GITHUB_WORKFLOW_REF']}") + "$")
    raise EnvbuildError("say whose signature to trust: --key FILE (the PEM public key the images were signed with) "
                        "or --certificate-identity-regexp RE (keyless: the publishing workflow, e.g. "
                        "'^https://github.com/acme/envbuild/.github/workflows/publish.yml@refs/heads/main$').")


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
@click.option("--certificate-identity-regexp", "identity", help="--manifest --keyless: the workflow identity.")
@click.option("--digests", type=click.Path(file_okay=False), default="digests", show_default=True,
              help="--manifest: the directory of digest files the jobs handed on.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="publish-out", show_default=True,
              help="--job: where build directories, logs, digests, attestations and report.json go.")
@click.option("--ext-cache", type=click.Path(dir_okay=False),
              help="--job: a compiled-extension cache file (ext-cache save/load): loaded before the builds if it "
                   "exists, saved after with this run's wheels; its cache key goes beside it (FILE.key).")
@click.option("--keep-images", is_flag=True, help="--job: keep the local images after pushing (CI frees the disk).")
@SERVICE
@click.option("--base-image", help="As `envbuild build`: replace the OS base image (a mirror).")
@click.option("--builder-image", help="As `envbuild build`: replace the builder stage's base image.")
@click.option("--pip-index-url", help="As `envbuild build`: a package index mirror (a BuildKit secret).")
@click.option("--torch-index-url", help="As `envbuild build`: a mirror of PyTorch's index (a secret).")
@click.option("--apt-mirror", help="As `envbuild build`: the distro mirror (a secret).")
@click.option("--source-mirror", help="As `envbuild build`: replaces https://github.com in fabric source URLs.")
@click.option("--ca-cert", type=click.Path(dir_okay=False), help="As `envbuild build`: extra CA certificate (PEM).")
@matrix_dir_option
def publish(job_id, manifest_tag, list_jobs, registry, signing_key, keyless, key, identity, digests, out_dir,
            ext_cache, keep_images, service, matrix_dir, **build_flags):
    """Publish the matrix the way its CI does: one job of the publish plan (--job), or one tag's
    manifest list (--manifest). The generated workflow runs exactly these commands.

    A variant that fails at any step publishes nothing of itself and the others go on; exit 1
    names each failed variant and its step."""
    from ..matrix import load_matrix

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if sum(map(bool, (job_id, manifest_tag, list_jobs))) != 1:
        raise EnvbuildError("give one of --job ID (a job of the plan), --manifest TAG (a published tag) or --list.")
    if list_jobs:
        from ..ci import publish_plan

        _, _, jobs, merges = publish_plan(m)
        for j in jobs:
            out.print(f"job {j['id']}  {j['gpus']}", markup=False)
        for t in merges:
            out.print(f"tag {t['tag']}  {t['platforms']}", markup=False)
        return
    if not registry:
        raise EnvbuildError("--registry is needed: the registry to publish to, such as ghcr.io/acme (CI passes "
                            "publish.yaml's with $OWNER filled in).")
    from ..audit import service_from
    from ..ci import publish_plan
    from ..registry import check_image_repo

    check_image_repo(registry, "--registry", suffix="/envbuild")
    cfg = publish_plan(m)[0]
    image_repo = f"{registry}/{cfg.image_repo}"
    if manifest_tag:  # signs only keyless (the list); with keys, each digest's provenance is what is checked
        from ..release import Signing

        signing = _signing(signing_key, keyless) if (signing_key or keyless) else Signing()
        from ..release import publish_manifest

        trust = _trust(key, identity, None, signing)
        digest, images = publish_manifest(m, registry, image_repo, manifest_tag, Path(digests), trust, signing, _say)
        out.print(f"pushed {image_repo}:{manifest_tag} (manifest list)", markup=False)
        out.print(f"digest {digest}", markup=False)
        for i in images:
            out.print(f"{i.platform} {i.digest}", markup=False)
        return
    signing = _signing(signing_key, keyless)
    _run_job(m, job_id, registry, image_repo, signing, service_from(service), Path(out_dir), ext_cache, keep_images,
             build_flags)


def _run_job(m, job_id, registry, image_repo, signing, service, out_dir, ext_cache, keep_images, build_flags):
    from ..build import build_image
    from ..release import JobContext, find_job, run_job
    from .stack import render_to

    job, variants, _ = find_job(m, job_id)
    secrets_given = {k: build_flags.get(k) for k in BUILD_FLAGS}

    def build(variant: dict, build_dir: Path) -> str:
        kw = {"gpu": variant["gpu"], "stack_id": variant["stack"], "fabric": variant["fabric"],
              "ext": variant.get("extensions") or None, "image_repo": image_repo, "registry": None,
              "matrix_dir": str(m.directory), "python": None, "cuda": None, "torch": None, "deepspeed": None,
              "ds_ops": None, "env_pairs": (), "cpu_target": None, "keep_toolchain": False, "no_compiler": False,
              "qemu": False, **secrets_given}
        r, secrets, path, _ = render_to(kw, str(build_dir), show=False)
        build_image(path, r.tag, r.request.image_repo, secrets,
                    on_step=lambda event, name: _say(f"{variant['variant']}: done {name}"[:160]) if event == "done" else None)
        return f"{r.request.image_repo}:{r.tag}"

    out_dir.mkdir(parents=True, exist_ok=True)
    if ext_cache and job["extensions"]:
        _ext_cache_load(m, job, Path(ext_cache), build_flags.get("base_image"))
    ctx = JobContext(m, registry, image_repo, out_dir, signing, service, build, keep_images, _say)
    outcomes = run_job(ctx, job, variants)
    if ext_cache and job["extensions"]:
        _ext_cache_save(m, job, Path(ext_cache), out_dir, build_flags.get("base_image"))
    for o in outcomes:
        if o.ok:
            out.print(f"published {o.variant}  {image_repo}@{o.digest}  {o.platform}", markup=False)
        else:
            out.print(f"FAILED    {o.variant}  at {o.failed_step}: {o.reason}", markup=False, soft_wrap=True)
            for left in o.left_in_registry:
                out.print(f"          left in the registry: {left}", markup=False, soft_wrap=True)
    out.print(f"report {out_dir / 'report.json'}", markup=False)
    if not all(o.ok for o in outcomes):
        sys.exit(1)


def _ext_cache_load(m, job, file: Path, base_image) -> None:
    from ..extcache import copy_image, load

    if not file.is_file():
        return
    try:
        done = load(file, base_image or copy_image(m, job["stack"]))
        _say(f"loaded {done.moved} of {len(done.wheels)} compiled wheel(s) from {file}")
    except EnvbuildError as e:  # a refused file is dropped (this run's save replaces it), never kept to block
        _say(f"warning: {file} was refused ({e.message}); compiling instead")
        file.unlink()


def _ext_cache_save(m, job, file: Path, out_dir: Path, base_image) -> None:
    import hashlib

    from ..extcache import copy_image, keys_of, save

    dirs = [d for d in sorted((out_dir / "build").glob("*")) if (d / "envbuild" / "extensions.json").is_file()]
    if not dirs:
        return
    file.unlink(missing_ok=True)  # the restored file: only the wheels this run's builds use are kept
    done = save(file, base_image or copy_image(m, job["stack"]), keys_of(dirs))
    if done.wheels:
        key = hashlib.sha256("\n".join(sorted(done.wheels)).encode()).hexdigest()[:16]
        Path(f"{file}.key").write_text(key + "\n")
        _say(f"saved {len(done.wheels)} wheel(s) into {file} (cache key {key})")


@main.command()
@click.argument("image")
@click.option("--key", type=click.Path(dir_okay=False), help="The PEM public key the image's provenance must be "
                                                             "signed with.")
@click.option("--certificate-identity-regexp", "identity", metavar="RE",
              help="Keyless (cosign): the identity the signing certificate must have (the publishing workflow).")
@click.option("--certificate-oidc-issuer", "issuer", metavar="URL",
              help="Keyless: the OIDC issuer (default GitHub Actions': https://token.actions.githubusercontent.com).")
@click.option("--platform", help="Check only this platform of a multi-arch tag (linux/amd64, linux/arm64).")
@click.option("--no-pull", is_flag=True, help="Do not pull the image: check signatures and records, not the SBOM "
                                              "against the image's content.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def verify(image, key, identity, issuer, platform, no_pull, as_json):
    """Check a published tag: its signed provenance (the expected key or identity), the SBOM
    against the image's real content (pip and dpkg inside it), the provenance against the tag
    and the image's manifest, the smoke record, the .sqsh beside it. One line per check; exit
    0 when every check passed, 1 when one failed, 2 for unusable input."""
    from ..verify import verify as run_verify

    trust = _trust(key, identity, issuer)
    checks = run_verify(image, trust, platform=platform, content=not no_pull)
    if as_json:
        click.echo(json.dumps({"image": image, "trust": trust.describe(), "ok": all(c.ok for c in checks),
                               "checks": [c.to_dict() for c in checks]}, indent=2))
    else:
        for c in checks:
            out.print(c.line(), markup=False, soft_wrap=True)
        passed = all(c.ok for c in checks)
        out.print(f"{'VERIFIED' if passed else 'NOT VERIFIED'}: {image} ({trust.describe()})", markup=False)
    if not all(c.ok for c in checks):
        sys.exit(1)


@main.command()
@click.option("--stack", "stack_ids", multiple=True, metavar="ID", help="Audit this stack's locks (repeatable); "
                                                                       "default: every lock.")
@SERVICE
@click.option("--json", "as_json", is_flag=True, help="Print every finding as JSON.")
@matrix_dir_option
def audit(stack_ids, service, as_json, matrix_dir):
    """Look up every pin of the matrix's locks (matrices/locks/*.txt) in PyPI's vulnerability
    data with pip-audit; a finding fails (exit 1) unless matrices/vulnerabilities.yaml allows
    it, with a reason, until a date. `envbuild lock --check` runs this too."""
    from ..matrix import load_matrix

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    results = audit_locks(m, stack_ids, service)
    if as_json:
        click.echo(json.dumps([{"lock": where, "ok": r.ok, "summary": r.summary(),
                                "blocked": [f.id for f, _ in r.blocked], "allowed": [f.id for f, _ in r.allowed],
                                "unaudited": [f"{u.package}=={u.version}" for u in r.unaudited]}
                               for where, r in results], indent=2))
    if not all(r.ok for _, r in results):
        sys.exit(1)


def audit_locks(m, stack_ids, service, show=True):
    """Audit the locks of `stack_ids` (all when empty); (lock file, result) each, printed."""
    from ..audit import audit_lock, load_allowlist, service_from
    from ..lock import LOCK_DIR, parse_lock
    from ..files import read_text

    service = service_from(service)
    allowlist = load_allowlist(m.directory)
    known = {s.id for s in m.stacks}
    for s in stack_ids:
        if s not in known:
            from ..errors import nearest
            raise EnvbuildError(f"--stack {s}: no such stack; nearest: {', '.join(nearest(s, known)) or 'none'}.")
    paths = sorted((m.directory / LOCK_DIR).glob("*.txt"))
    paths = [p for p in paths if not stack_ids or p.name.rsplit(".", 2)[0] in stack_ids]
    results = []
    for p in paths:
        r = audit_lock(parse_lock(read_text(p, "lock file", "matrix"), str(p)), service, allowlist)
        results.append((p.name, r))
        if show:
            out.print(f"{'audited' if r.ok else 'VULNERABLE' if r.blocked else 'unaudited'} {p.name}: {r.summary()}",
                      markup=False, soft_wrap=True)
            for f, a in r.allowed:
                out.print(f"  allowed {f.id} in {f.package} {f.version} until {a.expires}: {a.reason}", markup=False,
                          soft_wrap=True)
            if not r.ok:
                err.print(f"envbuild: {r.refusal(p.name)}", markup=False, soft_wrap=True)
    return results
