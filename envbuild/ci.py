"""Generate the GitHub Actions workflow that builds, smoke-tests and publishes the matrix."""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import EnvbuildError
from .matrix import Matrix
from .render import _environment
from .resolve import Request, resolve


def real_build_stack(m: Matrix):
    """The stack CI builds, smoke-tests and pushes for real on a GPU-less runner: the one
    whose CUDA toolchain comes from PyPI on plain Debian (no NVIDIA base image to pull).
    A matrix test keeps it the newest torch."""
    for s in m.stacks:
        if m.bases.toolchains[s.toolchain].install and s.os.startswith("debian"):
            return s
    raise EnvbuildError(f"the matrix in {m.directory} has no PyPI-toolchain stack on Debian for CI to build.")


def publish_jobs(m: Matrix, gpus: list[str]) -> list[dict]:
    """Every (stack, GPU) pair the rules allow, in matrix order."""
    jobs = []
    for s in m.stacks:
        for g in gpus:
            try:
                resolve(m, Request(gpu=g, stack=s.id))
            except EnvbuildError:
                continue
            jobs.append({"stack": s.id, "gpu": m.gpu(g).name})
    return jobs


def render_workflow(m: Matrix) -> str:
    path = m.directory / "publish.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
        gpus, registry = cfg["gpus"], cfg["registry"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise EnvbuildError(f"{path} must hold `gpus`, `registry`, `image_repo` and `runner` ({e}).") from None
    for g in gpus:
        m.gpu(g)
    return _environment().get_template("ci/publish.yml.j2").render(
        jobs=publish_jobs(m, gpus), registry=registry, image_repo=cfg.get("image_repo", "envbuild"),
        runner=cfg.get("runner", "ubuntu-latest"))


def write_workflow(m: Matrix, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_workflow(m))
    return out


REFRESH_WORKFLOW = Path(".github") / "workflows" / "matrix-refresh.yml"


def render_refresh_workflow(runner: str = "ubuntu-latest", cron: str = "17 5 * * 1",
                            branch: str = "matrix-refresh/pypi") -> str:
    """The weekly workflow that runs `envbuild matrix refresh --write`, the fast tests, and
    opens a pull request with the diff."""
    return _environment().get_template("ci/matrix-refresh.yml.j2").render(
        runner=runner, cron=cron, branch=branch, python="3.11", gha=lambda expr: "${{ " + expr + " }}")
