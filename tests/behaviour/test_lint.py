"""Every rendered file passes its linter, across the whole matrix (every stack x every
GPU it allows), not one example: hadolint, shellcheck, spython. hadolint reads one Dockerfile
of each shape here, in the fast suite, and every one in CI's whole run
(tests/behaviour/test_lint_whole.py, marked `whole`)."""

import re
import shutil
import subprocess

import pytest
from spython.main.parse.parsers import SingularityParser

from conftest import ROOT
from envbuild.base.errors import EnvbuildError
from envbuild.render.builddir import render_files, write_build_dir
from envbuild.resolve.resolver import Request, resolve

SHELL_SECTIONS = ("post", "environment", "runscript", "test")


def _combos(matrix):
    out = []
    for s in matrix.stacks:
        for g in matrix.gpus:
            try:
                out.append(resolve(matrix, Request(gpu=g.name, stack=s.id)))
            except EnvbuildError:
                continue
    return out


@pytest.fixture(scope="module")
def rendered(matrix, tmp_path_factory):
    base = tmp_path_factory.mktemp("all")
    combos = _combos(matrix)
    # Also the option paths: all ops, a kept toolchain, CPU-only ops on the PyPI stack.
    combos += [resolve(matrix, Request(gpu="h100", ds_ops="all")),
               resolve(matrix, Request(gpu="a100", torch="2.4", ds_ops="all", keep_toolchain=True)),
               resolve(matrix, Request(gpu="h20", python="3.11", ds_ops="cpu_adam"))]
    dirs = [write_build_dir(render_files(r), base / f"{i:03d}-{r.tag}") for i, r in enumerate(combos)]
    return dirs


def test_the_matrix_is_broad(rendered, matrix):
    assert len(rendered) >= 100
    stacks = {d.name.split("-", 1)[1].rsplit("-", 1)[0] for d in rendered}
    assert len(stacks) >= len(matrix.stacks)


def _tool(name):
    path = shutil.which(name)
    assert path, f"{name} is not installed: pip install '.[test]'"
    return path


_INSTRUCTION = re.compile(r"^([A-Z]+)\s")
_STRUCTURE = re.compile(r"--[\w-]+|\b[A-Z_][A-Z0-9_]*=|/[\w./-]+\.(?:sh|py)\b|\bAS \w+")
_WHOLE = {"FROM", "SHELL", "CMD", "ENTRYPOINT", "WORKDIR", "USER", "HEALTHCHECK", "EXPOSE", "VOLUME", "STOPSIGNAL"}


def shape(dockerfile: str) -> tuple:
    r"""A Dockerfile without the values no hadolint rule here reads: every line's instruction,
    flags, variable names, step scripts and stage names in order, and the whole of FROM, SHELL,
    CMD, ENTRYPOINT, WORKDIR, USER... lines (their form is what rules check: a tagged base, JSON
    arguments), numbers aside. Left out: versions, arches, package names, tags, label values;
    every apt and pip call is in the step scripts, which shellcheck reads.

    >>> one = "FROM b:1 AS builder\nRUN --mount=type=secret,id=a X=1 \\\n    bash /s/os.sh g++"
    >>> shape(one) == shape(one.replace("b:1", "b:2").replace("X=1", "X=9").replace("g++", "gcc"))
    True
    >>> shape("ENV A=1") == shape("ENV B=1"), shape("FROM b:1") == shape("FROM b:latest")
    (False, False)
    """
    out = []
    for line in dockerfile.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word = m.group(1) if (m := _INSTRUCTION.match(line)) else "+"
        out.append((word, re.sub(r"\d+", "N", line) if word in _WHOLE else tuple(_STRUCTURE.findall(line))))
    return tuple(out)


def one_of_each_shape(rendered: list) -> list:
    return list({shape((d / "Dockerfile").read_text()): d for d in reversed(rendered)}.values())


def _hadolint(dirs) -> None:
    files = [str(d / "Dockerfile") for d in dirs]
    r = subprocess.run([_tool("hadolint"), "--no-color", "--failure-threshold", "style", *files],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_hadolint_one_dockerfile_of_each_shape(rendered):
    """The renders of one shape differ only in values no hadolint rule reads (every rule here
    reads instructions, flags and variable names; the step scripts hold every apt and pip call)."""
    shapes = one_of_each_shape(rendered)
    assert 15 <= len(shapes) < len(rendered) / 4, len(shapes)  # the option paths each have their own
    _hadolint(shapes)


def test_hadolint_really_lints(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && apt-get install curl\n")
    r = subprocess.run([_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "DL3006" in r.stdout


def _shell_sections(def_text):
    """The shell bodies of a Singularity definition, one per section per stage."""
    out = []
    for m in re.finditer(r"^%(\w+)[^\n]*\n(.*?)(?=^%\w|^Bootstrap:|\Z)", def_text, re.S | re.M):
        if m.group(1) in SHELL_SECTIONS:
            out.append((m.group(1), m.group(2)))
    return out


def test_shellcheck_scripts_and_singularity_sections(rendered, tmp_path):
    scripts = sorted((ROOT / "templates" / "files").rglob("*.sh"))
    sections = {}
    for d in rendered:
        for name in ("Singularity.def", "Singularity.standalone.def"):
            for sec, body in _shell_sections((d / name).read_text()):
                sections.setdefault(body, f"{d.name}/{name}%{sec}")
    assert len(sections) > 20
    for i, (body, origin) in enumerate(sorted(sections.items(), key=lambda kv: kv[1])):
        f = tmp_path / f"{i:04d}.sh"
        f.write_text(f"#!/bin/sh\n# {origin}\n{body}")
        scripts.append(f)
    r = subprocess.run([_tool("shellcheck"), "-x", "--severity=style", *map(str, scripts)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


def test_spython_parses_every_definition(rendered):
    for d in rendered:
        plain = SingularityParser(str(d / "Singularity.def")).recipe
        standalone = SingularityParser(str(d / "Singularity.standalone.def")).recipe
        assert len(plain) == 1 and len(standalone) == 2, d
        (final,) = plain.values()
        assert final.fromHeader.startswith("envbuild:")
        assert any("NCCL_DEBUG" in line for line in final.environ)
        assert any(lb.startswith("io.envbuild.stack ") for lb in final.labels)
        builder, final2 = standalone.values()
        assert any(re.search(r"deepspeed\.sh (deepspeed==|\S+/lock/deepspeed\.txt )", line) for line in builder.install)
        assert "manifest.json /opt/envbuild/manifest.json" in final2.files
        assert "/opt/venv /opt/venv" in final2.layer_files["builder"]
