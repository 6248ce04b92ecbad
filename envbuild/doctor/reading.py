"""Read what doctor is given, whatever it was saved as, in bounded memory and bounded time.

Logs arrive as plain text, gzip/bzip2/xz files, UTF-16 (Windows redirection writes it with a
BOM), with ANSI colours and with tqdm's carriage returns, and sometimes as something that is
not a log at all (`/dev/zero`, a core file, a FIFO nobody writes to). A named file must be a
regular file, checked on the open descriptor before the first read, so a FIFO never blocks;
pipes come in through standard input (`-`). The text is streamed as blocks of whole lines
(UTF-8 bytes, escapes removed), never the whole file; a line longer than MAX_LINE bytes is
cut there. A Budget bounds the bytes read (after decompression, so a gzip bomb stops at the
bound) and the seconds spent over one run; where it stops a log, the reader says so.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import os
import re
import stat
import sys
import time
import zlib
from typing import BinaryIO, Callable, Iterator, Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import NotRegularFile, kind_of, open_checked
from envbuild.base.grammar import escaped, shown

MAX_LINE = 64 * 1024
CHUNK = 1 << 20
SNIFF = 8 * 1024
GIB = 1 << 30
DEFAULT_MAX_BYTES = 16 * GIB
DEFAULT_MAX_SECONDS = 600

COMPRESSED = {
    b"\x1f\x8b": ("gzip", lambda raw: gzip.GzipFile(fileobj=raw)),
    b"BZh": ("bzip2", bz2.BZ2File),
    b"\xfd7zXZ\x00": ("xz", lzma.LZMAFile),
}
UNSUPPORTED = {b"\x28\xb5\x2f\xfd": "zstd (decompress it first: zstd -d LOG)",
               b"PK\x03\x04": "a zip archive (unzip it first)",
               b"\x7fELF": "an ELF binary or core file"}
# CSI sequences (colours, cursor moves), OSC sequences (titles, hyperlinks), character-set
# designations (`ESC ( B`, which `tput sgr0` prints before its reset: enroot's coloured [ERROR]),
# other 2-byte escapes; none reaches past the end of its line.
ANSI_TEXT = r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b\n]*(?:\x07|\x1b\\)?|\x1b[ -/]+[0-~]|\x1b[@-Z\\-_]"
ANSI = re.compile(ANSI_TEXT)
ANSI_BYTES = re.compile(ANSI_TEXT.encode())
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def strip_ansi(line: str) -> str:
    """The line without terminal escape sequences (a bare ESC left over is dropped too)."""
    return ANSI.sub("", line).replace("\x1b", "") if "\x1b" in line else line


def clean_line(line: str) -> str:
    """A line as doctor matches it: no trailing carriage return (CRLF files), no ANSI escapes."""
    return strip_ansi(line[:-1] if line.endswith("\r") else line)


def clean_block(block: bytes) -> bytes:
    """`clean_line` for a block of whole lines at once: no escapes, CRLF as LF."""
    if b"\x1b" in block:
        block = ANSI_BYTES.sub(b"", block).replace(b"\x1b", b"")
    if b"\r" in block and b"\r\n" in block:  # memchr first: a two-byte search costs 25x more
        block = block.replace(b"\r\n", b"\n")
    return block


def printable(text: str) -> str:
    """Text safe to echo to a terminal and one line of the report: every control character
    (newline, carriage return, ESC, NEL, U+2028 too) written as an escape, never sent raw, so
    what a log or a dump says cannot add lines of its own to the report (grammar.escaped)."""
    return escaped(text)


def size_text(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


class Budget:
    """What one run may read: bytes of text after decompression and seconds, over all its inputs.
    The seconds count from the first read: loading the signatures and catalogues before it (seconds
    on a loaded machine) must not use up a short limit before a line is read."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_seconds: float = DEFAULT_MAX_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.max_bytes, self.max_seconds = max_bytes, max_seconds
        self.left = max_bytes
        self.clock = clock
        self.deadline: Optional[float] = None

    def expired(self) -> bool:
        """Whether the time is up (the first call starts the clock)."""
        if self.deadline is None:
            self.deadline = self.clock() + self.max_seconds
        return self.clock() > self.deadline

    def take(self, data: bytes) -> tuple[bytes, Optional[str]]:
        """The part of `data` the budget allows, and why reading stops here (None: it goes on)."""
        if self.expired():
            return b"", f"the time limit ({self.max_seconds:g} s, --max-seconds)"
        if len(data) > self.left:
            data = data[:self.left]
            self.left = 0
            return data, f"the size limit ({size_text(self.max_bytes)} of text, --max-bytes)"
        self.left -= len(data)
        return data, None


