"""The request's fields are declared once (envbuild/knowledge/request.py): the CLI's options, envbuild.yaml's
keys, describe() and a publish job's options are read from them, and stay in step by
construction; these tests hold what construction alone does not."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import click
import pytest

from conftest import FIXTURE_MATRIX, ROOT, run_here
from envbuild.cli import main
from envbuild.cli.options import request_kw
from envbuild.resolve.extend import Project
from envbuild.knowledge.request import DERIVED, Request, flags


def test_every_field_is_an_option_or_names_where_it_comes_from():
    names = [f.name for f in dataclasses.fields(Request)]
    assert set(names) == set(flags()) | set(DERIVED) and not set(flags()) & set(DERIVED)
    assert len({flag.name for flag in flags().values()}) == len(flags())


@pytest.mark.parametrize("command", ["render", "build", "extend"])
def test_the_request_commands_take_each_field_as_its_option(command):
    params = {p.name: p for p in main.commands[command].params if isinstance(p, click.Option)}
    for name, flag in flags().items():
        p = params[name]  # the value arrives under the field's own name
        assert p.opts == [flag.name] and p.help == flag.help
        assert (p.is_flag, p.multiple) == (flag.switch, flag.repeated), name
    assert params["gpu"].required == (command != "extend")


def test_a_command_given_some_options_receives_every_other_as_not_given():
    """publish --job builds each variant through request_from with request_kw: a field it does not
    name must arrive as the CLI leaves it (a KeyError or a stale spelling was a hand-written dict)."""
    params = {p.name for p in main.commands["render"].params}
    kw = request_kw(gpu="h100")
    assert set(flags()) <= set(kw) <= params
    assert kw["gpu"] == "h100" and kw["keep_toolchain"] is False and kw["env"] == ()


def test_envbuild_yaml_holds_the_project_fields_under_the_options_names():
    own = {"name", "requirements", "image"}
    project = {flag.key for flag in flags().values() if flag.project}
    assert set(Project.model_fields) == project | own
    assert not any(flags()[name].switch or flags()[name].repeated for name, f in flags().items() if f.project)
    docs = (ROOT / "docs" / "environments.md").read_text()
    assert all(f"`{key}`" in docs for key in project - {"gpu", "stack"} | own - {"name", "requirements"}), \
        "docs/environments.md names every key envbuild.yaml may hold"


def test_a_project_file_fills_in_what_the_command_line_left_out(tmp_path):
    """`ext:` (a key the project file gained with its option) reaches the stack image, and the
    command line's --ext wins over it."""
    (tmp_path / "envbuild.yaml").write_text("gpu: h100\nstack: torch2.11-cu130-py3.12\next: flash-attn\n"
                                            "requirements: [causal-conv1d]\n")
    r = run_here("extend", "-f", str(tmp_path / "envbuild.yaml"), "--matrix-dir", str(FIXTURE_MATRIX),
                 "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "names only CUDA extensions (causal-conv1d, flash-attn)" in r.stdout, r.stdout
    r = run_here("extend", "-f", str(tmp_path / "envbuild.yaml"), "--ext", "causal-conv1d",
                 "--matrix-dir", str(FIXTURE_MATRIX), "-o", str(tmp_path / "out2"))
    assert r.returncode == 0, r.stderr
    assert "names only CUDA extensions (causal-conv1d)" in r.stdout, r.stdout


def test_the_options_are_declared_without_loading_the_resolver():
    """`envbuild --help` and every command's options come from envbuild/knowledge/request.py, which is
    stdlib and rules only: the CLI's import loads neither pydantic nor the resolver."""
    code = "import sys, envbuild.cli; print(sorted(m for m in ('pydantic', 'envbuild.resolve.resolver', 'envbuild.knowledge.matrix') " \
           "if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
