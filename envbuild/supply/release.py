"""The publish job as one command (`envbuild publish --job ID`): what each job of the generated
workflow runs, and what a lab's own CI or a person runs the same way.

For each GPU variant of the job, in sequence, every step in this order, and a variant that
fails at any step publishes nothing and the others go on:

1. build (the stack's heavy layers are built once and reused from the build cache);
2. smoke: the image's own smoke test must pass (the record is kept);
3. sbom: a CycloneDX SBOM from what the image really holds (:mod:`envbuild.supply.sbom`);
4. audit: pip-audit of the image's Python distributions against the allowlist (:mod:`envbuild.supply.audit`);
   the stack's lock is audited once before any build, so a finding stops the job early;
5. sqsh: the enroot .sqsh exported (reproducible, as `envbuild export --enroot` writes it);
6. push: the image under its per-platform tag, pulled back by digest and compared;
7. attach: the SBOM, the smoke record and the .sqsh, as OCI artifacts whose subject is the digest;
8. provenance: an in-toto SLSA provenance listing all of it, signed (a key here; keyless
   Sigstore through cosign in CI) and attached;
9. digest: written for the manifest job (`envbuild publish --manifest TAG`), which merges only
   digests whose signed provenance verifies.

Steps 6 to 8 touch the registry. If one of them fails, what was attached is taken back out of
the referrers index and deleted where the registry allows, the digest is not handed on, so no
published tag ever serves the image, and the failure says what is left in the registry.

Around it: :mod:`envbuild.supply.jobplan` (which job and variants, `--plan`, the outcome lines and
the next commands), :mod:`envbuild.supply.signing` (a key or keyless), :mod:`envbuild.supply.heartbeat`
(a line while a step runs), :mod:`envbuild.supply.jobcache` (`--ext-cache`) and
:mod:`envbuild.supply.manifestjob` (the manifest job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_bytes, write_atomic
from envbuild.base.grammar import redact
from envbuild.builds.build import LOG_NAME, STAGE_LOG_NAME, compiles
from envbuild.builds.enroot import MKSQUASHFS_FROM, export_sqsh
from envbuild.builds.verdict import record_path, run_smoke
from envbuild.engine import get_engine
from envbuild.knowledge.lock import load_lock
from envbuild.knowledge.matrix import Matrix
from envbuild.oci.artifacts import Blob, Registry
from envbuild.supply import audit, provenance, published, sbom
from envbuild.supply.ci import digest_name
from envbuild.supply.heartbeat import Heartbeat
from envbuild.supply.jobcache import ext_cache_check
from envbuild.supply.jobplan import Outcome, layer_cache, repository
from envbuild.supply.publish import per_platform_tag, push
from envbuild.supply.signing import Signing, cosign
from envbuild.supply.verify import PREDICATE_ANNOTATION, SMOKE_TYPE, SQSH_TYPE, Trust

STEPS = ("build", "smoke", "sbom", "audit", "sqsh", "push", "attach", "provenance", "sign")


def slug(variant: str) -> str:
    """'h100:aws-efa:flash-attn' -> 'h100-aws-efa-flash-attn' (a directory name)."""
    return variant.replace(":", "-").replace(",", "-").strip("-")


def check_tools(signing: Signing, ext_cache: Optional[Path] = None) -> None:
    """Every tool a job needs, before it builds anything: a job that finds mksquashfs missing after
    an hour's build has wasted the hour (exit 2 in the first seconds, naming the package); and
    the --ext-cache file and its key, which must be envbuild's own if they exist."""
    if ext_cache:
        ext_cache_check(ext_cache)
    missing = []
    if not shutil.which("mksquashfs"):
        missing.append(f"mksquashfs, which writes each image's enroot .sqsh ({MKSQUASHFS_FROM})")
    if signing.keyless and not shutil.which("cosign"):
        missing.append("cosign, which signs keyless (the workflow installs it with sigstore/cosign-installer; sign "
                       "with --signing-key where there is no Sigstore)")
    if missing:
        raise EnvbuildError(f"publish --job needs {'; and '.join(missing)}; nothing was built.")


