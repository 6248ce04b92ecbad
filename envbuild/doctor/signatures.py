"""Known failure signatures, read from matrices/known_issues.yaml.

A signature is data: regular expressions, the cause, the fix and the source, so a new field
report is a new entry, not new code. Each belongs to a family (a shared library missing, a
symbol or version mismatch, the host's GPU stack, a launcher, the run-time toolchain, a
fabric, ...), and a family member names the specific part the log shows: a pattern's named
groups (`(?P<lib>lib\\S+\\.so\\S*)`) are the parts, `{lib}` in its title, cause or fix is
replaced by what the log said, and `cases` pick a cause and fix by the part's value (libcuda
comes from the driver, libcudnn from the image). A family that cannot tell the cause from the
log says so: `certainty: likely`.

Two kinds exist:

`detail` is a template too; every value a part took in the log fills it (`GLIBC_2.32, 2.34`).

- `match` (the default): every line matching `pattern` is a hit, unless `unless` appears later
  in the log (the step finished after all), and, when `context` is set, only if `context`
  appears within `context_lines` lines before or after the hit, and not if `excused_by` appears
  within `context_lines` lines before it (the user chose this on purpose, e.g. disabled IB).
- `wait`: `pattern` opens a wait (e.g. a JIT compile taking the torch_extensions lock) and
  `resolved_by` closes one, per rank. A wait still open at the end of the log is a hang, unless
  `moved_on` (training progress) appears after it or `quiet_lines` other lines of that rank
  follow it. `evidence` (e.g. a stack parked in the lock's wait loop) is a hang on its own.

Any expression may be a list of alternatives; each keeps its own group names.

`image` (a fact of the image's manifest, such as `nccl`) makes a signature compare the log with
the image it ran in: it applies only when doctor knows the image (`--manifest`), and `{image}`
in its pattern (escaped) and its texts is replaced by the image's value first, so a pattern
such as `NCCL version (?!{image}\b)` matches only another version than the image's.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Literal, Optional, Union

try:  # Python >= 3.11
    from re import _constants as sre_constants, _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants
    import sre_parse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_yaml
from envbuild.base.resources import KNOWN_ISSUES

REGEX_FIELDS = ("pattern", "unless", "context", "excused_by", "resolved_by", "evidence", "moved_on")
TEXT_FIELDS = ("title", "cause", "fix")
PLACEHOLDER = re.compile(r"\{([a-z][a-z0-9_]*)\}")
IMAGE_PLACEHOLDER = "{image}"  # the image's value of a signature's `image` fact
ALTERNATIVE_SUFFIX = re.compile(r"__\d+$")
GROUP_NAME = re.compile(r"(?<!\\)\(\?P([<=])([A-Za-z_]\w*)")

Expression = Optional[Union[str, list[str]]]


def merge_alternatives(value):
    """One expression from a list of alternatives, each alternative's group names made unique
    (`lib` in the second becomes `lib__2`; `part_name` strips the suffix again)."""
    if not isinstance(value, list):
        return value
    parts = []
    for number, alternative in enumerate(value, 1):
        if not isinstance(alternative, str):
            raise ValueError("every alternative of an expression must be a string")
        if number > 1:
            alternative = GROUP_NAME.sub(lambda m: f"(?P{m.group(1)}{m.group(2)}__{number}", alternative)
        parts.append(f"(?:{alternative})")
    return "|".join(parts)


def part_name(group: str) -> str:
    return ALTERNATIVE_SUFFIX.sub("", group)


class Case(BaseModel):
    """A cause and fix chosen by the value of a part (`when: {lib: '^libcuda\\.'}`)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    when: dict[str, str]
    title: Optional[str] = None
    cause: Optional[str] = None
    fix: Optional[str] = None
    certainty: Optional[Literal["certain", "likely"]] = None


QUOTED = ("nccl", "slurm", "enroot", "pyxis", "torch", "deepspeed", "triton", "container-toolkit",
          "libnvidia-container", "apptainer")  # catalogues a quote can name (a field's name has `_` for `-`)


