"""Which lines concern which signatures, decided by the bytes alone: one Aho-Corasick automaton
(ahocorasick_rs) over every guard word of every signature, so a line holding none costs no Python
work. Built once per list of signatures (`screen_of`) and shared by every log a run reads.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Optional

import ahocorasick_rs

from envbuild.doctor.said import Said, load_said
from envbuild.doctor.signatures import MIN_GUARD, REGEX_FIELDS, KnownIssue, applicable, literal_guard

SAID = -1  # the screen's owner index of the catalogue's words (what a component said)


class Screen:
    """Every guard word of every signature's expressions in one Aho-Corasick automaton, with the
    signatures each word concerns; `moved_on` words (training progress, on most lines) are looked
    for only while a wait is open, by a second automaton.

    For wrapped messages the automaton also holds each pattern guard word cut at a line end:
    its beginnings followed by a newline and its ends after one (`: cannot op` + `\\n`,
    `\\n` + `en shared object file`). A hit means the line's end may cut the message, so the
    line is joined with the next one.
    """

    def __init__(self, issues: list[KnownIssue], said: Optional[Said] = None):
        issues = applicable(issues)
        always = [name for name in REGEX_FIELDS if name != "moved_on"]
        self.everything = False
        self.said = said
        self.words, self.owners, self.pattern_owners, self.wraps = self._index(issues, always, wraps=True)
        self.wait_words, self.wait_owners, _, _ = self._index(issues, REGEX_FIELDS, wraps=False)
        self.automaton = ahocorasick_rs.BytesAhoCorasick(self.words) if self.words else None
        self.wait_automaton = ahocorasick_rs.BytesAhoCorasick(self.wait_words) if self.wait_words else None

    def _index(self, issues, fields, wraps: bool):
        owners: dict[bytes, set[int]] = {}
        pattern_owners: dict[bytes, set[int]] = {}
        cut: dict[bytes, set[int]] = {}
        for index, issue in enumerate(issues):
            for name in fields:
                expression = getattr(issue, name)
                if not expression:
                    continue
                guard = literal_guard(expression)
                if guard is None:  # an expression without a guard word: every line concerns it
                    self.everything = True
                    continue
                for word in guard:
                    owners.setdefault(word.encode(), set()).add(index)
                if not (wraps and name == "pattern" and issue.kind == "match"):
                    continue
                for word in guard:
                    data = word.encode()
                    pattern_owners.setdefault(data, set()).add(index)
                    for at in range(1, len(data)):  # the longer side of the cut, at least half the word
                        if at >= max(MIN_GUARD, len(data) - at):
                            cut.setdefault(data[:at] + b"\n", set()).add(index)
                        elif len(data) - at >= MIN_GUARD:
                            cut.setdefault(b"\n" + data[at:], set()).add(index)
        for word in self.said.words if self.said else ():
            owners.setdefault(word.encode(), set()).add(SAID)  # a line a catalogued message may be on
        words = sorted(set(owners) | set(cut))
        return (words, [frozenset(owners.get(w, ())) for w in words],
                [frozenset(pattern_owners.get(w, ())) for w in words], [frozenset(cut.get(w, ())) for w in words])

    def hits(self, block: bytes, waiting: bool = False) -> list[tuple[int, int, int]]:
        """(word index, start, end) of every word in `block`, overlapping ones included, by start."""
        automaton = self.wait_automaton if waiting else self.automaton
        if automaton is None:
            return []
        hits = automaton.find_matches_as_indexes(block, overlapping=True)
        hits.sort(key=itemgetter(1))
        return hits


_SCREENS: list[tuple[tuple[KnownIssue, ...], Screen]] = []  # the last few, newest last


def screen_of(issues: list[KnownIssue]) -> Screen:
    """The Screen of these very issue objects, built once: building one (two automata over every
    guard word and its cuts) takes longer than diagnosing a typical log. The issues are frozen, and
    each entry holds them, so an object's id cannot be reused while its entry is here."""
    key = tuple(issues)
    for held, screen in _SCREENS:
        if len(held) == len(key) and all(a is b for a, b in zip(held, key)):
            return screen
    screen = Screen(issues, load_said())
    _SCREENS[:] = [*_SCREENS[-3:], (key, screen)]
    return screen
