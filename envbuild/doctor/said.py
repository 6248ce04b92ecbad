"""What a component said: matchers built from a message catalogue (matrices/catalogues/).

Each catalogued format string becomes a regular expression: its printf conversions are typed
captures (`%d` an integer, `%lx` hex, `%p` a pointer, `%s` any text, ...), named by their kind and
position (`d1`, `s2`), and its whitespace matches any run of blanks (a terminal's wrap joined back,
a pasted indent). NCCL's `WARN` messages are looked for after `NCCL WARN` anywhere in a line, so
the prefixes pasting adds (`[rank3]:`, timestamps, `host:pid:tid [dev] file.cc:12`) do not
matter, and its ncclResult_t messages anywhere (torch quotes them in its errors). INFO lines are
catalogued but not reported: NCCL_DEBUG=INFO prints hundreds of them in a healthy job. The CUDA
catalogue's cudaError_t and CUresult names (`cudaErrorNoDevice`, `CUDA_ERROR_SYSTEM_NOT_READY`)
are looked for as words, and reported with their value and the header's documentation. The
launchers' error wordings (Slurm's srun, slurmstepd and PMI plugins, enroot, pyxis) are looked for
after what prints them (`srun: error:`, `[ERROR]`, `enroot-mount:`, ...; LAUNCHERS below), Slurm's
own conversions (`%m`, `%pJ`) as text captures. The Python packages' catalogues (torch.distributed,
DeepSpeed's launcher and op loading, Triton's compiler and runtime; PYTHON below) have no common
prefix: each wording's longest fixed piece is its screen word; so are the Go wordings of the NVIDIA
Container Toolkit and Apptainer (CONTAINERS below), libnvidia-container's follow `nvidia-container-cli`.

A line that no curated signature explains but that a catalogued message matches is reported as
what the component said: the message, the releases that print that wording, the source file and
line, the rank; its cause says it is not yet explained, never a guessed one. Matching costs
nothing on lines without `NCCL WARN`, a result message, `cudaError` or `CUDA_ERROR_` (the engine's
Aho-Corasick screen holds those words); on a line with one, a second automaton over each message's longest fixed piece
picks the few expressions worth running.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import ahocorasick_rs

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import parse_yaml, read_text
from envbuild.base.resources import CATALOGUES, matrices_dir
from envbuild.doctor.signatures import KnownIssue

CONVERSION = re.compile(r"%(?P<flags>[-+ #0']*)(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?"
                        r"(?P<length>hh|h|ll|l|L|q|j|z|t)?(?P<kind>[diouxXeEfFgGaAcspn%])")
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|inf|nan)"
TYPED = {"d": r"\s*[-+]?\d+", "i": r"\s*[-+]?\d+", "u": r"\s*\d+", "o": r"\s*[0-7]+", "x": r"\s*(?:0x)?[0-9a-fA-F]+",
         "X": r"\s*(?:0X)?[0-9a-fA-F]+", "p": r"(?:0x[0-9a-fA-F]+|\(nil\))", "c": r".", "e": NUMBER, "E": NUMBER,
         "f": NUMBER, "F": NUMBER, "g": NUMBER, "G": NUMBER, "a": NUMBER, "A": NUMBER}
KIND = {"i": "d", "X": "x", "E": "f", "F": "f", "e": "f", "g": "f", "G": "f", "a": "f", "A": "f"}
MIN_FIXED = 10  # a message whose fixed text is shorter than this (`%s`, `%s: %s`) says too little to match alone
WARN_WORD = "NCCL WARN"
REPORTED = ("WARN", "RESULT")
UNEXPLAINED = "unexplained"  # the family of what a component said that no curated signature explains


def to_regex(text: str) -> str:
    """The expression of a printf format: conversions as typed named captures (`%lx` becomes
    `(?P<x2>...)` for the second conversion, a hex number), blanks as any run of blanks."""
    out, pos, number = [], 0, 0
    text = text.strip()
    conversions = list(CONVERSION.finditer(text))
    for index, conversion in enumerate(conversions):
        out.append(_literal(text[pos:conversion.start()]))
        pos = conversion.end()
        kind = conversion.group("kind")
        if kind == "%":
            out.append("%")
            continue
        if kind == "n":
            continue
        number += 1
        last = index == len(conversions) - 1 and not text[pos:].strip()
        body = (r".*" if last else r".*?") if kind == "s" else TYPED[kind]
        out.append(f"(?P<{KIND.get(kind, kind)}{number}>{body})")
    out.append(_literal(text[pos:]))
    return "".join(out)


def _literal(piece: str) -> str:
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", piece)) if piece.strip() else \
        (r"\s*" if piece else "")


def capture_names(text: str) -> list[str]:
    """The names to_regex gives the captures of a format, in order (`d1`, `x2`, `s3`)."""
    kinds = [c.group("kind") for c in CONVERSION.finditer(text.strip()) if c.group("kind") not in "%n"]
    return [f"{KIND.get(kind, kind)}{number}" for number, kind in enumerate(kinds, 1)]


def fixed_text(text: str) -> str:
    """The message without its conversions: what decides whether it says enough to match alone."""
    return CONVERSION.sub(" ", text).strip()


def key_of(text: str) -> str:
    """The longest run of fixed text between conversions and blanks-runs: every printing holds it."""
    runs = [run for piece in CONVERSION.split(text) if piece for run in re.split(r"\s{2,}|\n", piece)]
    return max((run.strip() for run in runs if run and run.strip()), key=len, default="")


@dataclass
class Matcher:
    """One catalogued message: how to find it, and the finding it makes (no cause guessed)."""
    component: str
    text: str  # the wording (a format string) or the error's name
    pattern: str
    title: str
    detail: str
    cause: str
    fix: str
    source: str
    key: str = ""  # its screen word (default: the longest fixed piece of `text`)
    family: str = UNEXPLAINED  # a curated family makes it a verdict (the Xids), not a lead
    certainty: str = "certain"
    follows: bool = False

    @functools.cached_property
    def regex(self) -> re.Pattern:
        return re.compile(self.pattern)

    def issue(self) -> KnownIssue:
        return KnownIssue(id=f"{self.component}-said" if self.family == UNEXPLAINED else f"gpu-{self.component}",
                          family=self.family, title=self.title, pattern=self.pattern, detail=self.detail,
                          cause=self.cause, fix=self.fix, source=self.source, certainty=self.certainty,
                          follows=self.follows)


def _newest(releases: str) -> str:
    return releases.split(", ")[-1].split("..")[-1]


def _captures(text: str) -> str:
    """A lead's detail: each capture of the wording by name, filled in when a line matches."""
    return "".join(f"; {name}: {{{name}}}" for name in capture_names(text))