def open_regular(path: str, what: str) -> BinaryIO:
    """PATH opened for reading, if it is a regular file (checked on the descriptor: no FIFO can block)."""
    try:
        return open_checked(path)
    except NotRegularFile as e:
        streamed = stat.S_ISFIFO(e.mode) or stat.S_ISCHR(e.mode)
        hint = " (pipe it in instead: ... | envbuild doctor -)" if streamed and what == "log" else ""
        raise EnvbuildError(f"{what} {escaped(path)} is {kind_of(e.mode)}, not a regular file{hint}; give the file itself.") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        why = getattr(e, "strerror", None) or "not a file name"
        raise EnvbuildError(f"{what} {escaped(path)} cannot be read: {why}; check the path and its permissions.") from None


def read_head(path: str, what: str, size: int) -> bytes:
    """The first `size` bytes of PATH, a regular file whose size does not lie. Read without
    blocking (a /proc file such as kmsg that would wait is refused) and refused when the file
    says it is empty yet holds bytes (a /proc or /sys file: its size is no bound on what it
    gives), or when a read fails (/proc/self/mem: EIO)."""
    with open_regular(path, what) as f:
        fd = f.fileno()
        claimed = os.fstat(fd).st_size
        os.set_blocking(fd, False)
        try:
            head = os.read(fd, size)
        except BlockingIOError:
            raise EnvbuildError(f"{what} {escaped(path)} would block when read (a /proc or device file), not a "
                                "file of its own; give the file itself.") from None
        except OSError as e:
            raise EnvbuildError(f"{what} {escaped(path)} cannot be read: {e.strerror}; check the path and its "
                                "permissions.") from None
    if head and not claimed:
        raise EnvbuildError(f"{what} {escaped(path)} says it holds 0 bytes and yet gives some (a /proc or /sys "
                            "file, whose size is no bound on what it gives), not a log or dump; give the file itself.")
    return head


def read_regular(path, what: str, limit: int) -> bytes:
    """The bytes of a small regular file (a signature file, a dump), refused past `limit`."""
    with open_regular(str(path), what) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise EnvbuildError(f"{what} {escaped(str(path))} cannot be read: {e.strerror}; check the path and its "
                                "permissions.") from None
    if len(data) > limit:
        raise EnvbuildError(f"{what} {escaped(str(path))} is larger than {size_text(limit)}, which no real one is; "
                            "give the file itself.")
    return data


def sniff_binary(sample: bytes) -> Optional[str]:
    """Why `sample` (a file's first bytes) is not a text log, or None if it may be one."""
    for magic, why in UNSUPPORTED.items():
        if sample.startswith(magic):
            return f"is {why}, not a text log"
    return None


