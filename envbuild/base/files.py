"""Every file a user names is read here, with a size bound; every file envbuild writes goes
through the same three primitives: a lock on the directory written into, temporary names a
later run recognises, and an atomic move into place.

Why each exists:

- A bound: ``--ca-cert /dev/zero`` or ``-r /dev/zero`` must be refused in a moment, not
  after the machine's memory is gone. The limits are far above any real file of the kind.
- A lock: two runs writing into one directory at once must not interleave (one would
  record the other's half-written files as its own). ``flock`` on the directory itself
  leaves no lock file behind to go into a Docker build context; a directory nodes share
  over NFS gets a POSIX lock on a file in it instead. The kernel releases either when the
  process dies, so a killed run never leaves a stale lock.
- Temporary names ``.<name>.envbuild-tmp-<8 hex>`` and ``.<name>.envbuild-old-<8 hex>``:
  only envbuild makes them (``O_EXCL``), so a run holding the lock removes any it finds:
  what a Ctrl-C or a kill left behind is cleaned by the next run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import yaml

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import escaped

MIB = 1 << 20
# How large a file of each kind can reasonably be (the largest real one, times 10 or more).
LIMITS = {
    "ca": 8 * MIB,            # Debian's ca-certificates.crt: 0.2 MiB
    "requirements": 2 * MIB,  # a pip-compile'd lock of 500 packages with hashes: 0.3 MiB
    "project": 1 * MIB,       # envbuild.yaml
    "matrix": 16 * MIB,       # the matrix YAML files and locks: 0.5 MiB at most today
    "markdown": 8 * MIB,      # README.md / docs pages with generated blocks
    "record": 16 * MIB,       # an image's build record / a render's file record
    "key": 1 * MIB,           # a PEM signing or verification key: a few KiB (RSA-4096: 3 KiB)
    "workflow": 1 * MIB,      # a GitHub Actions workflow `envbuild ci` writes: 20 KiB
    "manifest": 4 * MIB,      # a Kubernetes manifest (`envbuild job --k8s --check`): envbuild's are 5 KiB
}
LOCK_WAIT_S = 120  # how long a run waits for another one writing into the same directory

_TEMP = re.compile(r"^\..+\.envbuild-(?:tmp|old)-[0-9a-f]{8}$")


def sha256_file(path: Path | str) -> str:
    """The sha256 of a file, read in blocks (a .sqsh is gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _size_text(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n} bytes"


_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}
# What each kind of file is, and an example of one, for the messages.
_NOUN = {"ca": "CA bundle", "requirements": "requirements file", "project": "project file",
         "matrix": "matrix file", "markdown": "Markdown page", "record": "record",
         "key": "key", "workflow": "workflow", "manifest": "Kubernetes manifest"}
_EXAMPLE = {"ca": "the PEM file itself, such as /etc/ssl/certs/ca-certificates.crt",
            "requirements": "a requirements file of the packages to add (one per line)",
            "project": "an envbuild.yaml of a few lines",
            "matrix": "a matrix directory of YAML files such as the shipped matrices/",
            "markdown": "a Markdown file with envbuild's generated blocks",
            "record": "the file envbuild wrote",
            "key": "the PEM key file itself (openssl genpkey / openssl pkey -pubout write one)",
            "workflow": "the workflow `envbuild ci -o FILE` wrote",
            "manifest": "the manifest's YAML file (kubectl apply -f takes the same)",
            "squashfs": "a .sqsh that `envbuild export --enroot` wrote",
            "ext-cache": "a file `envbuild ext-cache save` wrote"}


