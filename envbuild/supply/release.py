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
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import requests
from securesystemslib.signer import CryptoSigner

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.files import read_bytes, write_atomic
from envbuild.base.grammar import redact
from envbuild.base.resources import matrices_dir
from envbuild.base.untrusted import loads_json
from envbuild.builds import extcache
from envbuild.builds.build import LOG_NAME, STAGE_LOG_NAME, LayerCache, compiles
from envbuild.builds.enroot import MKSQUASHFS_FROM, export_sqsh
from envbuild.builds.verdict import record_path, run_smoke
from envbuild.engine import get_engine
from envbuild.knowledge.lock import load_lock
from envbuild.knowledge.matrix import Matrix
from envbuild.oci.artifacts import Blob, Registry
from envbuild.oci.registry import api_host, check_image_repo
from envbuild.supply import audit, provenance, published, sbom
from envbuild.supply.ci import digest_name, publish_plan
from envbuild.supply.publish import merge, per_platform_tag, push
from envbuild.supply.verify import (
    PREDICATE_ANNOTATION,
    SMOKE_TYPE,
    SQSH_TYPE,
    Trust,
    attached_byproduct,
    signed_statement,
    targets,
    trust_from,
)

STEPS = ("build", "smoke", "sbom", "audit", "sqsh", "push", "attach", "provenance", "sign")


@dataclass(frozen=True)
class Signing:
    """How provenance is signed: with a key (DSSE, here and in labs), or keyless by cosign in CI."""

    signer: Optional[CryptoSigner] = None
    keyless: bool = False


def signing_from(signing_key: Optional[str], keyless: bool, required: bool = True) -> Signing:
    """--signing-key / --keyless: exactly one where something is signed (envbuild never publishes
    unsigned images); the manifest job with a key signs nothing (each digest's provenance is signed)."""
    if signing_key and keyless:
        raise EnvbuildError("--signing-key and --keyless are two ways to sign; give one (CI: --keyless, with cosign "
                            "and the job's OIDC token; elsewhere: --signing-key).")
    if not signing_key and not keyless:
        if not required:
            return Signing()
        raise EnvbuildError("nothing would sign the provenance: give --signing-key FILE (a PEM private key: openssl "
                            "genpkey -algorithm ed25519 -out envbuild.key) or, in GitHub Actions with cosign, "
                            "--keyless. envbuild does not publish unsigned images.")
    return Signing(signer=provenance.load_signer(signing_key) if signing_key else None, keyless=keyless)


@dataclass
class Outcome:
    variant: str
    tag: str
    platform: str
    ok: bool = False
    digest: str = ""
    failed_step: str = ""
    reason: str = ""
    seconds: dict = field(default_factory=dict)  # step -> seconds
    bytes: dict = field(default_factory=dict)    # what each step added: sbom, sqsh, attestation sizes
    left_in_registry: list = field(default_factory=list)
    layer_cache: dict = field(default_factory=dict)  # the references the build imported and exported (LayerCache)
    compiles: dict = field(default_factory=dict)  # what the build compiled and the compile cache served (build.compiles)
    published_before: str = ""  # handed on as published before from the same rendered files: why it was trusted


def publish_trust(signing: "Signing") -> Optional[Trust]:
    """Whose signature makes an earlier publish count as this job's: the public half of its key,
    or keyless in GitHub Actions this workflow's identity; None where neither can be named."""
    try:
        return trust_from(None, None, None, signing.signer.public_key if signing.signer else None, signing.keyless)
    except EnvbuildError:
        return None


def repository(image_repo: str) -> str:
    """The repository path inside its registry: 'ghcr.io/acme/envbuild' -> 'acme/envbuild'.

    >>> repository("127.0.0.1:5000/envbuild")
    'envbuild'
    """
    host = api_host(image_repo)
    return image_repo[len(host) + 1:]


def slug(variant: str) -> str:
    """'h100:aws-efa:flash-attn' -> 'h100-aws-efa-flash-attn' (a directory name)."""
    return variant.replace(":", "-").replace(",", "-").strip("-")


