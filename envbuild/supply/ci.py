"""Generate the GitHub Actions workflow that builds, smoke-tests and publishes the matrix."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import check_owned, write_owned
from envbuild.base.grammar import shown
from envbuild.knowledge.matrix import PUBLISH, Matrix, load_publish
from envbuild.oci.registry import bad_port, valid_repository
from envbuild.render.builddir import environment
from envbuild.resolve.resolver import Request, resolve


def real_build_stack(m: Matrix):
    """The stack CI builds, smoke-tests and pushes for real on a GPU-less runner: the one
    whose CUDA toolchain comes from PyPI on plain Debian (no NVIDIA base image to pull).
    A matrix test keeps it the newest torch."""
    for s in m.stacks:
        if m.bases.toolchains[s.toolchain].install and s.os.startswith("debian"):
            return s
    raise EnvbuildError(f"the matrix in {m.directory} has no PyPI-toolchain stack on Debian for CI to build.")


def publish_jobs(m: Matrix, gpus: list[str], runners: dict[str, str] | None = None,
                 fabrics: dict[str, list[str]] | None = None,
                 extensions: dict[str, list[str]] | None = None,
                 extension_runners: dict[str, str] | None = None) -> list[dict]:
    """Every (stack, GPU, fabric, CUDA extension) the rules allow, in matrix order, with the
    image's CPU architecture, its readable tag and the runner that builds it natively: each GPU
    with the default fabric, the GPUs `fabrics` names (fabric -> GPUs) with that fabric too, and
    the GPUs `extensions` names (extension -> GPUs) with that extension compiled in, on the x86_64
    runner `extension_runners` names for it, if any.
    `variant` (GPU:fabric:extension) is what the build loop of the workflow reads."""
    runners = runners or DEFAULT_RUNNERS
    extension_runners = extension_runners or {}
    wanted = ([(g, None, ()) for g in gpus] + [(g, f, ()) for f, names in (fabrics or {}).items() for g in names]
              + [(g, None, (e,)) for e, names in (extensions or {}).items() for g in names])
    jobs = []
    for s in m.stacks:
        for g, f, ext in wanted:
            try:
                r = resolve(m, Request(gpu=g, stack=s.id, fabric=f, extensions=ext))
            except EnvbuildError:
                continue
            runner = extension_runners.get(ext[0], runners[r.arch]) if ext and r.arch == "x86_64" else runners[r.arch]
            jobs.append({"stack": s.id, "gpu": r.gpu.name, "fabric": r.fabric.name, "arch": r.arch,
                         "platform": r.platform, "tag": r.tag, "runner": runner,
                         "extensions": ",".join(ext), "variant": f"{r.gpu.name}:{r.fabric.name}:{','.join(ext)}"})
    return jobs


CI_PYTHON = "3.12"  # the Python the workflows run envbuild with (any the package supports)
DEFAULT_RUNNERS = {"x86_64": "ubuntu-latest", "aarch64": "ubuntu-24.04-arm"}


def digest_name(job: dict) -> str:
    """The file (and artifact suffix) a build job leaves its pushed digest in."""
    return f"{job['tag']}-{job['platform'].split('/')[1]}"


def merge_jobs(m: Matrix, jobs: list[dict], multiarch: dict[str, str]) -> list[dict]:
    """One manifest list per published tag: each image under its own tag, and for a GPU in
    `multiarch` (x86 GPU -> its Grace sibling, e.g. h100 -> gh200) the sibling's arm64 image of the
    same stack joins the x86 GPU's tag, so one tag serves both nodes. The sibling must have the
    same compute capability and the same baked GPU defaults, or the tag would not mean one thing."""
    for x86, grace in multiarch.items():
        a, b = m.gpu(x86), m.gpu(grace)
        if a.cc != b.cc or [e.model_dump() for e in a.env] != [e.model_dump() for e in b.env]:
            raise EnvbuildError(f"publish.yaml multiarch {x86}: {grace}: their compute capabilities ({a.cc}, {b.cc}) "
                                f"or baked GPU defaults differ, so one tag cannot serve both.")
    by_pair = {(j["stack"], j["gpu"], j["fabric"], j.get("extensions", "")): j for j in jobs}
    merges = []
    for j in jobs:
        sources = [j]
        sibling = by_pair.get((j["stack"], multiarch.get(j["gpu"], ""), j["fabric"], j.get("extensions", "")))
        if sibling and sibling["arch"] != j["arch"]:
            sources.append(sibling)
        merges.append({"tag": j["tag"], "stack": j["stack"], "gpu": j["gpu"],
                       "platforms": " ".join(x["platform"] for x in sources),
                       "digests": " ".join(digest_name(x) for x in sources)})
    return merges


def stack_jobs(jobs: list[dict]) -> list[dict]:
    """One CI job per (stack, CPU architecture): its GPU variants in sequence on one runner, so
    the stack's heavy layers (the OS packages, torch and its CUDA wheels) are built once and
    reused from the runner's build cache, not rebuilt by one job per GPU. A CUDA extension's
    variants get a job of their own per stack: a compile of hours (flash-attn) then neither
    delays the stack's other images nor takes them down with it at the job's time limit.
    `id` names the job's artifacts, unique per job."""
    grouped: dict[tuple[str, str, str], dict] = {}
    for j in jobs:
        key = (j["stack"], j["platform"], j.get("extensions", ""))
        if key not in grouped:
            suffix = f"-{key[2].replace(',', '-')}" if key[2] else ""
            grouped[key] = {"id": f"{j['stack']}-{j['platform'].split('/')[1]}{suffix}", "stack": j["stack"],
                            "platform": j["platform"], "runner": j["runner"], "extensions": key[2], "gpus": []}
        grouped[key]["gpus"].append(j["variant"])
    out = list(grouped.values())
    for g in out:
        g["gpus"] = " ".join(g["gpus"])
    return out


