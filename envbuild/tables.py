"""Rows for `envbuild matrix`/`envbuild gpus`, and the README's generated tables.

One place turns the matrix into rows; the CLI prints them with rich, the README embeds
them as Markdown between markers, and a test checks the README is current.
"""

from __future__ import annotations

import re
from pathlib import Path

from .matrix import Matrix

STACK_HEADERS = ("stack", "python", "cuda", "torch", "torchvision", "deepspeed", "os", "nvcc from",
                 "min driver", "builder base", "runtime base")
GPU_HEADERS = ("gpu", "aliases", "cc", "generation", "interconnect", "torch/CUDA floor", "baked env defaults")


def stack_rows(m: Matrix) -> list[tuple[str, ...]]:
    rows = []
    for s in m.stacks:
        rel = m.torch_release(s.torch)
        install = m.bases.toolchains[s.toolchain].install
        rows.append((s.id, s.python, s.cuda, s.torch, rel.torchvision, s.deepspeed, s.os,
                     f"PyPI {install.package} {s.cuda_toolkit}" if install else "NVIDIA devel image",
                     m.driver_floor(s.cuda).min_driver, s.base_images.builder, s.base_images.runtime))
    return rows


def gpu_rows(m: Matrix) -> list[tuple[str, ...]]:
    rows = []
    for p in m.gpus:
        floor = ""
        if p.requires:
            floor = ", ".join(f"{k} {v}" for k, v in (("torch", p.requires.torch), ("CUDA", p.requires.cuda)) if v)
        env = ", ".join(f"{e.name}={e.value}" + (f" ({condition(e)})" if e.node else "") for e in p.env)
        rows.append((p.name, ", ".join(p.aliases), p.cc + (" (arch)" if p.cc_inferred else ""), p.generation,
                     p.interconnect, floor, env))
    return rows


ENV_HEADERS = ("gpu", "variable", "reason", "cost", "source")
NOT_BAKED_HEADERS = ("gpus", "variable", "why not", "source")


def condition(e) -> str:
    """When a default applies: its torch range, and the node conditions checked at start-up.

    >>> from envbuild.matrix import EnvDefault, NodeCondition
    >>> condition(EnvDefault(name="X", value="1", reason="r", source="s", cost="c",
    ...                      node=NodeCondition(driver_below="550.40.07", infiniband="absent")))
    'on nodes with driver < 550.40.07 and no InfiniBand'
    """
    parts = []
    if e.when:
        parts.append(f"torch {e.when['torch']}")
    if e.node:
        node = []
        if e.node.driver_below:
            node.append(f"driver < {e.node.driver_below}")
        if e.node.infiniband:
            node.append("no InfiniBand" if e.node.infiniband == "absent" else "InfiniBand")
        parts.append("on nodes with " + " and ".join(node))
    return "; ".join(parts)


def env_rows(m: Matrix) -> list[tuple[str, ...]]:
    """Every default with its reason, cost and source: common ones first, then per GPU."""
    rows = []
    for e in m.gpus_file.common_env:
        rows.append(("all" + (f" ({condition(e)})" if condition(e) else ""), f"{e.name}={e.value}",
                     e.reason, e.cost, e.source))
    for p in m.gpus:
        for e in p.env:
            rows.append((p.name + (f" ({condition(e)})" if condition(e) else ""), f"{e.name}={e.value}",
                         e.reason, e.cost, e.source))
    return rows


def not_baked_rows(m: Matrix) -> list[tuple[str, ...]]:
    return [(", ".join(d.gpus), f"{d.name}={d.value}", d.why, d.source) for d in m.gpus_file.not_baked]


def gpu_json(m: Matrix) -> list[dict]:
    out = []
    for p in m.gpus:
        d = p.model_dump(exclude_none=True)
        d["sm"] = p.sm
        d["common_env"] = [e.model_dump(exclude_none=True) for e in m.gpus_file.common_env]
        d["not_baked"] = [n.model_dump() for n in m.gpus_file.not_baked if p.name in n.gpus or "all" in n.gpus]
        out.append(d)
    return out


def markdown(headers, rows) -> str:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


_BLOCK = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def readme_blocks(m: Matrix) -> dict[str, str]:
    common = "\n".join(f"- `{e.name}={e.value}`" + (f" ({condition(e)})" if condition(e) else "")
                       + f": {e.reason}. Cost: {e.cost}. Source: {e.source}."
                       for e in m.gpus_file.common_env)
    per_gpu = "\n".join(f"- {p.name}: `{e.name}={e.value}`" + (f" ({condition(e)})" if condition(e) else "")
                        + f": {e.reason}. Cost: {e.cost}. Source: {e.source}."
                        for p in m.gpus for e in p.env)
    floors = markdown(("CUDA", "min driver (Linux)", "branch", "source"),
                      [(f"{f.cuda}.x", f.min_driver, f.branch, f.source) for f in m.cuda_file.driver_floors])
    return {
        "stacks": markdown(STACK_HEADERS, stack_rows(m)) + "\n\nDriver floors (`matrices/cuda.yaml`): "
                  + m.cuda_file.forward_compat + "\n\n" + floors,
        "gpus": markdown(GPU_HEADERS, gpu_rows(m)) + "\n\nEvery image also gets:\n\n" + common
                + "\n\nPer GPU:\n\n" + per_gpu
                + "\n\nConsidered and not baked:\n\n" + markdown(NOT_BAKED_HEADERS, not_baked_rows(m)),
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
