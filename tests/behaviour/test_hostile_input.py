"""Input as an adversarial user or a lab's own matrix directory brings it, run in-process through
the real entry point (`envbuild.cli.app.run`: its exit codes and one-paragraph errors): every case
is exit 2 with one paragraph naming the input and nothing written, or exit 0 with the value
carried as data; never exit 70, never a new instruction in a rendered file. The cases of issue
32 are listed one by one; the classes behind them are properties (hypothesis) over every string
field of the matrix models, every string option, and hostile YAML in every matrix file.

ENVBUILD_PROPERTY_EXAMPLES raises the example counts (the fast suite runs few)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import FIXTURE_MATRIX, alarm_deadline


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def message(self) -> str:
        return " ".join(self.err.split())


def envbuild(*args: str, env: dict | None = None) -> Ran:
    """`envbuild ARGS` in this process, through the console entry point's error handling."""
    from envbuild.cli.app import run

    argv = sys.argv
    with CliRunner().isolation(env={"COLUMNS": "200", "ENVBUILD_DEBUG": None, **(env or {})}) as (out, err, _):
        sys.argv = ["envbuild", *args]
        try:
            run()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = argv
    return Ran(code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace"))


def listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() and not p.is_fifo() else b"<special>")
            for p in sorted(directory.rglob("*"))}


def refused(r: Ran, *words: str) -> None:
    """Exit 2, one paragraph naming what was wrong (each of `words`), no traceback."""
    assert r.code == 2, (r.code, r.out[-800:], r.err[-2000:])
    assert "Traceback" not in r.err + r.out and "internal error" not in r.err, r.err
    text = r.err.strip()
    assert text.startswith("envbuild: error:") and "\n\n" not in text, text
    for w in words:
        assert w in r.message, (w, r.message)


# ---------------------------------------------------------------- a work directory with what the cases name


