"""The compiled CUDA extension wheels, carried from one machine's build cache to another's.

A CUDA extension's wheel is compiled once per cache key (extensions.py: NAME/KEY/ in the
BuildKit cache mount `envbuild-ext`), but a CI runner starts with an empty BuildKit: without a
cache it carries, every workflow run compiles flash-attn again (hours). `envbuild ext-cache
save FILE` copies each finished wheel, with its sha256 stamp and under its key, out of this
machine's cache mount into one tar file; `envbuild ext-cache load FILE` puts the wheels of such
a file into another machine's, skipping any key that already has a wheel there. The CI's cache
(actions/cache) carries the file between runs.

Only finished wheels travel. An interrupted compile's tree stays where it was: ninja resumes it
on the machine whose builder layers it was compiled against, and on another machine pip
installs torch's headers with new times, so ninja would compile every object again anyway.

BuildKit shows a cache mount to nothing but a RUN step, so each direction is a two-stage build
on a small image with a POSIX shell, GNU cp and tar (the stack's builder base by default).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from envbuild.base.buildcache import DEEPSPEED_RECORD, EXTENSION_CACHE_ID, EXTENSION_SPEC, cache_mount
from envbuild.base.errors import EnvbuildError
from envbuild.base.files import (
    Identity,
    locked,
    open_regular,
    owned_file,
    read_text,
    remove_stale_temps,
    replace_owned,
    temp_path,
    write_owned,
)
from envbuild.base.grammar import escaped
from envbuild.engine import BuildFailed, BuildSecrets, Engine, get_engine
from envbuild.image import paths
from envbuild.knowledge.matrix import Matrix

MARKER = ".envbuild-ext-cache"  # in every file `save` writes: what makes it ours
MARKED = b"envbuild-ext-cache\n"  # the marker's content (SAVE_STEPS writes it)
KEY_SUFFIX = ".key"  # FILE.key: the cache key of the wheels in FILE (a CI job's, `publish --job --ext-cache`)
_KEY = re.compile(rb"[0-9a-f]{16}\n")  # all a FILE.key envbuild wrote holds
_NAME_KEY = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}/[0-9a-f]{16}")  # a wheel's folder in the cache: NAME/KEY
LOADED = "loaded"               # what `load`'s last stage leaves: how many wheels went in
MAX_FILE_BYTES = 64 * 2 ** 30   # a bound on the file `load` reads (flash-attn for every arch: < 1 GiB)

_MOUNT = cache_mount(EXTENSION_CACHE_ID, paths.EXTENSION_CACHE)
# A key's wheel: <cache>/NAME/KEY/*.whl beside its .sha256 stamp (extensions.py `store`). save:
# the keys named in ENVBUILD_KEYS (all when empty). load: a key with a stamped wheel here keeps
# it; a wheel goes in under a temporary name, then its stamp, then both are moved into place, so
# a cancelled load leaves nothing extensions.py would take or a later load would skip for.
SAVE_STEPS = f"""\
ARG ENVBUILD_RUN
ARG ENVBUILD_KEYS=""
RUN {_MOUNT} \\
    sh -c 'set -eu; mkdir -p /out; echo "$ENVBUILD_RUN" > /dev/null; echo envbuild-ext-cache > /out/{MARKER}; \\
      for w in {paths.EXTENSION_CACHE}/*/*/*.whl; do \\
        [ -f "$w" ] && [ -f "${{w%.whl}}.sha256" ] || continue; \\
        key=${{w%/*}}; key=${{key#{paths.EXTENSION_CACHE}/}}; \\
        case " $ENVBUILD_KEYS " in "  "|*" $key "*) ;; *) continue ;; esac; \\
        mkdir -p "/out/$key"; cp -a "$w" "${{w%.whl}}.sha256" "/out/$key/"; \\
      done'
FROM scratch
COPY --from=0 /out/ /
"""
LOAD_STEPS = f"""\
ARG ENVBUILD_RUN
RUN --mount=type=bind,source=ext-cache.tar,target=/envbuild-in.tar {_MOUNT} \\
    sh -c 'set -eu; echo "$ENVBUILD_RUN" > /dev/null; mkdir -p /tmp/in /out; tar -C /tmp/in -xf /envbuild-in.tar; n=0; \\
      for w in /tmp/in/*/*/*.whl; do \\
        [ -f "$w" ] && [ -f "${{w%.whl}}.sha256" ] || continue; \\
        key=${{w%/*}}; dest={paths.EXTENSION_CACHE}/${{key#/tmp/in/}}; kept=no; \\
        for h in "$dest"/*.whl; do [ -f "$h" ] && [ -f "${{h%.whl}}.sha256" ] && kept=yes; done; \\
        [ "$kept" = no ] || continue; \\
        name=${{w##*/}}; stamp=${{name%.whl}}.sha256; mkdir -p "$dest"; \\
        cp "$w" "$dest/.$name.envbuild-tmp"; cp "${{w%.whl}}.sha256" "$dest/.$stamp.envbuild-tmp"; \\
        mv "$dest/.$name.envbuild-tmp" "$dest/$name"; mv "$dest/.$stamp.envbuild-tmp" "$dest/$stamp"; \\
        n=$((n + 1)); \\
      done; echo "$n" > /out/{LOADED}'