class Quote(BaseModel):
    """A component's message a signature stands for: its format string exactly as the component's
    catalogue (matrices/catalogues/NAME.yaml) has it, under the component's name (`nccl:`,
    `slurm:`, `pyxis:`, `triton:`, ...: exactly one), and a line the component prints with it."""
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    nccl: Optional[str] = None
    slurm: Optional[str] = None
    enroot: Optional[str] = None
    pyxis: Optional[str] = None
    torch: Optional[str] = None
    deepspeed: Optional[str] = None
    triton: Optional[str] = None
    container_toolkit: Optional[str] = Field(None, alias="container-toolkit")
    libnvidia_container: Optional[str] = Field(None, alias="libnvidia-container")
    apptainer: Optional[str] = None
    line: str
    message: str = ""  # the message this wording is of (its wordings over the releases share the name)
    until: Optional[str] = None  # the last release that prints the message at all (it was removed after)

    @model_validator(mode="after")
    def _one_component(self):
        named = [name for name in QUOTED if getattr(self, name.replace("-", "_")) is not None]
        if len(named) != 1:
            raise ValueError(f"a quote names exactly one component's wording ({', '.join(QUOTED)}), not {named or 'none'}")
        return self

    @property
    def component(self) -> str:
        return next(name for name in QUOTED if getattr(self, name.replace("-", "_")) is not None)

    @property
    def text(self) -> str:
        return getattr(self, self.component.replace("-", "_"))


class Family(BaseModel):
    """A family of causes, and what an envbuild image already does about it."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    title: str
    envbuild: str


class KnownIssue(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    title: str
    family: str = "other"
    kind: Literal["match", "wait"] = "match"
    pattern: str
    unless: Optional[str] = None
    context: Optional[str] = None
    context_lines: int = Field(default=30, ge=1, le=1000)
    excused_by: Optional[str] = None
    superseded_by: list[str] = []
    resolved_by: Optional[str] = None
    evidence: Optional[str] = None
    moved_on: Optional[str] = None
    quiet_lines: int = Field(default=1000, ge=1)
    certainty: Literal["certain", "likely"] = "certain"
    follows: bool = False
    cases: list[Case] = []
    detail: Optional[str] = None
    image: Optional[Literal["nccl"]] = None
    quotes: list[Quote] = []
    cause: str
    fix: str
    source: str

    @field_validator(*REGEX_FIELDS, mode="before")
    @classmethod
    def _alternatives(cls, value):
        return merge_alternatives(value)

    @model_validator(mode="after")
    def _wait_needs_resolution(self):
        if self.kind == "wait" and not self.resolved_by:
            raise ValueError(f"{self.id}: a `wait` signature needs `resolved_by`")
        if self.kind == "match" and (self.resolved_by or self.evidence or self.moved_on):
            raise ValueError(f"{self.id}: `resolved_by`, `evidence` and `moved_on` belong to `wait` signatures")
        if self.kind == "wait" and (self.context or self.excused_by or self.cases):
            raise ValueError(f"{self.id}: `context`, `excused_by` and `cases` belong to `match` signatures")
        if self.image and IMAGE_PLACEHOLDER not in self.pattern:
            raise ValueError(f"{self.id}: a signature with `image` compares through {IMAGE_PLACEHOLDER} in its pattern")
        return self

    def bound(self, value: str) -> "KnownIssue":
        """This signature for an image whose `image` fact is `value`: `{image}` filled in."""
        def fill(text):
            return text.replace(IMAGE_PLACEHOLDER, value) if text else text

        update = {name: fill(getattr(self, name)) for name in (*TEXT_FIELDS, "detail")}
        update["pattern"] = self.pattern.replace(IMAGE_PLACEHOLDER, re.escape(value))
        update["cases"] = [c.model_copy(update={f: fill(getattr(c, f)) for f in TEXT_FIELDS}) for c in self.cases]
        update["image"] = None  # bound: an ordinary signature now
        return self.model_copy(update=update)

    def regex(self, name: str) -> Optional["GuardedRegex"]:
        """The compiled regular expression of field `name` (None where the field is unset)."""
        value = getattr(self, name)
        return GuardedRegex(value) if value else None

    def parts(self) -> set[str]:
        """The part names the pattern extracts (its named groups)."""
        return {part_name(name) for name in re.compile(self.pattern).groupindex}

    def texts(self) -> list[str]:
        own = [getattr(self, f) for f in TEXT_FIELDS] + [self.detail or ""]
        return own + [getattr(c, f) or "" for c in self.cases for f in TEXT_FIELDS]

    def fill_detail(self, values: dict[str, list[str]]) -> str:
        """`detail` with each `{part}` replaced by every value the log showed for it; a clause
        (between semicolons) whose parts the log never showed is left out."""
        if not self.detail:
            return ""
        clauses = [clause for clause in self.detail.split("; ")
                   if all(values.get(name) for name in PLACEHOLDER.findall(clause))]
        return PLACEHOLDER.sub(lambda m: ", ".join(values[m.group(1)]), "; ".join(clauses))

    def resolve(self, parts: dict[str, str]) -> dict[str, str]:
        """Title, cause, fix and certainty for the parts one log line showed: the first case
        whose `when` expressions all match, else the signature's own; `{part}` filled in."""
        chosen: dict[str, Optional[str]] = {}
        for case in self.cases:
            if all(re.search(expression, parts.get(name, "")) for name, expression in case.when.items()):
                chosen = {"title": case.title, "cause": case.cause, "fix": case.fix, "certainty": case.certainty}
                break
        texts = {f: chosen.get(f) or getattr(self, f) for f in TEXT_FIELDS}
        filled = {f: PLACEHOLDER.sub(lambda m: parts.get(m.group(1)) or "?", text) for f, text in texts.items()}
        filled["certainty"] = chosen.get("certainty") or self.certainty
        return filled