def kind_of(mode: int) -> str:
    """What a file of this mode is, in the words of the messages ('a FIFO (named pipe)')."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _not_regular(path, what: str, kind: str, mode: int) -> EnvbuildError:
    return EnvbuildError(f"{what} {escaped(str(path))} is {kind_of(mode)}, not a regular file: envbuild reads the files it is given "
                         f"whole, and a pipe or device may never end (or never start); give {_EXAMPLE[kind]}.")


class NotRegularFile(Exception):
    """What :func:`open_checked` opened is not a regular file (its mode says what it is)."""

    def __init__(self, mode: int):
        super().__init__(kind_of(mode))
        self.mode = mode


def open_checked(path: Path | str):
    """A binary file object of `path` if it is a regular file, checked on the descriptor: opened
    without blocking (a FIFO with no writer opens at once instead of waiting for one), then made
    blocking again. OSError as open raises it; NotRegularFile for anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(mode)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def open_regular(path: Path | str, what: str, kind: str):
    """A binary file object of `path`, refused (exit 2) unless it is a regular file: checked with
    stat before opening, and again on what was opened (:func:`open_checked`)."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, what, kind, mode)
        return open_checked(path)
    except NotRegularFile as e:  # a FIFO put there in between
        raise _not_regular(path, what, kind, e.mode) from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name, which no file name can hold
        missing = isinstance(e, (FileNotFoundError, ValueError)) and not os.path.lexists(path)
        why = "no such file" if missing else (getattr(e, "strerror", None) or str(e))
        raise EnvbuildError(f"{what} {escaped(str(path))}: cannot read it ({why}); check the path and its "
                            f"permissions.") from None


def read_bytes(path: Path | str, what: str, kind: str) -> bytes:
    """The bytes of a file the user named, refused (exit 2) when it is not a regular file (a FIFO
    with no writer would block, a device may never end), is larger than ``LIMITS[kind]`` or
    cannot be read.

    >>> read_bytes("/dev/zero", "--ca-cert", "ca")
    Traceback (most recent call last):
    ...
    envbuild.base.errors.EnvbuildError: --ca-cert /dev/zero is a character device, not a regular file: envbuild reads the files it is given whole, and a pipe or device may never end (or never start); give the PEM file itself, such as /etc/ssl/certs/ca-certificates.crt.
    """
    limit = LIMITS[kind]
    with open_regular(path, what, kind) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise EnvbuildError(f"{what} {escaped(str(path))}: cannot read it ({e.strerror or e}); check the path and its "
                                f"permissions.") from None
    if len(data) > limit:
        raise EnvbuildError(f"{what} {escaped(str(path))} is larger than {_size_text(limit)} (read {_size_text(limit)} and more), "
                            f"which no {_NOUN[kind]} is; give {_EXAMPLE[kind]}.")
    return data


def read_text(path: Path | str, what: str, kind: str, encoding: str = "utf-8") -> str:
    """:func:`read_bytes`, decoded; a file in another encoding (UTF-16, binary) is refused with
    the byte where decoding failed. A UTF-8 byte-order mark is dropped (editors on Windows
    write one)."""
    return decode(read_bytes(path, what, kind), f"{what} {escaped(str(path))}", encoding)


def decode(data: bytes, named: str, encoding: str = "utf-8") -> str:
    """`data` as text, or EnvbuildError naming `named` (the input) and the byte that failed."""
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        utf16 = " (it looks like UTF-16: save it as UTF-8)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise EnvbuildError(f"{named} is not {encoding.upper()} text: byte {e.start} cannot be decoded{utf16}; "
                            f"give a text file in {encoding.upper()}.") from None
    if "\0" in text:
        raise EnvbuildError(f"{named} holds a NUL byte (at character {text.index(chr(0))}), so it is not a text file; "
                            f"give a text file in {encoding.upper()}.")
    return text.removeprefix("\ufeff")


# ---------------------------------------------------------------- what files say, kept while they say it

RACY_NS = 2_000_000_000  # a file changed this recently may change again and keep its stat


class StatCache:
    """Values derived from files (a digest, a parsed lock), kept in this process while the files'
    stat (inode, size, modification and change times) is unchanged, and only once each is older
    than RACY_NS: a file's times move in kernel ticks, so one rewritten within a tick at the same
    size would look unchanged (git calls this "racily clean"). A cache, never a source: a miss
    derives the value from the files as they are now."""

    def __init__(self, size: int = 64):
        self._kept: dict[tuple, object] = {}
        self._size = size

    def get(self, key: tuple, paths: list[Path], make: Callable[[], object]):
        stats = [p.stat() for p in paths]
        seen = (key, tuple((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats))
        if seen in self._kept:
            return self._kept[seen]
        value = make()
        settled = time.time_ns() - RACY_NS
        if all(max(s.st_mtime_ns, s.st_ctime_ns) < settled for s in stats):
            if len(self._kept) >= self._size:
                self._kept.clear()
            self._kept[seen] = value
        return value

    def clear(self) -> None:
        self._kept.clear()


# ---------------------------------------------------------------- YAML, bounded

YAML_DEPTH = 64  # nesting deeper than any matrix file's (5 today); a deeper file is refused, not recursed into


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with two bounds its own composer lacks: nesting depth (it recurses
    once per level: 50,000 levels are a RecursionError) and aliases (refused: no envbuild file
    uses them, and a few nested ones expand to billions of nodes for whoever walks the result)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "an alias (*name): envbuild's YAML files hold no anchors or "
                                              "aliases; write the value out", event.start_mark)
        depth = getattr(self, "_envbuild_depth", 0)
        if depth >= YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nesting deeper than {YAML_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._envbuild_depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._envbuild_depth = depth


_LIBYAML = getattr(yaml, "CSafeLoader", None)  # PyYAML built with libyaml: parses about ten times faster


def _libyaml(text: str, documents: bool):
    """`text` parsed by libyaml where it is plainly within the bounds, else None (the pure-Python
    loader then decides, and says where it is not). The bounds are checked on libyaml's events
    first (its parser keeps its own stack, no recursion): an alias, or collections nested
    YAML_DEPTH deep, and it is not tried; nor with a tab, which libyaml takes inside a plain
    scalar where PyYAML refuses it. The values come from the same safe constructor."""
    if "\t" in text:
        return None
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_LIBYAML):
            if isinstance(event, yaml.AliasEvent):
                return None
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth >= YAML_DEPTH:
                    return None
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        if documents:
            return (list(yaml.load_all(text, Loader=_LIBYAML)),)  # noqa: S506  (a safe loader)
        return (yaml.load(text, Loader=_LIBYAML),)  # noqa: S506  (a safe loader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None


def parse_yaml(text: str, named: str, documents: bool = False):
    """`text` as YAML (safe types only, bounded depth, no aliases); EnvbuildError naming `named`
    and the line where it is not. `documents`: a stream of documents (``---``), as a list."""
    parsed = _libyaml(text, documents) if _LIBYAML else None
    if parsed is not None:
        return parsed[0]
    try:
        if documents:
            return list(yaml.load_all(text, Loader=_BoundedLoader))  # noqa: S506  (a SafeLoader)
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506  (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise EnvbuildError(f"{named} is not valid YAML{where}: {problem}.") from None
    except RecursionError:  # the scanner's own recursion, should a future PyYAML have one
        raise EnvbuildError(f"{named} is not valid YAML: nesting deeper than {YAML_DEPTH} levels.") from None
    except ValueError as e:  # a constructor's: an integer of over 4,300 digits, a date out of range
        raise EnvbuildError(f"{named} holds a value YAML cannot represent: {escaped(str(e).splitlines()[0])}.") from None


def read_yaml(path: Path | str, what: str, kind: str = "matrix"):
    """A YAML file a user (or a lab's matrix directory) names: a regular file, read with a size
    bound, decoded as UTF-8 and parsed with :func:`parse_yaml`."""
    return parse_yaml(read_text(path, what, kind), f"{what} {path}")


# ---------------------------------------------------------------- a write phase that completes


@contextlib.contextmanager
def signals_held(signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM for the block, then deliver them: a write phase (files moved into
    place, old ones put back on failure) runs to its end or its undo, whatever the moment a signal
    comes; the run stops right after. A signal caught in the middle of the swap or of its undo
    left the old files under their temporary names. SIGKILL cannot be held: what it leaves, the
    next run removes (:func:`remove_stale_temps`). Outside the main thread (where Python cannot
    set handlers) the block runs unguarded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)  # the handler it had: KeyboardInterrupt, SystemExit(143) ...


# ---------------------------------------------------------------- the lock and temporary names


@contextlib.contextmanager
def locked(directory: Path, what: str = "writing into", wait: float = LOCK_WAIT_S, *,
           lock_file: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (which must exist) for the block; a second run
    waits for it (saying so once, through `progress` or on stderr), and after `wait` seconds
    is refused with a clear message. Where the filesystem cannot lock the run goes on
    unlocked and says so.

    The lock is a ``flock`` on the directory itself (no file left behind), or, with
    `lock_file`, a POSIX lock on that file in it: NFS honours POSIX locks across nodes where
    it may not honour ``flock``, so a directory compute nodes share is locked that way. The
    kernel drops either when the holder dies: a killed run never leaves a stale lock."""
    say = progress or (lambda message: print(f"envbuild: {message}", file=sys.stderr))
    try:
        fd = (os.open(directory / lock_file, os.O_RDWR | os.O_CREAT, 0o664) if lock_file
              else os.open(directory, os.O_RDONLY | os.O_DIRECTORY))
    except OSError as e:
        raise EnvbuildError(f"{directory} cannot be {'written in' if lock_file else 'opened'} "
                            f"({e.strerror or e}); choose a directory you can write into.") from None
    take = fcntl.lockf if lock_file else fcntl.flock
    try:
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                take(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):  # held by another (lockf may say EACCES)
                    if time.monotonic() >= deadline:
                        raise EnvbuildError(f"another envbuild has been {what} {directory} for over {wait:.0f} s "
                                            f"(it holds the directory's lock); nothing was written. Wait for it "
                                            f"to finish, or choose another directory.") from None
                    if not said:
                        say(f"waiting for another envbuild {what} {directory}")
                        said = True
                    time.sleep(0.05)
                elif e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL):
                    say(f"warning: {directory} cannot be locked here ({e.strerror}); two envbuild runs "
                        f"{what} it at once could interleave")
                    break
                else:
                    raise
        yield
    finally:
        os.close(fd)