FROM scratch
COPY --from=0 /out/ /
"""


def copy_image(m: Matrix, stack_id: Optional[str] = None) -> str:
    """The image the copy runs on: the stack's builder base (pinned where the matrix knows its
    digest), which a build of that stack has pulled already; default the newest stack."""
    stack = m.stack(stack_id) if stack_id else m.stacks[-1]
    ref = stack.base_images.builder
    return f"{ref}@{m.base_digests[ref]}" if ref in m.base_digests else ref


def dockerfile(image: str, steps: str) -> str:
    """The whole Dockerfile of one direction, on `image`."""
    return f"FROM {image}\n{steps}"


@dataclass(frozen=True)
class Transfer:
    """A save or load: the file, the wheels it holds (NAME/KEY/WHEEL) and how many of them went
    into the cache (a load skips a key that has a wheel here already)."""

    file: Path
    wheels: tuple[str, ...]
    moved: int


def wheels_in(file: Path) -> tuple[str, ...]:
    """The NAME/KEY/WHEEL members of a file `save` wrote; EnvbuildError (exit 2) naming the file
    when it is not one."""
    refusal = "name a file `envbuild ext-cache save` wrote, or save one first"
    if not os.path.lexists(file):
        raise EnvbuildError(f"{escaped(str(file))}: no such file; {refusal}.")
    with open_regular(file, "extension cache file", "ext-cache") as f:  # /dev/null: a device, not "no such file"
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise EnvbuildError(f"{escaped(str(file))} is {size / 2 ** 30:.1f} GiB, over the {MAX_FILE_BYTES >> 30} GiB bound for "
                                f"an extension cache file; {refusal}.")
        try:  # "r:": plain tar only, as `save` writes it; a compressed file could unpack to any size
            with tarfile.open(fileobj=f, mode="r:") as tar:
                members = tar.getmembers()
        except (tarfile.TarError, OSError):
            raise EnvbuildError(f"{escaped(str(file))} is not a plain (uncompressed) tar file, so not an extension cache; "
                                f"{refusal}.") from None
    odd = [m.name for m in members if not (m.isfile() or m.isdir()) or m.issparse() or m.name.startswith("/")
           or ".." in Path(m.name).parts]
    if odd:  # what `save` never writes, and what could reach outside the directory it is unpacked in
        raise EnvbuildError(f"{escaped(str(file))} holds {odd[0]!r}, a link, device, sparse file or path outside its directory; an extension "
                            f"cache holds only files under NAME/KEY/; {refusal}.")
    names = [m.name.removeprefix("./") for m in members if m.isfile()]
    if MARKER not in names:
        raise EnvbuildError(f"{escaped(str(file))} is a tar file envbuild did not write (it holds no {MARKER}); {refusal}.")
    return tuple(sorted(n for n in names if n.count("/") == 2 and n.endswith(".whl")))


def _build(engine: Engine, context: Path, output: str, log: Path, build_args: dict[str, str]) -> None:
    engine.check_usable()  # no daemon: exit 2 (an unusable environment), not a failed copy (exit 1)
    args = [a for name, value in {"ENVBUILD_RUN": secrets.token_hex(8), **build_args}.items()
            for a in ("--build-arg", f"{name}={value}")]
    try:
        engine.build(context, (), BuildSecrets(), log, extra_args=(*args, "--output", output))
    except BuildFailed as failed:
        raise EnvbuildError(f"the extension cache copy failed at {failed.step}.{failed.hint} Last lines:\n    "
                            + "\n    ".join(failed.lines), exit_code=1) from None


def keys_of(build_dirs) -> tuple[str, ...]:
    """The NAME/KEY of every compiled wheel the builds rendered in `build_dirs` use (each
    directory's envbuild/extensions.json and envbuild/deepspeed.json): what a CI job saves, so the
    file holds this run's wheels and not every wheel the cache ever held."""
    keys = set()
    for directory in map(Path, build_dirs):
        records = [directory / "envbuild" / name for name in (EXTENSION_SPEC, DEEPSPEED_RECORD)]
        if not any(r.is_file() for r in records):
            raise EnvbuildError(f"--for {escaped(str(directory))}: it holds neither envbuild/{EXTENSION_SPEC} nor "
                                f"envbuild/{DEEPSPEED_RECORD}, so it is not a build directory of an image with compiled "
                                f"wheels (`envbuild render -o DIR` of a locked stack writes one); name such directories, or "
                                f"leave --for out to save every wheel.")
        for record in (r for r in records if r.is_file()):
            try:
                data = json.loads(read_text(record, "wheel cache record", "record"))
                found = ([f"{e['name']}/{e['cache_key']}" for e in data["extensions"]] if record.name == EXTENSION_SPEC
                         else [data["cache_key"]])
                if not all(isinstance(k, str) and _NAME_KEY.fullmatch(k) for k in found):
                    raise ValueError(found)
                keys.update(found)
            except (ValueError, KeyError, TypeError):
                raise EnvbuildError(f"--for {escaped(str(directory))}: envbuild/{record.name} is not one envbuild wrote "
                                    f"(no cache keys in it); render the directory again.") from None
    return tuple(sorted(keys))


def _is_saved(f) -> bool:
    """Whether the open file is one `save` wrote: a plain tar holding the marker with its content.
    Read member by member up to the marker, so a file cut short after it (a full disk, a
    cancelled copy) is still recognised, and replaced by the next save."""
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if member.name.removeprefix("./") == MARKER:
                    data = tar.extractfile(member) if member.isfile() else None
                    return data is not None and data.read(len(MARKED) + 1) == MARKED
    except (tarfile.TarError, OSError, EOFError):
        return False
    return False


def owned(file: Path, what: str = "") -> Optional[Identity]:
    """None when nothing is at `file`; else its identity, once it is checked to be a regular file
    (not a link, device or FIFO) that `save` wrote. Anything else is refused (exit 2) and left as
    it is: envbuild removes or replaces only what it wrote."""
    return owned_file(Path(file), _is_saved, f"{what}Name a new file, or one `envbuild ext-cache save` wrote.")


def check_key_file(file: Path) -> None:
    """FILE.key, beside `file`, is absent or one envbuild wrote (16 hex digits and a newline);
    a file of the user's there is refused before anything runs (exit 2)."""
    owned_file(Path(f"{file}{KEY_SUFFIX}"), lambda f: bool(_KEY.fullmatch(f.read(18))), _KEY_REFUSAL)


_KEY_REFUSAL = "It is where `publish --job --ext-cache FILE` writes FILE's cache key: name another FILE."


def write_key(file: Path, wheels: tuple[str, ...]) -> str:
    """The cache key of `wheels` (what CI caches FILE under) into FILE.key; only a FILE.key
    envbuild wrote is replaced."""
    key = hashlib.sha256("\n".join(sorted(wheels)).encode()).hexdigest()[:16]
    write_owned(Path(f"{file}{KEY_SUFFIX}"), f"{key}\n".encode(), lambda old: bool(_KEY.fullmatch(old)), _KEY_REFUSAL)
    return key


def save(file: Path, image: str, keys: Optional[tuple[str, ...]] = None, engine: Optional[Engine] = None) -> Transfer:
    """The finished wheels of this machine's extension cache (those of `keys`, NAME/KEY, where
    given) into `file`, replaced in one step: only a file `save` wrote is replaced; another is
    refused and nothing is written."""
    engine = engine or get_engine()
    file = Path(file)
    if file.is_dir() or file.name in ("", ".", ".."):
        raise EnvbuildError(f"{escaped(str(file))} is a directory; name a file to save the extension cache into, e.g. "
                            f"{escaped(str(file / 'ext-cache.tar'))}.")
    if not file.parent.is_dir():
        raise EnvbuildError(f"{escaped(str(file.parent))} does not exist, so {escaped(file.name)} cannot be saved there; nothing was "
                            f"written. Create the directory first, or name a file in an existing one.")
    if any(c in str(file.resolve()) for c in ',"'):
        raise EnvbuildError(f"{escaped(str(file))}: its path has a comma or a double quote, which `docker build --output` cannot "
                            f"take; nothing was written. Name a file whose path has neither.")
    owned(file)
    with locked(file.parent), tempfile.TemporaryDirectory(prefix="envbuild-ext-cache-") as tmp:
        remove_stale_temps(file.parent, recursive=False)
        found = owned(file)  # again, under the lock: another run may have put a file there
        (Path(tmp) / "Dockerfile").write_text(dockerfile(image, SAVE_STEPS))
        out = temp_path(file.resolve())
        try:
            _build(engine, Path(tmp), f"type=tar,dest={out}", Path(tmp) / "build.log",
                   {} if keys is None else {"ENVBUILD_KEYS": " ".join(keys)})
            wheels = wheels_in(out)
            replace_owned(out, file, found, "Name a new file, or one `envbuild ext-cache save` wrote.")
        finally:
            with contextlib.suppress(FileNotFoundError):
                out.unlink()
    return Transfer(file, wheels, len(wheels))


def load(file: Path, image: str, engine: Optional[Engine] = None) -> Transfer:
    """The wheels of `file` into this machine's extension cache; a key that already has a wheel
    here keeps it (`moved` counts the wheels that went in)."""
    engine = engine or get_engine()
    file = Path(file)
    offered = wheels_in(file)
    with tempfile.TemporaryDirectory(prefix="envbuild-ext-cache-") as tmp:
        context = Path(tmp) / "context"
        context.mkdir()
        (context / "Dockerfile").write_text(dockerfile(image, LOAD_STEPS))
        try:
            os.link(file, context / "ext-cache.tar")
        except OSError:  # another filesystem
            shutil.copyfile(file, context / "ext-cache.tar")
        _build(engine, context, f"type=local,dest={tmp}/out", Path(tmp) / "build.log", {})
        count = int((Path(tmp) / "out" / LOADED).read_text().strip() or 0)
    return Transfer(file, offered, count)
