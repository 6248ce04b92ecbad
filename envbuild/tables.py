"""Rows for `envbuild matrix`/`envbuild gpus`, and the README's generated tables.

One place turns the matrix into rows; the CLI prints them with rich, the README embeds
them as Markdown between markers, and a test checks the README is current.
"""

from __future__ import annotations

import re
from pathlib import Path

from .matrix import Matrix

STACK_HEADERS = ("stack", "python", "cuda", "torch", "torchvision", "deepspeed", "os", "nvcc from",
                 "builder base", "runtime base")
GPU_HEADERS = ("gpu", "aliases", "cc", "family", "interconnect", "torch/CUDA floor", "baked env defaults")


def stack_rows(m: Matrix) -> list[tuple[str, ...]]:
    rows = []
    for s in m.stacks:
        rel = m.torch_release(s.torch)
        rows.append((s.id, s.python, s.cuda, s.torch, rel.torchvision, s.deepspeed, s.os,
                     "PyPI cuda-toolkit " + s.cuda_toolkit if s.toolchain == "pypi" else "NVIDIA devel image",
                     s.base_images.builder, s.base_images.runtime))
    return rows


def gpu_rows(m: Matrix) -> list[tuple[str, ...]]:
    rows = []
    for p in m.gpus:
        floor = ""
        if p.requires:
            floor = ", ".join(f"{k} {v}" for k, v in (("torch", p.requires.torch), ("CUDA", p.requires.cuda)) if v)
        env = ", ".join(f"{e.name}={e.value}" for e in p.env)
        rows.append((p.name, ", ".join(p.aliases), p.cc + (" (arch)" if p.cc_inferred else ""), p.family,
                     p.interconnect, floor, env))
    return rows


def env_rows(m: Matrix) -> list[tuple[str, ...]]:
    """Every baked default with its reason and source: common ones first, then per GPU."""
    rows = []
    for e in m.gpus_file.common_env:
        when = f" (torch {e.when['torch']})" if e.when else ""
        rows.append(("all" + when, f"{e.name}={e.value}", e.reason, e.source))
    for p in m.gpus:
        for e in p.env:
            rows.append((p.name, f"{e.name}={e.value}", e.reason, e.source))
    return rows


def gpu_json(m: Matrix) -> list[dict]:
    out = []
    for p in m.gpus:
        d = p.model_dump()
        d["sm"] = p.sm
        d["common_env"] = [e.model_dump() for e in m.gpus_file.common_env]
        out.append(d)
    return out


def markdown(headers, rows) -> str:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


_BLOCK = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def readme_blocks(m: Matrix) -> dict[str, str]:
    common = "\n".join(f"- `{e.name}={e.value}`"
                       + (f" (torch {e.when['torch']})" if e.when else "") + f": {e.reason}. Source: {e.source}."
                       for e in m.gpus_file.common_env)
    return {
        "stacks": markdown(STACK_HEADERS, stack_rows(m)),
        "gpus": markdown(GPU_HEADERS, gpu_rows(m)) + "\n\nEvery image also gets:\n\n" + common,
    }


def update_readme(text: str, m: Matrix) -> str:
    blocks = readme_blocks(m)

    def sub(match):
        return match.group(1) + blocks[match.group(2)] + "\n" + match.group(4)

    return _BLOCK.sub(sub, text)


def refresh_readme(path: Path, m: Matrix, check: bool) -> bool:
    """Rewrite the generated tables in `path`; with check, only report if stale."""
    text = path.read_text(encoding="utf-8")
    new = update_readme(text, m)
    if new == text:
        return True
    if not check:
        path.write_text(new, encoding="utf-8")
    return False