def audit_stack(m: Matrix, stack: str, arch: str, service: str,
                progress: Callable[[str], None] = lambda _: None) -> Optional[audit.AuditResult]:
    """The stack's lock, audited before anything is built (None: the stack has no lock)."""
    lock = load_lock(m.directory, stack, arch)
    if lock is None:
        return None
    return audit.audit_lock(lock, service, audit.load_allowlist(m.directory), progress=progress)


def _timed(outcome: Outcome, step: str, action: Callable, ctx: Optional["JobContext"] = None):
    start = time.monotonic()
    beat = Heartbeat(ctx.say, f"{outcome.variant}: {step}", ctx.activity) if ctx else contextlib.nullcontext()
    try:
        with beat:
            return action()
    except BaseException:
        outcome.failed_step = outcome.failed_step or step
        raise
    finally:
        outcome.seconds[step] = round(time.monotonic() - start, 2)


@dataclass
class JobContext:
    m: Matrix
    registry: str
    image_repo: str          # REGISTRY/NAME: the repository the images are built for
    out: Path
    signing: Signing
    service: str
    build: Callable[[dict, Path], str]  # variant, build dir -> the local image (readable tag)
    keep_images: bool = False
    say: Callable[[str], None] = lambda _: None
    activity: dict = field(default_factory=dict)  # 'build': the BuildKit step now running (the heartbeat names it)
    cache_repo: Optional[str] = None  # where the builder stages' cache images go (--layer-cache); None: off
    render: Optional[Callable[[dict, Path], Path]] = None  # variant, build dir -> the rendered dir, not built
    trust: Optional[Trust] = None  # whose signature makes an earlier publish of the same files count (published.py)
    republish: bool = False  # build every variant, even one published before from the same rendered files


def publish_variant(ctx: JobContext, variant: dict) -> Outcome:
    """Every step of one variant; the outcome says which step failed and why."""
    o = Outcome(variant["variant"], variant["tag"], variant["platform"])
    cache = layer_cache(ctx.cache_repo, ctx.image_repo, variant)
    o.layer_cache = dataclasses.asdict(cache) if cache else {}
    s = slug(variant["variant"])
    build_dir, work = ctx.out / "build" / s, ctx.out / "attestations" / s
    started = provenance._now()
    engine = get_engine()
    name = repository(ctx.image_repo)
    client: Optional[Registry] = None
    attached: list[str] = []
    try:
        earlier = _published_before(ctx, o, variant, build_dir)
        if earlier is not None:
            _hand_on(ctx, o, variant, earlier)
            return o
        image, report = _build_and_smoke(ctx, o, variant, build_dir)
        work.mkdir(parents=True, exist_ok=True)
        inv, sbom_bytes = _sbom_and_audit(ctx, o, variant, image, engine, work)
        sqsh, smoke_bytes = _export(ctx, o, image, report, work)
        pushed = _timed(o, "push", lambda: push(image, ctx.registry, by_platform=True,
                                                on_event=lambda t: ctx.say(f"{variant['variant']}: {t}")), ctx)
        o.digest = pushed.digest
        client = Registry(ctx.registry)
        at = _Attaching(client, name, client.manifest(name, pushed.digest)[0], started, attached)
        _timed(o, "attach", lambda: _attach(o, at, variant, sbom_bytes, smoke_bytes, sqsh), ctx)
        stmt = _timed(o, "provenance", lambda: _statement(ctx, variant, inv, pushed.digest, started,
                                                          _byproducts(sbom_bytes, smoke_bytes, sqsh)), ctx)
        write_atomic(work / "provenance.json", json.dumps(stmt, indent=2, sort_keys=True).encode())
        _timed(o, "sign", lambda: _sign(ctx, o, at, work, stmt, f"{ctx.image_repo}@{pushed.digest}"), ctx)
        _commit(ctx, variant, pushed.digest)
        o.ok = True
        ctx.say(f"{variant['variant']}: published {ctx.image_repo}@{pushed.digest} ({variant['platform']})")
    except BaseException as e:  # a failed step, or Ctrl-C / SIGTERM: what was pushed goes back either way
        o.reason = e.message if isinstance(e, EnvbuildError) else f"interrupted ({type(e).__name__})"
        if o.digest:
            o.left_in_registry = _take_back_quietly(client, ctx.registry, name, o.digest, attached)
        if not isinstance(e, EnvbuildError):
            raise
    finally:
        _copy_log(build_dir, ctx.out / "logs" / f"{s}.log")
        (work / "image.sqsh").unlink(missing_ok=True)  # gigabytes; it is in the registry now (or not wanted)
        if not ctx.keep_images:
            _free_disk(engine, ctx.image_repo)
    return o


