"""Hash-locked stacks: every Python distribution an image installs, `==` with its sha256 hashes.

A stack row pins torch, torchvision and DeepSpeed; everything below them (DeepSpeed's own
dependencies, numpy, pydantic, ninja, setuptools, pip, the nvidia-* wheels, the PyPI CUDA
toolkit) would float with the day of the build. The lock closes that gap. This module is the
lock file's format and what reads a stack's lock from the matrix; a real resolver makes it
(``uv pip compile --generate-hashes``, :mod:`envbuild.resolve.locking`) for the image's Python,
CPU and glibc, with ``--exclude-newer`` set to the lock's date, so the same inputs give the same
file. It lives in ``matrices/locks/<stack>.<arch>.txt`` and the image installs from it with
``pip --require-hashes --no-deps``: a changed or missing hash fails the build.

One lock file has two sections: ``[venv]`` (the stack's virtual environment) and, for stacks
whose nvcc comes from PyPI, ``[toolchain]`` (installed outside the venv). An image built with
``--nccl`` carries a third, ``[nccl]``, which the render adds to the image's copy: the NCCL wheel
that replaces the venv's pin of the same name, its hashes from matrices/nccl.yaml
(:meth:`Lock.with_nccl`).

>>> text = '''# stack: s1
... # arch: x86_64
... # [venv]
... torch==2.15.0 \\\\
...     --hash=sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
...     # via -r inputs
... ninja==1.13.2 \\\\
...     --hash=sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb
... '''
>>> lock = parse_lock(text, "s1.x86_64.txt")
>>> lock.pins()
{'torch': '2.15.0', 'ninja': '1.13.2'}
>>> print(lock.requirements("venv", exclude=("ninja",)).strip())
torch==2.15.0 \\
    --hash=sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
    # via -r inputs
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from packaging.utils import canonicalize_name

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError
from envbuild.base.files import StatCache, read_text

LOCK_DIR = "locks"
SECTIONS = ("venv", "toolchain", "nccl")
_SECTION = re.compile(r"^# \[(?P<name>[a-z]+)\]")
_HEADER = re.compile(r"^# (?P<key>[a-z-]+): (?P<value>.*)$")
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(?P<version>[^ \\;]+)")
# A pin's continuation lines: its hashes (pip's --hash=sha256:<64 hex digits>) and uv's comments.
_HASH_LINE = re.compile(r"^\s+(--hash=sha256:[0-9a-f]{64}( \\)?|#.*)\s*$")


EXT_LOCK_DIR = "ext"  # <matrix dir>/locks/ext/<extension>.<stack>.<arch>.txt


def ext_lock_path(matrix_dir: Path, ext_name: str, stack_id: str, arch: str) -> Path:
    """Where an extension's lock for one stack lives: what it needs beyond the stack's lock."""
    return Path(matrix_dir) / LOCK_DIR / EXT_LOCK_DIR / f"{ext_name}.{stack_id}.{arch}.txt"


def lock_path(matrix_dir: Path, stack_id: str, arch: str) -> Path:
    """Where a stack's lock lives: ``<matrix dir>/locks/<stack>.<arch>.txt``."""
    return Path(matrix_dir) / LOCK_DIR / f"{stack_id}.{arch}.txt"


# ---------------------------------------------------------------- the file


@dataclass(frozen=True)
class LockedPackage:
    """One pinned distribution: its block of the lock (the `==` line, hashes, annotations)."""

    name: str
    version: str
    block: str

    @property
    def key(self) -> str:
        return canonicalize_name(self.name)


