"""Derive matrices/catalogues/container-toolkit.yaml, libnvidia-container.yaml and apptainer.yaml: what
the NVIDIA container stack and Apptainer can print when they hand a container its GPUs.

The NVIDIA Container Toolkit (github.com/NVIDIA/nvidia-container-toolkit, Go: the runtime, the
OCI hook, nvidia-ctk and the CDI hooks under cmd/, internal/ and pkg/) is read at the newest patch
tag of each release line (LINES below): every literal message of `fmt.Errorf`, `errors.New`
(returned errors, which the runtime prints chained with `: `), the logger's `Errorf`, `Warningf`
and `Infof`, and the hook's `log.Panicln`/`log.Fatalf` family. A Go string is read as the compiler
reads it (escapes, raw strings, `+` joins); a `Println` call's further operands are each ` %v`.

libnvidia-container (github.com/NVIDIA/libnvidia-container, C: nvidia-container-cli and the
library under src/) is read at the commit each toolkit release pins in its submodule
third_party/libnvidia-container: the CLI's `warnx`/`warn`/`errx`/`err` (what
`nvidia-container-cli: ...` prints), the library's `error_set*` messages (what the CLI's
`initialization error: %s` and the like are filled with) and its debug log's `log_*` calls.
Its release lines are the toolkit's; for each, the newest patch tag whose pinned commit the
libnvidia-container sources read hold (a fork that keeps upstream's commits will do: the upstream
repository is too large to fetch here), so a line can be catalogued at an older patch than the
toolkit's, and says so through its `tag`.

Apptainer (github.com/apptainer/apptainer, Go) is read by the toolkit's Go reader at the newest patch
tag of each of its release lines (APPTAINER_LINES): its `sylog.Fatalf`/`Errorf`/`Warningf`/`Infof`
and the `fmt.Errorf`/`errors.New` it returns, in the packages of the run path (APPTAINER_ROOTS).

All three are collated and written by the launchers' rule (launcher_catalogue): one wording an entry with
its level, call, file, line and releases; each release's tag and commit. Same sources, same bytes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.refresh import launcher_catalogue, nccl_catalogue
from envbuild.refresh.launcher_catalogue import Component, _c
from envbuild.refresh.nccl_catalogue import GitSources, Sources

TOOLKIT_URL = "https://github.com/NVIDIA/nvidia-container-toolkit"
LIBNVC_URL = "https://github.com/NVIDIA/libnvidia-container"
SUBMODULE = "third_party/libnvidia-container"
LINES = ("1.14", "1.15", "1.16", "1.17", "1.18", "1.19", "1.20")
TAG = re.compile(r"v(\d+)\.(\d+)\.(\d+)")

GO_CALL = re.compile(r"(?<![\w])(fmt\.Errorf|errors\.New|[lL]ogger\.(?:Errorf|Warningf|Infof)|"
                     r"log\.(?:Panicln|Panicf|Fatalf|Fatalln|Fatal|Panic))\s*\(")
GO_LEVEL = {"fmt.Errorf": "ERROR", "errors.New": "ERROR", "Errorf": "ERROR", "Warningf": "WARN", "Infof": "INFO",
            "Panicln": "FATAL", "Panicf": "FATAL", "Fatalf": "FATAL", "Fatalln": "FATAL", "Fatal": "FATAL",
            "Panic": "FATAL"}
APPTAINER_URL = "https://github.com/apptainer/apptainer"
APPTAINER_LINES = ("1.1", "1.2", "1.3", "1.4", "1.5")
APPTAINER_CALL = re.compile(r"(?<![\w])(fmt\.Errorf|errors\.New|sylog\.(?:Fatalf|Errorf|Warningf|Infof))\s*\(")
# What an Apptainer job goes through: its commands (cmd/internal/cli: run/exec/shell and --nv/--rocm up to
# 1.1), the launcher and engines (internal/pkg/runtime: --nv/--nvccli binds from 1.2 on, mounts, overlay),
# nvliblist.conf and the GPU helpers (internal/pkg/util/gpu), images (SIF, squashfs, OCI), pulling them
# (internal/pkg/client, ociimage, cache), the starter, cgroups, fakeroot, instances and the security options.
APPTAINER_ROOTS = ("cmd/internal/cli", "internal/pkg/runtime", "internal/pkg/util", "internal/pkg/image",
                   "internal/pkg/client", "internal/pkg/ociimage", "internal/pkg/cache", "internal/pkg/cgroups",
                   "internal/pkg/fakeroot", "internal/pkg/instance", "internal/pkg/security", "internal/app/starter",
                   "pkg/image", "pkg/runtime", "pkg/ocibundle", "pkg/util", "pkg/network")
_GO_STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"|`([^`]*)`')

LIBNVC_CALL = re.compile(r"(?<![\w#.>])(warnx|warn|errx|err|error_setx|error_set|error_set_nvml|error_set_dl|"
                         r"error_set_elf|error_set_rpc|log_errf|log_err|log_warnf|log_warn|log_infof|log_info)\s*\(")
LIBNVC_LEVEL = {"log_warnf": "WARN", "log_warn": "WARN", "log_infof": "INFO", "log_info": "INFO"}
LIBNVC_SKIP = {"errx": 1, "err": 1, "error_setx": 1, "error_set": 1, "error_set_dl": 1, "error_set_elf": 1,
               "error_set_nvml": 3, "error_set_rpc": 2}


def go_string(source: str, pos: int) -> tuple[Optional[str], int]:
    """The value of the Go string expression at `pos` (literals joined with `+`) and the position
    after it; None where the argument is not a literal (a variable, a call)."""
    pieces = []
    while True:
        while pos < len(source) and source[pos] in " \t\r\n":
            pos += 1
        match = _GO_STRING.match(source, pos)
        if not match:
            return None, pos
        pieces.append(nccl_catalogue._unescape(match.group(1)) if match.group(1) is not None else match.group(2))
        pos = match.end()
        after = re.match(r"[ \t]*\+[ \t\r\n]*", source[pos:])
        if not after or not _GO_STRING.match(source, pos + after.end()):
            return "".join(pieces), pos
        pos += after.end()


def go_extract(source: str, path: str, calls: re.Pattern = GO_CALL) -> list[dict]:
    """Each literal message of one Go file's error, log and panic calls (`calls`: the toolkit's by
    default, Apptainer's sylog with APPTAINER_CALL; module docstring)."""
    found, line_of = [], nccl_catalogue.line_finder(source)
    for call in calls.finditer(source):
        line_start = source.rfind("\n", 0, call.start()) + 1
        if source[line_start:call.start()].lstrip().startswith("//"):
            continue
        text, pos = go_string(source, call.end())
        while pos < len(source) and source[pos] in " \t\r\n":
            pos += 1
        if text is None or not text.strip() or pos >= len(source) or source[pos] not in ",)":
            continue
        name = call.group(1)
        if name.endswith(("ln", "Fatal", "Panic")) and source[pos] == ",":
            text += " %v" * _operands(source, pos)  # Println: a blank between operands
        found.append({"level": GO_LEVEL.get(name) or GO_LEVEL[name.rsplit(".", 1)[-1]], "call": name, "text": text,
                      "file": path, "line": line_of(call.start())})
    return found