def _unexplained(what: str) -> str:
    """A lead's cause: what printed it, and that no curated signature says more."""
    return (f"not yet explained: {what}; no curated signature says what it means for the job, and doctor "
            f"does not guess.")


def _read_source(link: str, url: str, then: str) -> str:
    """A lead's next step: the source line, the project's issues, then `then`."""
    return (f"Read the source line ({link}) for the check that failed and what its values mean; search "
            f"{url}/issues for the wording; {then}.")


def nccl_matchers(data: dict) -> list[Matcher]:
    """A matcher per WARN wording and ncclResult_t message that says enough to match alone."""
    url = str(data.get("source") or "https://github.com/NVIDIA/nccl")
    tags = {str(r["release"]): str(r["tag"]) for r in data.get("releases") or []}
    found = []
    for entry in data.get("messages") or []:
        level, text, releases = entry["level"], str(entry["text"]), str(entry["releases"])
        if level not in REPORTED or len(fixed_text(text)) < MIN_FIXED:
            continue
        where = f"{entry['file']}:{int(entry['line'])}"
        link = f"{url}/blob/{tags.get(_newest(releases), 'master')}/{entry['file']}#L{int(entry['line'])}"
        body = to_regex(text)
        said = "an ncclResult_t message" if level == "RESULT" else f"a {level} message"
        found.append(Matcher(
            "nccl", text, rf"{WARN_WORD}\s+{body}" if level == "WARN" else body, f"NCCL said: {text.strip()}",
            f"NCCL {releases}, {where}" + _captures(text),
            _unexplained(f"{said} of NCCL (printed at {where} in the releases {releases})"),
            _read_source(link, url, "rerun with NCCL_DEBUG=INFO for the lines before it"), link))
    return found


def cuda_matchers(data: dict) -> list[Matcher]:
    """A matcher per cudaError_t and CUresult name (success left out), documented as its newest header says."""
    pages = {str(r["release"]): str(r["url"]) for r in data.get("releases") or []}
    names: dict[tuple[str, str], list[dict]] = {}
    for entry in data.get("errors") or []:
        if int(entry["value"]) != 0:
            names.setdefault((str(entry["api"]), str(entry["name"])), []).append(entry)
    found = []
    for (api, name), entries in sorted(names.items()):
        newest = max(entries, key=lambda e: [int(p) for p in _newest(str(e["releases"])).split(".")])
        releases = ", ".join(str(e["releases"]) for e in entries)
        what = "a cudaError_t (runtime API)" if api == "runtime" else "a CUresult (driver API)"
        where = f"{newest['header']}:{int(newest['line'])}"
        found.append(Matcher(
            "cuda", name, rf"\b{re.escape(name)}\b", f"CUDA said: {name} ({int(newest['value'])})",
            f"CUDA {releases}, {where}",
            f"not yet explained: {what} CUDA returned; its header ({where}) documents it as: "
            f"\"{newest['doc']}\" No curated signature says what it means for this job, and doctor does not guess.",
            "Find the call that returned it in the lines before (CUDA_LAUNCH_BLOCKING=1 makes kernel errors "
            "surface at the launch that caused them); compare the driver (`nvidia-smi`) with the CUDA the image pins.",
            pages.get(_newest(str(newest["releases"])), "https://pypi.org/project/nvidia-cuda-runtime-cu12/")))
    return found