def find_job(m: Matrix, job_id: str) -> tuple[dict, list[dict], object]:
    """The CI job `job_id` (as in the workflow's matrix), its variants, and publish.yaml."""
    cfg, jobs, ci_jobs, _ = publish_plan(m)
    job = next((j for j in ci_jobs if j["id"] == job_id), None)
    if job is None:
        raise EnvbuildError(f"--job {grammar.shown(job_id)}: no such job in the publish plan of {m.directory}; nearest: "
                            f"{', '.join(nearest(job_id, [j['id'] for j in ci_jobs])) or 'none'} "
                            f"(`envbuild publish --list` prints them all).")
    variants = [j for j in jobs if j["stack"] == job["stack"] and j["platform"] == job["platform"]
                and j.get("extensions", "") == job["extensions"]]
    return job, variants, cfg


def layer_cache(cache_repo: Optional[str], image_repo: str, variant: dict) -> Optional[LayerCache]:
    """A variant's layer cache: its builder stage under `cache_repo`, and its published
    per-platform image, which carries its own stage's cache inline."""
    if not cache_repo:
        return None
    tag = per_platform_tag(variant["tag"], variant["platform"])
    return LayerCache(builder=f"{cache_repo}:{tag}-builder", final=f"{image_repo}:{tag}")


def plan(m: Matrix, job: dict, variants: list[dict], registry: str, image_repo: str, cache_repo: Optional[str],
         ext_cache: Optional[Path], out: Path, ds_key: Callable[[dict], Optional[str]] = lambda _: None) -> list[str]:
    """What `publish --job` would do, per variant, without building anything: which layer-cache
    images the registry already holds (pulled, not built) and which stages will be built, the
    compiled extensions an --ext-cache file holds, and how long the last run's build took."""
    images = {v["variant"]: f"{image_repo}:{per_platform_tag(v['tag'], v['platform'])}" for v in variants}
    held = _held_refs(registry, [*images.values(), *(c for v in variants for c in dataclasses.astuple(
        layer_cache(cache_repo, image_repo, v) or LayerCache("", "")))])
    last = _last_build_seconds(out)
    wheels = _cache_wheels(ext_cache) if ext_cache else None
    lines = [f"job {job['id']}: {len(variants)} variant(s), {job['platform']}, layer cache "
             f"{cache_repo or 'off'}"]
    for v in variants:
        cache = layer_cache(cache_repo, image_repo, v)
        lines.append(f"{v['variant']}  {v['tag']}")
        state = held.get(images[v["variant"]])
        lines.append("  published      " + (
            "yes: handed on as it is, not built, if its signed provenance records the files rendered now "
            "(--republish builds it anyway)" if state is True else
            f"cannot tell ({state})" if isinstance(state, str) else "no: built") + f"  ({images[v['variant']]})")
        if cache:
            for what, ref in (("builder stage", cache.builder), ("image", cache.final)):
                state = held.get(ref)
                verdict = ("in the cache: pulled, not built" if state is True else
                           f"cannot tell ({state})" if isinstance(state, str) else "not in the cache: built")
                lines.append(f"  {what:<14} {verdict}  ({ref})")
        else:
            lines.append("  every stage    built (--layer-cache off)")
        key = ds_key(v)
        if key:
            in_file = wheels is not None and any(w.startswith(f"{key}/") for w in wheels)
            lines.append(f"  deepspeed      wheel {key}: " + (f"in {ext_cache}, not compiled" if in_file else
                         "compiled unless this machine's wheel cache holds it (the compile cache, if given, serves "
                         "the units it holds)"))
        if wheels is not None and job["extensions"]:
            names = [w for w in wheels if w.split("/")[0] in v["extensions"].split(",")]
            lines.append(f"  extensions     {len(names)} compiled wheel(s) in {ext_cache}: "
                         f"{', '.join(n.rsplit('/', 1)[1] for n in names) or 'none (compiled in the build)'}")
        if v["variant"] in last:
            lines.append(f"  last run       build {last[v['variant']]:.0f} s ({out / 'report.json'})")
    return lines


def job_plan(m: Matrix, job_id: str, wanted: tuple[str, ...], registry: str, image_repo: str,
             cache_repo: Optional[str], ext_cache: Optional[str], out: Path,
             ds_key: Callable[[dict], Optional[str]] = lambda _: None) -> list[str]:
    """`publish --job ID --plan [--variant ...]`: :func:`plan` of the variants chosen."""
    job, variants, _ = find_job(m, job_id)
    return plan(m, job, select_variants(m, job, variants, wanted), registry, image_repo, cache_repo,
                Path(ext_cache) if ext_cache else None, out, ds_key)


