"""What another machine or person wrote is hostile until it has passed through here: an image's
record, a registry's index or referrers, a provenance statement, an SBOM, a flight-recorder dump,
a lab's ``publish.yaml`` or ``envbuild.yaml``, a cache's spec.

Each document is parsed with bounds (bytes, nesting depth, how many values, digits in an
integer) and then checked against a schema (a pydantic model) before any field is used; every
refusal is an EnvbuildError (exit 2) naming the document and the field. (Secrets in URLs: grammar.redact.) Strings that go on to a
generated file still pass the grammar of what they become (:mod:`envbuild.base.grammar`,
:mod:`envbuild.oci.registry`) where they are used.

Why each bound: Python's JSON parser recurses once per nesting level (100,000 levels are a
RecursionError), turns a 5,000-digit integer into a ValueError (or, below the interpreter's
limit, into an integer no field can hold), and makes one object of about 60 bytes per value (a
16 MB dump of ``[[],[],...]`` is about 900 MB). The value count is bounded before parsing, from
the bytes alone.

>>> loads_json(b'{"a": [1, 2]}', "a record")
{'a': [1, 2]}
>>> loads_json(b'[' * 100 + b']' * 100, "a record")
Traceback (most recent call last):
...
envbuild.base.errors.EnvbuildError: a record nests deeper than 64 levels; no document envbuild reads does: give the document envbuild wrote.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import MIB, decode, parse_yaml
from envbuild.base.grammar import shown

MAX_DEPTH = 64       # deeper than any document envbuild writes or reads (a record: 6 levels)
MAX_DIGITS = 40      # an integer field holds a size, a count or a time: 2**64 has 20 digits
MAX_VALUES = 1 << 20  # values in one document (a record holds a few thousand)
_MAX_BITS = (10 ** MAX_DIGITS).bit_length()

M = TypeVar("M", bound=BaseModel)


def _refuse(named: str, what: str) -> EnvbuildError:
    return EnvbuildError(f"{named} {what}; no document envbuild reads does: give the document envbuild wrote.")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _TooLong(len(text.lstrip("-")))
    return int(text)


def _constant(name: str) -> float:
    raise _NotFinite(name)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text[:20])
    return value


class _TooLong(ValueError):
    pass


class _NotFinite(ValueError):
    pass


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of a parsed document, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)
    return deepest


def values_bound(data: bytes | str) -> int:
    """An upper bound on the values a JSON or YAML flow document holds, from its bytes alone:
    each value but the first follows a comma or opens a container."""
    b = data.encode() if isinstance(data, str) else data
    return 1 + b.count(b",") + b.count(b"[") + b.count(b"{") + b.count(b"\n")


def check_size(data: bytes | str, named: str, max_bytes: int, max_values: int = MAX_VALUES) -> None:
    """`data` no longer than `max_bytes` and holding at most `max_values` values."""
    if len(data) > max_bytes:
        raise _refuse(named, f"is {len(data)} bytes, over the {max_bytes // MIB or 1} MiB such a document can be")
    if values_bound(data) > max_values:
        raise _refuse(named, f"holds more than {max_values} values")


def loads_json(data: bytes | str, named: str, max_bytes: int = 16 * MIB, *, max_depth: int = MAX_DEPTH,
               max_values: int = MAX_VALUES) -> Any:
    """`data` as JSON, bounded; EnvbuildError (exit 2) naming `named` otherwise."""
    check_size(data, named, max_bytes, max_values)
    text = decode(data, named) if isinstance(data, bytes) else data
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except _TooLong as e:
        raise _refuse(named, f"holds an integer of {e.args[0]} digits, over the {MAX_DIGITS} any field holds") from None
    except _NotFinite as e:
        raise _refuse(named, f"holds the number {shown(str(e.args[0]))}, which is not finite") from None
    except RecursionError:
        raise _refuse(named, f"nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as e:
        raise EnvbuildError(f"{named} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                            f"give the document envbuild wrote.") from None
    if _depth(value, max_depth) > max_depth:
        raise _refuse(named, f"nests deeper than {max_depth} levels")
    return value


def loads_yaml(data: bytes | str, named: str, max_bytes: int = MIB, *, max_values: int = MAX_VALUES,
               documents: bool = False) -> Any:
    """`data` as YAML (safe types, no aliases, bounded depth, bounded integers); EnvbuildError
    naming `named` otherwise. `documents`: a stream of documents (``---``), as a list."""
    check_size(data, named, max_bytes, max_values)
    text = decode(data, named) if isinstance(data, bytes) else data
    value = parse_yaml(text, named, documents)
    _check_ints(value, named)
    return value


def _check_ints(value: Any, named: str) -> None:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if isinstance(node, int) and node.bit_length() > _MAX_BITS:
            raise _refuse(named, f"holds an integer of more than {MAX_DIGITS} digits")
        if isinstance(node, float) and not math.isfinite(node):
            raise _refuse(named, f"holds the number {node}, which is not finite")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def field_path(loc: tuple) -> str:
    """A pydantic error location as a reader writes it: ``base_images.builder`` or ``layers[2].digest``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(the document)"


def validated(model: type[M], data: Any, named: str) -> M:
    """`data` checked against `model`; EnvbuildError naming the first field that is wrong and why."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        reason = first["msg"].removeprefix("Value error, ")
        more = len(e.errors()) - 1
        also = f" (and {more} more field{'s' * (more > 1)})" if more else ""
        raise EnvbuildError(f"{named}: field {shown(field_path(first['loc']))} is wrong: {reason}{also}; "
                            f"give the document envbuild wrote.") from None