def temp_path(dest: Path, kind: str = "tmp") -> Path:
    """A new name beside `dest` that only envbuild makes (see :func:`is_temp_name`)."""
    return dest.parent / f".{dest.name}.envbuild-{kind}-{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    """Whether `name` is one of envbuild's temporary names.

    >>> is_temp_name(".Dockerfile.envbuild-tmp-0a1b2c3d"), is_temp_name(".Dockerfile.swp")
    (True, False)
    """
    return bool(_TEMP.match(name))


def remove_stale_temps(directory: Path, recursive: bool = True) -> list[Path]:
    """Remove what an interrupted run left: files with envbuild's temporary names. Call it
    only while holding :func:`locked` on `directory` (no other run is writing there).
    Symlinks are not followed; only regular files are removed."""
    removed = []
    for root, dirs, names in os.walk(directory) if recursive else [(str(directory), [], os.listdir(directory))]:
        for name in names:
            path = Path(root) / name
            if is_temp_name(name) and path.is_file() and not path.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
    return removed


def write_temp(dest: Path, data: bytes, mode: int = 0o644) -> Path:
    """`data` in a new temporary file beside `dest` (not yet in place)."""
    for _ in range(100):
        tmp = temp_path(dest)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(dest.parent))


Identity = tuple[int, int]  # (st_dev, st_ino) of a file checked to be envbuild's


def owned_file(path: Path, ours: Callable[[BinaryIO], bool], refusal: str) -> Optional[Identity]:
    """Whether envbuild may remove or replace what is at `path`: None when nothing is there (not
    even a dangling link); else its (device, inode), once it is checked to be a regular file, not
    a link, that `ours` (given the file opened, without following a link or blocking) recognises
    by envbuild's own format. Anything else (a device, FIFO, socket, directory, symlink, a file
    of the user's) is refused (exit 2, `refusal` says what to do), and nothing is touched."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise EnvbuildError(f"{escaped(str(path))} cannot be checked ({getattr(e, 'strerror', None) or e}); nothing was "
                            f"written. {refusal}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_ours(path, f"is {kind_of(st.st_mode)}, not a regular file envbuild wrote", refusal)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise EnvbuildError(f"{escaped(str(path))} cannot be read ({e.strerror or e}) to tell whether envbuild wrote it; "
                            f"refusing to replace it, and nothing was written. {refusal}") from None
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            raise _not_ours(path, "changed while it was checked", refusal)
        if not ours(f):
            raise _not_ours(path, "exists and envbuild did not write it", refusal)
    return st.st_dev, st.st_ino