TORCH_REPORTED = ("RAISE", "ERROR")  # warnings (torchrun's OMP_NUM_THREADS notice) are in healthy jobs too
MIN_KEY = 16  # a torch message's screen word: its longest fixed piece, at least this long
MIN_TORCH_FIXED = 24  # torch words its errors plainly ("%s not supported"): fewer than this says too little
# The catalogues read from Python packages (torch_catalogue's rule): per component, what its
# messages are said by (the title) and its name before the release range. Warnings and prints
# are catalogued but not reported (DeepSpeed's op builders print theirs in every healthy start).
PYTHON = {"torch": ("torch.distributed", "torch", "https://github.com/pytorch/pytorch"),
          "deepspeed": ("DeepSpeed", "DeepSpeed", "https://github.com/deepspeedai/DeepSpeed"),
          "triton": ("Triton", "Triton", "https://github.com/triton-lang/triton")}
PACKAGES = ("deepspeed", "triton")  # the package catalogues besides torch's (matrices/catalogues/NAME.yaml)


def _torch_line(text: str) -> str:
    """The line of a (possibly multi-line) message with the most fixed text: what one log line holds."""
    return max((line for line in text.split("\n") if line.strip()), key=lambda line: len(fixed_text(line)), default="")


def _in_repository(path: str, paths: dict) -> str:
    """Where a packaged file is in its repository (Triton's wheel holds python/triton/ as triton/)."""
    prefix = max((p for p in paths if path.startswith(p)), key=len, default="")
    return str(paths[prefix]) + path[len(prefix):] if prefix else path


def python_matchers(data: dict, component: str = "torch") -> list[Matcher]:
    """A matcher per raised or logged-as-error wording of a Python package's catalogue (torch.distributed,
    DeepSpeed, Triton) that says enough to match alone."""
    title, short, default = PYTHON[component]
    url, paths = str(data.get("source") or default), data.get("paths") or {}
    found = []
    for entry in data.get("messages") or []:
        level, text, releases = entry["level"], _torch_line(str(entry["text"])), str(entry["releases"])
        if level not in TORCH_REPORTED or len(fixed_text(text)) < MIN_TORCH_FIXED or len(key_of(text)) < MIN_KEY:
            continue
        where = f"{entry['file']}:{int(entry['line'])}"
        link = f"{url}/blob/v{_newest(releases)}/{_in_repository(str(entry['file']), paths)}#L{int(entry['line'])}"
        said = f"raised as {entry['error']}" if level == "RAISE" and entry.get("error") else "logged as an error"
        found.append(Matcher(
            component, text, to_regex(text), f"{title} said: {text.strip()}",
            f"{short} {releases}, {where}" + _captures(text),
            _unexplained(f"a message {title} {said} (at {where} in the releases {releases})"),
            _read_source(link, url, "the first rank to print an error is where to look first"), link))
    return found


C10D_ERROR = re.compile(  # a piece that says something failed: what c10d prints when a job fails
    r"\b(?:fail(?:ed|ure|s)?|timed out|timeout|caught|exception|error|abort(?:ed)?|terminated|crash|closed|"
    r"refused|not listening|unable|could not|lost|stuck|hang)\b", re.IGNORECASE)
C10D_HEALTHY = re.compile(  # warnings and settings a healthy job prints; an assert's build path; an op's schema
    r"WARNING|TORCH_NCCL_|environments?:|terminated normally|Skip|hasn't been destroyed|ignoring|not an error|"
    r"INTERNAL ASSERT FAILED at \"|__torch__|to be true, but got false")
MIN_C10D_FIXED = 20  # `recvValue failed on %s: %s`: c10d names its call, so a shorter piece says enough


def c10d_matchers(data: dict) -> list[Matcher]:
    """A matcher per piece of c10d's C++ (matrices/catalogues/c10d.yaml, read from the wheels'
    libraries) that says something failed (C10D_ERROR) and enough to match alone; warnings and
    settings a healthy job prints (C10D_HEALTHY) are catalogued but not reported. The wheel holds no
    file or line: the lead names the library and the compile unit the piece sits among."""
    wheels = {str(r["release"]): str(r.get("url") or "") for r in data.get("releases") or []}
    found = []
    for entry in data.get("messages") or []:
        text, releases = _torch_line(str(entry["text"])), str(entry["releases"])
        if (len(fixed_text(text)) < MIN_C10D_FIXED or len(key_of(text)) < MIN_KEY or not C10D_ERROR.search(text)
                or C10D_HEALTHY.search(text)):
            continue
        where = f"{entry['library']} (among {entry['near']}'s strings; the wheel holds no file or line)"
        found.append(Matcher(
            "c10d", text, to_regex(text), f"c10d said: {text.strip()}", f"torch {releases}, {where}" + _captures(text),
            _unexplained(f"a piece of a message c10d's C++ prints (in {where}, torch {releases})"),
            "Search https://github.com/pytorch/pytorch/issues for the wording; rerun with TORCH_CPP_LOG_LEVEL=INFO "
            "and TORCH_DISTRIBUTED_DEBUG=DETAIL for the lines before it; the first rank to print an error is where "
            "to look first.", wheels.get(_newest(releases)) or "https://pypi.org/project/torch/"))
    return found