def _operands(source: str, pos: int) -> int:
    """How many further operands follow the comma at `pos`, up to the call's closing bracket."""
    count = 0
    while pos < len(source) and source[pos] == ",":
        end = nccl_catalogue._skip_argument(source, pos + 1)
        count += bool(source[pos + 1:end].strip())
        pos = end
    return count


def _go_wanted(path: str) -> bool:
    return path.endswith(".go") and not path.endswith("_test.go") and "/vendor/" not in f"/{path}" \
        and "/testdata/" not in f"/{path}"


COMPONENTS = {c.name: c for c in (
    Component("container-toolkit", "NVIDIA Container Toolkit", TOOLKIT_URL, TAG, "v*", ("cmd", "internal", "pkg"),
              LINES, _go_wanted, go_extract,
              "every literal message of fmt.Errorf, errors.New, the logger's Errorf/Warningf/Infof and log.Panic*/"
              "Fatal* in the Go sources under cmd/, internal/ and pkg/ (tests and vendor/ left out)"),
    Component("libnvidia-container", "libnvidia-container", LIBNVC_URL, TAG, "v*", ("src",), LINES,
              lambda p: p.startswith("src/") and p.endswith((".c", ".h")), _c(LIBNVC_CALL, LIBNVC_LEVEL, LIBNVC_SKIP),
              "every warnx/warn/errx/err format string of nvidia-container-cli (src/cli), every error_set* message "
              "of the library (what the CLI's errors are filled with) and every log_* message of its debug log, "
              "in src/ and src/cli/ (.c and .h; src/nvcgo, Go, left out), at the commit the toolkit release pins "
              f"({SUBMODULE})"),
    Component("apptainer", "Apptainer", APPTAINER_URL, TAG, "v*", APPTAINER_ROOTS, APPTAINER_LINES, _go_wanted,
              lambda source, path: go_extract(source, path, APPTAINER_CALL),
              "every literal message of sylog.Fatalf/Errorf/Warningf/Infof (printed as `FATAL:`, `ERROR:`, "
              "`WARNING:`, `INFO:`) and of the fmt.Errorf and errors.New it returns (printed chained with `: ` by "
              "the FATAL that stops the command) in the Go sources of the run path: " + ", ".join(APPTAINER_ROOTS)
              + " (tests left out; the starter's C, image builds, signing, keys, remotes and plugins not read)"),
)}