def _not_ours(path: Path, why: str, refusal: str) -> EnvbuildError:
    return EnvbuildError(f"{escaped(str(path))} {why}; refusing to replace it, and nothing was written. {refusal}")


def still(path: Path, identity: Optional[Identity], refusal: str) -> None:
    """Refuse (exit 2) unless `path` is still what :func:`owned_file` found: nothing, or that
    same file. Called right before it is replaced or removed (under the directory's lock)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # gone: nothing is there to lose
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != identity:
        raise _not_ours(path, "changed while envbuild ran (another program put a file there)", refusal)


def replace_owned(tmp: Path, path: Path, identity: Optional[Identity], refusal: str) -> None:
    """Move `tmp` (envbuild's new file) onto `path`, which :func:`owned_file` found to be
    `identity` (None: nothing was there); refused if anything else is there now."""
    still(path, identity, refusal)
    os.replace(tmp, path)


def check_owned(path: Path, ours: Callable[[bytes], bool], refusal: str) -> Optional[bytes]:
    """The bytes of the file at `path` if envbuild may replace it (None: no file there);
    refused (exit 2, `refusal` says what to do) when it is not a regular file envbuild wrote."""
    found: list[bytes] = []

    def read(f: BinaryIO) -> bool:
        found.append(f.read(LIMITS["record"] + 1))
        return len(found[0]) <= LIMITS["record"] and ours(found[0])

    return found[0] if owned_file(Path(path), read, refusal) else None


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` by `data` in one step: a reader (or a run killed half-way) sees the old
    file or the new one, never a truncated one. Only a regular file is replaced: a symlink,
    device, FIFO or directory there is refused (exit 2) and left as it is."""
    refusal = "envbuild writes this name itself in a directory it writes into: remove it, or choose another directory."
    found = owned_file(Path(path), lambda f: True, refusal)
    tmp = write_temp(Path(path), data, mode)
    try:
        replace_owned(tmp, Path(path), found, refusal)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_owned(path: Path, data: bytes, ours: Callable[[bytes], bool], refusal: str,
                mode: int = 0o644) -> bool:
    """Write one generated file atomically, under its directory's lock: only where no file
    is, or where the file there is one envbuild wrote (``ours(old_bytes)``); otherwise
    refuse with `refusal` (a sentence saying what to do), writing nothing. Returns whether
    the file changed."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise EnvbuildError(f"'{path}' names a directory, not a file; give a file name.")
    parent = path.parent
    made = []
    try:
        probe = parent
        while not os.path.lexists(probe):
            made.append(probe)
            probe = probe.parent
        parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise EnvbuildError(f"{path} is a directory; give a file name inside it.")
        with locked(parent):
            remove_stale_temps(parent, recursive=False)
            old = check_owned(path, ours, refusal)
            if old == data:
                return False
            tmp = write_temp(path, data, mode)
            try:
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return True
    except OSError as e:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise EnvbuildError(f"{path} cannot be written: {e.strerror or e} ({e.filename or path}); nothing was "
                            f"changed; choose a writable path.") from None
    except BaseException:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