# What the launchers print (matrices/catalogues/slurm.yaml, enroot.yaml, pyxis.yaml), per component:
# its name, the levels reported (info and warnings are in healthy jobs too), the screen words a line
# must hold, and per call the expression before the message and the text printed after it.
SLURM_PREFIX = r"(?:(?:srun|slurmstepd|slurmd|salloc|sbatch)[\w.-]*:|\])\s*"
LAUNCHERS = {
    "slurm": ("Slurm", ("ERROR", "FATAL"), ("error:", "fatal:"),
              {"error": (SLURM_PREFIX + r"error:\s*", ""), "fatal": (SLURM_PREFIX + r"fatal:\s*", ""),
               "PMIXP_ERROR": (SLURM_PREFIX + r"error:\s.*?", ""), "PMIXP_ABORT": (SLURM_PREFIX + r"error:\s.*?", ""),
               "PMIXP_ERROR_STD": (SLURM_PREFIX + r"error:\s.*?", ": %s (%d)"),
               "PMIXP_ERROR_NO": (SLURM_PREFIX + r"error:\s.*?", ": %s (%d)")}),
    "pyxis": ("pyxis", ("ERROR",), ("error:",), {"slurm_error": (r"\berror:\s*", "")}),
    "enroot": ("enroot", ("ERROR",), ("[ERROR]", "enroot-"),
               {"common::err": (r"\[ERROR\]\s*", ""), "common::log": (r"\[ERROR\]\s*", ""),
                "err": (r"\benroot-[\w-]+:\s*", ": %s"), "errx": (r"\benroot-[\w-]+:\s*", "")}),
}
# Slurm's own conversions (its log.c: %m strerror, %t/%T/%M times, %pA an address, %pJ a job,
# %ps/%pS a step, %pd/%pD data), and glibc's %m in enroot's err(): each prints text, a %s here.
LAUNCHER_CONVERSION = re.compile(r"%%|%(?:p[AdDJsS]|m|[tTM](?![diouxX]))")


def printed(text: str) -> str:
    """A launcher's format as printf would read it: its own conversions as %s."""
    return LAUNCHER_CONVERSION.sub(lambda c: c.group(0) if c.group(0) == "%%" else "%s", text)


def launcher_matchers(data: dict) -> list[Matcher]:
    """A matcher per error wording of a launcher's catalogue (Slurm, enroot, pyxis) that says enough to match alone."""
    name = str(data.get("component"))
    title, levels, _, calls = LAUNCHERS[name]
    url = str(data["source"])
    tags = {str(r["release"]): str(r["tag"]) for r in data.get("releases") or []}
    found = []
    for entry in data.get("messages") or []:
        releases, call = str(entry["releases"]), str(entry["call"])
        if entry["level"] not in levels or call not in calls:
            continue
        prefix, suffix = calls[call]
        text = printed(_torch_line(str(entry["text"]))).strip() + suffix
        if len(fixed_text(text)) < MIN_FIXED or len(key_of(text)) < MIN_FIXED:
            continue
        where = f"{entry['file']}:{int(entry['line'])}"
        link = f"{url}/blob/{tags.get(_newest(releases), 'master')}/{entry['file']}#L{int(entry['line'])}"
        found.append(Matcher(
            name, text, prefix + to_regex(text), f"{title} said: {str(entry['text']).strip()}",
            f"{title} {releases}, {where}" + _captures(text),
            _unexplained(f"a message {title} prints with {call}() (at {where} in the releases {releases})"),
            _read_source(link, url, f"the lines before it say what {title} was doing"), link))
    return found


# The NVIDIA container stack and Apptainer (matrices/catalogues/container-toolkit.yaml,
# libnvidia-container.yaml, apptainer.yaml; refresh/container_catalogue.py), per component: its title, the levels reported, and per call the
# expression before the message and the text printed after it (error_set's `: strerror`, warn's).
# nvidia-container-cli prints its own name first and the library's message inside its own
# (`nvidia-container-cli: initialization error: nvml error: driver not loaded`); the toolkit's Go
# errors are chained with `: ` and have no common prefix, so each wording's longest fixed piece is
# its screen word, as for the Python packages. Only the toolkit's CLI-visible levels are reported;
# libnvidia-container's log_* lines go to its debug log only (`--debug`), and are catalogued, not reported.
CLI = r"nvidia-container-cli:\s*"
_LIB = (r"nvidia-container-cli:.*?", ": %s")
CONTAINERS = {
    "container-toolkit": ("NVIDIA Container Toolkit", ("ERROR", "FATAL"), {}),
    "apptainer": ("Apptainer", ("ERROR", "FATAL"), {}),
    "libnvidia-container": ("libnvidia-container", ("ERROR",), {
        "warnx": (CLI, ""), "errx": (CLI, ""), "warn": (CLI, ": %s"), "err": (CLI, ": %s"),
        "error_setx": (r"nvidia-container-cli:.*?", ""), "error_set": _LIB, "error_set_nvml": _LIB,
        "error_set_dl": _LIB, "error_set_elf": _LIB, "error_set_rpc": _LIB}),
}
CLI_WORD = "nvidia-container-cli"
# The Go components: their wordings printed by Go's fmt (GO_VERB), no common prefix. Apptainer's sylog
# prints `FATAL:   `, `ERROR:   ` (warnings too, in healthy jobs: catalogued, not reported) before its own
# and before the returned errors it chains, but not in --debug's layout, so no prefix is required.
GO = ("container-toolkit", "apptainer")
THEN = {"apptainer": "rerun with `apptainer --debug` for what it was doing; `apptainer --version` names the release",
        "_": "`nvidia-container-cli -k -d /dev/tty info` on the host shows what the runtime's hook sees"}
