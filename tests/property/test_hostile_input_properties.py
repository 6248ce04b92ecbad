"""The classes behind issue 32's cases, as properties (hypothesis) over every string a lab's matrix
or `render`'s options take: exit 2 with one paragraph naming the input and nothing written, or
a render whose files pass their linters and hold the value as data. HOSTILE (hostile strings)
and assert_holds_as_data are what the other properties over hostile input use too. The cases
one by one are tests/behaviour/test_hostile_input.py."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE_MATRIX
from property_settings import EXAMPLES
from test_hostile_input import envbuild, refused


MARKER = "PWNED"
# Pieces of hostile values: control characters, quotes, command substitution, instruction
# keywords after a newline, format placeholders, and an oversize run.
PIECES = ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\u2028", '"', "'", "`", "\\", "$", "$(touch PWNED)",
          "`touch PWNED`", "${HOME}", ";touch PWNED", " && touch PWNED", "|", "#", "}", "{", "{venv}", "%post",
          "\nRUN touch PWNED", "\n%post\ntouch PWNED", " ", "x", "1", "-", "/", ":", "@", "=", "x" * 5000]
HOSTILE = (st.lists(st.sampled_from(PIECES), min_size=1, max_size=6).map("".join)
           | st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))


def instructions(dockerfile: str) -> list[str]:
    """The instruction keywords of a Dockerfile, in order (continuation lines joined)."""
    out, continued = [], False
    for line in dockerfile.splitlines():
        stripped = line.strip()
        if not continued and stripped and not stripped.startswith("#"):
            out.append(stripped.split()[0].upper())
        continued = line.endswith("\\") and not (not continued and stripped.startswith("#"))
    return out


def definition_layout(text: str) -> list[str]:
    """A Singularity definition's headers and section names, in order."""
    return [line.split(":")[0] if ":" in line and not line.startswith("%") else line.split()[0]
            for line in text.splitlines() if re.match(r"^(%\w|Bootstrap:|From:|Stage:)", line)]


def shell_texts(files: dict[str, str]) -> list[str]:
    """What a shell runs: the Dockerfile's RUN instructions and the definitions' shell sections."""
    texts = []
    docker = files.get("Dockerfile", "")
    for m in re.finditer(r"^RUN (.*?)(?<!\\)$", docker, re.M | re.S):
        texts.append(m.group(1))
    for name, text in files.items():
        if name.endswith(".def"):
            texts += [m.group(2) for m in re.finditer(r"^%(post|environment|runscript|test)[^\n]*\n(.*?)(?=^%\w|^Bootstrap:|\Z)",
                                                      text, re.S | re.M)]
    return texts


def runs(shell: str, marker: str = MARKER) -> bool:
    """Whether `marker` stands where a shell would run it: unquoted, or inside $(...) or `...`
    (in double quotes or not); inside single quotes, double quotes alone or a comment it is text."""
    stack: list[str] = []
    i, word_start = 0, True
    while i < len(shell):
        top = stack[-1] if stack else None
        if shell.startswith(marker, i):
            if top not in ("'", '"'):
                return True
            i += len(marker)
            continue
        c = shell[i]
        if top == "'":
            if c == "'":
                stack.pop()
        elif top == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                stack.pop()
            elif shell.startswith("$(", i):
                stack.append("$(")
                i += 1
            elif c == "`":
                stack.append("`")
        else:
            if c == "\\":
                i += 1
            elif c == "#" and word_start:
                end = shell.find("\n", i)
                i = len(shell) if end < 0 else end
                continue
            elif c in "'\"":
                stack.append(c)
            elif shell.startswith("$(", i):
                stack.append("$(")
                i += 1
            elif c == "`":
                stack.pop() if top == "`" else stack.append("`")
            elif c == ")" and top == "$(":
                stack.pop()
        word_start = c in " \t\n;&|()"
        i += 1
    return False


def assert_holds_as_data(out: Path, baseline: dict[str, str], same_layout: bool = True) -> None:
    """A render that took a hostile value: its files pass their linters and keep the baseline's
    instructions, sections and shell commands; the value is text wherever it landed."""
    from spython.main.parse.parsers import SingularityParser

    files = {p.name: p.read_text(errors="replace") for p in out.iterdir() if p.suffix in ("", ".def") and p.is_file()}
    if same_layout:
        assert instructions(files["Dockerfile"]) == instructions(baseline["Dockerfile"])
    for name in ("Singularity.def", "Singularity.standalone.def"):
        if name in baseline and same_layout:
            assert definition_layout(files[name]) == definition_layout(baseline[name]), name
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                SingularityParser(str(out / name))  # spython's warnings: not failures
    assert not any(runs(text) for text in shell_texts(files)), "a value reached a shell as code"
    hadolint = subprocess.run(["hadolint", "--no-color", "--failure-threshold", "style", str(out / "Dockerfile")],
                              capture_output=True, text=True)
    assert hadolint.returncode == 0, hadolint.stdout[-2000:]
    for text in shell_texts(files):
        assert subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True).returncode == 0, text[:500]

def refused_or_data_with(matrix_dir: Path, file_name: str, document: dict, path: tuple, value: str,
                         request: list[str], baseline: dict[str, str]) -> None:
    """`document` with `value` at `path`, written as the matrix's `file_name`, then rendered:
    refused naming the file and writing nothing, or rendered with the value as data."""
    _set(document, path, value)
    (matrix_dir / file_name).write_text(yaml.safe_dump(document, sort_keys=False, allow_unicode=False))
    out = matrix_dir.parent / "o"
    r = envbuild("render", *request, "--matrix-dir", str(matrix_dir), "-o", str(out))
    assert r.code in (0, 2), (r.code, r.err[-3000:])
    if r.code == 2:
        refused(r)
        assert file_name in r.message and not out.exists(), (path, r.message)
        return
    assert_holds_as_data(out, baseline)