def publish_plan(m: Matrix):
    """publish.yaml, checked against the matrix, and what it publishes: (config, image jobs, CI jobs,
    manifest jobs). The workflow and `envbuild publish` read this one plan."""
    cfg = load_publish(m.directory)
    if not cfg.gpus or not cfg.registry:
        raise EnvbuildError(f"{m.directory / PUBLISH} must name the `gpus` to publish and the `registry` to push to "
                            f"(e.g. registry: \"ghcr.io/$OWNER\", gpus: [h100, h20]); `envbuild ci` has nothing to "
                            f"generate without them.")
    check_publish_strings(cfg, m.directory / PUBLISH)
    gpus, multiarch, fabrics = cfg.gpus, cfg.multiarch, cfg.fabrics
    runners = {**DEFAULT_RUNNERS, **cfg.runners}
    for g in [*gpus, *multiarch, *multiarch.values(), *(g for names in fabrics.values() for g in names),
              *(g for names in cfg.extensions.values() for g in names)]:
        m.gpu(g)
    for f in fabrics:
        m.fabric(f)
    for e in cfg.extensions:
        m.extension(e)
    for e in cfg.extension_runners:
        if e not in cfg.extensions:
            raise EnvbuildError(f"{m.directory / PUBLISH} extension_runners names {e}, which `extensions` does not "
                                f"publish ({', '.join(cfg.extensions) or 'none'}).")
    jobs = publish_jobs(m, gpus, runners, fabrics, cfg.extensions, cfg.extension_runners)
    return cfg, jobs, stack_jobs(jobs), merge_jobs(m, jobs, multiarch)


OWNER = "$OWNER"  # in publish.yaml's registry: the GitHub owner, filled in (lower-cased) by the workflow
RUNNER_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")  # a GitHub-hosted or self-hosted runner label


def check_registry(registry: str, image_repo: str, where) -> None:
    """publish.yaml's `registry` (HOST[:PORT][/NAMESPACE], `$OWNER` standing for a namespace
    component) and `image_repo` by the OCI name grammar: nothing else reaches the workflow."""
    probe = registry.replace(OWNER, "owner")
    host = probe.split("/", 1)[0]
    if "$" in probe or bad_port(host) or not valid_repository(f"{probe.lower()}/envbuild"):
        nearest = re.sub(r"[^a-z0-9./:-]+", "-", registry.replace(OWNER, "\0").lower()).replace("\0", OWNER)
        raise EnvbuildError(f"{where}: field `registry` {shown(registry)} is not a registry: expected "
                            f"HOST[:PORT][/NAMESPACE] of letters, digits, '.', '_' and '-' ({OWNER}, filled in by CI, "
                            f"may stand for a namespace), such as ghcr.io/{OWNER}; nearest: {shown(nearest.strip('-'))}.")
    if not valid_repository(f"{probe.lower()}/{image_repo}"):
        raise EnvbuildError(f"{where}: field `image_repo` {shown(image_repo)} is not a repository name: lower-case "
                            f"letters, digits and '.', '_', '-' separated by '/', such as envbuild.")