# Go's verbs as printf reads them: %v, %w, %T (and their + # flags) print text, %q a quoted string.
GO_VERB = re.compile(r"%%|%[+#]?[vwT]|%q")


def go_printed(text: str) -> str:
    """A Go format as printf would read it (module comment above)."""
    return GO_VERB.sub(lambda v: {"%%": "%%", "%q": '"%s"'}.get(v.group(0), "%s"), text)


def _same_printing(data: dict) -> list[dict]:
    """The toolkit's wordings, those that print the same (`%v` and `%w` of one message in two releases)
    as one, at its newest place, with the releases of all."""
    order = [str(r["release"]) for r in data.get("releases") or []]
    groups: dict[str, list[dict]] = {}
    for entry in data.get("messages") or []:
        groups.setdefault(f"{entry['level']}\0{go_printed(str(entry['text']))}", []).append(entry)
    merged = []
    for entries in groups.values():
        held = set().union(*(released_in(str(e["releases"]), order) for e in entries))
        newest = max(entries, key=lambda e: max((order.index(r) for r in released_in(str(e["releases"]), order)), default=-1))
        runs = [[]]
        for release in order:
            runs[-1].append(release) if release in held else runs.append([])
        spans = ", ".join(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs if run)
        merged.append({**newest, "releases": spans or str(newest["releases"])})
    return merged


def container_matchers(data: dict) -> list[Matcher]:
    """A matcher per error wording of the toolkit's, libnvidia-container's or Apptainer's catalogue that says
    enough to match alone; the source line linked at the newest release's tag (libnvidia-container: its commit)."""
    name = str(data.get("component"))
    title, levels, calls = CONTAINERS[name]
    url, go = str(data["source"]), name in GO
    at = {str(r["release"]): str(r["tag"] if go else r["commit"]) for r in data.get("releases") or []}
    found = []
    for entry in _same_printing(data) if go else data.get("messages") or []:
        releases, call = str(entry["releases"]), str(entry["call"])
        if entry["level"] not in levels or not (go or call in calls):
            continue
        prefix, suffix = ("", "") if go else calls[call]
        text = (go_printed(_torch_line(str(entry["text"]))) if go else str(entry["text"])).strip() + suffix
        if len(fixed_text(text)) < (MIN_TORCH_FIXED if go else MIN_FIXED) or len(key_of(text)) < (MIN_KEY if go else MIN_FIXED):
            continue
        where = f"{entry['file']}:{int(entry['line'])}"
        link = f"{url}/blob/{at.get(_newest(releases), 'main')}/{entry['file']}#L{int(entry['line'])}"
        found.append(Matcher(
            name, text, prefix + to_regex(text), f"{title} said: {str(entry['text']).strip()}",
            f"{title} {releases}, {where}" + _captures(text),
            _unexplained(f"a message {title} prints with {call}() (at {where} in the releases {releases})"),
            _read_source(link, url, THEN.get(name, THEN["_"])), link))
    return found


# NVIDIA's Xids (matrices/catalogues/xid.yaml; refresh/xid_catalogue.py): the driver's `NVRM: Xid
# (PCI:0000:3b:00): 79, pid=..., <what it says>` (older drivers: no `PCI:`; MIG: ` GPU-I:NN`). Each
# catalogued number is a verdict of family gpu-hardware naming the Xid, its names and the driver's published
# meaning; the numbers below get a cause and next step of their group, the others the general one.
XID_FAMILY = "gpu-hardware"
XID_WORD = "NVRM: Xid ("
XID_LINE = r"NVRM: Xid \((?:PCI:)?(?P<gpu>[0-9a-fA-F:.]+)[^)]*\):\s*"
XID_CATALOGUE = "https://docs.nvidia.com/deploy/xid-errors/"
XID_SAID = ("What the driver printed with it ({said}) names the engine or unit; NVIDIA's Xid catalogue gives "
            "each Xid's immediate and investigatory action.")
