"""The options many commands share, declared once, and the request, secrets and pinned bases
they become."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import click

from envbuild.base.errors import EnvbuildError
from envbuild.cli.app import err
from envbuild.knowledge.request import Flag, defaults, flags

SERVICE = click.option("--vulnerability-service", "service", metavar="pypi|osv|URL",
                       help="Where pip-audit looks up advisories: pypi (PyPI's vulnerability data, the default), osv "
                            "(api.osv.dev), or an OSV-compatible query URL (a mirror). Env: "
                            "ENVBUILD_VULNERABILITY_SERVICE.")


def not_empty(ctx, param, value):
    """An option given as '' is refused: click would hand the command an empty string, which the
    command's `if value:` then reads as the default, silently (`--matrix-dir ''`, `--fabric ''`)."""
    if value is not None and not str(value).strip():
        flag = max(param.opts, key=len)
        command = " ".join(["envbuild", *ctx.command_path.split()[1:]])
        raise EnvbuildError(f"{flag} is empty; give a value (`{command} --help` says what it takes), or leave the "
                            f"option out for its default.")
    return value


def matrix_dir_option(f):
    """--matrix-dir, declared once for every command that reads the matrix."""
    return click.option("--matrix-dir", type=click.Path(file_okay=False), envvar="ENVBUILD_MATRIX_DIR",
                        callback=not_empty,
                        help="Use another matrix directory instead of the built-in one. Env: ENVBUILD_MATRIX_DIR.")(f)


