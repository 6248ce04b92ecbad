"""The plan of a publish job (`envbuild publish --job ID`), before and after it runs: which job
of the publish plan and which of its variants (`--variant`), the layer cache of each, what each
would pull or build (`--plan`: nothing is built), and after the run each variant's outcome in a
line and the `publish --manifest` commands that come next. :mod:`envbuild.supply.release` runs
the job."""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import requests

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.files import read_bytes
from envbuild.base.grammar import redact
from envbuild.base.resources import matrices_dir
from envbuild.base.untrusted import loads_json
from envbuild.builds.build import LayerCache
from envbuild.knowledge.matrix import Matrix
from envbuild.oci.artifacts import Registry
from envbuild.oci.registry import api_host, check_image_repo
from envbuild.supply.ci import digest_name, publish_plan
from envbuild.supply.jobcache import ext_cache_wheels
from envbuild.supply.publish import per_platform_tag


@dataclass
class Outcome:
    """What one variant of a job came to: published (its digest) or the step it failed at and why,
    with what each step took; the job's report.json holds one per variant."""

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


def repository(image_repo: str) -> str:
    """The repository path inside its registry: 'ghcr.io/acme/envbuild' -> 'acme/envbuild'.

    >>> repository("127.0.0.1:5000/envbuild")
    'envbuild'
    """
    host = api_host(image_repo)
    return image_repo[len(host) + 1:]


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


def layer_cache(cache_repo: Optional[str], image_repo: str, variant: dict) -> Optional[LayerCache]:
    """A variant's layer cache: its builder stage under `cache_repo`, and its published
    per-platform image, which carries its own stage's cache inline."""
    if not cache_repo:
        return None
    tag = per_platform_tag(variant["tag"], variant["platform"])
    return LayerCache(builder=f"{cache_repo}:{tag}-builder", final=f"{image_repo}:{tag}")


def cache_repo_from(value: Optional[str], registry: str) -> Optional[str]:
    """--layer-cache: a repository (checked by the reference grammar: it reaches the build's
    command line), 'off', or REGISTRY/envbuild-cache by default."""
    if value == "off":
        return None
    repo = value or f"{registry}/envbuild-cache"
    check_image_repo(repo, "--layer-cache")
    return repo


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


def plan(m: Matrix, job: dict, variants: list[dict], registry: str, image_repo: str, cache_repo: Optional[str],
         ext_cache: Optional[Path], out: Path, ds_key: Callable[[dict], Optional[str]] = lambda _: None) -> list[str]:
    """What `publish --job` would do, per variant, without building anything: which layer-cache
    images the registry already holds (pulled, not built) and which stages will be built, the
    compiled extensions an --ext-cache file holds, and how long the last run's build took."""
    images = {v["variant"]: f"{image_repo}:{per_platform_tag(v['tag'], v['platform'])}" for v in variants}
    held = _held_refs(registry, [*images.values(), *(c for v in variants for c in dataclasses.astuple(
        layer_cache(cache_repo, image_repo, v) or LayerCache("", "")))])
    last = _last_build_seconds(out)
    wheels = ext_cache_wheels(ext_cache) if ext_cache else None
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
