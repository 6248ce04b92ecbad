"""Small readers shared by the torch and DeepSpeed derivations: wheel METADATA, requirement
markers for a given Linux machine and Python, cpXY wheel tags, Python ranges."""

from __future__ import annotations

import email.parser
import re
from typing import Iterable, Optional

from packaging.markers import InvalidMarker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.refresh.pypi import DistFile, Index

MACHINES = ("x86_64", "aarch64")


def marker_env(machine: str, py_minor: int) -> dict[str, str]:
    """The PEP 508 environment of CPython 3.<py_minor> on Linux <machine>."""
    return {"platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
            "platform_machine": machine, "python_version": f"3.{py_minor}",
            "python_full_version": f"3.{py_minor}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


def read_metadata(index: Index, dist: DistFile) -> dict[str, list[str]]:
    """The METADATA header fields of a wheel (name -> all values), read by range request."""
    names = [m for m in index.members(dist) if m.endswith(".dist-info/METADATA") and m.count("/") == 1]
    if len(names) != 1:
        raise EnvbuildError(f"{dist.filename} has {len(names)} .dist-info/METADATA members, expected one.")
    text = index.member(dist, names[0]).decode("utf-8", "replace")
    message = email.parser.Parser().parsestr(text, headersonly=True)
    fields: dict[str, list[str]] = {}
    for key, value in message.items():
        fields.setdefault(key.lower(), []).append(str(value).strip())
    return fields


def requirement(meta: dict[str, list[str]], name: str, machine: str, py_minor: int,
                where: str) -> Optional[tuple[Requirement, str]]:
    """The Requires-Dist entry for `name` whose marker applies on Linux <machine> with
    Python 3.<py_minor>, with its specifier text exactly as written ("==3.3.1", "~=3.9.0")."""
    wanted = canonicalize_name(name)
    for line in meta.get("requires-dist", []):
        try:
            req = Requirement(line)
        except (InvalidRequirement, InvalidMarker) as e:
            raise EnvbuildError(f"{where}: Requires-Dist {line!r} does not parse ({e}).") from None
        if canonicalize_name(req.name) != wanted:
            continue
        if req.marker is not None and not req.marker.evaluate(marker_env(machine, py_minor)):
            continue
        return req, specifier_text(line)
    return None


def specifier_text(line: str) -> str:
    """'triton (==3.1.0) ; marker' -> '==3.1.0'; 'cuda-toolkit[a,b]==13.0.2; m' -> '==13.0.2'."""
    head = line.split(";", 1)[0]
    head = re.sub(r"^\s*[A-Za-z0-9._-]+\s*(\[[^\]]*\])?", "", head)
    return head.strip().strip("()").replace(" ", "")


def exact_pin(spec: str) -> Optional[str]:
    """'==2.21.5' -> '2.21.5'; anything that is not one exact pin -> None."""
    match = re.fullmatch(r"===?([0-9][0-9A-Za-z.+!-]*)", spec)
    return match.group(1) if match else None


def linux_wheels(files: Iterable[DistFile], version: Version, machine: str) -> list[DistFile]:
    """The manylinux <machine> wheels of one version, free-threaded builds left out, only the
    highest build number per tag set, ordered by Python version (oldest first)."""
    out = []
    for f in files:
        if not f.is_wheel or f.yanked or f.version != version:
            continue
        if not any(p.startswith("manylinux") and p.endswith("_" + machine) for p in f.platforms):
            continue
        if all(t.abi.endswith("t") and t.abi.startswith("cp") for t in f.tags):
            continue
        out.append(f)
    # A re-uploaded build (torch-2.10.0-3-cp310-...) replaces the same tags' older builds, as in pip.
    newest: dict[frozenset, DistFile] = {}
    for f in out:
        if f.tags not in newest or f.build > newest[f.tags].build:
            newest[f.tags] = f
    return sorted(newest.values(), key=lambda f: (min(_tag_minor(t.interpreter) for t in f.tags), f.filename))


def _tag_minor(interpreter: str) -> int:
    match = re.fullmatch(r"cp3(\d+)", interpreter)
    return int(match.group(1)) if match else 0


class PythonTags:
    """Which CPython 3 minors a set of wheels installs on: cpXY tags, cpXY-abi3 (XY and
    later), or py3-none (every one)."""

    def __init__(self, wheels: Iterable[DistFile]):
        self.exact: set[int] = set()
        self.from_minor: Optional[int] = None
        self.any = False
        for w in wheels:
            for t in w.tags:
                if t.interpreter in ("py3", "py2.py3") and t.abi == "none":
                    self.any = True
                elif t.abi == "abi3" and _tag_minor(t.interpreter):
                    m = _tag_minor(t.interpreter)
                    self.from_minor = m if self.from_minor is None else min(self.from_minor, m)
                elif t.abi.startswith("cp") and not t.abi.endswith("t") and _tag_minor(t.interpreter):
                    self.exact.add(_tag_minor(t.interpreter))

    def admits(self, minor: int) -> bool:
        return self.any or minor in self.exact or (self.from_minor is not None and minor >= self.from_minor)

    @property
    def empty(self) -> bool:
        return not (self.any or self.exact or self.from_minor is not None)


def python_admits(spec: Optional[str], minor: int) -> bool:
    """Whether a Requires-Python admits some 3.<minor>.x (patch exclusions like !=3.14.1
    do not drop the minor)."""
    if not spec:
        return True
    specifier = SpecifierSet(spec)
    return any(specifier.contains(f"3.{minor}.{patch}") for patch in (0, 1, 2, 99))


def python_range(minors: Iterable[int]) -> str:
    """[10, 11, 12] -> '>=3.10,<3.13'; gaps become '!=3.X.*'."""
    ordered = sorted(set(minors))
    if not ordered:
        return ""
    gaps = [f"!=3.{m}.*" for m in range(ordered[0], ordered[-1]) if m not in ordered]
    return ",".join([f">=3.{ordered[0]}", f"<3.{ordered[-1] + 1}", *gaps])