def check_publish_strings(cfg, where) -> None:
    """Every string of publish.yaml that the workflow carries, by its grammar (exit 2 naming the field)."""
    if cfg.registry:
        check_registry(cfg.registry, cfg.image_repo, where)
    for field, labels in (("runners", cfg.runners), ("extension_runners", cfg.extension_runners)):
        for key, label in labels.items():
            if not RUNNER_LABEL.match(label):
                nearest = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-._")[:100] or DEFAULT_RUNNERS["x86_64"]
                raise EnvbuildError(f"{where}: field `{field}.{key}` {shown(label)} is not a runner label: letters, "
                                    f"digits, '.', '_' and '-', at most 100, such as ubuntu-latest; nearest: {nearest}.")


def yaml_scalar(value: str) -> str:
    """`value` as one double-quoted YAML scalar on one line, read back as exactly `value` in a
    flow mapping or as a block value (the workflow's matrix rows and `env:` values).

    >>> print(yaml_scalar("ubuntu-latest"), yaml_scalar('a"b: {c}'))
    "ubuntu-latest" "a\\"b: {c}"
    """
    return yaml.safe_dump(value, default_style='"', width=1 << 30, allow_unicode=False).removesuffix("\n")


def render_workflow(m: Matrix) -> str:
    cfg, jobs, ci_jobs, merges = publish_plan(m)
    return environment().get_template("ci/publish.yml.j2").render(
        images=len(jobs), jobs=ci_jobs, merges=merges, registry=cfg.registry,
        image_repo=cfg.image_repo, python=CI_PYTHON, quote=yaml_scalar)


def workflows_for(m: Matrix, output: str) -> dict[Path, str]:
    """The publish workflow at `output` and the refresh workflow beside it (path -> text)."""
    name = Path(output).name
    if not name or name in (".", "..") or output.endswith("/"):
        raise EnvbuildError(f"-o/--output '{output}' names no file; give the workflow file to write, such as "
                            f".github/workflows/publish.yml.")
    if name == REFRESH_WORKFLOW.name:
        raise EnvbuildError(f"-o/--output {output} is the name of the refresh workflow `envbuild ci` writes beside "
                            f"the publish workflow; choose another name, such as publish.yml.")
    return {Path(output): render_workflow(m), Path(output).parent / REFRESH_WORKFLOW.name: render_refresh_workflow()}


# The first line of each workflow `envbuild ci` writes. The refresh workflow's named the function
# that wrote it (envbuild.ci.render_refresh_workflow) until the modules moved into packages: such a
# file is still envbuild's own.
GENERATED_MARKS = (b"# Generated by `envbuild ci`", b"# Generated by envbuild.ci.")


def is_generated_workflow(data: bytes) -> bool:
    """A workflow `envbuild ci` wrote (its first line says so): the only kind it replaces.

    >>> is_generated_workflow(b"# Generated by `envbuild ci` from matrices/publish.yaml"), is_generated_workflow(b"on: push")
    (True, False)
    >>> is_generated_workflow(b"# Generated by envbuild.ci.render_refresh_workflow from templates/ci/x.j2")
    True
    """
    return data.startswith(GENERATED_MARKS)


def write_workflows(workflows: dict[Path, str]) -> list[Path]:
    """Write the workflows, each only over a file `envbuild ci` wrote; the paths that changed."""
    refusal = "Move it away, or choose another file with -o (matrix-refresh.yml is written beside it)."
    for path in workflows:  # every file checked before any is written
        try:
            check_owned(path, is_generated_workflow, refusal)
        except OSError as e:
            raise EnvbuildError(f"{path} cannot be read: {e.strerror or e}; choose another file with -o.") from None
    return [path for path, text in workflows.items() if write_owned(path, text.encode(), is_generated_workflow, refusal)]


REFRESH_WORKFLOW = Path(".github") / "workflows" / "matrix-refresh.yml"


def render_refresh_workflow(runner: str = "ubuntu-latest", cron: str = "17 5 * * 1",
                            branch: str = "matrix-refresh/pypi") -> str:
    """The weekly workflow that runs `envbuild matrix refresh --write`, the fast tests, and
    opens a pull request with the diff."""
    return environment().get_template("ci/matrix-refresh.yml.j2").render(
        runner=runner, cron=cron, branch=branch, python=CI_PYTHON, gha=lambda expr: "${{ " + expr + " }}")