def _published_before(ctx: JobContext, o: Outcome, variant: dict, build_dir: Path) -> Optional[published.Earlier]:
    """Step 0: the variant rendered, and the registry asked whether it already serves the image
    of exactly these files (published.find); None: it is built."""
    if ctx.republish or ctx.render is None:
        return None

    def look() -> tuple[Optional[published.Earlier], str]:
        rendered = ctx.render(variant, build_dir)
        manifest = read_bytes(rendered / "manifest.json", "rendered manifest", "record")
        return published.find(ctx.image_repo, per_platform_tag(variant["tag"], variant["platform"]),
                              variant["platform"], manifest, ctx.trust)
    earlier, why = _timed(o, "published before", look, ctx)
    ctx.say(f"{variant['variant']}: {why}" + ("" if earlier else "; building it"))
    return earlier


def _hand_on(ctx: JobContext, o: Outcome, variant: dict, earlier: published.Earlier) -> None:
    """The image published before is this run's: its pins audited again, its digest handed on."""
    _audit_image(ctx, o, variant, earlier.pins, " (published before)")
    _commit(ctx, variant, earlier.digest)
    o.ok, o.digest, o.published_before = True, earlier.digest, earlier.ref
    ctx.say(f"{variant['variant']}: unchanged: {ctx.image_repo}@{earlier.digest} ({variant['platform']}) is handed on "
            f"as published before; not built (--republish builds it again)")


def _build_and_smoke(ctx: JobContext, o: Outcome, variant: dict, build_dir: Path):
    """Steps 1-2: the image, and its smoke report, which must pass before anything leaves."""
    try:
        image = _timed(o, "build", lambda: ctx.build(variant, build_dir), ctx)
    finally:
        # the build's own logs, bounded all the same: with a layer cache the builder stage is built
        # first (its log, written anew, holds the compiling steps) and the image's build finds them
        # cached; without one, a stage log in the directory is an earlier run's
        text = ""
        for log in ((build_dir / STAGE_LOG_NAME,) if o.layer_cache else ()) + (build_dir / LOG_NAME,):
            if log.is_file():
                with open(log, "rb") as f:
                    text += f.read(256 * 2 ** 20).decode("utf-8", "replace") + "\n"
        o.compiles = compiles(text)
    report = _timed(o, "smoke", lambda: run_smoke(image), ctx)
    if not report.ok:
        failed = [c.get("name") for c in report.checks if not c.get("ok") and c.get("status") != "skip"]
        raise EnvbuildError(f"the smoke test failed ({', '.join(map(str, failed)) or 'see the record'}); record "
                            f"{record_path(report.image_id)}.", exit_code=1)
    return image, report


def _sbom_and_audit(ctx: JobContext, o: Outcome, variant: dict, image: str, engine, work: Path) -> tuple[dict, bytes]:
    """Steps 3-4: the SBOM of what the image holds (written), and its Python pins audited."""
    def make_sbom() -> tuple[dict, bytes]:
        inv = sbom.read_inventory(image, engine)
        return inv, sbom.to_json(sbom.make_bom(inv, f"{ctx.image_repo}:{variant['tag']}"))
    inv, sbom_bytes = _timed(o, "sbom", make_sbom, ctx)
    write_atomic(work / sbom.FILE_NAME, sbom_bytes)
    o.bytes["sbom"] = len(sbom_bytes)

    _audit_image(ctx, o, variant, sbom.python_pins(inv))
    return inv, sbom_bytes


def _audit_image(ctx: JobContext, o: Outcome, variant: dict, pins: dict, said: str = "") -> None:
    """Step 4: the image's Python pins through the vulnerability gate (a built image's, or the
    signed SBOM's of one published before); a finding the allowlist does not allow fails it."""
    found = _timed(o, "audit", lambda: audit.audit_pins(
        pins, f"image {variant['tag']}", ctx.service, audit.load_allowlist(ctx.m.directory)), ctx)
    ctx.say(f"{variant['variant']}: audit: {found.summary()}")
    if not found.ok:
        o.failed_step = "audit"
        raise EnvbuildError(found.refusal(f"image {variant['tag']}{said}"), exit_code=1)


