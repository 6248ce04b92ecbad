"""The compiled-extension cache of a publish job (`publish --job ID --ext-cache FILE`): an
earlier run's compiled wheels loaded into this machine's build cache before the job's builds,
this run's saved into FILE after them (with their cache key in FILE.key), and the wheels FILE
holds for `publish --plan`. Only files envbuild wrote are replaced; :mod:`envbuild.builds.extcache`
moves the wheels."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from envbuild.base.errors import EnvbuildError
from envbuild.builds import extcache
from envbuild.knowledge.matrix import Matrix


def ext_cache_wheels(file: Path) -> tuple[str, ...]:
    """The compiled wheels an --ext-cache file holds, as `extcache.wheels_in` names them (none
    when there is no file yet)."""
    return extcache.wheels_in(file) if file.is_file() else ()


def ext_cache_check(file: Path) -> None:
    """--ext-cache FILE and FILE.key, before anything runs: each absent or a regular file envbuild
    wrote (exit 2 otherwise): the job replaces both at its end, and never a file of the user's."""
    extcache.owned(file, "--ext-cache: ")
    extcache.check_key_file(file)


def ext_cache_load(m: Matrix, job: dict, file: Path, base_image: Optional[str], say: Callable[[str], None]) -> None:
    """An earlier run's compiled wheels into this machine's build cache. A file `ext-cache save`
    wrote that load refuses (a cut-short copy) is kept, and this run's save replaces it; any other
    file is refused (exit 2) and never removed."""
    if extcache.owned(file, "--ext-cache: ") is None:
        return
    try:
        done = extcache.load(file, base_image or extcache.copy_image(m, job["stack"]))
        say(f"loaded {done.moved} of {len(done.wheels)} compiled wheel(s) from {file}")
    except EnvbuildError as e:
        say(f"warning: {file} was refused ({e.message}); compiling instead")


def ext_cache_save(m: Matrix, job: dict, file: Path, out: Path, base_image: Optional[str],
                   say: Callable[[str], None]) -> None:
    """This run's compiled wheels into `file` (replacing only a file `ext-cache save` wrote: the
    restored file's other wheels are not kept), their cache key into FILE.key (likewise)."""
    dirs = [d for d in sorted((out / "build").glob("*"))
            if any((d / "envbuild" / name).is_file() for name in (extcache.EXTENSION_SPEC, extcache.DEEPSPEED_RECORD))]
    if not dirs:
        return
    ext_cache_check(file)
    done = extcache.save(file, base_image or extcache.copy_image(m, job["stack"]), extcache.keys_of(dirs))
    if done.wheels:
        key = extcache.write_key(file, done.wheels)
        say(f"saved {len(done.wheels)} wheel(s) into {file} (cache key {key})")