def _held_refs(registry: str, refs: list[str]) -> dict[str, object]:
    """ref -> True/False (the registry holds it or not), or why it cannot tell."""
    refs = [r for r in refs if r]
    if not refs:
        return {}
    try:
        client = Registry(registry)
    except EnvbuildError as e:
        return {r: f"registry unreachable: {e.message}" for r in refs}
    found: dict[str, object] = {}
    for ref in refs:
        name, tag = ref.rsplit(":", 1)
        try:
            found[ref] = client.exists(repository(name), tag)
        except (EnvbuildError, requests.RequestException) as e:
            found[ref] = getattr(e, "message", None) or type(e).__name__
    return found


def _last_build_seconds(out: Path) -> dict[str, float]:
    """Each variant's build time in the report an earlier run left in `out` (none: {})."""
    path = out / "report.json"
    if not path.is_file():
        return {}
    try:
        report = loads_json(read_bytes(path, "report", "record"), f"{path}")
        return {o["variant"]: float(o["seconds"]["build"]) for o in report.get("outcomes", [])
                if isinstance(o, dict) and isinstance(o.get("seconds"), dict) and "build" in o["seconds"]}
    except (EnvbuildError, TypeError, ValueError, AttributeError):  # not a report this version wrote: no figure
        return {}


def _cache_wheels(file: Path) -> tuple[str, ...]:
    return extcache.wheels_in(file) if file.is_file() else ()


def cache_repo_from(value: Optional[str], registry: str) -> Optional[str]:
    """--layer-cache: a repository (checked by the reference grammar: it reaches the build's
    command line), 'off', or REGISTRY/envbuild-cache by default."""
    if value == "off":
        return None
    repo = value or f"{registry}/envbuild-cache"
    check_image_repo(repo, "--layer-cache")
    return repo


def next_commands(m: Matrix, outcomes: list["Outcome"], variants: list[dict], registry: str, out: Path,
                  signing: tuple[Optional[str], bool]) -> list[str]:
    """The `publish --manifest` command of each tag this run's images join, to copy and run."""
    tags = next_manifests(m, outcomes, variants)
    if not tags:
        return []
    signing_key, keyless = signing
    sign = ["--keyless"] if keyless else ["--signing-key", str(signing_key)]
    where = [] if Path(m.directory) == matrices_dir().resolve() else ["--matrix-dir", str(m.directory)]
    lines = ["next (merge each tag's platforms into its manifest list, then it is published):"]
    for tag, complete in tags:
        words = ["envbuild", "publish", "--manifest", tag, "--registry", registry, "--digests", str(out / "digests"),
                 *sign, *where]
        lines.append(f"  {shlex.join(words)}" + ("" if complete else "  # once the jobs of its other platforms have run"))
    return lines


def build_hooks(variant: dict, activity: dict, cache: Optional[LayerCache], say: Callable[[str], None]) -> dict:
    """build_image's progress and cache for one variant: a line per finished BuildKit step, the
    step now running kept in `activity` for the heartbeat, the variant's layer cache."""
    activity.clear()
    name = variant["variant"]

    def on_step(event: str, step: str) -> None:
        if event == "start":
            activity["build"] = step[:120]
        elif event == "done":
            say(f"{name}: done {step}"[:160])

    return {"on_step": on_step, "cache": cache, "say": lambda text: say(f"{name}: {text}")}


def outcome_lines(outcomes: list["Outcome"], image_repo: str) -> list[str]:
    """A line per variant: published where, or the step it failed at, why, and what stayed behind."""
    lines = []
    for o in outcomes:
        if o.ok:
            word = "unchanged" if o.published_before else "published"
            lines.append(f"{word} {o.variant}  {image_repo}@{o.digest}  {o.platform}"
                         + ("  (published before from the same rendered files: not built)" if o.published_before else ""))
            continue
        lines.append(f"FAILED    {o.variant}  at {o.failed_step}: {redact(o.reason)}")
        lines += [f"          left in the registry: {left}" for left in o.left_in_registry]
    return lines


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


def next_manifests(m: Matrix, outcomes: list["Outcome"], variants: list[dict]) -> list[tuple[str, bool]]:
    """(tag, whether this job's digests are all it needs) for each tag a published variant joins:
    `publish --manifest TAG` is the next command, once every platform's job has run."""
    published = {digest_name(v) for v, o in zip(variants, outcomes) if o.ok}
    tags = []
    for merge_job in publish_plan(m)[3]:
        files = set(merge_job["digests"].split())
        if files & published:
            tags.append((merge_job["tag"], files <= published))
    return tags


