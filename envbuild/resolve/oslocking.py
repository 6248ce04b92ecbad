"""Making a stack's OS lock: apt's solver run in a throwaway container of each stage's base image
(steps/os-resolve.sh), its answer read back and written in the format of
:mod:`envbuild.knowledge.oslock`; the driver behind `envbuild lock --os` and its --check.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.files import write_owned
from envbuild.base.grammar import redact, shown
from envbuild.base.resources import is_installed_copy, templates_dir
from envbuild.knowledge.oslock import (
    MAGIC,
    STAGES,
    Deb,
    StageLock,
    archive_url,
    format_os_lock,
    load_os_lock,
    os_lock_path,
    parse_os_lock,
    stage_inputs,
)
from envbuild.oci.registry import repo_of

RESOLVER = "os-resolve.sh"  # templates/files/steps: runs in a throwaway container of the base


def timestamp_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


@dataclass(frozen=True)
class Resolved:
    apt: str
    base: tuple[tuple[str, str, str], ...]
    debs: tuple[Deb, ...]


def parse_resolver_output(out: str, roots: dict[str, str], where: str) -> Resolved:
    """Read os-resolve.sh's @@ lines. `roots` maps each archive name to the URL apt fetched it
    from; a .deb's URL tells which archive holds it.

    >>> out = '''@@apt 2.6.1
    ... @@base libc6 amd64 2.36-9
    ... @@deb g++ amd64 4:12.2.0-3 ''' + "ab" * 32 + ''' 1640 pool/main/g/gcc-defaults/g++_12.2.0-3_amd64.deb
    ... @@uri http://h/debian/pool/main/g/gcc-defaults/g%2b%2b_12.2.0-3_amd64.deb'''
    >>> r = parse_resolver_output(out, {"debian": "http://h/debian", "debian-security": "http://h/debian-security"}, "x")
    >>> r.debs[0].archive, r.base
    ('debian', (('libc6', 'amd64', '2.36-9'),))
    """
    apt, base, pending, uris = "", [], [], []
    for line in out.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "@@apt":
            apt = rest.strip()
        elif kind == "@@base":
            base.append(tuple(rest.split()))
        elif kind == "@@deb":
            pending.append(rest.split())
        elif kind == "@@uri":
            uris.append(re.sub(r"%([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), rest.strip()))
    debs = []
    for name, arch, version, sha, size, filename in pending:
        root = next((archive for archive, url in sorted(roots.items(), key=lambda kv: -len(kv[1]))
                     for uri in uris if uri == f"{url.rstrip('/')}/{filename}"), None)
        if root is None:
            raise EnvbuildError(f"{where}: apt would fetch {filename} from none of the lock's archives "
                                f"({', '.join(roots.values())}).")
        debs.append(Deb(name, arch, version, sha, int(size), root, filename))
    text = "\n".join([*(f"base {' '.join(b)}" for b in base), *(d.line() for d in debs)])
    sources = "".join(f"# source: {archive} any / main\n" for archive in roots)
    parse_os_lock(f"{MAGIC}\n# stack: x\n# arch: x\n# snapshot: 20000101T000000Z\n{sources}"
                  f"# [builder]\n# base: x\n# base-id: x\n{text}\n", where)  # the grammar, before it is written
    return Resolved(apt, tuple(base), tuple(debs))


def resolver_script() -> str:
    return (templates_dir() / "files" / "steps" / RESOLVER).read_text()


def sources_list(sources, url_for: Callable[[str], str], keyring: str, check_valid_until: bool) -> str:
    """apt's one-line-style sources for the lock's archives (only these: not the base's own)."""
    option = f"[signed-by={keyring}{'' if check_valid_until else ' check-valid-until=no'}]"
    return "".join(f"deb {option} {url_for(archive)} {suite} {' '.join(components)}\n"
                   for archive, suites, components in sources for suite in suites)


def resolve_stage(engine, base_ref: str, platform: str, packages: tuple[str, ...], sources_text: str,
                  roots: dict[str, str], where: str) -> Resolved:
    """Run apt's solver for `packages` in a throwaway container of `base_ref` (installs nothing)."""
    result = engine.run(base_ref, ["bash", "-c", resolver_script(), RESOLVER, *packages], timeout=900,
                        network="host", env={"ENVBUILD_APT_SOURCES": sources_text}, platform=platform)
    if result.timed_out or result.exit_code != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-12:])
        raise EnvbuildError(f"{where}: apt could not resolve the packages on {base_ref}"
                            f"{' (timed out)' if result.timed_out else ''}:\n{tail}")
    return parse_resolver_output(result.stdout, roots, where)