class LogReader:
    """Opens LOG (a path or "-" for stdin) and yields its text as blocks of whole lines.

    Raises EnvbuildError (exit 2) for a missing, unreadable, non-regular or non-text input; the
    check happens on the first bytes, before anything is yielded.
    """

    def __init__(self, log: str, budget: Optional[Budget] = None):
        self.name = "standard input" if log == "-" else escaped(log)
        self.format = "text"
        self.encoding = "utf-8"
        self.cut_lines = 0
        self.bytes_read = 0
        self.stopped: Optional[str] = None  # why reading ended before the end of the log
        self.budget = budget or Budget()
        self._stream = self._open(log)
        self._first = self._read()
        self._decoder = self._sniff(self._first)

    def _fail(self, what: str) -> EnvbuildError:
        return EnvbuildError(f"log {self.name} {what}. Give `envbuild doctor` the training log as a text file "
                             "(plain, gzip, bzip2 or xz; UTF-8 or UTF-16), a directory of them, or - to read "
                             "standard input.")

    def _open(self, log: str) -> BinaryIO:
        if log == "-":
            raw: BinaryIO = sys.stdin.buffer
        else:
            try:
                raw = open_regular(log, "log")
            except EnvbuildError as e:
                raise self._fail(e.message.removeprefix(f"log {escaped(log)} ").split(";")[0]) from None
        self._raw = raw
        buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)
        try:
            head = buffered.peek(8)[:8]
        except OSError as e:
            raise self._fail(f"cannot be read: {e.strerror}") from None
        why = sniff_binary(head)
        if why:
            raise self._fail(why)
        for magic, (name, opener) in COMPRESSED.items():
            if head.startswith(magic):
                self.format = name
                return opener(buffered)
        return buffered

    def _read(self) -> bytes:
        if self.stopped:
            return b""
        try:
            data = self._stream.read(CHUNK)
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
            if self.bytes_read:  # a log cut short in transfer: what came before is still the log
                self.stopped = f"a damaged {self.format} stream after {size_text(self.bytes_read)} ({e})"
                return b""
            raise self._fail(f"is a damaged {self.format} file ({e})") from None
        data, self.stopped = self.budget.take(data)
        self.bytes_read += len(data)
        return data

    def _sniff(self, sample: bytes):
        """A decoder to UTF-8 for the log's encoding (None: it is UTF-8), or an error if it is not text."""
        sample = sample[:SNIFF]
        if sample.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            self.encoding = "utf-16"
        elif sample.startswith(codecs.BOM_UTF8):
            self.encoding = "utf-8-sig"
        elif b"\x00" in sample:
            even, odd = sample[0::2], sample[1::2]
            if len(sample) >= 4 and odd.count(0) > 0.4 * len(odd) and even.count(0) == 0:
                self.encoding = "utf-16-le"
            elif len(sample) >= 4 and even.count(0) > 0.4 * len(even) and odd.count(0) == 0:
                self.encoding = "utf-16-be"
            else:
                raise self._fail(f"is binary (NUL bytes in its first {len(sample)} bytes), not a text log")
        else:
            text = sample.decode("utf-8", errors="replace")
            odd_chars = text.count("\ufffd") + len(CONTROL.findall(text.replace("\x1b", "")))
            if text and odd_chars > 0.1 * len(text):
                raise self._fail("is not text (mostly undecodable bytes and control characters in its first "
                                 f"{len(sample)} bytes)")
            return None
        return codecs.getincrementaldecoder(self.encoding)(errors="replace")

    def _chunks(self) -> Iterator[bytes]:
        """The log's bytes as UTF-8."""
        data = self._first
        while data:
            yield self._decoder.decode(data).encode("utf-8", "surrogatepass") if self._decoder else data
            data = self._read()
        if self._decoder:
            yield self._decoder.decode(b"", final=True).encode("utf-8", "surrogatepass")

    def blocks(self) -> Iterator[bytes]:
        """The log as blocks of whole lines ending in a newline (the last one may not), cleaned
        like `clean_line`; a line that runs on past MAX_LINE bytes is cut there."""
        carry, skipping = b"", False
        try:
            for chunk in self._chunks():
                if skipping:
                    newline = chunk.find(b"\n")
                    if newline < 0:
                        continue
                    chunk, skipping = chunk[newline + 1:], False
                data = carry + chunk if carry else chunk
                last = data.rfind(b"\n")
                block, carry = (data[:last + 1], data[last + 1:]) if last >= 0 else (b"", data)
                if len(carry) > MAX_LINE:
                    self.cut_lines += 1
                    block, carry, skipping = block + carry[:MAX_LINE] + b"\n", b"", True
                if block:
                    yield clean_block(block)
            if carry:
                yield clean_block(carry[:-1] if carry.endswith(b"\r") else carry)
        finally:
            self.close()

    def lines(self) -> Iterator[str]:
        """Every line, decoded, without its end-of-line characters or ANSI escapes, cut at MAX_LINE bytes."""
        for block in self.blocks():
            for line in block.split(b"\n")[:-1] if block.endswith(b"\n") else block.split(b"\n"):
                if len(line) > MAX_LINE:
                    self.cut_lines += 1
                    line = line[:MAX_LINE]
                yield line.decode("utf-8", "replace")

    def close(self):
        """Close what this reader opened (never standard input)."""
        if self._raw is not sys.stdin.buffer:
            self._stream.close()
            self._raw.close()


def text_blocks(text: str) -> Iterator[bytes]:
    """A log already in memory as the blocks LogReader yields (tests, small inputs)."""
    data = text.encode("utf-8", "surrogatepass")
    pos = 0
    while pos < len(data):
        end = len(data) if pos + CHUNK >= len(data) else data.rfind(b"\n", pos, pos + CHUNK) + 1 or pos + CHUNK
        block = data[pos:end]
        yield clean_block(block[:-1] if end == len(data) and block.endswith(b"\r") else block)
        pos = end


SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*\Z", re.IGNORECASE)
MAX_SIZE = 1 << 50  # 1024T (1 PiB): more text than a run can read in --max-seconds


def parse_size(text: str, option: str = "--max-bytes") -> int:
    """A size a user typed: 500M, 16G, 2.5GiB, 1000000 (bytes), from 1 byte to 1024T.

    >>> parse_size("16G"), parse_size("512k"), parse_size("100")
    (17179869184, 524288, 100)
    """
    match = SIZE.match(text)
    if not match:
        raise EnvbuildError(f"{option} {shown(text)} is not a size; give a number of bytes with an optional K, M, G "
                            "or T suffix, from 1 to 1024T, e.g. 16G.")
    scale = 1 << (10 * " KMGT".index(match.group(2).upper() or " "))
    whole, _, fraction = match.group(1).partition(".")
    # 400 digits would be a float of inf: a number past the bound is over it whatever its digits
    size = int(float(f"{whole}.{fraction[:20] or 0}") * scale) if len(whole.lstrip("0")) <= 20 else MAX_SIZE + 1
    if not 1 <= size <= MAX_SIZE:
        raise EnvbuildError(f"{option} {shown(text)} is {'under 1 byte' if size < 1 else 'over 1024T (1 PiB)'}; "
                            "give a size from 1 byte to 1024T, e.g. 16G.")
    return size


def run_budget(max_bytes: str, max_seconds: float) -> Budget:
    """The budget of a run from its options (--max-seconds' nan passes a range check and would
    make the limit no limit)."""
    if max_seconds != max_seconds:
        raise EnvbuildError("--max-seconds 'nan' is not a number of seconds; give one from 1 to 604800 (a week), "
                            "e.g. 600.")
    return Budget(parse_size(max_bytes), max_seconds)
