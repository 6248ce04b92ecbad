"""Input as an adversarial user or a lab's own matrix directory brings it, run in-process through
the real entry point (`envbuild.cli.app.run`: its exit codes and one-paragraph errors): every case
is exit 2 with one paragraph naming the input and nothing written, or exit 0 with the value
carried as data; never exit 70, never a new instruction in a rendered file. The cases of issue
32 are listed one by one, and hostile YAML in every matrix file; the classes behind them are
properties (hypothesis) over every string field of the matrix models and every string option, in
tests/property/test_hostile_input_properties.py. `envbuild` and `refused` here are the in-process
runner and the refusal check the other hostile-input tests share."""

from __future__ import annotations

import os
import re
import shutil
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


# ---------------------------------------------------------------- what -o holds


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
