"""The docs hold up: the CLI reference (docs/cli.md) is what the commands declare today, every
command and option has help, and every relative link in the README and docs/ resolves."""

from __future__ import annotations

import re
import subprocess
import sys

import click
import pytest

from conftest import ROOT, load_yaml

REGENERATE = "python -m envbuild.reference docs/cli.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# --- the generated CLI reference ----------------------------------------------------------

def test_cli_reference_is_current():
    from envbuild.reference import reference

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert text == reference(), f"docs/cli.md is stale: run `{REGENERATE}`"


def test_manifest_reference_is_current():
    """docs/manifest.md is generated from the manifest's schema (envbuild/plan/schema.py)."""
    from envbuild.plan import schema

    text = (ROOT / "docs" / "manifest.md").read_text()
    assert text == schema.reference(), "docs/manifest.md is stale: run `python -m envbuild.reference docs/manifest.md`"


def test_components_reference_is_current_and_every_component_keeps_the_protocol():
    from envbuild.plan.components.base import Component
    from envbuild.plan.stack import COMPONENTS, RUNTIME_ORDER
    from envbuild.reference import components

    assert all(isinstance(c, Component) and c.__doc__ for c in COMPONENTS) and set(RUNTIME_ORDER) <= set(COMPONENTS)
    text = (ROOT / "docs" / "components.md").read_text()
    assert text == components(), "docs/components.md is stale: run `python -m envbuild.reference docs/components.md`"


def test_matrix_schemas_are_current_and_validate_the_shipped_matrix():
    """docs/schemas/ is what the models say today, and each schema accepts the shipped file and
    refuses a wrong type where the model does (an editor then says what the loader would)."""
    import json

    import jsonschema

    from envbuild.reference import matrix_schemas

    generated = matrix_schemas()
    on_disk = {p.name: p.read_text() for p in (ROOT / "docs" / "schemas").glob("*.schema.json")}
    assert on_disk == generated, "docs/schemas is stale: run `python -m envbuild.reference docs/schemas`"
    for name, text in generated.items():
        data = load_yaml((ROOT / "matrices" / name.replace(".schema.json", ".yaml")).read_text())
        jsonschema.validate(data, json.loads(text))
    stacks = json.loads(generated["stacks.schema.json"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"stacks": "not a list"}, stacks)


def test_cli_reference_lists_every_command_and_option():
    """Nothing declared is missing from the page: each command has its section, each option its line."""
    from envbuild.cli import main
    from envbuild.reference import commands, is_help_option

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    for ctx, command in commands(main):
        assert ctx.command_path in sections, ctx.command_path
        for param in command.params:
            if isinstance(param, click.Option) and not is_help_option(param, ctx):
                assert f"`{', '.join(param.opts)}" in sections[ctx.command_path], (ctx.command_path, param.opts)


def test_reference_check_mode_names_the_command_to_run(tmp_path):
    stale = tmp_path / "cli.md"
    stale.write_text("# old\n")
    r = subprocess.run([sys.executable, "-m", "envbuild.reference", str(stale), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and f"python -m envbuild.reference {stale}" in r.stderr, r.stderr
    assert stale.read_text() == "# old\n"  # --check writes nothing
    r = subprocess.run([sys.executable, "-m", "envbuild.reference", str(stale)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "envbuild.reference", str(stale), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and stale.read_text() == (ROOT / "docs" / "cli.md").read_text(), r.stderr


def test_the_reference_depends_only_on_the_declarations(monkeypatch):
    """The terminal, the environment and the working directory do not change the page."""
    from envbuild.reference import reference

    first = reference()
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("ENVBUILD_REGISTRY", "ghcr.io/elsewhere")
    monkeypatch.chdir(ROOT / "docs")
    assert reference() == first


# --- every command and option says what it does ---------------------------------------------

def test_every_command_and_option_has_help():
    """`envbuild COMMAND --help` describes the command and each of its options (hidden commands
    included: someone runs them too). Lists every gap at once."""
    from envbuild.cli import main
    from envbuild.reference import commands, is_help_option

    missing = []
    for ctx, command in commands(main):
        if not (command.help or "").strip():
            missing.append(f"{ctx.command_path}: no help text")
        for param in command.params:
            if isinstance(param, click.Option) and not is_help_option(param, ctx) and not (param.help or "").strip():
                missing.append(f"{ctx.command_path} {'/'.join(param.opts)}: no help text")
    assert missing == [], "\n".join(missing)


# --- links -----------------------------------------------------------------------------------

def _prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code, where a [x](y) is not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, code marks and punctuation dropped,
    spaces as hyphens, a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchor_rules():
    assert anchors("# A\n## ARM64 / Grace\n## Add your packages: `envbuild extend`\n## A\n```\n# not\n```\n") == {
        "a", "arm64--grace", "add-your-packages-envbuild-extend", "a-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    """Each [text](target) that is not a URL names a file of this checkout, and a #fragment
    names a heading of that page (Markdown pages only)."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert broken == [], broken


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert {p for p in pages if f"]({p})" not in index} == set()
    readme = (ROOT / "README.md").read_text()
    assert {p for p in pages | {"index.md"} if f"](docs/{p})" not in readme} == set()
