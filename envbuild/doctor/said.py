"""What a component said: matchers built from a message catalogue (matrices/catalogues/).

Each catalogued format string becomes a regular expression: its printf conversions are typed
captures (`%d` an integer, `%lx` hex, `%p` a pointer, `%s` any text, ...), named by their kind and
position (`d1`, `s2`), and its whitespace matches any run of blanks (a terminal's wrap joined back,
a pasted indent). NCCL's `WARN` messages are looked for after `NCCL WARN` anywhere in a line, so
the prefixes pasting adds (`[rank3]:`, timestamps, `host:pid:tid [dev] file.cc:12`) do not
matter, and its ncclResult_t messages anywhere (torch quotes them in its errors). INFO lines are
catalogued but not reported: NCCL_DEBUG=INFO prints hundreds of them in a healthy job.

A line that no curated signature explains but that a catalogued message matches is reported as
what the component said: the message, the releases that print that wording, the source file and
line, the rank; its cause says it is not yet explained, never a guessed one. Matching costs
nothing on lines without `NCCL WARN` or a result message (the engine's Aho-Corasick screen holds
those words); on a line with one, a second automaton over each message's longest fixed piece
picks the few expressions worth running.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import ahocorasick_rs

import yaml

from ..files import parse_yaml, read_text
from ..resources import matrices_dir
from .signatures import KnownIssue

CONVERSION = re.compile(r"%(?P<flags>[-+ #0']*)(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?"
                        r"(?P<length>hh|h|ll|l|L|q|j|z|t)?(?P<kind>[diouxXeEfFgGaAcspn%])")
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|inf|nan)"
TYPED = {"d": r"\s*[-+]?\d+", "i": r"\s*[-+]?\d+", "u": r"\s*\d+", "o": r"\s*[0-7]+", "x": r"\s*(?:0x)?[0-9a-fA-F]+",
         "X": r"\s*(?:0X)?[0-9a-fA-F]+", "p": r"(?:0x[0-9a-fA-F]+|\(nil\))", "c": r".", "e": NUMBER, "E": NUMBER,
         "f": NUMBER, "F": NUMBER, "g": NUMBER, "G": NUMBER, "a": NUMBER, "A": NUMBER}
KIND = {"i": "d", "X": "x", "E": "f", "F": "f", "e": "f", "g": "f", "G": "f", "a": "f", "A": "f"}
MIN_FIXED = 10  # a message whose fixed text is shorter than this (`%s`, `%s: %s`) says too little to match alone
WARN_WORD = "NCCL WARN"
REPORTED = ("WARN", "RESULT")
UNEXPLAINED = "unexplained"  # the family of what a component said that no curated signature explains


def to_regex(text: str) -> str:
    """The expression of a printf format: conversions as typed named captures (`%lx` becomes
    `(?P<x2>...)` for the second conversion, a hex number), blanks as any run of blanks."""
    out, pos, number = [], 0, 0
    text = text.strip()
    conversions = list(CONVERSION.finditer(text))
    for index, conversion in enumerate(conversions):
        out.append(_literal(text[pos:conversion.start()]))
        pos = conversion.end()
        kind = conversion.group("kind")
        if kind == "%":
            out.append("%")
            continue
        if kind == "n":
            continue
        number += 1
        last = index == len(conversions) - 1 and not text[pos:].strip()
        body = (r".*" if last else r".*?") if kind == "s" else TYPED[kind]
        out.append(f"(?P<{KIND.get(kind, kind)}{number}>{body})")
    out.append(_literal(text[pos:]))
    return "".join(out)


def _literal(piece: str) -> str:
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", piece)) if piece.strip() else \
        (r"\s*" if piece else "")


def fixed_text(text: str) -> str:
    """The message without its conversions: what decides whether it says enough to match alone."""
    return CONVERSION.sub(" ", text).strip()


def key_of(text: str) -> str:
    """The longest run of fixed text between conversions and blanks-runs: every printing holds it."""
    runs = [run for piece in CONVERSION.split(text) if piece for run in re.split(r"\s{2,}|\n", piece)]
    return max((run.strip() for run in runs if run and run.strip()), key=len, default="")


@dataclass
class Matcher:
    level: str
    text: str
    file: str
    line: int
    releases: str
    tag: str
    pattern: str

    @functools.cached_property
    def regex(self) -> re.Pattern:
        return re.compile(self.pattern)

    def issue(self, component: str, url: str) -> KnownIssue:
        """The finding's signature: what was said, where in the source, and no cause guessed."""
        where = f"{self.file}:{self.line}"
        link = f"{url}/blob/{self.tag}/{self.file}#L{self.line}"
        said = "an ncclResult_t message" if self.level == "RESULT" else f"a {self.level} message"
        return KnownIssue(
            id=f"{component}-said", family=UNEXPLAINED, title=f"{component.upper()} said: {self.text.strip()}",
            pattern=self.pattern, detail=f"{component.upper()} {self.releases}, {where}",
            cause=f"not yet explained: {said} of {component.upper()} (printed at {where} in the releases "
                  f"{self.releases}); no curated signature says what it means for the job, and doctor does not guess.",
            fix=f"Read the source line ({link}) for the check that failed and what its values mean; search "
                f"{url}/issues for the wording; rerun with NCCL_DEBUG=INFO for the lines before it.",
            source=link)