def applicable(issues: list[KnownIssue]) -> list[KnownIssue]:
    """The signatures a scan runs: one still waiting for its image's value (not bound with
    bind_image) would take every version for another one, so it is left out."""
    return [issue for issue in issues if not issue.image]


def bind_image(issues: list[KnownIssue], facts: Optional[dict]) -> list[KnownIssue]:
    """The signatures that apply to a log of an image with these manifest `facts` (None: no image
    known): the others as they are, each `image` signature bound to its fact or left out."""
    facts = facts or {}
    return [issue if not issue.image else issue.bound(facts[issue.image])
            for issue in issues if not issue.image or facts.get(issue.image)]


MIN_GUARD = 3


def _better(a: Optional[tuple[str, ...]], b: Optional[tuple[str, ...]]) -> Optional[tuple[str, ...]]:
    """The more selective of two guards: the longer shortest word, then fewer words."""
    if a is None or b is None:
        return a or b
    return max(a, b, key=lambda g: (min(map(len, g)), -len(g)))


def _guard_of(items) -> Optional[tuple[str, ...]]:
    """Words one of which every match of the parsed sequence `items` contains (None: no such set)."""
    best, run = None, ""

    def take_run():
        nonlocal best, run
        if len(run) >= MIN_GUARD:
            best = _better(best, (run,))
        run = ""

    for op, arg in items:
        if op is sre_constants.LITERAL:
            run += chr(arg)
            continue
        take_run()
        sub = None
        if op is sre_constants.SUBPATTERN and not arg[1] and not arg[2]:  # a group without inline flags
            sub = _guard_of(arg[3])
        elif op is sre_constants.BRANCH:
            guards = [_guard_of(branch) for branch in arg[1]]
            if all(guards):
                sub = tuple(dict.fromkeys(word for guard in guards for word in guard))
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and arg[0] >= 1:
            sub = _guard_of(arg[2])
        best = _better(best, sub)
    take_run()
    return best


@functools.lru_cache(maxsize=None)
def literal_guard(pattern: str) -> Optional[tuple[str, ...]]:
    """Substrings one of which every match of `pattern` contains, or None if there is no such set.
    Cached: a pure function of the pattern, and parsing every signature's expressions again for
    each log (each rank's, in a multi-rank run) was most of doctor's start-up.

    A sequence contributes its longest run of plain characters, or the guard of a group or an
    alternation inside it, whichever is the more selective; an alternation needs a guard in
    each branch. `any(word in line for word in guard)` is then a necessary condition for a
    match, and testing it first is far cheaper than running the regular expression on every line.

    >>> literal_guard(r"(?:PyTorch|CUDA) version mismatch!")
    (' version mismatch!',)
    >>> literal_guard(r"(?P<lib>lib\\w+\\.so): cannot open|Could not load (?P<lib__2>\\S+)")
    (': cannot open', 'Could not load ')
    >>> literal_guard(r"foo|\\bx") is None
    True
    """
    tree = sre_parse.parse(pattern)
    if tree.state.flags & re.IGNORECASE:
        return None
    return _guard_of(list(tree))