XID_GENERAL = (
    "An event of the GPU's hardware or of the driver's state on this node, which the image neither causes nor "
    "fixes. " + XID_SAID,
    f"On the node: `dmesg -T | grep -i xid` around the failure, `nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT`; "
    f"look the Xid up in NVIDIA's catalogue ({XID_CATALOGUE}) for its action (restart the job, reset the GPU, drain "
    f"the node), and run `envbuild smoke IMAGE --gpus all` there before the node takes jobs again.")
XID_GROUPS = (  # (Xids, cause, fix, certainty, follows)
    ((13, 31, 43), "Often the program's own fault: a kernel touched an address it had not mapped (31: a GPU "
     "memory page fault), hit an illegal instruction or out-of-range address (13), and the driver stopped its "
     "channel (43); the job's log then holds a CUDA error such as an illegal memory access. The same Xid on "
     "one GPU under different programs points at that GPU.",
     "Find the CUDA error in the job's log; rerun with CUDA_LAUNCH_BLOCKING=1 (or under compute-sanitizer) to "
     "name the kernel; an extension built for another GPU or against another torch does this. If it recurs on "
     "one GPU only, drain that GPU and run `envbuild smoke IMAGE --gpus all` on the node.", "likely", False),
    ((45,), "Preemptive cleanup: the driver tore down this process's GPU channels because of an earlier error "
     "(the Xid before it; the driver may say `caused by previous Xid N`) or because the process was ending.",
     "Look at the Xid or CUDA error before this one: it is the cause.", "likely", True),
    ((48, 63, 64, 92, 94, 95, 140, 171, 172), "The GPU's memory reported an ECC event: an uncorrectable "
     "(double-bit) error (48, 95: not contained, every process on the GPU is affected; 94: contained to the "
     "process it names), a page retirement or row remapping (63, pending until the GPU is reset) or its "
     "failure (64), or too many corrected errors (92). The job's data on that GPU cannot be trusted.",
     "`nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT` on the node; reset the GPU (or reboot) so pending "
     "remaps take effect, and restart the job from its last checkpoint; a failed remap (64) or recurring "
     "uncorrectable errors: drain the node and have the GPU replaced.", "certain", False),
    ((74, 144, 145, 146, 147, 148, 149, 150), "An NVLink between GPUs reported an error: collectives over it fail "
     "or hang (NCCL then reports a remote or fabric error).",
     "`nvidia-smi nvlink -s` and `-e` on the node; on NVSwitch systems check the fabric manager "
     "(`systemctl status nvidia-fabricmanager`); reset the GPUs or reboot; if it persists, drain the node.",
     "certain", False),
    ((79,), "The GPU stopped answering on the PCIe bus: every process on it is lost and the GPU is unusable "
     "until it is reset or the node rebooted (overheating, power delivery, a PCIe slot, riser or board fault).",
     "Drain the node; `nvidia-smi` shows the GPU missing or `Unknown Error`; check temperatures and power, "
     "reboot, and if it recurs have the board and slot inspected.", "certain", False),
    ((119, 120), "The GPU's firmware (GSP) did not answer the driver, or reported an error: the GPU needs a "
     "reset, and some driver releases are known for it.",
     "Reset the GPU or reboot the node; if it recurs, compare the driver release with NVIDIA's release notes "
     "and update it.", "certain", False),
)


def _xid_text(xid: int) -> tuple[str, str, str, bool]:
    """An Xid's cause, fix, certainty and follows (its group's, or the general ones)."""
    for numbers, cause, fix, certainty, follows in XID_GROUPS:
        if xid in numbers:
            return f"{cause} {XID_SAID}", fix, certainty, follows
    return XID_GENERAL[0], XID_GENERAL[1], "certain", False


def xid_matchers(data: dict) -> list[Matcher]:
    """A verdict per catalogued Xid number (its names and published meaning in the title), and one for an
    Xid the catalogued releases do not define."""
    url, file = str(data.get("source")), str(data.get("file"))
    tags = {str(r["release"]): str(r["tag"]) for r in data.get("releases") or []}
    entries: dict[int, list[dict]] = {}
    for entry in data.get("messages") or []:
        entries.setdefault(int(entry["xid"]), []).append(entry)
    found = []
    for xid, named in sorted(entries.items()):
        newest = max(named, key=lambda e: list(tags).index(_newest(str(e["releases"]))))
        names = " / ".join(str(e["name"]) for e in named)
        meaning = next((str(e["meaning"]) for e in named if e.get("meaning")), "")
        releases = "; ".join(f"{e['name']} in {e['releases']}" for e in named)
        cause, fix, certainty, follows = _xid_text(xid)
        link = f"{url}/blob/{tags.get(_newest(str(newest['releases'])), 'main')}/{file}#L{int(newest['line'])}"
        found.append(Matcher(
            "xid", f"NVRM: Xid (%s): {xid},", XID_LINE + rf"{xid},\s*(?P<said>.*)",
            f"GPU Xid {xid}: {meaning or names}" + (f" ({names})" if meaning else ""),
            f"the driver's nverror.h: {releases}; GPU {{gpu}}", f"Xid {xid} ({names}" + (f": \"{meaning}\"" if meaning else "")
            + f") on the GPU at {{gpu}}. {cause}", fix, link, key=f"): {xid},", family=XID_FAMILY,
            certainty=certainty, follows=follows))
    found.append(Matcher(
        "xid", "NVRM: Xid (%s): %d,", XID_LINE + r"(?P<xid>\d+),\s*(?P<said>.*)", "GPU Xid {xid}",
        "no catalogued driver release's nverror.h names Xid {xid}; GPU {gpu}",
        f"Xid {{xid}} on the GPU at {{gpu}}, a number the driver's header does not name (the firmware reports "
        f"it). {XID_GENERAL[0]}", XID_GENERAL[1], XID_CATALOGUE, key=XID_WORD, family=XID_FAMILY))
    return found


