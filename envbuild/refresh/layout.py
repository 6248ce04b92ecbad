"""A fixed YAML layout for the matrix files: one fact per line, so a refresh's diff shows
exactly the facts that changed.

Top-level mappings and lists of rows are block style; the rows inside them (a torch
release, an op) are block mappings; lists of plain values and anything deeper (variants,
needs, triton rules) are flow style on one line. Strings are plain when that reads back as the same string, else double-quoted;
version-like strings are always quoted. The output is checked to load back equal.
"""

from __future__ import annotations

import json
import re

import yaml

from envbuild.base.files import parse_yaml

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and yaml.safe_load(text) == text:
        return text
    return json.dumps(text, ensure_ascii=False)


def flow(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{scalar(k)}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    return scalar(value)


def _mapping(value: dict, indent: int, depth: int) -> list[str]:
    pad = " " * indent
    lines = []
    for key, item in value.items():
        if isinstance(item, dict) and item and depth < 2:
            lines.append(f"{pad}{scalar(key)}:")
            lines += _mapping(item, indent + 2, depth + 1)
        elif isinstance(item, list) and item and depth < 1 and any(isinstance(i, (dict, list)) for i in item):
            lines.append(f"{pad}{scalar(key)}:")
            lines += _sequence(item, indent + 2, depth + 1)
        else:
            lines.append(f"{pad}{scalar(key)}: {flow(item)}")
    return lines


def _sequence(value: list, indent: int, depth: int) -> list[str]:
    pad = " " * indent
    lines = []
    for item in value:
        if isinstance(item, dict) and item:
            body = _mapping(item, indent + 2, depth + 1)
            lines.append(f"{pad}- {body[0].lstrip()}")
            lines += body[1:]
        else:
            lines.append(f"{pad}- {flow(item)}")
    return lines


def dump(data: dict, header: str, comments: dict[str, str]) -> str:
    """The whole file: `header` (comment lines), then each top-level key in `data` order,
    preceded by its comment from `comments` and separated by blank lines."""
    chunks = [header.rstrip("\n")]
    for key, value in data.items():
        lines = [f"# {line}".rstrip() for line in comments.get(key, "").splitlines()]
        lines += _mapping({key: value}, 0, 0)
        chunks.append("\n".join(lines))
    text = "\n\n".join(chunks) + "\n"
    if parse_yaml(text, "the layout just written") != data:
        raise AssertionError("the YAML layout does not read back as the data it was given")
    return text