class PinnedSources:
    """libnvidia-container's sources at the commits the toolkit's releases pin: a toolkit tag is a
    release here when the libnvidia-container git directory holds the commit that tag pins."""

    def __init__(self, libnvc: GitSources, toolkit: Sources):
        self.libnvc, self.pins, self.toolkit = libnvc, {}, {}
        for tag in toolkit.tags():
            if not TAG.fullmatch(tag):
                continue
            pin = re.search(rf"^160000 commit ([0-9a-f]{{40}})\t{re.escape(SUBMODULE)}$",
                            _ls_tree(toolkit, tag), re.M)
            if pin and _has_commit(libnvc, pin.group(1)):
                self.pins[tag], self.toolkit[tag] = pin.group(1), toolkit.commit(tag)

    def tags(self) -> list[str]:
        return sorted(self.pins)

    def commit(self, tag: str) -> str:
        return self.pins[tag]

    def files(self, tag: str) -> list[str]:
        return self.libnvc.files(self.pins[tag])

    def read(self, tag: str, path: str) -> bytes:
        return self.libnvc.read(self.pins[tag], path)


def _ls_tree(toolkit: Sources, tag: str) -> str:
    if not isinstance(toolkit, GitSources):
        raise EnvbuildError("--container-toolkit-source must be a git clone of NVIDIA/nvidia-container-toolkit to read "
                            "which libnvidia-container commit each release pins.")
    return toolkit._git("ls-tree", tag, "--", SUBMODULE)


def _has_commit(sources: GitSources, commit: str) -> bool:
    try:
        sources._git("cat-file", "-e", f"{commit}^{{commit}}")
    except EnvbuildError:
        return False
    return True


def header(spec: Component) -> str:
    which = " whose pinned commit the sources read hold" if spec.name == "libnvidia-container" else ""
    text = (f"What {spec.title} can print, for the newest patch release{which} of each release line "
            f"envbuild/refresh/container_catalogue.py names ({', '.join(spec.lines)}): {spec.reads}, read from "
            f"{spec.url} (each release's tag and commit under `releases`). `level` is what the call prints at and "
            f"`call` the call; `file` and `line` are where the newest release that has the wording prints it; "
            f"`releases` the releases in which that exact wording exists. Generated by `envbuild matrix catalogue "
            f"--{spec.name}-source DIR` (see docs/doctor.md); do not edit. A release line the sources read lack is "
            f"listed under `not_catalogued`.")
    return nccl_catalogue.comment(text)


def derive(spec: Component, sources: Sources, progress=lambda _: None) -> dict:
    """The catalogue's data (launcher_catalogue.derive), a missing line's reason said for pinned sources."""
    data = launcher_catalogue.derive(spec, sources, progress)
    if isinstance(sources, PinnedSources):
        for release in data["releases"]:
            release["pinned_by"] = f"{TOOLKIT_URL.removeprefix('https://github.com/')}@{sources.toolkit[release['tag']]}"
        for missing in data["not_catalogued"]:
            missing["why"] = (f"the libnvidia-container sources read hold no commit a toolkit {missing['release']}.x "
                              f"release pins in {SUBMODULE}")
    return data


def render(spec: Component, data: dict) -> str:
    return nccl_catalogue.layout(header(spec), data, ("source",), ("releases", "not_catalogued", "messages"))


def summary(spec: Component, old: dict, new: dict) -> list[str]:
    return launcher_catalogue.summary(spec, old, new)


def component(name: str) -> Component:
    if name not in COMPONENTS:
        raise EnvbuildError(f"no container catalogue named {name!r}; known: {', '.join(COMPONENTS)}.")
    return COMPONENTS[name]


def open_sources(name: str, path: Path, toolkit: Optional[Path] = None) -> Sources:
    """The toolkit's sources, or libnvidia-container's: saved files (tags.txt: the toolkit's tag and the
    libnvidia-container commit it pins), or a git directory read at the commits `toolkit`'s tags pin."""
    spec = component(name)
    sources = nccl_catalogue.open_sources(path, spec.tag, spec.glob, spec.roots, spec.url)
    if name != "libnvidia-container" or not isinstance(sources, GitSources):
        return sources
    if toolkit is None:
        raise EnvbuildError(f"--libnvidia-container-source {path} is a git directory: give --container-toolkit-source "
                            f"too (a clone of {TOOLKIT_URL}), whose releases name the commit of libnvidia-container "
                            f"each pins ({SUBMODULE}).")
    return PinnedSources(sources, nccl_catalogue.open_sources(toolkit, TAG, "v*", (), TOOLKIT_URL))
