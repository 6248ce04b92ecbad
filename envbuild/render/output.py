"""Write a rendered build directory without ever losing a file envbuild did not write.

envbuild records every file it writes in ``.envbuild-files`` (``sha256sum`` format:
``<sha256>  <path>``, one line per file; ``sha256sum -c .envbuild-files`` checks a tree),
written last. A later render into the same directory

- replaces or removes a recorded file only while its content still equals what envbuild
  wrote; a file edited since (or turned into a symlink or directory) stops the render
  before anything is written, naming the file;
- never touches a file that is not recorded: ``build.log`` and ``*.sif`` next to the
  Dockerfile, the user's own scripts, anything else;
- refuses a directory that has files but no record (a directory envbuild did not write,
  or one from an envbuild before records), unless it is empty.

Two renders into one directory never interleave: each holds the directory's lock
(:func:`envbuild.base.files.locked`) from reading the record to writing it; the second waits.
Every file is written to a temporary file in its own directory and moved into place with
``os.replace``; what a killed render leaves under those temporary names is removed by the
next one. A failure at any point (disk full, permission error, Ctrl-C) undoes what
was done: temporary files and directories created on the way are removed and the old
files, kept as hard links (copies where the filesystem has no hard links) until the new
record is in place, are put back. While files are being swapped the record lists both
the old and the new content, so even a process killed at that moment leaves a directory
the next render accepts and cleans up.

An ``-o`` that is a symlink is followed: the files go into its target, which
:func:`write_build_dir` returns (the CLI says so). A dangling symlink is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path, PurePosixPath

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import (
    is_temp_name,
    locked,
    read_bytes,
    remove_stale_temps,
    sha256_file,
    signals_held,
    temp_path,
    write_temp,
)

RECORD = ".envbuild-files"
_RECORD_LINE = re.compile(r"^([0-9a-f]{64})  (.+)$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _safe_relative(rel: str) -> bool:
    """A plain relative POSIX path inside the directory: no '..', no absolute, no '.'."""
    p = PurePosixPath(rel)
    return (bool(rel) and not p.is_absolute() and "\\" not in rel and "\0" not in rel
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def _cannot_write(out: Path, e: OSError) -> EnvbuildError:
    return EnvbuildError(f"output path {out} cannot be written: {e.strerror or e} ({e.filename or out}); "
                         f"nothing was changed; choose a writable directory with -o/--output.")


# ---------------------------------------------------------------- the record


def format_record(entries: dict[str, set[str]]) -> bytes:
    """``sha256sum`` lines, sorted by path, then by hash (deterministic)."""
    return "".join(f"{digest}  {rel}\n" for rel in sorted(entries) for digest in sorted(entries[rel])).encode()


def read_record(directory: Path) -> dict[str, set[str]] | None:
    """Recorded path -> accepted sha256s (one, or two while a render is swapping files);
    None when the directory has no record. A damaged record is refused: envbuild never
    deletes on the word of a record it cannot read."""
    path = Path(directory) / RECORD
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        raise EnvbuildError(f"{path} is not a regular file (a symlink or directory); envbuild will not trust it. "
                            f"Remove it and the files it listed yourself, or choose another -o/--output.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EnvbuildError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e}); choose another "
                            f"-o/--output.") from None
    entries: dict[str, set[str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        found = _RECORD_LINE.match(line)
        if not found or not _safe_relative(found.group(2)) or found.group(2) == RECORD:
            raise EnvbuildError(f"{path} is damaged at line {number} ({line[:80]!r}); envbuild will not delete or "
                                f"replace files on its word. Remove the directory's generated files yourself, or "
                                f"choose another -o/--output.")
        entries.setdefault(found.group(2), set()).add(found.group(1))
    return entries


def recorded_files(directory: Path) -> list[str]:
    """The files envbuild rendered into `directory` (what a content hash should cover:
    not build.log, *.sif or the user's own files)."""
    return sorted(read_record(directory) or {})


# ---------------------------------------------------------------- checks before writing


def _output_dir(out: Path) -> Path:
    """The directory to write: `out`, or the target of a symlinked `out`."""
    if out.is_symlink():
        target = Path(os.path.realpath(out))
        if not target.exists():
            raise EnvbuildError(f"output path {out} is a symlink to {os.readlink(out)}, which does not exist; create "
                                f"the target directory or choose another -o/--output.")
        out = target
    if out.exists() and not out.is_dir():
        raise EnvbuildError(f"output path {out} exists and is not a directory; choose another -o/--output.")
    return out


def _looks_like_old_render(out: Path) -> bool:
    try:  # a FIFO or a device named manifest.json is no old render (and must not block the read)
        return "envbuild" in json.loads(read_bytes(out / "manifest.json", "manifest", "record"))
    except (EnvbuildError, ValueError, TypeError):
        return False


def _require_empty(out: Path) -> None:
    try:  # what a killed first render left under temporary names does not count
        names = sorted(p.name for p in out.iterdir() if not is_temp_name(p.name))
    except OSError as e:
        raise _cannot_write(out, e) from None
    if not names:
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    old = (" Its manifest.json looks like a render by an envbuild without records; envbuild will not delete files "
           "it has no record of, so remove that directory yourself or render into a new one."
           if _looks_like_old_render(out) else "")
    raise EnvbuildError(f"output path {out} is a non-empty directory that envbuild did not write (it holds {shown} and "
                        f"no {RECORD} record); refusing to replace it or write into it.{old} Choose an empty or new "
                        f"directory with -o/--output.")


def _check_ownership(out: Path, old: dict[str, set[str]], files: dict[str, bytes]) -> None:
    """Stop before writing anything if a write would touch a file envbuild did not write
    or one changed since envbuild wrote it."""
    edited, foreign = [], []
    for rel in sorted(set(old) | set(files)):
        parts = rel.split("/")
        for depth in range(1, len(parts)):  # a directory on the way that is a symlink or a file
            sub = out.joinpath(*parts[:depth])
            if os.path.lexists(sub) and (sub.is_symlink() or not sub.is_dir()):
                foreign.append("/".join(parts[:depth]))
                break
        else:
            path = out / rel
            if not os.path.lexists(path):
                continue
            if rel not in old:
                foreign.append(rel)
            elif path.is_symlink() or not path.is_file() or sha256_file(path) not in old[rel]:
                edited.append(rel)
    if edited:
        raise EnvbuildError(
            f"output path {out} holds files envbuild wrote that were changed since: {', '.join(edited)}; refusing "
            f"to overwrite your edits, and nothing was written. Move them out of the way (or delete them to let "
            f"envbuild write them again), or choose another directory with -o/--output.")
    if foreign:
        raise EnvbuildError(
            f"output path {out} holds {', '.join(sorted(set(foreign)))}, which envbuild did not write (not in its "
            f"{RECORD} record) and would have to replace; nothing was written. Move them out of the way, or choose "
            f"another directory with -o/--output.")


# ---------------------------------------------------------------- writing


def _mkdirs(directory: Path) -> list[Path]:
    """mkdir -p, returning the directories it created, outermost first (one another run
    created in the meantime is not ours)."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    made = []
    for d in reversed(missing):
        try:
            d.mkdir()
            made.append(d)
        except FileExistsError:
            if not d.is_dir():
                raise
    return made


def _write_temp(directory: Path, name: str, data: bytes, mode: int) -> Path:
    """Write `data` to a new temporary file next to where it goes (the one write call)."""
    return write_temp(directory / name, data, mode)


def _keep_old(path: Path) -> Path:
    """A second name for an old file, to put it back if the render fails (hard link; a
    copy where the filesystem has none)."""
    for _ in range(100):
        backup = temp_path(path, "old")
        try:
            os.link(path, backup)
            return backup
        except FileExistsError:
            continue
        except OSError:
            if os.path.lexists(backup):
                continue
            shutil.copy2(path, backup)
            return backup
    raise FileExistsError(f"no free temporary name in {path.parent}")


def _replace(src: Path, dst: Path) -> None:
    """Move a finished file into place (atomic: readers see the old or the new file)."""
    os.replace(src, dst)


def _write_record(out: Path, data: bytes) -> None:
    tmp = _write_temp(out, RECORD, data, 0o644)
    try:
        _replace(tmp, out / RECORD)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _mode(data: bytes) -> int:
    """Scripts meant to run directly (a #! line: the step scripts, cc-wrapper.sh, entrypoint.sh)
    are executable; everything else, sourced files (env.sh, lib.sh) included, is not."""
    return 0o755 if data.startswith(b"#!") else 0o644


def _swap(out: Path, old: dict[str, set[str]] | None, files: dict[str, bytes]) -> None:
    """Put `files` in place of the recorded ones; on any failure, undo everything."""
    new = {rel: {sha256(data)} for rel, data in files.items()}
    old_record = (out / RECORD).read_bytes() if old is not None else None
    old = old or {}
    made: list[Path] = []            # directories created, outermost first
    staged: dict[str, Path] = {}     # rel -> temporary file with the new bytes
    kept: dict[str, Path] = {}       # rel -> second name of the old file
    placed: list[str] = []           # rels whose new file is in place
    removed: list[str] = []          # rels of old files no longer rendered, unlinked
    record_changed = False
    try:
        for rel in sorted(files):
            dest = out / rel
            made += _mkdirs(dest.parent)
            staged[rel] = _write_temp(dest.parent, dest.name, files[rel], _mode(files[rel]))
        for rel in sorted(old):
            if os.path.lexists(out / rel):
                kept[rel] = _keep_old(out / rel)
        # While swapping, the record accepts old and new content (and the temporary names),
        # so a process killed half-way leaves a directory the next render can clean up.
        during = {rel: set(digests) for rel, digests in old.items()}
        for rel, digests in new.items():
            during.setdefault(rel, set()).update(digests)
        for rel, tmp in staged.items():
            during[tmp.relative_to(out).as_posix()] = new[rel]
        for rel, backup in kept.items():
            during[backup.relative_to(out).as_posix()] = set(old[rel])
        record_changed = True
        _write_record(out, format_record(during))
        for rel in sorted(staged):
            _replace(staged[rel], out / rel)
            placed.append(rel)
        for rel in sorted(set(old) - set(files)):
            if os.path.lexists(out / rel):
                (out / rel).unlink()
                removed.append(rel)
        _write_record(out, format_record(new))  # the listed set, written last
    except BaseException:
        _undo(out, placed, removed, kept, staged, made, old_record if record_changed else False)
        raise
    for backup in kept.values():
        backup.unlink(missing_ok=True)
    for rel in removed:  # directories emptied by files no longer rendered
        parent = (out / rel).parent
        while parent != out:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def _undo(out, placed, removed, kept, staged, made, old_record) -> None:
    """Best effort, in reverse order: the old files back, every temporary thing gone."""
    def quietly(action, *args):
        try:
            action(*args)
        except OSError:
            pass

    for rel in reversed(placed):
        if rel in kept:
            quietly(os.replace, kept.pop(rel), out / rel)
        else:
            quietly((out / rel).unlink)
    for rel in reversed(removed):
        if rel in kept:
            quietly(os.replace, kept.pop(rel), out / rel)
    for path in [*kept.values(), *staged.values()]:
        quietly(path.unlink, True)
    if old_record is None:
        quietly((out / RECORD).unlink, True)
    elif old_record is not False:
        try:
            _write_record(out, old_record)
        except OSError:
            pass  # the record still accepts both contents: the next render can go on
    for directory in reversed(made):
        quietly(directory.rmdir)


def write_build_dir(files: dict[str, bytes], out: Path) -> Path:
    """Write `files` (relative path -> bytes) into `out` and return the directory written
    (the target when `out` is a symlink).

    Raises EnvbuildError (exit 2) before writing anything if `out` is not a directory, has
    files but no record, or holds an edited generated file or a foreign file in the way;
    and (after undoing what it did) when a write fails.
    """
    out = Path(out)
    for rel in files:
        if not _safe_relative(rel) or rel == RECORD:
            raise ValueError(f"not a relative path inside the build directory: {rel!r}")
    try:
        target = _output_dir(out)
        made = _mkdirs(target)
    except OSError as e:
        raise _cannot_write(out, e) from None
    try:
        with locked(target):
            old = read_record(target)
            if old is None:
                _require_empty(target)
            _check_ownership(target, old or {}, files)
            # What a killed render left under envbuild's temporary names, where renders write.
            for directory in sorted({target} | {(target / rel).parent for rel in [*(old or {}), *files]}):
                if directory.is_dir() and not directory.is_symlink():
                    remove_stale_temps(directory, recursive=False)
            with signals_held():  # a Ctrl-C lands after the swap (or its undo), never in it
                _swap(target, old, files)
    except BaseException as e:
        for directory in reversed(made):
            try:
                directory.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError):
            raise _cannot_write(out, e) from None
        raise
    return target