@pytest.fixture
def work(tmp_path, monkeypatch):
    """An empty directory (the cwd) holding the files the cases name; afterwards only they are there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ENVBUILD_MATRIX_DIR", str(FIXTURE_MATRIX))
    (tmp_path / "req.txt").write_text("einops\n")
    (tmp_path / "mine.yml").write_text("on: push  # the user's own workflow\n")
    (tmp_path / "fake.pem").write_text("-----BEGIN CERTIFICATE-----\nhello\n-----END CERTIFICATE-----\n")
    (tmp_path / "random.sqsh").write_bytes(os.urandom(4096))
    (tmp_path / "empty.sqsh").write_bytes(b"")
    (tmp_path / "utf16.txt").write_bytes("einops\n".encode("utf-16"))
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)))
    os.mkfifo(tmp_path / "fifo.pem")
    os.mkfifo(tmp_path / "fifo.txt")
    os.mkfifo(tmp_path / "fifo.json")
    os.mkfifo(tmp_path / "fifo.md")
    (tmp_path / "shared").mkdir()
    return tmp_path


# (arguments, words the message must hold). Each is exit 2, one paragraph, nothing written.
CASES = [
    # job: values Slurm or the runtime cannot take (the script's own test: test_jobs.py)
    (["job", "--image", "/s/x.sqsh", "--time", "forever"], ["--time 'forever'", "--time UNLIMITED"]),
    (["job", "--image", "/s/x.sqsh", "--time", "1:00\n#SBATCH --wrap=id"], ["--time '1:00\\n#SBATCH --wrap=id'"]),
    (["job", "--image", "/s/x.sqsh", "--nodes", "9" * 20], ["--nodes", "above 2,147,483,647"]),
    (["job", "--image", "/s/x.sqsh", "--gpus-per-node", "100000"], ["--gpus-per-node '100000'", "above 64"]),
    (["job", "--image", "/s/x.sif"], ["--image /s/x.sif is an Apptainer image", "--runtime apptainer"]),
    (["job", "--image", "/s/x.sqsh", "--runtime", "apptainer"], ["--image /s/x.sqsh is an enroot image",
                                                                 "--runtime pyxis"]),
    # stage: not a squashfs, checked before anything is copied
    (["stage", "random.sqsh", "--to", "shared"], ["stage random.sqsh is not a squashfs", "nothing was staged"]),
    (["stage", "empty.sqsh", "--to", "shared"], ["stage empty.sqsh is empty", "nothing was staged"]),
    # extend --from an image the engine does not hold and whose tag is not the stack's
    (["extend", "--gpu", "h100", "-r", "req.txt", "--from", "ubuntu:24.04"],
     ["--from ubuntu:24.04 is not on this machine", "tag (24.04) is not stack", "Nearest valid choice: --from envbuild:"]),
    (["extend", "--gpu", "h100", "-r", "req.txt", "--from", "envbuild:torch2.5.1-cu124-py3.10-ds0.16.9-h100"],
     ["is another stack's or GPU's image"]),
    # empty values that silently meant the default
    (["render", "--gpu", "h20", "--fabric", ""], ["--fabric is empty", "leave the option out"]),
    (["render", "--gpu", "h20", "--matrix-dir", ""], ["--matrix-dir is empty"]),
    (["render", "--gpu", "h20", "--apt-key", ""], ["--apt-key is empty"]),
    # a registry port no server can listen on
    (["render", "--gpu", "h20", "--registry", "localhost:99999"], ["--registry 'localhost:99999': the port 99999",
                                                                   "--registry localhost:5000"]),
    (["render", "--gpu", "h20", "--image-repo", "localhost:0/envbuild"], ["the port 0 is not a TCP port"]),
    (["render", "--gpu", "h20", "--base-image", "localhost:99999/debian:bookworm"], ["the registry port 99999"]),
    # a certificate OpenSSL cannot read
    (["render", "--gpu", "h20", "--ca-cert", "fake.pem"], ["--ca-cert fake.pem is not a PEM certificate bundle"]),
    # variables whose value cannot work
    (["render", "--gpu", "h20", "--env", "PYTHONHOME=/x"], ["--env PYTHONHOME=/x", "cannot start", "Leave it out"]),
    (["render", "--gpu", "h20", "--env", "NCCL_P2P_DISABLE=banana"], ["NCCL_P2P_DISABLE takes 1 (P2P off) or 0 (P2P on, NCCL's default), not 'banana'"]),
    (["render", "--gpu", "h20", "--env", "NCCL_DEBUG=verbose"], ["NCCL_DEBUG takes VERSION, WARN, INFO, ABORT or TRACE"]),
    (["render", "--gpu", "h20", "--env", "TORCH_NCCL_BLOCKING_WAIT=maybe"], ["TORCH_NCCL_BLOCKING_WAIT takes"]),
    (["render", "--gpu", "h20", "--env", "X=a\nRUN id"], ["--env X='a\\nRUN id'", "control character"]),
    # files: regular files only (a FIFO with no writer must not block), bounded, decoded
    (["render", "--gpu", "h20", "--ca-cert", "fifo.pem"], ["--ca-cert fifo.pem is a FIFO (named pipe)"]),
    (["render", "--gpu", "h20", "--apt-key", "fifo.pem"], ["--apt-key fifo.pem is a FIFO"]),
    (["render", "--gpu", "h20", "--ca-cert", "/dev/zero"], ["--ca-cert /dev/zero is a character device"]),
    (["extend", "--gpu", "h100", "-r", "fifo.txt"], ["-r fifo.txt is a FIFO"]),
    (["extend", "--gpu", "h100", "-r", "utf16.txt"], ["-r utf16.txt is not UTF-8 text", "UTF-16"]),
    (["extend", "--gpu", "h100", "-r", "binary.txt"], ["-r binary.txt is not UTF-8 text"]),
    (["extend", "--gpu", "h100", "-f", "fifo.txt"], ["-f fifo.txt is a FIFO"]),
    (["readme-tables", "--check", "fifo.md"], ["fifo.md is a FIFO"]),
    (["rebuild", "fifo.json"], ["fifo.json is a FIFO"]),
    (["ext-cache", "load", "fifo.txt"], ["fifo.txt is a FIFO"]),
    (["ci", "--check", "-o", "fifo.md"], ["workflow fifo.md is a FIFO", "the workflow `envbuild ci -o FILE` wrote"]),
    # messages that named the wrong thing
    (["ext-cache", "load", "/dev/null"], ["/dev/null is a character device, not a regular file", "ext-cache save"]),
    (["ci", "--check", "-o", "mine.yml"], ["mine.yml exists and envbuild did not write it", "--check"]),
    (["ext-cache", "save", "x.tar", "--base-image", "Not A Ref!"], ["--base-image 'Not A Ref!' is not a valid image"]),
]


@pytest.mark.parametrize("args, words", CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_values_that_cannot_work_are_exit_2_one_paragraph_nothing_written(work, args, words):
    before = listing(work)
    with alarm_deadline(60, f"envbuild {' '.join(args)} blocked"):  # a FIFO with no writer must not block
        r = envbuild(*args, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock",
                                 # ci reads publish.yaml, which only the shipped matrix has
                                 **({"ENVBUILD_MATRIX_DIR": None} if args[0] == "ci" else {})})
    refused(r, *words)
    assert listing(work) == before


def test_a_missing_known_issues_file_is_called_missing(work, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 1\n")
    empty = tmp_path / "m"
    empty.mkdir()
    refused(envbuild("doctor", str(log), "--matrix-dir", str(empty)), f"known-issues file {empty}/known_issues.yaml "
                                                                      f"is missing")


def test_ext_cache_without_a_docker_daemon_is_exit_2_after_its_inputs_are_checked(work):
    import io
    import tarfile

    with tarfile.open(work / "ok.tar", "w") as tar:  # a file `save` could have written: the input is fine
        info = tarfile.TarInfo(".envbuild-ext-cache")
        tar.addfile(info, io.BytesIO(b""))
    before = listing(work)
    for args in (["load", "ok.tar"], ["save", "out.tar"]):
        refused(envbuild("ext-cache", *args, "--base-image", "debian:bookworm",
                         env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"}), "cannot reach the Docker engine")
    assert listing(work) == before


def test_a_lock_entry_with_a_65_digit_hash_is_refused_naming_the_file_and_line(matrix_copy, tmp_path):
    lock = next(matrix_copy.glob("locks/torch2.11-cu130-py3.12.x86_64.txt"))
    text = lock.read_text()
    lock.write_text(re.sub(r"(--hash=sha256:[0-9a-f]{64})", r"\g<1>0", text, count=1))
    r = envbuild("render", "--gpu", "h20", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "o"))
    refused(r, f"{lock}:", "is not a hash line", "64 lower-case hex digits")
    assert not (tmp_path / "o").exists()


def test_a_newline_in_a_labs_base_image_is_refused_by_the_loader_naming_file_and_field(matrix_copy, tmp_path):
    stacks = matrix_copy / "stacks.yaml"
    data = yaml.safe_load(stacks.read_text())
    data["stacks"][0]["base_images"]["runtime"] += "\nRUN touch /tmp/pwned"
    stacks.write_text(yaml.safe_dump(data, sort_keys=False))
    r = envbuild("render", "--gpu", "h20", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "o"))
    refused(r, f"matrix file {stacks} is malformed", "base_images.runtime", "control character '\\n'")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- hostile YAML in every matrix file

from conftest import ROOT  # noqa: E402

SHIPPED = ROOT / "matrices"
# Structure no matrix file has: nesting 50,000 deep (PyYAML's composer recursed once per level:
# RecursionError), aliases (a few nested ones expand to billions of nodes), another encoding,
# random bytes, a link to an endless device, a FIFO no one writes, a list where a mapping is due.
YAML_HOSTILE = {
    "nested 50,000 deep": (lambda p: p.write_text("x: " + "[" * 50_000 + "]" * 50_000 + "\n"), "nesting deeper than"),
    "aliases": (lambda p: p.write_text("a: &a [x, x, x]\nb: &b [*a, *a, *a]\nc: [*b, *b]\n"), "alias"),
    "UTF-16": (lambda p: p.write_bytes(p.read_text().encode("utf-16")), "not UTF-8 text"),
    "binary": (lambda p: p.write_bytes(bytes(range(256)) * 4), "not UTF-8 text"),
    "a link to /dev/zero": (lambda p: (p.unlink(), p.symlink_to("/dev/zero")), "is a character device"),
    "a FIFO": (lambda p: (p.unlink(), os.mkfifo(p)), "is a FIFO"),
    "a list": (lambda p: p.write_text("- 1\n- 2\n"), ""),
}
# The command that reads each file (every matrix file the shipped matrix has).
READER = {"known_issues.yaml": ["doctor", "{log}"], "publish.yaml": ["ci", "-o", "{out}/publish.yml"],
          "vulnerabilities.yaml": ["audit", "--vulnerability-service", "http://127.0.0.1:9/v1/query"]}
YAML_CASES = [(name, kind) for name in sorted(p.name for p in SHIPPED.glob("*.yaml")) for kind in YAML_HOSTILE]


def test_every_matrix_file_is_covered():
    assert {name for name, _ in YAML_CASES} >= {"stacks.yaml", "known_issues.yaml", "publish.yaml", "gpus.yaml"}


@pytest.mark.parametrize("name, kind", YAML_CASES, ids=[f"{n} {k}" for n, k in YAML_CASES])
def test_hostile_yaml_in_any_matrix_file_is_exit_2_naming_it(tmp_path, name, kind):
    matrix = tmp_path / "matrices"
    shutil.copytree(SHIPPED, matrix)
    make, words = YAML_HOSTILE[kind]
    make(matrix / name)
    log = tmp_path / "train.log"
    log.write_text("step 1\n")
    out = tmp_path / "out"
    command = [a.format(log=log, out=out) for a in READER.get(name, ["render", "--gpu", "h20", "-o", "{out}"])]
    with alarm_deadline(60, f"envbuild {' '.join(command)} blocked on {name} ({kind})"):
        r = envbuild(*command, "--matrix-dir", str(matrix))
    refused(r, str(matrix / name), words)
    assert not out.exists()


# ---------------------------------------------------------------- what a rendered file holds

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from property_settings import EXAMPLES  # noqa: E402

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


def test_a_fifo_named_manifest_json_in_the_output_directory_does_not_block_render(work):
    """render asks whether -o holds an old render by reading its manifest.json: a FIFO there
    blocked it for ever."""
    (work / "o").mkdir()
    os.mkfifo(work / "o" / "manifest.json")
    before = listing(work)
    with alarm_deadline(60, "render blocked on a FIFO named manifest.json"):
        r = envbuild("render", "--gpu", "h20", "-o", "o")
    refused(r, "o")
    assert listing(work) == before
