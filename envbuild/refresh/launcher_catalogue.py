"""Derive matrices/catalogues/slurm.yaml, enroot.yaml and pyxis.yaml: what the launchers can print.

The messages are read from each project's own sources at the newest patch tag of each release
line people run (LINES below): Slurm's srun, slurmstepd and its mpi/pmix and mpi/pmi2 plugins
(every `error(...)`, `fatal(...)`, `info(...)`, `verbose(...)` and pmix's `PMIXP_ERROR(...)`
family), pyxis's spank plugin (`slurm_error`, `slurm_info`, `slurm_spank_log`), and enroot's
shell scripts and hooks (`common::err "..."`, `common::log LEVEL "..."`: each `${var}`, `$1` or
`$(...)` becomes a `%s`) and its C helpers (`err`, `errx`, `warn`, `warnx`). The C format strings
are read by the rule NCCL's catalogue reads its own with (nccl_catalogue.format_calls), and the
catalogues are collated and written by its layout: one wording an entry, with its level, the
call that prints it, the file and line in the newest release that has it, and the releases in
which that exact wording exists; each release's tag and commit are recorded. Same sources, same
bytes.

The sources are a git directory holding the project's tags (a clone or mirror of its GitHub
repository), or a directory of saved files laid out as `<tag>/<path>` with a `tags.txt` (one
`TAG COMMIT` a line): the offline tests read tests/fixtures/catalogue/<component> through it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from envbuild.base.errors import EnvbuildError
from envbuild.refresh import nccl_catalogue
from envbuild.refresh.nccl_catalogue import Sources, collate, comment, format_calls, layout

SLURM_CALL = re.compile(r"(?<![\w#.>])(error|fatal|info|verbose|PMIXP_ERROR|PMIXP_ERROR_STD|PMIXP_ERROR_NO|"
                        r"PMIXP_ABORT)\s*\(")
SLURM_LEVEL = {"error": "ERROR", "fatal": "FATAL", "info": "INFO", "verbose": "VERBOSE"}
PYXIS_CALL = re.compile(r"(?<![\w#.>])(slurm_error|slurm_info|slurm_spank_log)\s*\(")
PYXIS_LEVEL = {"slurm_error": "ERROR", "slurm_info": "INFO", "slurm_spank_log": "LOG"}
ENROOT_CALL = re.compile(r"(?<![\w#.>])(err|errx|warn|warnx)\s*\(")
SHELL_CALL = re.compile(r"(?<![\w:])common::(err|log)[ \t]+(?:(INFO|WARN|ERROR)[ \t]+)?(?=[\"'])")


def _c(call: re.Pattern, levels: dict[str, str], skip: dict[str, int]) -> Callable[[str, str], list[dict]]:
    def extract(source: str, path: str) -> list[dict]:
        return [{"level": levels.get(name, "ERROR"), "call": name, "text": text, "file": path, "line": line}
                for name, text, line in format_calls(source, call, skip)]
    return extract


def shell_string(source: str, pos: int) -> tuple[Optional[str], int]:
    """The printf format a quoted bash word starting at `pos` prints (each expansion a `%s`, a
    literal `%` doubled) and the position after it; None where the word is not closed."""
    quote, out, pos = source[pos], [], pos + 1
    while pos < len(source):
        char = source[pos]
        if char == quote:
            return "".join(out), pos + 1
        if quote == "'":
            out.append("%%" if char == "%" else char)
        elif char == "\\" and pos + 1 < len(source):
            pos += 1
            out.append(source[pos] if source[pos] in '$`"\\' else "\\" + source[pos])
            out[-1] = out[-1].replace("%", "%%")
        elif char == "$" and source.startswith(("$(", "${"), pos):
            pos = _closing(source, pos + 1) - 1
            out.append("%s")
        elif char == "$" and re.match(r"\$(?:[A-Za-z_]\w*|[0-9?#@*!$-])", source[pos:]):
            pos += re.match(r"\$(?:[A-Za-z_]\w*|[0-9?#@*!$-])", source[pos:]).end() - 1
            out.append("%s")
        elif char == "`":
            pos = source.find("`", pos + 1) if source.find("`", pos + 1) >= 0 else len(source)
            out.append("%s")
        else:
            out.append("%%" if char == "%" else char)
        pos += 1
    return None, pos


def _closing(source: str, pos: int) -> int:
    """The position after the bracket closing the one at `pos` (`(` or `{`), quotes inside skipped."""
    depth = 0
    while pos < len(source):
        char = source[pos]
        if char in "({":
            depth += 1
        elif char in ")}":
            depth -= 1
            if depth == 0:
                return pos + 1
        elif char in "\"'":
            pos = shell_string(source, pos)[1] - 1
        pos += 1
    return pos


def shell_extract(source: str, path: str) -> list[dict]:
    """Each `common::err "..."` (ERROR) and `common::log LEVEL "..."` message of one enroot script."""
    found, line_of = [], nccl_catalogue.line_finder(source)
    for call in SHELL_CALL.finditer(source):
        line_start = source.rfind("\n", 0, call.start()) + 1
        if source[line_start:call.start()].lstrip().startswith("#"):
            continue
        level = "ERROR" if call.group(1) == "err" else call.group(2)
        text, _ = shell_string(source, call.end())
        if level and text is not None and text.strip():
            found.append({"level": level, "call": f"common::{call.group(1)}", "text": text, "file": path,
                          "line": line_of(call.start())})
    return found


def _enroot_extract(source: str, path: str) -> list[dict]:
    if path.endswith(".c"):
        return _c(ENROOT_CALL, {"err": "ERROR", "errx": "ERROR", "warn": "WARN", "warnx": "WARN"},
                  {"err": 1, "errx": 1})(source, path)
    return shell_extract(source, path)


@dataclass(frozen=True)
class Component:
    """A launcher whose messages are catalogued: where its sources are and how they are read."""
    name: str
    title: str
    url: str
    tag: re.Pattern  # a release tag, fully; groups: major, minor, patch (and Slurm's package release)
    glob: str
    roots: tuple[str, ...]
    lines: tuple[str, ...]  # the release lines catalogued, oldest first: the newest patch tag of each
    wanted: Callable[[str], bool]  # a file under `roots` whose messages are read
    extract: Callable[[str, str], list[dict]]
    reads: str  # what is read, for the header


COMPONENTS = {c.name: c for c in (
    Component("slurm", "Slurm", "https://github.com/SchedMD/slurm", re.compile(r"slurm-(\d+)-(\d+)-(\d+)-(\d+)"),
              "slurm-*", ("src/srun", "src/slurmd/slurmstepd", "src/plugins/mpi/pmix", "src/plugins/mpi/pmi2",
                          "src/plugins/launch"),
              ("22.05", "23.02", "23.11", "24.05", "24.11"), lambda p: p.endswith((".c", ".h")),
              _c(SLURM_CALL, SLURM_LEVEL, {"PMIXP_ERROR_NO": 1}),
              "every error(), fatal(), info() and verbose() format string and pmix's PMIXP_ERROR*() under "
              "src/srun, src/slurmd/slurmstepd, src/plugins/mpi/pmix and src/plugins/mpi/pmi2 (and src/plugins/launch, "
              "where 22.05 kept srun's launch code)"),
    Component("enroot", "enroot", "https://github.com/NVIDIA/enroot", re.compile(r"v(\d+)\.(\d+)\.(\d+)"), "v*",
              ("enroot.in", "src", "conf/hooks", "bin"), ("3.4", "3.5", "4.0", "4.1"),
              lambda p: p.endswith((".sh", ".c", ".in")), _enroot_extract,
              "every `common::err` and `common::log LEVEL` message of enroot.in, src/*.sh and conf/hooks (an "
              "expansion is %s), and every err/errx/warn/warnx format string of bin/*.c"),
    Component("pyxis", "pyxis", "https://github.com/NVIDIA/pyxis", re.compile(r"v(\d+)\.(\d+)\.(\d+)"), "v*",
              (), ("0.19", "0.20", "0.21", "0.22", "0.23", "0.24"),
              lambda p: "/" not in p and p.endswith((".c", ".h")), _c(PYXIS_CALL, PYXIS_LEVEL, {}),
              "every slurm_error(), slurm_info() and slurm_spank_log() format string of its C files"),
)}


def header(component: Component) -> str:
    text = (f"What {component.title} can print, for the newest patch release of each release line "
            f"envbuild/refresh/launcher_catalogue.py names ({', '.join(component.lines)}): {component.reads}, read "
            f"from {component.url} at each release's tag (its commit under `releases`). `level` is what the call "
            f"prints at and `call` the call; `file` and `line` are where the newest release that has the wording "
            f"prints it; `releases` the releases in which that exact wording exists. Generated by `envbuild matrix "
            f"catalogue --{component.name}-source DIR` (see docs/doctor.md); do not edit. A release line with no tag "
            f"in the sources read is listed under `not_catalogued`.")
    return comment(text)


def open_sources(component: Component, path: Path) -> Sources:
    return nccl_catalogue.open_sources(path, component.tag, component.glob, component.roots, component.url)


def releases_of(component: Component, tags: list[str]) -> tuple[list[tuple[str, str]], list[dict]]:
    """(release, tag) of the newest patch tag of each of the component's lines, and the lines the tags lack."""
    newest: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for tag in tags:
        match = component.tag.fullmatch(tag)
        if not match:
            continue
        parts = [int(g) for g in match.groups()]
        width = 2 if component.name == "slurm" else 1  # Slurm writes its minor with two digits: 22.05
        line = f"{parts[0]}.{parts[1]:0{width}d}"
        rank = tuple(parts[2:])
        if line in component.lines and (line not in newest or rank > newest[line][0]):
            newest[line] = (rank, f"{line}.{parts[2]}", tag)
    found = [(newest[line][1], newest[line][2]) for line in component.lines if line in newest]
    missing = [{"release": line, "why": f"the sources read have no release tag of {component.title} {line}"}
               for line in component.lines if line not in newest]
    return found, missing