class Said:
    """One component's catalogue as matchers: `words` for the engine's screen, `match` for a line."""

    def __init__(self, data: dict):
        self.component = str(data.get("component") or "nccl")
        self.url = str(data.get("source") or "")
        tags = {str(r["release"]): str(r["tag"]) for r in data.get("releases") or []}
        self.matchers: list[Matcher] = []
        keys: dict[str, list[int]] = {}
        self.results: list[str] = []
        for entry in data.get("messages") or []:
            level, text = entry.get("level"), str(entry.get("text", ""))
            if level not in REPORTED or len(fixed_text(text)) < MIN_FIXED:
                continue
            newest = str(entry.get("releases", "")).split(", ")[-1].split("..")[-1]
            body = to_regex(text)
            pattern = rf"{WARN_WORD}\s+{body}" if level == "WARN" else body
            matcher = Matcher(level, text, str(entry["file"]), int(entry["line"]), str(entry["releases"]),
                              tags.get(newest, "master"), pattern)
            keys.setdefault(key_of(text), []).append(len(self.matchers))
            self.matchers.append(matcher)
            if level == "RESULT":
                self.results.append(text.strip())
        self.keys = list(keys)
        self.owners = [keys[k] for k in self.keys]
        self.automaton = ahocorasick_rs.AhoCorasick(self.keys) if self.keys else None
        self.words = [WARN_WORD, *sorted(set(self.results))]
        self._issues: dict[int, KnownIssue] = {}

    def match(self, line: str) -> Optional[tuple[int, re.Match]]:
        """The most specific catalogued message the line holds (the longest fixed text), or None."""
        if self.automaton is None:
            return None
        best = None
        for key_index, _, _ in self.automaton.find_matches_as_indexes(line, overlapping=True):
            for index in self.owners[key_index]:
                found = self.matchers[index].regex.search(line)
                if found and (best is None or len(fixed_text(self.matchers[index].text)) >
                              len(fixed_text(self.matchers[best[0]].text))):
                    best = (index, found)
        return best

    def issue(self, index: int) -> KnownIssue:
        if index not in self._issues:
            self._issues[index] = self.matchers[index].issue(self.component, self.url)
        return self._issues[index]


@functools.lru_cache(maxsize=4)
def load_said(directory: Optional[Path] = None) -> Optional[Said]:
    """The NCCL catalogue envbuild ships (or the one in `directory`) as matchers; None without one."""
    path = (directory or matrices_dir()) / "catalogues" / "nccl.yaml"
    if not path.is_file():
        return None
    text = read_text(path, "message catalogue", "matrix")
    if getattr(yaml, "CSafeLoader", None):  # libyaml: the shipped catalogue in 0.1 s, not 0.5 s
        try:
            return Said(yaml.load(text, Loader=yaml.CSafeLoader))  # noqa: S506  (a safe loader)
        except yaml.YAMLError:
            pass  # parse_yaml says where it is broken
    return Said(parse_yaml(text, f"message catalogue {path}"))


def released_in(spans: str, order: list[str]) -> set[str]:
    """The releases of `order` a catalogue entry's `releases` ('2.20.5..2.26.5, 2.28.3') names."""
    held: set[str] = set()
    for run in spans.split(", "):
        first, _, last = run.partition("..")
        if first in order and (last or first) in order:
            held.update(order[order.index(first):order.index(last or first) + 1])
    return held


def drift(issues: list[KnownIssue], data: dict) -> list[str]:
    """What keeps a signature's quotes of NCCL from holding on every catalogued release: a quoted
    wording no release prints, a quoted line the wording cannot print, a wording the pattern does
    not match in the releases that print it, a release that prints none of the signature's wordings."""
    order = [str(r["release"]) for r in data.get("releases") or []]
    printed: dict[str, set[str]] = {}
    for entry in data.get("messages") or []:
        printed.setdefault(str(entry["text"]), set()).update(released_in(str(entry["releases"]), order))
    problems = []
    for issue in issues:
        if not issue.quotes:
            continue
        pattern, covered = re.compile(issue.pattern), set()
        for quote in issue.quotes:
            releases = printed.get(quote.nccl)
            if not releases:
                problems.append(f"{issue.id}: quotes {quote.nccl!r}, which no catalogued NCCL release prints")
            elif not re.search(to_regex(quote.nccl), quote.line):
                problems.append(f"{issue.id}: {quote.line!r} is not a line {quote.nccl!r} prints")
            elif not pattern.search(quote.line):
                problems.append(f"{issue.id}: NCCL {', '.join(r for r in order if r in releases)} print {quote.nccl!r} "
                                f"({quote.line!r}) and its pattern does not match it")
            else:
                covered |= releases
        missing = [r for r in order if r not in covered]
        if missing:
            problems.append(f"{issue.id}: NCCL {', '.join(missing)} print none of the wordings it quotes and matches")
    return problems
