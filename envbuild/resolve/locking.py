"""Making a stack's Python lock with uv: the resolver driver behind `envbuild lock` and the
resolution `envbuild extend` runs against a stack's lock.

A lock (:mod:`envbuild.knowledge.lock`, the file's format) is made by a real resolver, ``uv pip
compile --generate-hashes``, for the image's Python, CPU and glibc, with ``--exclude-newer`` set
to the lock's date, so the same inputs give the same file; `envbuild lock --check` resolves again
and compares. DeepSpeed is an sdist whose ``setup.py`` imports torch, so uv cannot build it to
read its requirements; they are read from the sdist itself (``requirements/requirements.txt``
plus what ``setup.py`` appends for a CUDA torch) and handed to uv as the package's static metadata.
"""

from __future__ import annotations

import ast
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

try:  # the uv package ships its own binary; without it, a uv on PATH
    from uv import find_uv_bin
except ImportError:  # pragma: no cover - uv is a dependency
    find_uv_bin = None

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.files import write_owned
from envbuild.base.resources import is_installed_copy
from envbuild.knowledge import rules
from envbuild.knowledge.lock import (
    disagreements,
    expected_fields,
    ext_lock_fields,
    ext_lock_path,
    load_lock,
    lock_path,
    parse_lock,
)
from envbuild.refresh.pypi import PyPI, default_cache_dir

PYPI_SIMPLE = "https://pypi.org/simple"


@dataclass(frozen=True)
class LockInputs:
    """What a stack's lock is resolved from (all derived from the matrix row)."""

    stack: str
    arch: str
    python: str
    platform: str  # uv's --python-platform, e.g. x86_64-manylinux_2_36
    venv: tuple[str, ...]  # requirements of the venv
    toolchain: tuple[str, ...] = ()  # requirements installed outside the venv (PyPI nvcc)
    adds: tuple[tuple[str, str], ...] = ()  # (need, the toolchain with its extra): a section each
    indexes: tuple[str, ...] = (PYPI_SIMPLE,)  # searched first to last
    deepspeed: str = ""  # the DeepSpeed version, whose requirements come from its sdist
    deepspeed_requires: tuple[str, ...] = ()
    deepspeed_requires_source: str = ""
    build_only: tuple[str, ...] = ()
    build_only_reason: str = ""


def uv_binary() -> str:
    """The uv executable: the `uv` Python package's own binary, else one on PATH."""
    if find_uv_bin is not None:
        with contextlib.suppress(FileNotFoundError):  # the package without its binary
            return find_uv_bin()
    found = shutil.which("uv")
    if found:
        return found
    raise EnvbuildError("envbuild lock and extend need uv (the resolver that writes the locks): "
                        "`pip install 'uv>=0.8,<0.14'`, or reinstall envbuild, which depends on it.")