def _leaves(data, path=()):
    """(path, value) of every string in a YAML document: the matrix fields a lab can set."""
    if isinstance(data, str):
        yield path, data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _leaves(value, (*path, i))


MATRIX_FILES = sorted(p.name for p in FIXTURE_MATRIX.glob("*.yaml"))
FIELDS = [(name, path) for name in MATRIX_FILES
          for path, _ in _leaves(yaml.safe_load((FIXTURE_MATRIX / name).read_text()))]
# The requests each example renders: the default stack image, and one with a CUDA extension and
# a cloud fabric (fields only those reach: extensions.yaml, a built fabric's sources).
REQUESTS = [["--gpu", "h20"], ["--gpu", "h100", "--ext", "flash-attn", "--fabric", "aws-efa", "--ds-ops", "all"]]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    out = {}
    for i, request in enumerate(REQUESTS):
        d = tmp_path_factory.mktemp("baseline") / "o"
        r = envbuild("render", *request, "--matrix-dir", str(FIXTURE_MATRIX), "-o", str(d))
        assert r.code == 0, r.err
        out[i] = {p.name: p.read_text() for p in d.iterdir() if p.is_file() and p.suffix in ("", ".def")}
    return out


def _set(data, path, value):
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=HOSTILE, request_index=st.sampled_from([0, 1]))
def test_any_matrix_string_field_is_refused_naming_it_or_rendered_as_data(tmp_path_factory, baselines, field, value,
                                                                         request_index):
    """A lab's matrix with a hostile string in any field: exit 2 naming the file (and the field),
    nothing written; or a render whose files pass their linters and hold the value as text."""
    name, path = field
    matrix = tmp_path_factory.mktemp("m") / "matrices"
    shutil.copytree(FIXTURE_MATRIX, matrix)
    data = yaml.safe_load((matrix / name).read_text())
    _set(data, path, value)
    (matrix / name).write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=False))
    out = matrix.parent / "out"
    r = envbuild("render", *REQUESTS[request_index], "--matrix-dir", str(matrix), "-o", str(out))
    assert r.code in (0, 2), (r.code, r.err[-3000:])
    if r.code == 2:
        refused(r)
        assert name in r.message, (name, path, r.message)
        assert not out.exists()
        return
    # Another stack id is another stack: its lock (matrices/locks/<id>.<arch>.txt) is not found, and
    # the image is rendered unlocked, as the summary says; the layout is not the baseline's then.
    assert_holds_as_data(out, baselines[request_index], same_layout=not (name == "stacks.yaml" and path[-1] == "id"))


# Every string option of `render` that reaches a rendered file or a build secret, with a value a
# render accepts (the baseline): a hostile value, alone or around that one, is refused naming
# the option or rendered as data, never a new instruction.
OPTION_BASELINES = {
    "--env": "ENVBUILD_PROBE=benign",
    "--base-image": "nvidia/cuda:13.0.2-base-ubuntu24.04",
    "--builder-image": "nvidia/cuda:13.0.2-devel-ubuntu24.04",
    "--registry": "127.0.0.1:5000",
    "--image-repo": "localhost:5000/envbuild",
    "--pip-index-url": "https://pypi.example/simple",
    "--torch-index-url": "https://download.example/whl",
    "--apt-mirror": "https://mirror.example",
    "--source-mirror": "http://127.0.0.1:8799",
    "--cpu-target": "x86-64-v3",
}


@pytest.fixture(scope="module")
def option_baselines(tmp_path_factory):
    out = {}
    for option, value in OPTION_BASELINES.items():
        d = tmp_path_factory.mktemp("baseline") / "o"
        r = envbuild("render", "--gpu", "h20", option, value, "--matrix-dir", str(FIXTURE_MATRIX), "-o", str(d))
        assert r.code == 0, (option, r.err)
        out[option] = {p.name: p.read_text() for p in d.iterdir() if p.is_file() and p.suffix in ("", ".def")}
    return out


@st.composite
def option_values(draw):
    option = draw(st.sampled_from(sorted(OPTION_BASELINES)))
    benign, hostile = OPTION_BASELINES[option], draw(HOSTILE)
    return option, draw(st.sampled_from([hostile, benign + hostile, hostile + benign]))


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(option_value=option_values())
def test_any_string_option_is_refused_naming_it_or_rendered_as_data(tmp_path_factory, option_baselines, option_value):
    option, value = option_value
    out = tmp_path_factory.mktemp("o") / "o"
    r = envbuild("render", "--gpu", "h20", option, value, "--matrix-dir", str(FIXTURE_MATRIX), "-o", str(out))
    assert r.code in (0, 2), (r.code, r.err[-3000:])
    if r.code == 2:
        refused(r, option)
        # The value is quoted with its control characters escaped (a newline cannot be told from
        # the terminal's own wrapping here; test_jobs.py checks it for --time and --image).
        assert not [c for c in value if c not in "\n\t" and (ord(c) < 32 or 127 <= ord(c) < 160) and c in r.err], r.err
        assert not out.exists()
        return
    assert_holds_as_data(out, option_baselines[option])
