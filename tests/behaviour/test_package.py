"""Packaging and docs: the generated tables in docs/ are current; the README's quick start is two
commands and CI runs its test command. The wheel itself (templates and matrices inside, a render
from a fresh venv) is tests/behaviour/test_package_wheel.py."""

import re

from conftest import ROOT


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_generated_tables_are_current():
    """Every `<!-- generated:NAME -->` block in the README and docs/ is what the matrix says today."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.render.tables import update_generated

    m = load_matrix()
    for path in DOCS:
        text = path.read_text()
        rel = path.relative_to(ROOT)
        assert update_generated(text, m) == text, f"{rel}'s generated tables are stale; run: envbuild readme-tables {rel}"


def test_every_generated_block_is_in_the_docs_once():
    """Each table the matrix generates has one home (the matrix's in docs/matrix.md, the fabrics'
    in docs/running.md); a block dropped in a move would otherwise go stale unnoticed."""
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.render.tables import generated_blocks

    found = [(name, path.relative_to(ROOT).as_posix()) for path in DOCS
             for name in re.findall(r"^<!-- generated:(\w+) -->$", path.read_text(), re.M)]
    assert sorted(name for name, _ in found) == sorted(generated_blocks(load_matrix())), found
    assert {"stacks": "docs/matrix.md", "gpus": "docs/matrix.md", "fabrics": "docs/running.md",
            "job_apptainer": "docs/running.md", "job_pyxis": "docs/running.md"} == dict(found)


def test_readme_tables_command_checks_and_writes_a_docs_page(cli, tmp_path):
    """`envbuild readme-tables FILE` works on any page: --check passes on the committed one, and
    a page whose block was emptied is reported stale, then refilled."""
    ok = cli("readme-tables", "docs/matrix.md", "--check")
    assert ok.returncode == 0, ok.stderr
    page = tmp_path / "matrix.md"
    committed = (ROOT / "docs" / "matrix.md").read_text()
    page.write_text(re.sub(r"(<!-- generated:stacks -->\n).*?(<!-- /generated -->)", r"\1\2", committed, 1, re.S))
    stale = cli("readme-tables", str(page), "--check")
    assert stale.returncode == 1 and f"envbuild readme-tables {page}" in stale.stderr, stale.stderr
    assert cli("readme-tables", str(page)).returncode == 0 and page.read_text() == committed


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)\n(.*?)```", quick, re.S)


def test_readme_quick_start_is_two_commands_and_ci_runs_the_test_one():
    blocks = _readme_commands()
    assert len(blocks) == 2, blocks
    assert "envbuild render --gpu h20" in blocks[0]
    quick = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert '\n```\npython3 -m pytest -m "not docker" -q -p no:cacheprovider -n auto\n```\n' in quick  # verbatim
    test_cmd = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, f".ci/run must call the README's test command: {test_cmd}"