@dataclass(frozen=True)
class Lock:
    """A parsed lock file: its header fields and its sections of pinned packages."""

    path: str
    text: str
    header: dict[str, str]
    sections: dict[str, tuple[LockedPackage, ...]] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def build_only(self) -> tuple[str, ...]:
        """Packages the build needs and the runtime drops (the first word of each entry)."""
        value = self.header.get("build-only", "")
        return tuple(canonicalize_name(word) for word in value.split(" (")[0].split() if word)

    def pins(self, section: str = "venv") -> dict[str, str]:
        """Canonical name -> version of one section."""
        return {p.key: p.version for p in self.sections.get(section, ())}

    def replaced(self) -> tuple[str, ...]:
        """The venv's packages another section replaces (the [nccl] override)."""
        return tuple(self.pins("nccl"))

    def with_nccl(self, package: str, version: str, sha256s: tuple[str, ...], notes: tuple[str, ...]) -> "Lock":
        """This lock with an [nccl] section: `package` at `version`, each of `sha256s` allowed,
        in place of the venv's pin of it (the image's copy of the lock; the matrix's is unchanged)."""
        hashes = "".join(f" \\\n    --hash=sha256:{h}" for h in sha256s)
        block = f"{package}=={version}{hashes}\n" + "".join(f"    # {grammar.one_line(n)}\n" for n in notes)
        return parse_lock(self.text.rstrip("\n") + "\n\n# [nccl]\n" + block, self.path)

    def requirements(self, section: str, only: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> str:
        """A hash-pinned requirements file of one section (or of some of its packages)."""
        only_keys = {canonicalize_name(n) for n in only}
        skip = {canonicalize_name(n) for n in exclude}
        blocks = [p.block for p in self.sections.get(section, ())
                  if p.key not in skip and (not only_keys or p.key in only_keys)]
        return "".join(blocks)


def parse_lock(text: str, path: str = "<lock>") -> Lock:
    """Parse a lock file written by :func:`envbuild.resolve.locking.write_lock` (uv's requirements
    format inside)."""
    header: dict[str, str] = {}
    sections: dict[str, list[LockedPackage]] = {}
    section: Optional[str] = None
    current: Optional[list] = None  # [name, version, lines]

    def close():
        if current is not None and section is not None:
            sections[section].append(LockedPackage(current[0], current[1], "".join(current[2])))

    for number, line in enumerate(text.splitlines(keepends=True), 1):
        marker = _SECTION.match(line)
        if marker:
            close()
            current = None
            section = marker.group("name")
            known = (*SECTIONS, *added_sections(header))
            if section not in known:
                raise EnvbuildError(f"{path}:{number}: unknown lock section [{section}] (known: {', '.join(known)}).")
            sections.setdefault(section, [])
            continue
        if section is None:
            field_match = _HEADER.match(line.rstrip("\n"))
            if field_match:
                header[field_match.group("key")] = field_match.group("value")
            continue
        if line[:1] in (" ", "\t") and current is not None:
            if not _HASH_LINE.match(line):
                raise EnvbuildError(f"{path}:{number}: {grammar.shown(line.strip(), 100)} is not a hash line of {current[0]}: a lock's hashes are "
                                    f"--hash=sha256:<64 lower-case hex digits>, which pip --require-hashes checks; "
                                    f"regenerate the lock with `envbuild lock`.")
            current[2].append(line)
            continue
        if not line.strip() or line.startswith("#"):
            continue
        close()
        pin = _PIN.match(line)
        if not pin:
            raise EnvbuildError(f"{path}:{number}: not a pinned requirement: {line.strip()!r}. A lock pins every "
                                f"package with ==; regenerate it with `envbuild lock`.")
        current = [pin.group("name"), pin.group("version"), [line]]
    close()
    if "venv" not in sections:
        raise EnvbuildError(f"{path}: no [venv] section; regenerate it with `envbuild lock`.")
    return Lock(path=path, text=text, header=header, sections={k: tuple(v) for k, v in sections.items()})


def added_sections(header: dict[str, str]) -> tuple[str, ...]:
    """The sections the header's `toolchain-adds` declares (NEED=REQUIREMENT words): one per
    CUDA library an extra of the toolchain adds for the ops that need it.

    >>> added_sections({"toolchain-adds": "curand=cuda-toolkit[nvcc,curand]==13.2.2"})
    ('curand',)
    """
    return tuple(word.split("=", 1)[0] for word in header.get("toolchain-adds", "").split())


_LOCKS = StatCache()  # a resolve per variant reads the same lock: parsed once while its file is unchanged


def load_lock(matrix_dir: Path, stack_id: str, arch: str) -> Optional[Lock]:
    """The stack's lock, or None when the matrix has none for it."""
    path = lock_path(matrix_dir, stack_id, arch)
    if not path.is_file():
        return None
    return _LOCKS.get((str(path),), [path], lambda: parse_lock(read_text(path, "lock file", "matrix"), str(path)))


def disagreements(lock: Lock, expected: dict[str, str]) -> list[str]:
    """What a lock says against its stack row: `expected` maps header fields (stack, arch,
    python, platform) and package names (torch, torchvision, deepspeed) to the row's values."""
    problems = []
    pins = lock.pins()
    for key, want in expected.items():
        if key in ("stack", "arch", "python", "platform"):
            have = lock.header.get(key)
        else:
            have = pins.get(canonicalize_name(key))
        if have != want:
            problems.append(f"{key} {have or 'missing'} in the lock, {want} in the stack")
    return problems


# ---------------------------------------------------------------- from the matrix


def wheel_platform(arch: str, glibc: str) -> str:
    """uv's --python-platform for a CPU and a glibc.

    >>> wheel_platform("x86_64", "2.36")
    'x86_64-manylinux_2_36'
    """
    return f"{arch}-manylinux_{glibc.replace('.', '_')}"


def expected_fields(matrix, stack, arch: str = "x86_64") -> dict[str, str]:
    """What a stack's lock for one CPU architecture must agree with: its row (and the
    torchvision its torch pins)."""
    release = matrix.torch_release(stack.torch)
    family = matrix.bases.families[stack.os]
    return {"stack": stack.id, "arch": arch, "python": stack.python,
            "platform": wheel_platform(arch, family.glibc), "torch": stack.torch,
            "torchvision": release.torchvision, "deepspeed": stack.deepspeed}


def stack_lock(matrix, stack, arch: str = "x86_64") -> Optional[Lock]:
    """The stack's lock for one CPU architecture, checked against its row; None when the
    matrix has no lock for it. A lock that disagrees with its row is an error naming the
    command that refreshes it.
    """
    lock = load_lock(matrix.directory, stack.id, arch)
    if lock is None:
        return None
    problems = disagreements(lock, expected_fields(matrix, stack, arch))
    if problems:
        raise EnvbuildError(f"The lock {lock.path} is stale for stack {stack.id}: {'; '.join(problems)}. "
                            f"Refresh it with `envbuild lock --stack {stack.id}` (it resolves the stack again "
                            f"with uv and rewrites the file).")
    return lock


def unlocked_reason(stack_id: str, torch_index: Optional[str], alternative: Optional[str] = None) -> str:
    """Why a stack has no lock, and what would make one, honestly for this stack; with the newest
    locked stack the rules also allow for the same request, when there is one.

    >>> unlocked_reason("torch2.14-cu126-py3.12", "https://download.pytorch.org/whl/cu126",
    ...                 "torch2.10-cu128-py3.12").split("; ")[-1]
    'a locked stack for this GPU: --stack torch2.10-cu128-py3.12 (older torch)'
    """
    if torch_index:
        host = urlsplit(torch_index).hostname or torch_index
        why = (f"none: its torch comes from {host} (PyTorch's CUDA-variant index), which `envbuild lock --stack "
               f"{stack_id}` must reach; it cannot be locked from a machine without it, so packages below "
               f"torch/DeepSpeed float")
    else:
        why = f"none yet: packages below torch/DeepSpeed float; `envbuild lock --stack {stack_id}` makes one"
    return why + (f"; a locked stack for this GPU: --stack {alternative} (older torch)" if alternative else "")


# ---------------------------------------------------------------- an extension's lock


def venv_digest(lock: Lock) -> str:
    """The sha256 of a lock's [venv] blocks: what an extension's lock was resolved against."""
    return hashlib.sha256("".join(p.block for p in lock.sections["venv"]).encode()).hexdigest()


def ext_lock_fields(ext, stack, arch: str, stack_lock_: Lock) -> dict[str, str]:
    """What an extension's lock must say in its header to be used: the extension's release, the
    stack and CPU, and the digest of the stack lock it was resolved against."""
    return {"extension": f"{ext.name}=={ext.version}", "stack": stack.id, "arch": arch,
            "stack-venv": venv_digest(stack_lock_)}


def ext_lock(matrix, ext, stack, arch: str, stack_lock_: Optional[Lock]) -> Optional[Lock]:
    """The lock of what `ext` needs beyond the stack's lock ([venv]: installed into the venv by
    hash before it), when the matrix has one that agrees with the extension's release and the
    stack lock as they are now; None otherwise (`envbuild lock --stack` makes it)."""
    if stack_lock_ is None:
        return None
    path = ext_lock_path(matrix.directory, ext.name, stack.id, arch)
    if not path.is_file():
        return None
    lock = parse_lock(read_text(path, "extension lock file", "matrix"), str(path))
    want = ext_lock_fields(ext, stack, arch, stack_lock_)
    return lock if all(lock.header.get(k) == v for k, v in want.items()) else None