def _commit(ctx: JobContext, variant: dict, digest: str) -> None:
    """The commit point: the manifest job merges only the digests handed on here."""
    (ctx.out / "digests").mkdir(parents=True, exist_ok=True)
    write_atomic(ctx.out / "digests" / digest_name(variant), f"{digest}\n".encode())


def _export(ctx: JobContext, o: Outcome, image: str, report, work: Path):
    """Step 5: the .sqsh, and the smoke record kept beside it; both are attached after the push."""
    sqsh_path = work / "image.sqsh"
    if sqsh_path.exists():
        sqsh_path.unlink()  # an earlier run's export of this directory (ours)
    sqsh = _timed(o, "sqsh", lambda: export_sqsh(image, sqsh_path), ctx)
    o.bytes["sqsh"] = sqsh.size
    smoke_bytes = record_path(report.image_id).read_bytes()
    write_atomic(work / "smoke.json", smoke_bytes)
    o.bytes["smoke"] = len(smoke_bytes)
    return sqsh, smoke_bytes


@dataclass
class _Attaching:
    """Where a variant's artifacts go, and every digest attached so far: what a failure takes back."""

    client: Registry
    name: str
    subject: object
    started: str
    attached: list[str]


def _attach(o: Outcome, at: _Attaching, variant: dict, sbom_bytes: bytes, smoke_bytes: bytes, sqsh) -> None:
    """Step 7: the SBOM, the smoke record and the .sqsh, each an artifact whose subject is the image."""
    for step, kind, blob in (
            ("attach:sbom", sbom.MEDIA_TYPE, Blob(sbom.MEDIA_TYPE, sbom.FILE_NAME, data=sbom_bytes)),
            ("attach:smoke", SMOKE_TYPE, Blob(SMOKE_TYPE, "smoke.json", data=smoke_bytes)),
            ("attach:sqsh", SQSH_TYPE, Blob(SQSH_TYPE, f"{variant['tag']}.sqsh", path=sqsh.path))):
        desc = _timed(o, step, lambda: at.client.attach(at.name, at.subject, kind, [blob],
                                                        {"org.opencontainers.image.created": at.started}))
        at.attached.append(desc.digest)


def _byproducts(sbom_bytes: bytes, smoke_bytes: bytes, sqsh) -> list[dict]:
    """What the provenance lists beside the image: the attached files, by digest."""
    return [{"name": sbom.FILE_NAME, "digest": {"sha256": _sha(sbom_bytes)}, "mediaType": sbom.MEDIA_TYPE},
            {"name": "smoke.json", "digest": {"sha256": _sha(smoke_bytes)}, "mediaType": SMOKE_TYPE},
            {"name": "image.sqsh", "digest": {"sha256": sqsh.sha256}, "mediaType": SQSH_TYPE,
             "annotations": {"size": str(sqsh.size)}}]


def _statement(ctx: JobContext, variant: dict, inv: dict, digest: str, started: str, byproducts: list[dict]) -> dict:
    """Step 8: the provenance statement, its request taken from the variant and the image's manifest."""
    manifest_bytes = ((inv.get("records") or {}).get("manifest") or "").encode()
    manifest = json.loads(manifest_bytes or b"{}")
    request = {"job": variant.get("job", ""), "variant": variant["variant"], "stack": variant["stack"],
               "gpu": variant["gpu"], "fabric": variant["fabric"], "extensions": variant.get("extensions", ""),
               "ds_ops": manifest.get("ds_ops"), "platform": variant["platform"],
               "cpu_target": manifest.get("cpu_target"), "torch_cuda_arch_list": manifest.get("torch_cuda_arch_list")}
    lock = manifest.get("lock")
    arch = "aarch64" if variant["platform"].endswith("arm64") else "x86_64"
    return provenance.statement(
        f"{ctx.image_repo}:{variant['tag']}", digest, request, manifest_bytes, ctx.m.directory,
        byproducts, started, {"name": f"{variant['stack']}.{arch}.txt", "sha256": lock["sha256"]} if lock else None)