@dataclass(frozen=True)
class OsLockOutcome:
    stack: str
    arch: str
    path: Path
    state: str  # written, unchanged, current, stale, unreachable, failed, skipped
    detail: str = ""


_UNREACHABLE = re.compile(r"could not resolve|temporary failure resolving|failed to fetch|connection (?:refused|"
                          r"timed out)|unable to connect|no route to host|network is unreachable|cannot reach|"
                          r"pull access denied|not found: manifest unknown|i/o timeout|TLS handshake", re.I)


def lock_stack_os(engine, matrix, stack, arch: str, platform: str, bases: dict[str, str], snapshot: Optional[str],
                  progress: Callable[[str], None] = lambda _: None, check: bool = False,
                  now: Callable[[], str] = timestamp_now) -> OsLockOutcome:
    """Resolve (and write, unless `check`) one stack's OS lock for one CPU architecture.

    `bases`: stage -> the base image to resolve on (the stack's, or --base-image's). `snapshot`:
    where to resolve from: None is the family's snapshot service at this moment (or, with
    `check`, at the lock's own moment), 'live' the live archive, else a URL template.
    """
    path = os_lock_path(matrix.directory, stack.id, arch)
    family = matrix.bases.families[stack.os]
    apt = family.apt
    if apt is None:
        return OsLockOutcome(stack.id, arch, path, "skipped", f"bases.yaml gives family {stack.os} no apt archive")
    existing = load_os_lock(matrix.directory, stack.id, arch)
    moment = existing.snapshot if (check and existing and snapshot is None) else now()
    if snapshot is None:
        template, resolved_from = apt.snapshot, "snapshot"
    elif snapshot == "live":
        template, resolved_from = apt.live_url(arch), "live"
    else:
        template, resolved_from = snapshot, "mirror"
    names = {src.archive: apt.archive_name(src.archive, arch) for src in apt.sources}
    roots = {names[a]: archive_url(template, names[a], moment) for a in names}
    sources = tuple((names[s.archive], tuple(s.suites), tuple(s.components)) for s in apt.sources)
    text_sources = sources_list(sources, lambda a: roots[a], apt.keyring, apt.check_valid_until or resolved_from != "snapshot")
    stages = {}
    apt_version = ""
    for stage in STAGES:
        ref = bases[stage]
        inputs = stage_inputs(family, stack.python, stage)
        progress(f"resolving {stack.id} ({arch}) stage {stage} on {ref} from {redact(roots[next(iter(roots))])}")
        try:
            info = _base_info(engine, ref)
            resolved = resolve_stage(engine, ref, platform, inputs, text_sources, roots,
                                     f"{stack.id} ({arch}) {stage}")
        except EnvbuildError as e:
            state = "unreachable" if _UNREACHABLE.search(str(e)) else "failed"
            return OsLockOutcome(stack.id, arch, path, state, str(e))
        apt_version = resolved.apt
        stages[stage] = StageLock(info[0], info[1], inputs, resolved.base, resolved.debs)
    header = {"stack": stack.id, "arch": arch, "family": stack.os, "snapshot": moment,
              "resolved-from": f"{resolved_from} {redact(template)}", "resolver": f"apt {apt_version} in the base image"}
    text = format_os_lock(header, sources, stages)
    same = existing is not None and _comparable(existing.text) == _comparable(text)
    if check:
        return OsLockOutcome(stack.id, arch, path, "current" if same else "stale",
                             "" if same else ("no OS lock yet" if existing is None else "resolving again gives other packages"))
    if same:
        return OsLockOutcome(stack.id, arch, path, "unchanged")
    if is_installed_copy(matrix.directory):
        raise EnvbuildError(f"envbuild lock --os writes into the matrix it reads, and that is the copy installed with "
                            f"envbuild ({matrix.directory}); copy it to a directory you own and pass --matrix-dir.")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_owned(path, text.encode(), lambda old: old.startswith(MAGIC.encode()),
                "Move it away first: `envbuild lock --os` writes only the files it wrote.")
    return OsLockOutcome(stack.id, arch, path, "written")


