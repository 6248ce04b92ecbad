"""The shape of the code, checked: rooms layered without cycles (import-linter, the contracts in
pyproject.toml), no import hidden inside a function outside the CLI and the in-image package (ruff
PLC0415, so the layer graph is the whole graph), and layout templates that see only the plan."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def _tool(name: str) -> str:
    """A test extra's command: beside this Python, else on PATH."""
    found = Path(sys.executable).parent / name
    if not found.exists():
        found = Path(shutil.which(name) or "/nonexistent")
    if not found.exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return str(found)


def test_rooms_are_layered_without_cycles():
    r = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout or "broken" not in r.stdout.split("Contracts:")[-1], r.stdout[-2000:]


@pytest.mark.parametrize("module, line, said", [
    # the tiers: the matrix loader reaching for the renderer
    ("envbuild/knowledge/matrix/loader.py", "from envbuild.render import builddir",
     "envbuild.knowledge.matrix.loader -> envbuild.render.builddir"),
    # a plan component applying a rule itself instead of reading the resolver's decision
    ("envbuild/plan/components/python.py", "from envbuild.knowledge import rules",
     "envbuild.plan.components.python -> envbuild.knowledge.rules"),
    # the wheel cache reading the plan's constants instead of base.buildcache's
    ("envbuild/builds/extcache.py", "from envbuild.plan import blocks",
     "envbuild.builds.extcache -> envbuild.plan.blocks"),
    # the next commands folding a whole plan to read its manifest
    ("envbuild/render/running.py", "from envbuild.plan.stack import stack_plan",
     "envbuild.render.running -> envbuild.plan.stack"),
    # one family of rules reaching into a sibling instead of the shared helpers
    ("envbuild/knowledge/rules/fabrics.py", "from envbuild.knowledge.rules import nccl",
     "envbuild.knowledge.rules.fabrics -> envbuild.knowledge.rules.nccl"),
], ids=["tiers", "components-rules", "extcache-plan", "running-stack", "rules-families"])
def test_each_contract_fails_on_a_deliberate_violation(tmp_path, module, line, said):
    """The checker is live: one deliberate violation of the tiers, of each forbidden contract and of
    the rules' families breaks it, and the report names the import."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "envbuild", copy / "envbuild", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # noqa: E402,F401\n")
    r = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=copy, capture_output=True, text=True,
                       env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and said in r.stdout, r.stdout[-3000:]


def test_ruff_finds_no_hidden_import_and_no_undefined_name():
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "envbuild", "tests", "bench", "scripts"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


def test_layout_templates_see_only_the_plan():
    """`grep -rn "resolution\\." templates/` is empty: a layout reads the build plan, which every
    kind of image (stack, extension) produces, and nothing else."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "templates").rglob("*.j2"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bresolution\.", line)]
    assert found == []


def test_the_cli_is_thin():
    """Each CLI module stays under 250 lines and each command's body under 25: a command parses
    and delegates, and the work lives in the module that owns it."""
    import ast

    import click

    from envbuild.cli import main

    for path in sorted((ROOT / "envbuild" / "cli").glob("*.py")):
        assert len(path.read_text().splitlines()) <= 250, path
    groups = [c for c in main.commands.values() if isinstance(c, click.Group)]
    commands = {c.callback.__name__ for c in [*main.commands.values(), *(c for g in groups for c in g.commands.values())]
                if c.callback}
    long = []
    for path in sorted((ROOT / "envbuild" / "cli").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in commands:
                body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
                if body and body[-1].end_lineno - body[0].lineno + 1 > 25:
                    long.append(f"{path.name}:{node.name}")
    assert long == [] and len(commands) >= 12, (long, commands)
    assert isinstance(main, click.Group)


def test_no_function_is_over_sixty_lines():
    """A function that grows a branch per feature (resolve() did, with --nccl and the OS lock)
    is split where it grows, not found long later by a reviewer."""
    import ast

    long = []
    for path in sorted((ROOT / "envbuild").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long