class GuardedRegex:
    """A compiled regular expression that skips lines without any of its literal guard words."""

    def __init__(self, pattern: str):
        self.regex = re.compile(pattern)
        self.guard = literal_guard(pattern)
        if self.guard is None:
            self.possible = lambda line: True
        elif len(self.guard) == 1:
            word = self.guard[0]
            self.possible = lambda line: word in line
        else:
            words = re.compile("|".join(re.escape(word) for word in self.guard))
            self.possible = lambda line: words.search(line) is not None

    def search(self, line: str):
        return self.regex.search(line) if self.possible(line) else None

    def finditer(self, line: str):
        return self.regex.finditer(line) if self.possible(line) else iter(())

    def count(self, line: str) -> int:
        return len(self.regex.findall(line)) if self.possible(line) else 0


def _malformed(path: Path, what: str) -> EnvbuildError:
    return EnvbuildError(f"known-issues file {path} is malformed: {what}. Compare it with the one envbuild ships "
                         "(matrices/known_issues.yaml), or leave out --matrix-dir to use that one.")


def _check(issues: list[KnownIssue], families: list[Family], path: Path):
    """What the models cannot check alone: unique ids, known families and parts, compilable expressions."""
    ids = [i.id for i in issues]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    unknown = sorted({s for i in issues for s in i.superseded_by} - set(ids))
    if duplicates or unknown:
        raise _malformed(path, f"duplicate ids {duplicates}" if duplicates else f"superseded_by names unknown ids {unknown}")
    known_families = {f.id for f in families}
    for issue in issues:
        if families and issue.family not in known_families:
            raise _malformed(path, f"{issue.id}: family {issue.family!r} is not one of {sorted(known_families)}")
        for name in REGEX_FIELDS:
            issue.regex(name)
        parts = issue.parts()
        used = {name for text in issue.texts() for name in PLACEHOLDER.findall(text)}
        used |= {name for case in issue.cases for name in case.when}
        if issue.image:
            used.discard("image")
        if used - parts:
            raise _malformed(path, f"{issue.id}: {sorted(used - parts)} named in its texts or cases but not a "
                             f"named group of its pattern (parts: {sorted(parts) or 'none'})")
        for case in issue.cases:
            for expression in case.when.values():
                re.compile(expression)


def load_catalogue(matrix_dir: Path) -> tuple[list[KnownIssue], list[Family]]:
    """Every signature and family in `matrix_dir/known_issues.yaml`, validated, regexes compiled once."""
    path = matrix_dir / KNOWN_ISSUES
    if not os.path.lexists(path):
        raise EnvbuildError(f"known-issues file {path} is missing: the matrix directory {matrix_dir} has no "
                            f"known_issues.yaml; copy the shipped matrices/known_issues.yaml there, or leave out "
                            f"--matrix-dir (ENVBUILD_MATRIX_DIR) to use the shipped one.")
    # A regular file (no FIFO can block, /dev/zero is refused), bounded, UTF-8, YAML of bounded
    # depth without aliases: or exit 2 naming the file.
    document = read_yaml(path, "known-issues file")
    try:
        if not isinstance(document, dict) or not isinstance(document.get("issues"), list):
            raise _malformed(path, "it needs a list `issues:`")
        families = [Family.model_validate(f) for f in document.get("families") or []]
        issues = [KnownIssue.model_validate(i) for i in document["issues"]]
        _check(issues, families, path)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "an entry"
        raise _malformed(path, f"{where}: {error['msg']}") from None
    except (TypeError, ValueError, re.error) as e:
        raise _malformed(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return issues, families


def load_issues(matrix_dir: Path) -> list[KnownIssue]:
    """Every signature in `matrix_dir/known_issues.yaml` (see load_catalogue)."""
    return load_catalogue(matrix_dir)[0]