class Said:
    """The catalogues as matchers: `words` for the engine's screen, `match` for a line."""

    def __init__(self, matchers: list[Matcher], words: list[str]):
        self.matchers = matchers
        keys: dict[str, list[int]] = {}
        for index, matcher in enumerate(matchers):
            keys.setdefault(matcher.key or key_of(matcher.text), []).append(index)
        self.keys = list(keys)
        self.owners = [keys[k] for k in self.keys]
        self.automaton = ahocorasick_rs.AhoCorasick(self.keys) if self.keys else None
        self.words = sorted(set(words))
        self._issues: dict[int, KnownIssue] = {}

    @classmethod
    def of(cls, nccl: Optional[dict] = None, cuda: Optional[dict] = None, torch: Optional[dict] = None,
           launchers: tuple[dict, ...] = (), packages: tuple[dict, ...] = (), xid: Optional[dict] = None,
           c10d: Optional[dict] = None) -> "Said":
        """The matchers of the NCCL, CUDA, torch.distributed, c10d, launcher and package (DeepSpeed, Triton)
        catalogues and the Xids (any may be absent)."""
        matchers = nccl_matchers(nccl or {}) + cuda_matchers(cuda or {}) + python_matchers(torch or {})
        matchers += c10d_matchers(c10d or {})
        matchers += xid_matchers(xid) if xid else []
        matchers += [m for data in launchers for m in (launcher_matchers(data) if str(data.get("component")) in LAUNCHERS
                                                       else container_matchers(data))]
        matchers += [m for data in packages for m in python_matchers(data, str(data.get("component")))]
        words = [WARN_WORD] if nccl else []
        words += [w for data in launchers for w in LAUNCHERS.get(str(data.get("component")), ("", "", ()))[2]]
        words += [CLI_WORD] if any(m.component == "libnvidia-container" for m in matchers) else []
        words += [m.text.strip() for m in matchers if m.component == "nccl" and not m.pattern.startswith(WARN_WORD)]
        words += ["cudaError", "CUDA_ERROR_"] if cuda else []
        words += [XID_WORD] if xid else []
        own = (*PYTHON, *GO, "c10d")  # no common prefix: each one's own
        words += [key_of(m.text) for m in matchers if m.component in own]
        return cls(matchers, words)

    def match(self, line: str) -> Optional[tuple[int, re.Match]]:
        """The most specific catalogued message the line holds (the longest fixed text), or None."""
        if self.automaton is None:
            return None
        best = None
        for key_index, _, _ in self.automaton.find_matches_as_indexes(line, overlapping=True):
            for index in self.owners[key_index]:
                found = self.matchers[index].regex.search(line)
                if found and (best is None or len(fixed_text(self.matchers[index].text)) >
                              len(fixed_text(self.matchers[best[0]].text))):
                    best = (index, found)
        return best

    def issue(self, index: int) -> KnownIssue:
        if index not in self._issues:
            self._issues[index] = self.matchers[index].issue()
        return self._issues[index]


def _read(path: Path):
    """A catalogue file envbuild wrote (None when absent), parsed by parse_yaml (libyaml where there is one)."""
    if not path.is_file():
        return None
    return parse_yaml(read_text(path, "message catalogue", "matrix"), f"message catalogue {path}")


@functools.lru_cache(maxsize=4)
def load_said(directory: Optional[Path] = None) -> Optional[Said]:
    """The catalogues envbuild ships (or those in `directory`) as matchers; None without any."""
    folder = (directory or matrices_dir()) / CATALOGUES
    nccl, cuda, torch = _read(folder / "nccl.yaml"), _read(folder / "cuda.yaml"), _read(folder / "torch.yaml")
    launchers = [_read(folder / f"{name}.yaml") for name in (*LAUNCHERS, *CONTAINERS)]
    packages = [_read(folder / f"{name}.yaml") for name in PACKAGES]
    xid, c10d = _read(folder / "xid.yaml"), _read(folder / "c10d.yaml")
    if nccl is None and cuda is None and torch is None and not any(launchers) and not any(packages) and xid is None \
            and c10d is None:
        return None
    try:
        return Said.of(*(data if isinstance(data, dict) else None for data in (nccl, cuda, torch)),
                       tuple({**data, "component": name} for name, data in zip((*LAUNCHERS, *CONTAINERS), launchers)
                             if isinstance(data, dict)),
                       tuple({**data, "component": name} for name, data in zip(PACKAGES, packages)
                             if isinstance(data, dict)), xid if isinstance(xid, dict) else None,
                       c10d if isinstance(c10d, dict) else None)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise EnvbuildError(f"a message catalogue in {folder} is malformed ({type(e).__name__}: {e}); "
                            f"regenerate it with `envbuild matrix catalogue --write`.") from None