_VARIANT_PART = re.compile(r"[a-z0-9][a-z0-9._+,-]{0,63}\Z")  # a GPU, fabric or extension name


def _matches(parts: list[str], variant: dict) -> bool:
    return all(not p or p == have for p, have in zip(parts, variant["variant"].split(":")))


def select_variants(m: Matrix, job: dict, variants: list[dict], wanted: tuple[str, ...]) -> list[dict]:
    """The variants `--variant GPU[:FABRIC][:EXT]` names (all of the job's when none is given): a
    part left out matches any, and each value must name exactly one variant of this job. Which
    variants a run publishes changes no image (nor anything `rebuild` compares)."""
    chosen = []
    names = ", ".join(v["variant"] for v in variants)
    for value in wanted:
        parts = value.split(":")
        if len(parts) > 3 or not parts[0] or not all(_VARIANT_PART.match(p) for p in parts if p):
            raise EnvbuildError(f"--variant {grammar.shown(value)} is not GPU[:FABRIC][:EXT]; this job's variants: "
                                f"{names}.")
        found = [v for v in variants if _matches(parts, v)]
        if len(found) > 1:
            raise EnvbuildError(f"--variant {grammar.shown(value)} matches {len(found)} variants of job {job['id']} "
                                f"({', '.join(v['variant'] for v in found)}); give the one to publish, e.g. "
                                f"--variant {found[0]['variant'].rstrip(':')}.")
        if not found:
            _, every, ci_jobs, _ = publish_plan(m)
            elsewhere = sorted({j["id"] for v in every if _matches(parts, v) for j in ci_jobs
                                if (j["stack"], j["platform"], j["extensions"]) == (v["stack"], v["platform"],
                                                                                    v.get("extensions", ""))})
            where = f"; it is a variant of job {', '.join(elsewhere[:3])}" if elsewhere else ""
            raise EnvbuildError(f"--variant {grammar.shown(value)} is not a variant of job {job['id']}{where}; this "
                                f"job's variants: {names} (nearest: "
                                f"{', '.join(nearest(value, [v['variant'] for v in variants])) or 'none'}).")
        chosen += [v for v in found if v not in chosen]
    return chosen or variants


HEARTBEAT_S = float(os.environ.get("ENVBUILD_HEARTBEAT_S") or 60)  # a line at least this often while a step runs


class Heartbeat:
    """While a long step runs (a build of an hour, BuildKit waiting on a lock, a push of 6 GB), a
    line every HEARTBEAT_S seconds with the step, the time it has taken and, for a build, the
    BuildKit step now running (`activity['build']`): a job that prints nothing for 15 minutes
    looks hung and gets cancelled."""

    def __init__(self, say: Callable[[str], None], label: str, activity: Optional[dict] = None):
        self.say, self.label, self.activity = say, label, activity if activity is not None else {}
        self.stop = threading.Event()
        self.every: Optional[float] = None  # HEARTBEAT_S, read when the step starts
        self.start = time.monotonic()
        self.thread = threading.Thread(target=self._beat, daemon=True, name=f"heartbeat {label}")

    def _beat(self) -> None:
        while not self.stop.wait(self.every):
            elapsed = int(time.monotonic() - self.start)
            now = self.activity.get("build")
            self.say(f"{self.label}: still running, {elapsed // 60} min {elapsed % 60:02d} s"
                     + (f" (now: {now})" if now else ""))

    def __enter__(self) -> "Heartbeat":
        self.every = HEARTBEAT_S
        self.say(f"{self.label}: started")
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


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


def audit_stack(m: Matrix, stack: str, arch: str, service: str,
                progress: Callable[[str], None] = lambda _: None) -> Optional[audit.AuditResult]:
    """The stack's lock, audited before anything is built (None: the stack has no lock)."""
    lock = load_lock(m.directory, stack, arch)
    if lock is None:
        return None
    return audit.audit_lock(lock, service, audit.load_allowlist(m.directory), progress=progress)


