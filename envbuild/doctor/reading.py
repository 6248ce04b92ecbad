"""Read a training log as lines of text, whatever it was saved as, in bounded memory.

Logs arrive as plain text, gzip/bzip2/xz files, UTF-16 (Windows redirection writes it with a
BOM), with ANSI colours and with tqdm's carriage returns, and sometimes as something that is
not a log at all (`/dev/zero`, a core file). Lines are streamed, never the whole file, and a
line longer than MAX_LINE characters is cut there (the rest of it up to the newline is skipped).
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import re
import sys
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

from ..errors import EnvbuildError

MAX_LINE = 64 * 1024
CHUNK = 64 * 1024
SNIFF = 8 * 1024

COMPRESSED = {
    b"\x1f\x8b": ("gzip", lambda raw: gzip.GzipFile(fileobj=raw)),
    b"BZh": ("bzip2", bz2.BZ2File),
    b"\xfd7zXZ\x00": ("xz", lzma.LZMAFile),
}
UNSUPPORTED = {b"\x28\xb5\x2f\xfd": "zstd (decompress it first: zstd -d LOG)",
               b"PK\x03\x04": "a zip archive (unzip it first)",
               b"\x7fELF": "an ELF binary or core file"}

# CSI sequences (colours, cursor moves), OSC sequences (titles, hyperlinks), other 2-byte escapes.
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def strip_ansi(line: str) -> str:
    """The line without terminal escape sequences (a bare ESC left over is dropped too)."""
    return ANSI.sub("", line).replace("\x1b", "") if "\x1b" in line else line


def clean_line(line: str) -> str:
    """A line as doctor matches it: no trailing carriage return (CRLF files), no ANSI escapes."""
    return strip_ansi(line[:-1] if line.endswith("\r") else line)


def printable(text: str) -> str:
    """Text safe to echo to a terminal: control characters shown as \\xNN, never sent raw."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class LogReader:
    """Opens LOG (a path or "-" for stdin) and yields its lines, decoded and without escapes.

    Raises EnvbuildError (exit 2) for a missing, unreadable, directory or non-text input; the
    check happens on the first bytes, before any line is yielded.
    """

    def __init__(self, log: str):
        self.name = "standard input" if log == "-" else log
        self.format = "text"
        self.encoding = "utf-8"
        self.cut_lines = 0
        self._stream = self._open(log)
        self._first = self._read(self._stream)
        self._decoder = codecs.getincrementaldecoder(self._sniff(self._first))(errors="replace")

    def _fail(self, what: str) -> EnvbuildError:
        return EnvbuildError(f"log {self.name} {what}. Give `envbuild doctor` the training log as a text file "
                             "(plain, gzip, bzip2 or xz; UTF-8 or UTF-16), or - to read standard input.")

    def _open(self, log: str) -> BinaryIO:
        if log == "-":
            raw: BinaryIO = sys.stdin.buffer
        else:
            path = Path(log)
            if path.is_dir():
                raise self._fail("is a directory, not a log file")
            try:
                raw = open(path, "rb")
            except OSError as e:
                raise self._fail(f"cannot be read: {e.strerror}") from None
        self._raw = raw
        buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)
        try:
            head = buffered.peek(8)[:8]
        except OSError as e:
            raise self._fail(f"cannot be read: {e.strerror}") from None
        for magic, why in UNSUPPORTED.items():
            if head.startswith(magic):
                raise self._fail(f"is {why}, not a text log")
        for magic, (name, opener) in COMPRESSED.items():
            if head.startswith(magic):
                self.format = name
                return opener(buffered)
        return buffered

    def _read(self, stream: BinaryIO) -> bytes:
        try:
            return stream.read(CHUNK)
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
            raise self._fail(f"is a damaged {self.format} file ({e})") from None

    def _sniff(self, sample: bytes) -> str:
        """The encoding of the log, or an error if the first bytes are not text."""
        sample = sample[:SNIFF]
        if sample.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            self.encoding = "utf-16"
            return self.encoding
        if sample.startswith(codecs.BOM_UTF8):
            self.encoding = "utf-8-sig"
            return self.encoding
        if b"\x00" in sample:
            even, odd = sample[0::2], sample[1::2]
            if len(sample) >= 4 and odd.count(0) > 0.4 * len(odd) and even.count(0) == 0:
                self.encoding = "utf-16-le"
            elif len(sample) >= 4 and even.count(0) > 0.4 * len(even) and odd.count(0) == 0:
                self.encoding = "utf-16-be"
            else:
                raise self._fail(f"is binary (NUL bytes in its first {len(sample)} bytes), not a text log")
            return self.encoding
        text = sample.decode("utf-8", errors="replace")
        odd_chars = text.count("\ufffd") + len(CONTROL.findall(text.replace("\x1b", "")))
        if text and odd_chars > 0.1 * len(text):
            raise self._fail("is not text (mostly undecodable bytes and control characters in its first "
                             f"{len(sample)} bytes)")
        return self.encoding

    def _chunks(self) -> Iterator[str]:
        data = self._first
        while data:
            yield self._decoder.decode(data)
            data = self._read(self._stream)
        yield self._decoder.decode(b"", final=True)

    def lines(self) -> Iterator[str]:
        """Every line without its end-of-line characters or ANSI escapes, cut at MAX_LINE characters."""
        partial, skipping = "", False
        try:
            for text in self._chunks():
                pieces = text.split("\n")
                for piece in pieces[:-1]:
                    if not skipping:
                        yield self._finish(partial + piece)
                    partial, skipping = "", False
                tail = pieces[-1]
                if skipping:
                    continue
                partial += tail
                if len(partial) > MAX_LINE:
                    self.cut_lines += 1
                    yield self._finish(partial[:MAX_LINE])
                    partial, skipping = "", True
            if partial and not skipping:
                yield self._finish(partial)
        finally:
            self.close()

    def _finish(self, line: str) -> str:
        if len(line) > MAX_LINE:
            self.cut_lines += 1
            line = line[:MAX_LINE]
        return clean_line(line)

    def close(self):
        """Close what this reader opened (never standard input)."""
        if self._raw is not sys.stdin.buffer:
            self._stream.close()
            self._raw.close()