def _comparable(text: str) -> str:
    """What --check compares: the packages and bases, not the moment or the apt that said so."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("# snapshot:", "# resolver:", "# resolved-from:")))


def _base_info(engine, ref: str) -> tuple[str, str]:
    """(the base as the build should name it: ref@digest where this engine knows a registry
    digest, its image ID); pulled first when the engine does not have it."""
    try:
        info = engine.inspect(ref)
    except EnvbuildError:
        try:
            engine.pull(ref)
        except Exception as e:  # the engine's RegistryError (a room above this one), in the registry's words
            raise EnvbuildError(f"cannot pull the base image {ref}: {getattr(e, 'message', e)}") from None
        info = engine.inspect(ref)
    name = ref.split("@", 1)[0]
    digest = next((d.partition("@")[2] for d in info.repo_digests if d.partition("@")[0] == repo_of(ref)), None)
    return (f"{name}@{digest}" if digest else name), info.id


def lock_os_stacks(engine, matrix, stack_ids: tuple[str, ...] = (), base_image: Optional[str] = None,
                   snapshot: Optional[str] = None, check: bool = False, platforms: Optional[dict] = None,
                   progress: Callable[[str], None] = lambda _: None) -> list[OsLockOutcome]:
    """Resolve (or --check) the OS locks of some stacks, or of every stack that has one (check)
    or whose family has an archive (write). `base_image` resolves both stages on that image
    instead of the stack's (a lab's own base, or one this machine has)."""
    known = [s.id for s in matrix.stacks]
    for stack_id in stack_ids:
        if stack_id not in known:
            raise EnvbuildError(f"--stack {shown(stack_id)}: no such stack in {matrix.directory / 'stacks.yaml'}. "
                                f"Nearest: {', '.join(nearest(stack_id, known)) or known[-1]}.")
    if base_image and len(stack_ids) != 1:
        raise EnvbuildError("--base-image locks one stack on another base: give exactly one --stack with it.")
    only_arch = None
    if base_image:  # one image is one platform: lock the stack for that CPU architecture only
        platform = engine_platform(engine, base_image)
        only_arch = next((a for a, p in (platforms or {}).items() if p == platform), platform)
    outcomes = []
    for stack in [s for s in matrix.stacks if not stack_ids or s.id in stack_ids]:
        if stack_ids and matrix.bases.families[stack.os].apt is None:
            raise EnvbuildError(f"--stack {stack.id}: its OS family {stack.os} has no `apt` archive in "
                                f"{matrix.directory / 'bases.yaml'}, so there is no snapshot to lock its packages to.")
        digests = matrix.base_digests
        arches = matrix.stack_arches(stack)
        if only_arch and only_arch not in arches:
            raise EnvbuildError(f"--base-image {base_image} is a {only_arch} image, and stack {stack.id} has no "
                                f"{only_arch} build (it has {', '.join(arches)}).")
        for arch in [only_arch] if only_arch else arches:
            if check and not os_lock_path(matrix.directory, stack.id, arch).is_file() and not stack_ids:
                continue  # --check of the whole matrix: the locks there are
            bases = {stage: base_image or (lambda ref: f"{ref}@{digests[ref]}" if ref in digests else ref)(
                getattr(stack.base_images, stage)) for stage in STAGES}
            outcomes.append(lock_stack_os(engine, matrix, stack, arch, (platforms or {}).get(arch, ""), bases,
                                          snapshot, progress=progress, check=check))
    return outcomes


def engine_platform(engine, ref: str) -> str:
    """The platform (linux/amd64) of a base image the engine has, pulling it first if need be."""
    _base_info(engine, ref)
    return engine.inspect(ref).platform
