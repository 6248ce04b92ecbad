"""Render a build plan into a build directory: Dockerfile, Singularity definitions,
manifest.json and every file they copy in.

The plan (:mod:`envbuild.plan`) holds every derived fact; each output format is a Jinja
layout in ``templates/`` that places the plan's blocks (each renders itself, with the
format as an argument) between headers and comments. Output is deterministic and written
by :mod:`envbuild.output`, which never touches a file envbuild did not write.

Examples
--------
>>> from envbuild.matrix import load_matrix
>>> from envbuild.resolve import Request, resolve
>>> files = render_files(resolve(load_matrix(), Request(gpu="h20")))
>>> [name for name in sorted(files) if "/" not in name]
['.dockerignore', 'Dockerfile', 'Singularity.def', 'Singularity.standalone.def', 'manifest.json']
"""

from __future__ import annotations

import json
import shlex

import jinja2

from . import __version__
from .image import paths
from .output import write_build_dir  # noqa: F401  (re-exported: writing lives in output.py)
from . import running
from .plan import Environment, build_plan
from .resolve import Resolution
from .resources import templates_dir

# Output formats: build-directory file -> its layout template.
LAYOUTS = {
    "Dockerfile": "docker/Dockerfile.j2",
    "Singularity.def": "singularity/Singularity.def.j2",
    "Singularity.standalone.def": "singularity/Singularity.standalone.def.j2",
}
DOCKERIGNORE = b"build.log\n*.sif\n"


def _environment():
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


def render_files(r: Resolution) -> dict[str, bytes]:
    """All files of the build directory, path -> bytes. Pure and deterministic."""
    plan = build_plan(r)
    env = _environment()
    ctx = {"plan": plan, "resolution": r, "version": __version__,
           "local_only": running.local_only(r.request.image_repo)}
    files = {name: env.get_template(layout).render(**ctx).encode() for name, layout in LAYOUTS.items()}
    files[".dockerignore"] = DOCKERIGNORE
    files["manifest.json"] = (json.dumps(plan.manifest, indent=2, sort_keys=False, ensure_ascii=False) + "\n").encode()
    for build_path, source in sorted(plan.build_files.items()):
        files[build_path] = source.read_bytes()
    for build_path, text in sorted(plan.generated_files.items()):
        files[build_path] = text.encode()
    return files
