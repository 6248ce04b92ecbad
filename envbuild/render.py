"""Render a build plan into a build directory: Dockerfile, Singularity definitions,
manifest.json and every file they copy in.

The plan (:mod:`envbuild.plan`) holds every derived fact; each output format is a Jinja
layout in ``templates/`` that places the plan's blocks (each renders itself, with the
format as an argument) between headers and comments. Output is deterministic and written
to a temporary directory that is moved into place only when complete.

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
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import jinja2

from . import __version__
from .errors import EnvbuildError
from .image import paths
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
    ctx = {"plan": plan, "resolution": r, "version": __version__}
    files = {name: env.get_template(layout).render(**ctx).encode() for name, layout in LAYOUTS.items()}
    files[".dockerignore"] = DOCKERIGNORE
    files["manifest.json"] = (json.dumps(plan.manifest, indent=2, sort_keys=False, ensure_ascii=False) + "\n").encode()
    src = templates_dir()
    for build_path, template_path in sorted(plan.build_files.items()):
        files[build_path] = (src / template_path).read_bytes()
    return files


def _is_build_dir(path: Path) -> bool:
    """Only a directory envbuild rendered may be replaced by a re-render."""
    try:
        return "envbuild" in json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def write_build_dir(files: dict[str, bytes], out: Path) -> Path:
    """Write all files to `out` atomically: a sibling temp dir, then one rename.

    An existing `out` is replaced only when the new tree is complete, so a failure never
    leaves a half-written directory behind.
    """
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if out.exists() and not out.is_dir():
            raise EnvbuildError(f"output path {out} exists and is not a directory; choose another -o/--output.")
        if out.is_dir() and any(out.iterdir()) and not _is_build_dir(out):
            raise EnvbuildError(f"output path {out} is a non-empty directory that envbuild did not write (no "
                                f"envbuild manifest.json in it); refusing to replace it. Choose an empty or new "
                                f"directory with -o/--output.")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except EnvbuildError:
        raise
    except OSError as e:
        raise EnvbuildError(f"output path {out} cannot be written: {e.strerror} ({e.filename or parent}); "
                            f"choose a writable directory with -o/--output.") from None
    try:
        for rel, data in sorted(files.items()):
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            p.chmod(0o755 if data.startswith(b"#!") else 0o644)  # scripts run directly are executable
        tmp.chmod(0o755)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=parent))
            os.replace(out, old / "x")
        os.replace(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EnvbuildError(f"output path {out} cannot be written: {e.strerror}; "
                            f"choose a writable directory with -o/--output.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
