"""The field types of the matrix models: the grammar of each kind of value (versions, specifiers,
driver versions, Debian words, URLs, environment names and values), and the strict base model
every model derives from (no unknown key, frozen, every string one line)."""

from __future__ import annotations

import re
from typing import ClassVar, Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, field_validator

from envbuild.base import grammar


def _version(v: str) -> str:
    try:
        Version(str(v))
    except InvalidVersion:
        raise ValueError(f"expected a version like '2.11.0', got {v!r}") from None
    return str(v)


def _specifier(v: str) -> str:
    try:
        SpecifierSet(str(v))
    except InvalidSpecifier:
        raise ValueError(f"expected a PEP 440 specifier like '>=2.7', got {v!r}") from None
    return str(v)


_CC = re.compile(r"^\d+\.\d+\Z")
_DRIVER = re.compile(r"^\d{3}(\.\d+){1,2}\Z")


def _driver(v: str) -> str:
    if not _DRIVER.match(str(v)):
        raise ValueError(f"expected an NVIDIA driver version like '580.65.06', got {v!r}")
    return str(v)


def _cc(v: str) -> str:
    if not _CC.match(str(v)):
        raise ValueError(f"expected a compute capability like '9.0', got {v!r}")
    return str(v)


_APT_WORD = re.compile(r"^[a-z0-9][a-z0-9.+-]*\Z")


def _apt_words(v):
    """Archive, suite and component names: what apt's sources.list grammar takes as one word."""
    for word in ([v] if isinstance(v, str) else v):
        if not _APT_WORD.match(str(word)):
            raise ValueError(f"expected a lower-case apt name like 'bookworm-updates' or 'main', got {word!r}")
    return v


def _url_template(v: str, timestamp: bool) -> str:
    """An http(s) archive URL with {archive} (and, for a snapshot, {timestamp}) in it."""
    if not re.match(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~{}/-]*)?\Z", v):
        raise ValueError(f"expected an http(s) URL such as 'http://deb.debian.org/{{archive}}', got {v!r}")
    needed = ["{archive}"] + (["{timestamp}"] if timestamp else [])
    missing = [p for p in needed if p not in v]
    if missing:
        raise ValueError(f"{v!r} lacks {' and '.join(missing)}")
    return v


def _text(value, field: str):
    """Every string of a matrix field (in lists and mappings too) is one line of text: a matrix
    value reaches comments, labels and shell lines of the rendered files, where a newline or
    another control character would end the line and start an instruction of its own."""
    if isinstance(value, str):
        grammar.one_line(value, "a matrix value")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _text(item, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            _text(key, field)
            _text(item, field)
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    _multiline: ClassVar[tuple[str, ...]] = ()  # fields whose text may span lines (a patch's old and new source)

    @field_validator("*")
    @classmethod
    def _one_line(cls, v, info):
        return v if info.field_name in cls._multiline else _text(v, info.field_name)


def _matching(pattern: str, like: str, prepare=lambda v: v):
    """A field validator: the value, if `prepare(value)` is all of `pattern`; else why not."""
    def check(v: str) -> str:
        if not re.fullmatch(pattern, prepare(v)):
            raise ValueError(f"expected {like}, got {v!r}")
        return v
    return check


_env_name = _matching(r"[A-Z_][A-Z0-9_]*", "an environment variable name like NCCL_DEBUG")
# An op's build switch, DS_BUILD_<env>: a build argument and an environment name.
_op_switch = _matching(r"[A-Z0-9_]+", "the part after DS_BUILD_ of a DeepSpeed build switch, like FUSED_ADAM")
# A Debian package name (Debian Policy 5.6.1), `{python}` standing for the family's Python
# package: a word of an apt-get line in a RUN instruction and %post.
_package = _matching(r"[a-z0-9][a-z0-9+.-]+", "a Debian package name like 'libaio-dev' or '{python}-dev'",
                     lambda v: v.replace("{python}", "python3"))
_host = _matching(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*",
                  "a host name like 'deb.debian.org'")


def _env_value(v: str) -> str:
    """A value written into a Dockerfile ENV line and Apptainer's %environment: the grammar of
    --env values (grammar.env_value)."""
    return grammar.env_value(v)


def _env_pairs(v: dict[str, str]) -> dict[str, str]:
    for name, value in v.items():
        _env_name(name)
        grammar.env_value(value, name)
    return v


def _git_commit(v: Optional[str]) -> Optional[str]:
    """A commit a source archive is of (the fabrics' sources, an extension's GitHub archives)."""
    if v is not None and not re.match(r"^[0-9a-f]{40}\Z", v):
        raise ValueError(f"expected a 40-hex-digit git commit, got {v!r}")
    return v


def _source_word(v: str) -> str:
    """A source's name or version: one word, as scripts/fabric-sources.sh lists it between spaces."""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._+-]*\Z", v):
        raise ValueError(f"expected letters, digits and ._+- like 'libfabric' or 'v2.8.3.post1', got {v!r}")
    return v


def _sha256_hex(v: str) -> str:
    if not re.match(r"^[0-9a-f]{64}\Z", v):
        raise ValueError(f"expected 64 lower-case hex digits, got {v!r}")
    return v