def uv_version() -> str:
    out = subprocess.run([uv_binary(), "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "uv (unknown version)"


def _uv_config(metadata: tuple[tuple[str, str, tuple[str, ...]], ...], directory: Path) -> Path:
    """A uv.toml giving each (name, version, requirements) as the package's static metadata: an
    sdist whose setup.py imports torch (DeepSpeed, mamba-ssm), which uv cannot build."""
    # TOML basic strings are JSON strings (json.dumps escapes what TOML needs escaped).
    path = directory / "uv.toml"
    path.write_text("".join("[[dependency-metadata]]\n"
                            f"name = {json.dumps(name)}\nversion = {json.dumps(version)}\n"
                            f"requires-dist = [{', '.join(json.dumps(r) for r in requires)}]\n"
                            for name, version, requires in metadata))
    return path


def compile_requirements(requirements: tuple[str, ...], inputs: LockInputs, exclude_newer: str, directory: Path,
                         constraints: Optional[Path] = None,
                         metadata: tuple[tuple[str, str, tuple[str, ...]], ...] = (),
                         wheels_only_but: Optional[str] = None) -> str:
    """Run `uv pip compile` and return its output (no header). `metadata`: packages' requirements
    given as data (besides DeepSpeed's); `wheels_only_but`: every package a wheel except this one
    (an extension lock: nothing of its closure may compile in the image)."""
    source = directory / "requirements.in"
    source.write_text("".join(r + "\n" for r in requirements))
    # uv: --index-url is the last resort, each --extra-index-url is searched before it.
    *extra, default = inputs.indexes
    command = [uv_binary(), "pip", "compile", str(source), "--generate-hashes", "--emit-index-annotation",
               "--no-header", "--python-version", inputs.python, "--python-platform", inputs.platform,
               "--exclude-newer", exclude_newer, "--index-url", default,
               *(word for url in extra for word in ("--extra-index-url", url))]
    metadata = (*((("deepspeed", inputs.deepspeed, inputs.deepspeed_requires),) if inputs.deepspeed_requires else ()),
                *metadata)
    if metadata:
        command += ["--config-file", str(_uv_config(metadata, directory))]
    if constraints is not None:
        command += ["--constraint", str(constraints)]
    if wheels_only_but is not None:
        command += ["--only-binary", ":all:", *(("--no-binary", wheels_only_but) if wheels_only_but else ())]
    # Only what the lock says counts: no uv.toml of the user or the machine, no UV_* setting
    # (UV_EXTRA_INDEX_URL would add an index; inside an envbuild image UV_CONSTRAINT is the guard).
    env = {name: value for name, value in os.environ.items() if not name.startswith("UV_")}
    env.update(UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1", UV_NO_CONFIG="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=directory, check=False)
    if result.returncode != 0:
        detail = "\n".join(line for line in result.stderr.strip().splitlines()
                           if "will be used to build dependencies" not in line)
        raise ResolveFailed(requirements, detail)
    return result.stdout


class ResolveFailed(EnvbuildError):
    """uv found no solution; `detail` is uv's own explanation."""

    def __init__(self, requirements, detail: str):
        self.requirements = tuple(requirements)
        self.detail = detail
        super().__init__(detail)


def write_lock(inputs: LockInputs, exclude_newer: str) -> str:
    """The lock file's text for `inputs`, resolved by uv as of `exclude_newer`."""
    with tempfile.TemporaryDirectory(prefix="envbuild-lock-") as tmp:
        directory = Path(tmp)
        venv = compile_requirements(inputs.venv, inputs, exclude_newer, directory)
        toolchain = compile_requirements(inputs.toolchain, inputs, exclude_newer, directory) if inputs.toolchain else ""
        adds = {need: _beyond(compile_requirements((requirement,), inputs, exclude_newer, directory), venv + toolchain)
                for need, requirement in inputs.adds}
    lines = [
        f"# envbuild lock: every Python distribution the image of stack {inputs.stack} ({inputs.arch}) installs,",
        "# each == with its sha256 hashes; the build installs it with pip --require-hashes --no-deps.",
        f"# Do not edit: `envbuild lock --stack {inputs.stack}` writes it (uv pip compile, as of exclude-newer),",
        "# `envbuild lock --check` tells whether it is current.",
        f"# stack: {inputs.stack}",
        f"# arch: {inputs.arch}",
        f"# python: {inputs.python}",
        f"# platform: {inputs.platform}",
        f"# index: {' '.join(inputs.indexes)}",
        f"# exclude-newer: {exclude_newer}",
        f"# resolver: {uv_version()}",
        f"# inputs: {' '.join(inputs.venv)}",
    ]
    if inputs.toolchain:
        lines.append(f"# toolchain-inputs: {' '.join(inputs.toolchain)}")
    if inputs.adds:
        lines.append(f"# toolchain-adds: {' '.join(f'{need}={requirement}' for need, requirement in inputs.adds)}")
    if inputs.deepspeed_requires:
        lines.append(f"# deepspeed-requires: {' '.join(inputs.deepspeed_requires)} ({inputs.deepspeed_requires_source})")
    if inputs.build_only:
        lines.append(f"# build-only: {' '.join(inputs.build_only)} ({inputs.build_only_reason})")
    text = "\n".join(lines) + "\n\n# [venv]\n" + venv
    if toolchain:
        text += "\n# [toolchain]\n" + toolchain
    for need, section in adds.items():
        text += f"\n# [{need}]\n" + section
    return text


def _beyond(compiled: str, locked: str) -> str:
    """The blocks of `compiled` (uv's output for the toolchain with one more extra) that the
    venv and toolchain sections (`locked`) do not hold: what the extra adds (nothing where
    torch's own wheels already bring it, as torch 2.11's nvidia-curand)."""
    have = set(parse_lock("# [venv]\n" + locked).pins())
    return "".join(p.block for p in parse_lock("# [venv]\n" + compiled).sections["venv"] if p.key not in have)


def today() -> str:
    """The lock date for a new lock: the start of today, UTC (a whole day, so a re-run the
    same day gives the same file)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT00:00:00Z")


def normalized(text: str) -> str:
    """A lock's text without the resolver-version line (what --check compares)."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("# resolver:"))


# ---------------------------------------------------------------- DeepSpeed's requirements


def deepspeed_install_requires(files: dict[str, bytes], where: str) -> list[str]:
    """What DeepSpeed built for CUDA declares: requirements/requirements.txt, plus each name
    setup.py appends to install_requires (nvidia-ml-py, when torch is a CUDA build).

    >>> files = {"requirements/requirements.txt": b"hjson\\nninja\\n# c\\ntorch>=2.0.0\\n",
    ...          "setup.py": b"install_requires = []\\nif cuda:\\n    install_requires.append('nvidia-ml-py')\\n"}
    >>> deepspeed_install_requires(files, "ds.tar.gz")
    ['hjson', 'ninja', 'torch>=2.0.0', 'nvidia-ml-py']
    """
    text = files.get("requirements/requirements.txt")
    if text is None:
        raise EnvbuildError(f"{where}: no requirements/requirements.txt in the sdist.")
    requires = []
    for line in text.decode().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            Requirement(line)
        except InvalidRequirement:
            raise EnvbuildError(f"{where}: requirements/requirements.txt has {line!r}, not a requirement.") from None
        requires.append(line)
    tree = ast.parse(files.get("setup.py", b""))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "install_requires"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            requires.append(node.args[0].value)
    return requires


def fetch_deepspeed_requires(version: str, progress: Callable[[str], None] = lambda _: None) -> tuple[list[str], str]:
    """DeepSpeed `version`'s requirements read from its PyPI sdist, and where they came from."""
    index = PyPI(default_cache_dir(), unreachable_hint="")
    sdists = [f for f in index.files("deepspeed") if f.filename.endswith(".tar.gz") and f.version == Version(version)]
    if not sdists:
        raise EnvbuildError(f"DeepSpeed {version} has no sdist on PyPI; the lock reads its requirements from it.")
    progress(f"reading {sdists[0].filename}")
    files = index.sdist_files(sdists[0])
    return (deepspeed_install_requires(files, sdists[0].filename),
            f"{sdists[0].filename}: requirements/requirements.txt and setup.py's install_requires.append")


# ---------------------------------------------------------------- from the matrix


def lock_inputs(matrix, stack, deepspeed_requires: Optional[tuple[list[str], str]] = None,
                arch: str = "x86_64") -> LockInputs:
    """Everything a stack's lock is resolved from, derived from its matrix row.

    `deepspeed_requires` is (requirements, source) read from DeepSpeed's sdist (fetched
    from PyPI when not given).
    """
    fields = expected_fields(matrix, stack, arch)
    release = matrix.torch_release(stack.torch)
    torch_index = matrix.torch_index(release, stack.cuda)
    ds = matrix.deepspeed_file
    venv = (f"torch=={stack.torch}", f"torchvision=={fields['torchvision']}", f"deepspeed=={stack.deepspeed}",
            *sorted(ds.build_requires))
    toolchain = matrix.bases.toolchains[stack.toolchain]
    toolchain_inputs: tuple[str, ...] = ()
    adds: tuple[tuple[str, str], ...] = ()
    if toolchain.install is not None:
        install = toolchain.install
        extras = install.extras_for(stack.cuda_toolkit)
        toolchain_inputs = (f"{install.package}[{','.join(extras)}]=={stack.cuda_toolkit}",)
        adds = tuple((need, f"{install.package}[{','.join([*extras, add.extra])}]=={stack.cuda_toolkit}")
                     for need, add in toolchain.adds.items())
    requires, source = deepspeed_requires or fetch_deepspeed_requires(stack.deepspeed)
    return LockInputs(
        stack=stack.id, arch=arch, python=stack.python, platform=fields["platform"],
        venv=venv, toolchain=toolchain_inputs, adds=adds,
        indexes=((torch_index,) if torch_index else ()) + (PYPI_SIMPLE,),
        deepspeed=stack.deepspeed, deepspeed_requires=tuple(requires), deepspeed_requires_source=source,
        build_only=tuple(sorted(ds.build_only)),
        build_only_reason=("; ".join(f"{name}: {why}" for name, why in sorted(ds.build_only.items()))
                           if len(ds.build_only) > 1 else "".join(ds.build_only.values())),
    )


# ---------------------------------------------------------------- an extension's lock


def _fits(matrix, e, stack, arch: str) -> bool:
    """The extension can be in the stack's image on `arch`, installed from a wheel that fits or
    from its sdist with its install_requires given as data (uv cannot read them otherwise)."""
    return (not e.unbuildable and not e.unpinned and arch in e.cpu_arch
            and all(rules.contains(spec, v) for spec, v in ((e.torch, stack.torch), (e.cuda, stack.cuda),
                                                            (e.python, stack.python)))
            and rules.glibc_rejection(matrix, stack, e, arch) is None
            and (_wheel(e, stack, arch) is not None or (e.compiled and e.requires_dist is not None)))


def _wheel(e, stack, arch: str):
    return rules.extension_wheel(e, stack, arch)[0] if e.wheels else None


def _needed(matrix, ext, stack) -> list:
    """The extensions `ext` needs that fit the stack (TE's binding: the core of its CUDA major)."""
    return [matrix.extensions[n] for need in ext.needs for n in rules.extension_needs(need)
            if n in matrix.extensions and rules.contains(matrix.extensions[n].cuda, stack.cuda)]


def locked_extensions(matrix, stack, arch: str, stack_lock_) -> list:
    """The extensions that fit the stack on `arch` and need something its lock does not hold, each
    of which gets a lock of its own: those installed from a PyPI wheel (FA4, Transformer Engine's
    core), and those compiled from an sdist whose install_requires extensions.yaml gives
    (mamba-ssm, TE's binding); an extension another needs comes first (its pins constrain)."""
    have = set(stack_lock_.pins())
    exts = [e for e in matrix.extensions.values() if _fits(matrix, e, stack, arch)
            and any(rules.requirement_name(r) not in have for r in rules.extension_requirements(e, stack))]
    needed = {n.name for e in exts for n in _needed(matrix, e, stack)}
    return sorted(exts, key=lambda e: e.name not in needed)


def write_ext_lock(ext, stack, inputs: LockInputs, stack_text: str, exclude_newer: str,
                   needed: tuple[tuple[str, str, str], ...] = ()) -> str:
    """The lock of what `ext` needs beyond the stack's lock: uv resolves the extension's own
    release (its wheel's Requires-Dist, or for an sdist its install_requires from extensions.yaml
    as static metadata) and its CUDA major's requirements, wheels only, with every package of the
    stack's [venv] as a constraint, for the stack's Python, CPU and glibc, as of the stack lock's
    date; what the stack lock already holds, and the extension itself and those it needs
    (installed by their own hash from extensions.yaml), are left out. `needed`: (name, version,
    lock text) of each extension it needs, whose pins constrain it too."""
    stack_lock_ = parse_lock(stack_text)
    major = stack.cuda.split(".")[0]
    requirements = (f"{ext.name}=={ext.version}", *ext.requires_by_cuda.get(major, []))
    sdist = _wheel(ext, stack, inputs.arch) is None
    requires = tuple(r.format(cuda_major=major) for r in ext.requires_dist.requirements) if sdist else ()
    pins = {**stack_lock_.pins(), **{k: v for _, _, text in needed if text for k, v in parse_lock(text).pins().items()},
            **{rules.requirement_name(name): version for name, version, _ in needed}}
    with tempfile.TemporaryDirectory(prefix="envbuild-ext-lock-") as tmp:
        directory = Path(tmp)
        constraints = directory / "stack.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
        compiled = compile_requirements(requirements, replace(inputs, deepspeed_requires=()), exclude_newer, directory,
                                        constraints, metadata=((ext.name, ext.version, requires),) if sdist else (),
                                        wheels_only_but=ext.name if sdist else "")
    skip = {*stack_lock_.pins(), rules.requirement_name(ext.name), *(rules.requirement_name(n) for n, _, _ in needed)}
    beyond = "".join(p.block for p in parse_lock("# [venv]\n" + compiled).sections["venv"] if p.key not in skip)
    fields = ext_lock_fields(ext, stack, inputs.arch, stack_lock_)
    lines = [f"# envbuild extension lock: what {ext.name} {ext.version} needs beyond the lock of stack {stack.id} "
             f"({inputs.arch}),",
             "# each == with its sha256 hashes; the build installs it into the venv with pip --require-hashes --no-deps.",
             f"# Do not edit: `envbuild lock --stack {stack.id}` writes it with the stack's lock; `envbuild lock --check`"
             " checks both.",
             *(f"# {k}: {v}" for k, v in fields.items()),
             f"# python: {inputs.python}", f"# platform: {inputs.platform}", f"# index: {' '.join(inputs.indexes)}",
             f"# exclude-newer: {exclude_newer}", f"# resolver: {uv_version()}",
             f"# inputs: {' '.join(requirements)} (constraints: the stack lock's [venv]"
             f"{''.join(f', {n}=={v} and its lock' for n, v, _ in needed)}; wheels only"
             f"{f' but {ext.name} itself' if sdist else ''})"]
    if sdist:
        lines.append(f"# requires-dist: {' '.join(requires)} ({ext.requires_dist.source})")
    return "\n".join(lines) + "\n\n# [venv]\n" + beyond


def lock_extensions(matrix, stack, arch: str, inputs: LockInputs, stack_text: str, date: str,
                    check: bool) -> list["LockOutcome"]:
    """Make (or with `check`, compare) the lock of each extension the stack needs one for."""
    outcomes, made = [], {}
    for ext in locked_extensions(matrix, stack, arch, parse_lock(stack_text)):
        path = ext_lock_path(matrix.directory, ext.name, stack.id, arch)
        needed = tuple((n.name, n.version, made.get(n.name, "")) for n in _needed(matrix, ext, stack))
        try:
            text = made[ext.name] = write_ext_lock(ext, stack, inputs, stack_text, date, needed)
        except EnvbuildError as e:
            outcomes.append(LockOutcome(stack.id, arch, path, "failed", f"--ext {ext.name}'s lock: {e}"))
            continue
        existing = path.read_text() if path.is_file() else None
        same = existing is not None and normalized(existing) == normalized(text)
        if check:
            outcomes.append(LockOutcome(stack.id, arch, path, "current" if same else "stale",
                                        "" if same else f"--ext {ext.name}: " + ("no lock yet" if existing is None
                                                                                 else "resolving again gives another file")))
            continue
        if not same:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_owned(path, text.encode(), lambda old: old.startswith(b"# envbuild extension lock"),
                        "Move it away first: `envbuild lock` writes only the files it wrote.")
        outcomes.append(LockOutcome(stack.id, arch, path, "unchanged" if same else "written"))
    return outcomes


# ---------------------------------------------------------------- every stack


@dataclass(frozen=True)
class LockOutcome:
    stack: str
    arch: str
    path: Path
    state: str  # "written", "unchanged", "current", "stale", "unreachable", "failed"
    detail: str = ""
    hosts: tuple[str, ...] = ()  # unreachable: the index hosts that could not be reached


# uv's and urllib's words for an index this machine cannot reach (DNS, refused, timed out, proxy):
# a lock that cannot be resolved from here is "cannot be checked here", not "stale".
_UNREACHABLE = re.compile(r"failed to fetch|error sending request|dns error|failed to lookup|name or service not "
                          r"known|temporary failure in name resolution|connection (?:refused|reset)|timed out|"
                          r"network is unreachable|tcp connect error|urlopen error|cannot be reached|"
                          r"could not connect", re.I)


def unreachable(message: str) -> bool:
    """Whether a resolution failed because an index could not be reached (not for want of a solution).

    >>> unreachable("error: Failed to fetch: `https://download.pytorch.org/whl/cu126/torch/`"), unreachable(
    ...     "No solution found when resolving dependencies")
    (True, False)
    """
    return bool(_UNREACHABLE.search(message))


_URL_HOST = re.compile(r"https?://([A-Za-z0-9.-]+)")


def unreachable_hosts(message: str, indexes: tuple[str, ...]) -> list[str]:
    """The index hosts a resolution could not reach: those of `indexes` (and PyPI's file host)
    the error names, else all of them (a DNS or proxy error may name none, or only the proxy).

    >>> unreachable_hosts("error sending request for url (https://download.pytorch.org/whl/cu126/torch/)",
    ...                   ("https://download.pytorch.org/whl/cu126", PYPI_SIMPLE))
    ['download.pytorch.org']
    >>> unreachable_hosts("dns error: failed to lookup address information", (PYPI_SIMPLE,))
    ['pypi.org']
    """
    known = [urlsplit(i).hostname or i for i in indexes]
    named = [h.lower() for h in _URL_HOST.findall(message) if h.lower() in (*known, "files.pythonhosted.org")]
    return list(dict.fromkeys(named or known))


def lock_summary(outcomes: list, check: bool, command: str = "envbuild lock") -> list[str]:
    """What did not pass, one sentence per kind: stale locks (and the command that refreshes
    them), locks that cannot be checked from this machine (an index it cannot reach: not stale),
    failures. Empty: all current (or written). `command`: `envbuild lock --os` for OS locks."""
    total, out = len(outcomes), []
    stale = [o for o in outcomes if o.state == "stale"]
    if stale:
        out.append(f"{len(stale)} of {total} locks are stale (resolving again gives another file, or there is none "
                   f"yet); refresh with: {command} {' '.join(dict.fromkeys('--stack ' + o.stack for o in stale))}")
    far = [o for o in outcomes if o.state == "unreachable"]
    if far and command.endswith("--os"):
        out.append(f"{len(far)} of {total} OS locks cannot be {'checked' if check else 'made'} from here (a base "
                   f"image or the archive cannot be reached; this says nothing about whether they are current): "
                   f"{', '.join(dict.fromkeys(o.stack for o in far))}. Run it where the bases' registries and the "
                   f"snapshot service are reachable (the publish CI), or give --apt-snapshot a mirror.")
    elif far:
        hosts = ", ".join(dict.fromkeys(h for o in far for h in o.hosts))
        out.append(f"{len(far)} of {total} locks cannot be {'checked' if check else 'made'} from here (an index "
                   f"they resolve from cannot be reached; this says nothing about whether they are current): "
                   f"{', '.join(dict.fromkeys(o.stack for o in far))}. Run it where {hosts or 'PyPI'} "
                   f"{'are' if ', ' in hosts else 'is'} reachable (the publish CI).")
    failed = [o for o in outcomes if o.state == "failed"]
    if failed:
        out.append(f"{len(failed)} of {total} locks failed: {', '.join(dict.fromkeys(o.stack for o in failed))} "
                   f"(the reasons are above)")
    return out


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:200]


def lock_stacks(matrix, stack_ids: tuple[str, ...] = (), check: bool = False, upgrade: bool = False,
                progress: Callable[[str], None] = lambda _: None) -> list[LockOutcome]:
    """Resolve (and write, unless `check`) the locks of some stacks, or of all.

    A lock keeps its date (uv's --exclude-newer) while it agrees with its row, so re-running
    gives the same file; `upgrade`, or a row that moved, resolves as of today.
    """
    if not check and is_installed_copy(matrix.directory):
        raise EnvbuildError(f"envbuild lock writes into the matrix it reads, and that is the copy installed with "
                            f"envbuild ({matrix.directory}), which the next `pip install` replaces. Copy it to a "
                            f"directory you own and lock there: cp -r {matrix.directory} ./matrix && envbuild lock "
                            f"--matrix-dir ./matrix (then set ENVBUILD_MATRIX_DIR=./matrix for every command).")
    known = [s.id for s in matrix.stacks]
    for stack_id in stack_ids:
        if stack_id not in known:
            raise EnvbuildError(f"--stack {grammar.shown(stack_id)}: no such stack in {matrix.directory / 'stacks.yaml'}. "
                                f"Nearest: {', '.join(nearest(stack_id, known)) or known[-1]}; `envbuild matrix` lists them all.")
    requires_cache: dict[str, tuple[list[str], str]] = {}
    outcomes = []
    for stack, arch in [(s, arch) for s in matrix.stacks if not stack_ids or s.id in stack_ids
                        for arch in matrix.stack_arches(s)]:
        path = lock_path(matrix.directory, stack.id, arch)
        try:
            existing = load_lock(matrix.directory, stack.id, arch)
            if existing is not None and not existing.text.startswith("# envbuild lock"):
                raise EnvbuildError(f"{path} was not written by envbuild lock; move it away first.")
            agrees = existing is not None and not disagreements(existing, expected_fields(matrix, stack, arch))
            date = existing.header.get("exclude-newer", today()) if agrees and not upgrade else today()
            if stack.deepspeed not in requires_cache:
                requires_cache[stack.deepspeed] = fetch_deepspeed_requires(stack.deepspeed, progress)
            progress(f"resolving {stack.id} ({arch}) as of {date}")
            inputs = lock_inputs(matrix, stack, requires_cache[stack.deepspeed], arch)
            text = write_lock(inputs, date)
        except EnvbuildError as e:
            if not unreachable(str(e)):
                outcomes.append(LockOutcome(stack.id, arch, path, "failed", str(e)))
                continue
            torch_index = matrix.torch_index(matrix.torch_release(stack.torch), stack.cuda)
            hosts = unreachable_hosts(str(e), ((torch_index,) if torch_index else ()) + (PYPI_SIMPLE,))
            outcomes.append(LockOutcome(stack.id, arch, path, "unreachable",
                                        f"cannot be {'checked' if check else 'made'} from here: {' or '.join(hosts)} "
                                        f"cannot be reached ({_first_line(str(e))})", tuple(hosts)))
            continue
        same = existing is not None and normalized(existing.text) == normalized(text)
        outcomes += lock_extensions(matrix, stack, arch, inputs, text, date, check)
        if check:
            outcomes.append(LockOutcome(stack.id, arch, path, "current" if same else "stale",
                                        "" if same else ("no lock yet" if existing is None else
                                                         "resolving again gives another file")))
            continue
        if not same:
            write_owned(path, text.encode(), lambda old: old.startswith(b"# envbuild lock"),
                        "Move it away first: `envbuild lock` writes only the files it wrote.")
        outcomes.append(LockOutcome(stack.id, arch, path, "unchanged" if same else "written"))
    return outcomes