def messages_of(component: Component, sources: Sources, tag: str) -> dict[tuple[str, str, str], dict]:
    """Each (level, call, text) of one release, at its first place in file order."""
    found: dict[tuple[str, str, str], dict] = {}
    for path in sources.files(tag):
        if not component.wanted(path):
            continue
        for message in component.extract(sources.read(tag, path).decode("utf-8", "replace"), path):
            found.setdefault((message["level"], message["call"], message["text"]), message)
    return found


def derive(component: Component, sources: Sources, progress=lambda _: None) -> dict:
    """The catalogue's data: the newest patch release of each line (oldest first) the sources hold."""
    found, missing = releases_of(component, sources.tags())
    read, per_release = [], {}
    for release, tag in found:
        progress(f"{component.title} {tag}")
        read.append({"release": release, "tag": tag, "commit": sources.commit(tag)})
        per_release[release] = messages_of(component, sources, tag)
    messages = collate(per_release, [r["release"] for r in read], ("level", "call", "text"))
    return {"component": component.name, "source": component.url, "releases": read, "not_catalogued": missing,
            "messages": messages}


def render(component: Component, data: dict) -> str:
    """One message a line, so a refresh's diff shows the wordings that came or went."""
    return layout(header(component), data, ("source",), ("releases", "not_catalogued", "messages"))


def summary(component: Component, old: dict, new: dict) -> list[str]:
    """Per release, what came or went (as the NCCL catalogue's summary says it)."""
    return nccl_catalogue.summary(old, new, component.name, lambda m: (m["level"], m.get("call"), m["text"]))


def component(name: str) -> Component:
    if name not in COMPONENTS:
        raise EnvbuildError(f"no launcher catalogue named {name!r}; known: {', '.join(COMPONENTS)}.")
    return COMPONENTS[name]
