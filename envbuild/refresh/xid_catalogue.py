"""Derive matrices/catalogues/xid.yaml: NVIDIA's Xid numbers, their names and meanings, from the driver's
own source.

The NVIDIA driver reports a GPU's hardware and driver events to the kernel log as Xids (`NVRM: Xid
(PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.`). Their numbers and names are the
`#define NAME (N)` lines of src/common/sdk/nvidia/inc/nverror.h in the open kernel modules
(github.com/NVIDIA/open-gpu-kernel-modules), read at the newest tag of each driver branch in BRANCHES;
a number with two names in a release (13: GR_EXCEPTION and GR_ERROR_SW_NOTIFY) is two entries. Their
meanings are the driver's own published strings, the table ROBUST_CHANNEL_ERROR_STR_PUBLIC_PUBLISHED
(indexed by Xid) of the same header, which the driver carried up to its 520 branch: each Xid up to 95
gets the string of the newest catalogued release that has the table (`meanings`), and a number past
it or missing from it has only its name. NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors)
is not read: it is not reachable from here, and its table is no source file of a release.

Written by nccl_catalogue's layout: one (xid, name) an entry with the line in the newest release that
has it and the releases in which it exists; each release's tag and commit. Same sources, same bytes.
"""

from __future__ import annotations

import re
from pathlib import Path

from envbuild.base.errors import EnvbuildError
from envbuild.refresh import nccl_catalogue
from envbuild.refresh.nccl_catalogue import Sources

URL = "https://github.com/NVIDIA/open-gpu-kernel-modules"
HEADER_FILE = "src/common/sdk/nvidia/inc/nverror.h"
TAG = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")  # the driver's release tags: 595.45.04, 565.77
# The driver branches catalogued (the newest release of each): 520, the last with the published strings,
# and every branch after it that the open modules were released for.
BRANCHES = ("520", "525", "530", "535", "545", "550", "555", "560", "565", "570", "575", "580", "590", "595")
DEFINE = re.compile(r"^#define[ \t]+([A-Z][A-Z0-9_]*)[ \t]+\((\d+)\)", re.M)
TABLE = re.compile(r"#define[ \t]+ROBUST_CHANNEL_ERROR_STR_PUBLIC_PUBLISHED\b(.*?)(?:\n\s*\n|\Z)", re.S)
_STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def defines(source: str) -> list[dict]:
    """Each `#define NAME (N)` of nverror.h: an Xid number and its name, with its line (the
    ROBUST_CHANNEL_ERROR_RECOVERY_LEVEL_* levels and ROBUST_CHANNEL_LAST_ERROR, the highest number, are no
    Xids of their own and are left out)."""
    line_of = nccl_catalogue.line_finder(source)
    return [{"xid": int(m.group(2)), "name": m.group(1), "file": HEADER_FILE, "line": line_of(m.start())}
            for m in DEFINE.finditer(source) if "_RECOVERY_LEVEL_" not in m.group(1) and not m.group(1).endswith("_LAST_ERROR")]


def meanings(source: str) -> dict[int, tuple[str, int]]:
    """Xid -> (its published string, the line it is on), from the header's public table; {} without one."""
    table = TABLE.search(source)
    if not table:
        return {}
    line_of = nccl_catalogue.line_finder(source)
    strings = list(_STRING.finditer(source, table.start(1), table.end(1)))
    return {index: (nccl_catalogue._unescape(m.group(1)), line_of(m.start())) for index, m in enumerate(strings) if index}


def releases_of(tags: list[str]) -> tuple[list[str], list[dict]]:
    """The newest tag of each branch in BRANCHES the tags hold, and the branches they lack."""
    newest: dict[str, tuple[tuple[int, ...], str]] = {}
    for tag in tags:
        match = TAG.fullmatch(tag)
        if match and match.group(1) in BRANCHES:
            rank = tuple(int(g or 0) for g in match.groups())
            if match.group(1) not in newest or rank > newest[match.group(1)][0]:
                newest[match.group(1)] = (rank, tag)
    return ([newest[b][1] for b in BRANCHES if b in newest],
            [{"release": b, "why": f"the sources read have no release tag of driver branch {b}"}
             for b in BRANCHES if b not in newest])


def derive(sources: Sources, progress=lambda _: None) -> dict:
    """The catalogue's data: the Xids of the newest release of each branch, oldest first, and the meanings."""
    found, missing = releases_of(sources.tags())
    read, per_release, published = [], {}, ({}, None)
    for tag in found:
        progress(f"NVIDIA driver {tag}")
        source = sources.read(tag, HEADER_FILE).decode("utf-8", "replace")
        read.append({"release": tag, "tag": tag, "commit": sources.commit(tag)})
        per_release[tag] = {(d["xid"], d["name"]): d for d in defines(source)}
        published = (meanings(source), tag) if meanings(source) else published
    entries = nccl_catalogue.collate(per_release, found, ("xid", "name"))
    table, at = published
    for entry in entries:
        entry["meaning"] = table.get(entry["xid"], ("", 0))[0]
    return {"component": "xid", "source": URL, "file": HEADER_FILE,
            "meanings": {"release": at, "line": min((line for _, line in table.values()), default=0)} if at else {},
            "releases": read, "not_catalogued": missing, "messages": entries}


def header() -> str:
    text = (f"NVIDIA's Xid numbers (what the driver reports as `NVRM: Xid (PCI:...): N, ...`), their names and "
            f"meanings, for the newest release of each driver branch envbuild/refresh/xid_catalogue.py names "
            f"({', '.join(BRANCHES)}), read from {HEADER_FILE} of {URL} at each release's tag (its commit under "
            f"`releases`): `xid` and `name` each `#define NAME (N)`, `line` its line in the newest release that has "
            f"it, `releases` the releases that define it so; `meaning` the driver's own published string for that "
            f"number (ROBUST_CHANNEL_ERROR_STR_PUBLIC_PUBLISHED, last in the release `meanings` names; empty past "
            f"it). Generated by `envbuild matrix catalogue --xid-source DIR` (see docs/doctor.md); do not edit.")
    return nccl_catalogue.comment(text)


def render(data: dict) -> str:
    return nccl_catalogue.layout(header(), data, ("source", "file", "meanings"), ("releases", "not_catalogued", "messages"))


def summary(old: dict, new: dict) -> list[str]:
    return nccl_catalogue.summary(old, new, "xid", lambda m: (m["xid"], m["name"]))


def open_sources(path: Path) -> Sources:
    sources = nccl_catalogue.open_sources(path, TAG, "[0-9]*", (HEADER_FILE,), URL)
    if not releases_of(sources.tags())[0]:
        raise EnvbuildError(f"--xid-source {path} holds no release tag of the driver branches {', '.join(BRANCHES)}: "
                            f"give a clone of {URL} with its tags.")
    return sources
