"""Render a build plan into a build directory: Dockerfile, Singularity definitions,
manifest.json and every file they copy in.

The plan (:mod:`envbuild.plan`) holds every derived fact; each output format is a Jinja
layout in ``templates/`` that places the plan's blocks (each renders itself, with the
format as an argument) between headers and comments. Output is deterministic and written
by :mod:`envbuild.render.output`, which never touches a file envbuild did not write.

Examples
--------
>>> from envbuild.knowledge.matrix import load_matrix
>>> from envbuild.resolve.resolver import Request, resolve
>>> files = render_files(resolve(load_matrix(), Request(gpu="h20")))
>>> [name for name in sorted(files) if "/" not in name]
['.dockerignore', 'Dockerfile', 'Singularity.def', 'Singularity.standalone.def', 'manifest.json']
"""

from __future__ import annotations

import hashlib
import json
import shlex

import jinja2

from envbuild import __version__
from envbuild.base.resources import templates_dir
from envbuild.image import paths
from envbuild.plan import DOCKERIGNORE, MANIFEST_NAME, BuildPlan, Environment, stack_plan
from envbuild.render.output import write_build_dir  # noqa: F401  (re-exported: writing lives in output.py)
from envbuild.resolve.resolver import Resolution


def environment() -> jinja2.Environment:
    """The Jinja environment of every template: the layouts and the CI workflows."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = shlex.quote
    env.filters["dq"] = lambda v: json.dumps(str(v))
    env.globals["env"] = lambda variables: Environment(tuple(variables))
    env.globals["paths"] = paths
    env.globals["section"] = lambda name, lines: "\n".join([f"%{name}", *(f"    {line}" for line in lines)])
    return env


def render(plan: BuildPlan) -> dict[str, bytes]:
    """All files of the build directory of any plan, path -> bytes. Pure and deterministic."""
    env = environment()
    files = {name: env.get_template(layout).render(plan=plan, version=__version__).encode()
             for name, layout in plan.layouts}
    files[".dockerignore"] = DOCKERIGNORE.encode()
    for build_path, source in sorted(plan.build_files.items()):
        files[build_path] = source.read_bytes()
    for build_path, text in sorted(plan.generated_files.items()):
        files[build_path] = text.encode()
    # The manifest records a digest of every other file: a re-render that gives other files (another
    # envbuild, edited templates) is told apart from one that gives the same (`envbuild rebuild`).
    manifest = {**plan.manifest, "render": {"sha256": render_digest(files)}}
    files[MANIFEST_NAME] = (json.dumps(manifest, indent=2, sort_keys=False, ensure_ascii=False) + "\n").encode()
    return files


def render_digest(files: dict[str, bytes]) -> str:
    """One sha256 over a build directory's files but manifest.json (path and content of each)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        if name != MANIFEST_NAME:
            digest.update(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    return digest.hexdigest()


def render_files(r: Resolution) -> dict[str, bytes]:
    """The build directory of the stack image `r` resolves to."""
    return render(stack_plan(r))