def _sign(ctx: JobContext, o: Outcome, at: _Attaching, work: Path, stmt: dict, ref: str) -> None:
    """Step 8's signature: a DSSE envelope attached (a key), or cosign's attestation (keyless)."""
    if ctx.signing.signer is not None:
        envelope = provenance.sign(stmt, ctx.signing.signer)
        write_atomic(work / "provenance.dsse.json", envelope)
        o.bytes["provenance"] = len(envelope)
        desc = at.client.attach(at.name, at.subject, provenance.DSSE_MEDIA_TYPE,
                                [Blob(provenance.DSSE_MEDIA_TYPE, "provenance.dsse.json", data=envelope)],
                                {PREDICATE_ANNOTATION: provenance.SLSA_PROVENANCE})
        at.attached.append(desc.digest)
    if ctx.signing.keyless:  # Sigstore: the job's OIDC identity, Fulcio and Rekor (CI only)
        predicate = work / "provenance-predicate.json"
        write_atomic(predicate, json.dumps(stmt["predicate"], sort_keys=True).encode())
        cosign("attest", "--yes", "--type", "slsaprovenance1", "--predicate", str(predicate), ref)
        cosign("sign", "--yes", ref)


def _take_back_quietly(client: Optional[Registry], registry: str, name: str, digest: str,
                       attached: list[str]) -> list[str]:
    """:func:`_take_back`, reporting rather than raising when the registry fails meanwhile."""
    try:
        return _take_back(client or Registry(registry), name, digest, attached)
    except EnvbuildError as e:
        return [f"{registry}/{name}@{digest} and what was attached to it ({e.message})"]


def _take_back(client: Registry, name: str, digest: str, attached: list[str]) -> list[str]:
    """Remove what this variant attached and its image, where the registry allows; what stays.
    An image that still carries attachments of an earlier publish (the same bits, published
    before) is kept: deleting it would break a tag that works."""
    client.detach(name, digest, set(attached))
    if client.referrers(name, digest):
        return [f"{client.host}/{name}@{digest} (kept: an earlier publish of the same image is attached to it)"]
    if client.delete_manifest(name, digest):
        return []
    return [f"{client.host}/{name}@{digest} (the registry does not delete manifests; its per-platform tag stays, no "
            f"published tag serves it, and `envbuild verify` fails on it)"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _copy_log(build_dir: Path, dest: Path) -> None:
    """The build log beside the job's others (best effort: a full disk must not hide why the
    variant failed)."""
    log = build_dir / "build.log"
    try:
        if log.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, dest)
    except OSError:
        pass


def _free_disk(engine, image_repo: str) -> None:
    """The job's images, untagged once pushed (their layers stay in the build cache): a runner's
    disk holds one CUDA image at a time."""
    try:
        refs = [t for t in engine.client.images.list(name=image_repo) for t in t.tags]  # type: ignore[attr-defined]
    except Exception:  # another engine, or none: nothing to free
        return
    for ref in refs:
        try:
            engine.untag(ref)
        except Exception:
            pass


def run_job(ctx: JobContext, job: dict, variants: list[dict]) -> list[Outcome]:
    """Every variant of the job, after the stack's lock passed the vulnerability gate."""
    arch = "aarch64" if job["platform"].endswith("arm64") else "x86_64"
    ctx.say(f"{job['id']}: auditing the lock of {job['stack']} ({arch}) against {ctx.service}")
    result = audit_stack(ctx.m, job["stack"], arch, ctx.service, progress=ctx.say)
    if result is not None and not result.ok:
        reason = result.refusal(f"the lock of {job['stack']} ({arch})")
        outcomes = [Outcome(v["variant"], v["tag"], v["platform"], failed_step="audit", reason=reason) for v in variants]
    else:
        outcomes = []
        for v in variants:
            ctx.say(f"{v['variant']}: building {v['tag']}")
            outcomes.append(publish_variant(ctx, {**v, "job": job["id"]}))
    # The report is written whatever failed (the CLI names it; CI uploads it), and no URL's
    # credentials (a --vulnerability-service with a token) reach it.
    report = json.dumps({"job": job["id"], "outcomes": [asdict(o) for o in outcomes]}, indent=2)
    write_atomic(ctx.out / "report.json", redact(report).encode())
    return outcomes