def released_in(spans: str, order: list[str]) -> set[str]:
    """The releases of `order` a catalogue entry's `releases` ('2.20.5..2.26.5, 2.28.3') names."""
    held: set[str] = set()
    for run in spans.split(", "):
        first, _, last = run.partition("..")
        if first in order and (last or first) in order:
            held.update(order[order.index(first):order.index(last or first) + 1])
    return held


TITLES = {"nccl": "NCCL", **{name: spec[0] for name, spec in LAUNCHERS.items()},
          **{name: spec[1] for name, spec in PYTHON.items()},
          **{name: spec[0] for name, spec in CONTAINERS.items()}}  # a component as drift names it


def wording_regex(component: str, text: str) -> str:
    """The expression of the line a catalogued wording prints, read as doctor's matchers read it
    (a launcher's own conversions as %s; of a Python package's multi-line message, its fullest line)."""
    if component in LAUNCHERS:
        return to_regex(printed(_torch_line(text)))
    if component in GO:
        return to_regex(go_printed(_torch_line(text)))
    return to_regex(_torch_line(text) if component in PYTHON else text)


def _quote_problem(issue: KnownIssue, pattern: re.Pattern, quote, releases: set[str], order: list[str]) -> str:
    """Why a quote does not hold ('' when it does)."""
    title = TITLES.get(quote.component, quote.component)
    if not releases:
        return f"{issue.id}: quotes {quote.text!r}, which no catalogued {title} release prints"
    if not re.search(wording_regex(quote.component, quote.text), quote.line):
        return f"{issue.id}: {quote.line!r} is not a line {quote.text!r} prints"
    if not pattern.search(quote.line):
        return (f"{issue.id}: {title} {', '.join(r for r in order if r in releases)} print {quote.text!r} "
                f"({quote.line!r}) and its pattern does not match it")
    return ""


def drift(issues: list[KnownIssue], catalogues: dict) -> list[str]:
    """What keeps a signature's quotes of a component (NCCL, Slurm, enroot, pyxis, torch.distributed,
    DeepSpeed, Triton) from holding on every release of that component's catalogue: a quoted
    wording no release prints, a quoted line the wording cannot print, a wording the pattern does
    not match in the releases that print it, a release that prints none of the signature's wordings
    of that component; and for each message the quotes name (`message`), a release from the first
    that prints it to the newest (or to its `until`: the last release that prints it at all) that
    prints none of its quoted wordings: the component reworded it and the signature does not know
    the new wording. `catalogues`: each component's catalogue by its name (or one catalogue)."""
    if "messages" in catalogues:
        catalogues = {str(catalogues.get("component") or "nccl"): catalogues}
    problems = []
    for issue in (i for i in issues if i.quotes):
        for component in sorted({q.component for q in issue.quotes}):
            quotes = [q for q in issue.quotes if q.component == component]
            if component not in catalogues:
                problems.append(f"{issue.id}: quotes {component}, which has no catalogue in matrices/catalogues/")
                continue
            problems += _component_drift(issue, quotes, catalogues[component])
    return problems


def _component_drift(issue: KnownIssue, quotes: list, data: dict) -> list[str]:
    """drift() for one signature's quotes of one component, against that component's catalogue."""
    title = TITLES.get(quotes[0].component, quotes[0].component)
    order = [str(r["release"]) for r in data.get("releases") or []]
    printed_in: dict[str, set[str]] = {}
    for entry in data.get("messages") or []:
        printed_in.setdefault(str(entry["text"]), set()).update(released_in(str(entry["releases"]), order))
    problems, pattern, covered, groups = [], re.compile(issue.pattern), set(), {}
    for quote in quotes:
        releases = printed_in.get(quote.text, set())
        problem = _quote_problem(issue, pattern, quote, releases, order)
        problems += [problem] if problem else []
        group = groups.setdefault(quote.message, [set(), None])
        group[0] |= set() if problem else releases
        group[1] = quote.until or group[1]
        covered |= set() if problem else releases
    missing = [r for r in order if r not in covered]
    if missing:
        problems.append(f"{issue.id}: {title} {', '.join(missing)} print none of the wordings it quotes and matches")
    for message, (held, until) in groups.items():
        start = min((order.index(r) for r in held), default=len(order))
        end = order.index(until) + 1 if until in order else len(order)
        gone = [r for r in order[start:end] if r not in held]
        if message and gone:
            problems.append(f"{issue.id}: {title} {', '.join(gone)} print none of its quoted wordings of {message!r} "
                            f"that it matches (reworded? or say `until` the release that last prints it)")
    return problems