def secret_options(f):
    """The mirrors, their CA and key: what a build is handed as BuildKit secrets, never in a file
    it renders (`render`, `build`, `rebuild`)."""
    opts = [
        click.option("--pip-index-url", help="Package index mirror for pip (a BuildKit secret at build time)."),
        click.option("--torch-index-url", help="Mirror of PyTorch's CUDA-variant index (a BuildKit secret)."),
        click.option("--apt-mirror", help="Replaces the distro mirror host, e.g. https://mirror.example (a secret)."),
        click.option("--apt-snapshot", metavar="URL",
                     help="Where a stack with an OS lock installs its OS packages from instead of the snapshot "
                          "service: a mirror of the lock's moment, {archive} and {timestamp} in the URL (a secret)."),
        click.option("--apt-key", type=click.Path(dir_okay=False), callback=not_empty,
                     help="The public key that signs --apt-snapshot's Release files, when not the distro's (a secret)."),
        click.option("--source-mirror", help="Replaces https://github.com in the source URLs of a fabric or an extension (FA3), e.g. "
                                             "http://127.0.0.1:8765 (scripts/fabric-sources.sh serves one; the "
                                             "pinned sha256 is checked all the same; a secret)."),
        click.option("--ca-cert", type=click.Path(dir_okay=False), help="Extra CA certificate (PEM) for TLS proxies (a secret)."),
        click.option("--compile-cache", envvar="ENVBUILD_COMPILE_CACHE", metavar="URL",
                     help="Where sccache keeps compiled units for DeepSpeed's ops and the CUDA extensions: "
                          "redis://HOST:PORT, s3://BUCKET/PREFIX or gha (a secret; the image is the same with or "
                          "without it). Env: ENVBUILD_COMPILE_CACHE."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def trust_options(prefix: str = ""):
    """--key, --certificate-identity-regexp, --certificate-oidc-issuer: whose signature a published
    image's provenance must carry (`verify`, `stage`), declared once."""
    def add(f):
        f = click.option("--certificate-oidc-issuer", "issuer", metavar="URL",
                         help="Keyless: the OIDC issuer (default GitHub Actions': "
                              "https://token.actions.githubusercontent.com).")(f)
        f = click.option("--certificate-identity-regexp", "identity", metavar="RE",
                         help=f"{prefix}Keyless (cosign): the identity the signing certificate must have (the "
                              f"publishing workflow).")(f)
        return click.option("--key", type=click.Path(dir_okay=False),
                            help=f"{prefix}The PEM public key the image's provenance must be signed with.")(f)
    return add


def _request_option(name: str, flag: Flag, gpu_required: bool):
    """One request field's option, as envbuild/knowledge/request.py declares it (the value arrives as `name`)."""
    if flag.switch:
        return click.option(flag.name, name, is_flag=True, help=flag.help)
    return click.option(flag.name, name, required=gpu_required and name == "gpu", multiple=flag.repeated,
                        metavar=flag.metavar, callback=not_empty if flag.refuse_empty else None, help=flag.help)


def request_options(f=None, gpu_required=True):
    """The options shared by `render`, `build` and `extend`: the request's fields (declared once,
    in envbuild/knowledge/request.py), where the image is published, the mirrors and the matrix."""
    if f is None:
        return functools.partial(request_options, gpu_required=gpu_required)
    opts = [
        *(_request_option(name, flag, gpu_required) for name, flag in flags().items()),
        click.option("--registry", envvar="ENVBUILD_REGISTRY", metavar="HOST[/NAMESPACE]",
                     help="Where the image is published (as `envbuild push --registry`, e.g. ghcr.io/acme): "
                          "the image becomes REGISTRY/envbuild:TAG and Singularity.def pulls it from there. "
                          "Env: ENVBUILD_REGISTRY."),
        click.option("--image-repo", envvar="ENVBUILD_IMAGE_REPO", metavar="[HOST/]NAME",
                     help="The whole image repository instead (wins over --registry). Default: the local name "
                          "envbuild, which no registry serves (render warns). Env: ENVBUILD_IMAGE_REPO."),
        secret_options,
        matrix_dir_option,
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def request_kw(**given) -> dict:
    """The options `request_from` reads, as a command that was given only `given` receives them."""
    return {**defaults(), "registry": None, "image_repo": None, "matrix_dir": None, **given}


def request_from(kw):
    """The matrix and the Request the options name; an option not given is the field's default."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.knowledge.validate import parse_extensions
    from envbuild.render.running import image_repo
    from envbuild.resolve.inputs import parse_env_pairs
    from envbuild.resolve.resolver import Request

    m = load_matrix(Path(kw["matrix_dir"]) if kw.get("matrix_dir") else None)
    values = {name: kw.get(name, default) for name, default in defaults().items()}
    values.update(env=parse_env_pairs(values["env"]), extensions=parse_extensions(m, values["extensions"]))
    given = {name: value for name, value in values.items() if value is not None or name == "gpu"}
    return m, Request(**given, image_repo=image_repo(kw.get("image_repo"), kw.get("registry"), m.directory))


def secrets_from(kw):
    from envbuild.builds.build import BuildSecrets
    from envbuild.knowledge.oslock import check_snapshot_template
    from envbuild.knowledge.validate import check_mirror_options, compile_cache_secret
    from envbuild.resolve.inputs import apt_key_file, ca_file

    check_mirror_options(kw)
    check_snapshot_template("--apt-snapshot", kw.get("apt_snapshot"))
    return BuildSecrets(ca_cert=ca_file(kw.get("ca_cert")), pip_index_url=kw.get("pip_index_url"),
                        torch_index_url=kw.get("torch_index_url"), apt_mirror=kw.get("apt_mirror"),
                        source_mirror=kw.get("source_mirror"), apt_snapshot=kw.get("apt_snapshot"),
                        apt_key=apt_key_file(kw.get("apt_key")),
                        compile_cache=compile_cache_secret(kw.get("compile_cache"), dict(os.environ)))


def pin_named_bases(r):
    """A base image the user named is pinned by digest when this machine can learn it (its
    Docker pulled it from a registry, or its registry answers); the matrix's own bases stay
    tags (a render does not contact Docker Hub)."""
    from envbuild.builds.digests import pin

    named = {"runtime": r.request.base_image, "builder": r.request.builder_image or (
        r.request.base_image if r.base_images["builder"] == r.request.base_image else None)}
    pinned = {ref: pin(ref) for ref in set(named.values()) if ref}
    for ref in sorted(ref for ref, (_, digest) in pinned.items() if not digest):
        err.print(f"envbuild: note: {ref} is pinned by tag only: no registry digest is known for it on "
                  f"this machine", markup=False, soft_wrap=True)
    return dataclasses.replace(r, base_images={stage: pinned[named[stage]][0] if named.get(stage) else ref
                                               for stage, ref in r.base_images.items()})


def variant_kw(m, variant: dict, image_repo: str, build_flags: dict) -> dict:
    """The request options one variant of a job builds with (as `envbuild build` would get them)."""
    return request_kw(gpu=variant["gpu"], stack=variant["stack"], fabric=variant["fabric"],
                      extensions=variant.get("extensions") or None, image_repo=image_repo,
                      matrix_dir=str(m.directory), **build_flags)


def deepspeed_key(m, image_repo: str, build_flags: dict):
    """variant -> the key of its DeepSpeed wheel in the wheel cache (None: a stack without a lock),
    from the plan the build would render: what `--plan` looks for in the --ext-cache file."""
    def key(variant: dict):
        import json

        from envbuild.plan.stack import stack_plan
        from envbuild.resolve.resolver import resolve

        record = stack_plan(resolve(*request_from(variant_kw(m, variant, image_repo, build_flags)))).generated_files
        text = record.get("envbuild/deepspeed.json")
        return json.loads(text)["cache_key"] if text else None
    return key