def cosign(*args: str) -> None:
    """Run cosign (CI: installed by sigstore/cosign-installer; keyless through the job's OIDC token)."""
    binary = shutil.which("cosign")
    if not binary:
        raise EnvbuildError("--keyless signs with cosign, which is not installed here; the workflow installs it "
                            "(sigstore/cosign-installer). Sign with --signing-key where there is no Sigstore.",
                            exit_code=2)
    run = subprocess.run([binary, *args], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise EnvbuildError(f"cosign {args[0]} failed: {run.stderr.strip()[-400:]}", exit_code=1)


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


# ---------------------------------------------------------------- the manifest job


def manifest_sources(m: Matrix, tag: str) -> dict:
    """The manifest job of `tag` (its digest files, platforms)."""
    merges = publish_plan(m)[3]
    found = next((j for j in merges if j["tag"] == tag), None)
    if found is None:
        raise EnvbuildError(f"--manifest {grammar.shown(tag)}: no published tag of that name in {m.directory}'s publish plan; "
                            f"nearest: {', '.join(nearest(tag, [j['tag'] for j in merges])) or 'none'}.")
    return found


def publish_manifest(m: Matrix, registry: str, image_repo: str, tag: str, digests: Path, trust: Trust,
                     signing: Signing, say: Callable[[str], None] = lambda _: None) -> tuple[str, list]:
    """Merge the tag's digests into its manifest list, each only if its signed provenance, SBOM,
    smoke record and .sqsh are attached and verify; then (keyless) sign the list."""
    job = manifest_sources(m, tag)
    name = repository(image_repo)
    refs = []
    for file in job["digests"].split():
        path = Path(digests) / file
        if not path.is_file() or not path.read_text().strip():
            raise EnvbuildError(f"no published image for {file} (its job failed or was cancelled): not publishing "
                                f"{tag}.", exit_code=1)
        refs.append(path.read_text().strip())
    client = Registry(registry)
    for digest in refs:
        for target in targets(client, client.host, name, digest):
            doc, why = signed_statement(client, target, trust)
            if doc is None:
                raise EnvbuildError(f"refusing to publish {tag}: {name}@{digest[:19]}... is not signed as it must be "
                                    f"({why}).", exit_code=1)
            missing = [w for w in (sbom.MEDIA_TYPE, SMOKE_TYPE, SQSH_TYPE)
                       if attached_byproduct(client, target, doc, w)[0] is None]
            if missing:
                raise EnvbuildError(f"refusing to publish {tag}: {name}@{digest[:19]}... lacks what its provenance "
                                    f"lists ({', '.join(missing)}).", exit_code=1)
            say(f"{target.platform} {digest}: {why}")
    index_digest, images = merge(registry, name, tag, refs, on_event=say, vouch=lambda image, what: None)
    if signing.keyless:
        cosign("sign", "--yes", f"{image_repo}@{index_digest}")
    return index_digest, images




# ---------------------------------------------------------------- the compiled-extension cache of a job


def ext_cache_check(file: Path) -> None:
    """--ext-cache FILE and FILE.key, before anything runs: each absent or a regular file envbuild
    wrote (exit 2 otherwise): the job replaces both at its end, and never a file of the user's."""
    extcache.owned(file, "--ext-cache: ")
    extcache.check_key_file(file)


def ext_cache_load(m: Matrix, job: dict, file: Path, base_image: Optional[str], say: Callable[[str], None]) -> None:
    """An earlier run's compiled wheels into this machine's build cache. A file `ext-cache save`
    wrote that load refuses (a cut-short copy) is kept, and this run's save replaces it; any other
    file is refused (exit 2) and never removed."""
    if extcache.owned(file, "--ext-cache: ") is None:
        return
    try:
        done = extcache.load(file, base_image or extcache.copy_image(m, job["stack"]))
        say(f"loaded {done.moved} of {len(done.wheels)} compiled wheel(s) from {file}")
    except EnvbuildError as e:
        say(f"warning: {file} was refused ({e.message}); compiling instead")


def ext_cache_save(m: Matrix, job: dict, file: Path, out: Path, base_image: Optional[str],
                   say: Callable[[str], None]) -> None:
    """This run's compiled wheels into `file` (replacing only a file `ext-cache save` wrote: the
    restored file's other wheels are not kept), their cache key into FILE.key (likewise)."""
    dirs = [d for d in sorted((out / "build").glob("*"))
            if any((d / "envbuild" / name).is_file() for name in (extcache.EXTENSION_SPEC, extcache.DEEPSPEED_RECORD))]
    if not dirs:
        return
    ext_cache_check(file)
    done = extcache.save(file, base_image or extcache.copy_image(m, job["stack"]), extcache.keys_of(dirs))
    if done.wheels:
        key = extcache.write_key(file, done.wheels)
        say(f"saved {len(done.wheels)} wheel(s) into {file} (cache key {key})")
