"""The build directory: envbuild replaces only what it wrote and never loses a user's file. Real
files in tmp dirs throughout. That a failure part-way (Ctrl-C, a kill, a permission error, a
full disk) leaves the old tree as it was is tests/process/test_output_failures.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, tree
from envbuild.render import output
from envbuild.base.errors import EnvbuildError
from envbuild.render.output import RECORD, read_record, write_build_dir
from envbuild.render.builddir import render_files
from envbuild.resolve.resolver import Request, resolve


@pytest.fixture(scope="module")
def h100(matrix):
    return render_files(resolve(matrix, Request(gpu="h100")))


@pytest.fixture(scope="module")
def h20(matrix):
    return render_files(resolve(matrix, Request(gpu="h20")))


def _cli(*args, cwd=None, prefix=()):
    """The real CLI of this checkout (PYTHONPATH: a cwd outside the repo must not pick up
    another installed envbuild)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ENVBUILD_MATRIX_DIR": str(FIXTURE_MATRIX)}
    env.pop("ENVBUILD_DEBUG", None)
    return subprocess.run([*prefix, sys.executable, "-m", "envbuild", *args], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _one_paragraph_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    msg = " ".join(r.stderr.split())
    assert msg.startswith("envbuild: error:") and "Traceback" not in r.stderr and "\n\n" not in r.stderr.strip()
    for w in words:
        assert w in msg, (w, msg)
    return msg


def _no_temporaries(directory: Path):
    leftovers = [p.name for p in directory.rglob("*") if ".envbuild-tmp-" in p.name or ".envbuild-old-" in p.name]
    assert leftovers == []


# ---------------------------------------------------------------- the record


def test_record_lists_every_file_with_its_sha256_and_sha256sum_accepts_it(h20, tmp_path):
    out = write_build_dir(h20, tmp_path / "b")
    record = read_record(out)
    assert set(record) == set(h20)
    for rel, data in h20.items():
        assert record[rel] == {hashlib.sha256(data).hexdigest()}
    assert set(tree(out)) == set(h20) | {RECORD}
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "--check", "--strict", RECORD], cwd=out, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_rerender_keeps_sif_build_log_and_every_other_user_file(cli, tmp_path):
    """Measured before: a re-render deleted the .sif the Singularity.def says to build there."""
    out = tmp_path / "b"
    assert cli("render", "--gpu", "h100", "-o", str(out)).returncode == 0
    mine = {"torch.sif": b"\x00SIF image", "build.log": b"$ docker build ...\n", "train.py": b"print('hi')\n",
            "notes/todo.txt": b"check NCCL\n", ".hidden": b"x"}
    for rel, data in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    r = cli("render", "--gpu", "h20", "-o", str(out))
    assert r.returncode == 0, r.stderr
    after = tree(out)
    for rel, data in mine.items():
        assert after[rel] == data
    assert json.loads(after["manifest.json"])["gpu"] == "h20"
    assert set(read_record(out)) == set(after) - set(mine) - {RECORD}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    _no_temporaries(out)


def test_a_directory_with_an_envbuild_manifest_but_no_record_is_refused(cli, tmp_path):
    """Measured before: a manifest.json with an "envbuild" key was enough to replace the
    whole directory, train.py included."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "manifest.json").write_text('{"envbuild": "0.0.1", "mine": true}\n')
    (out / "train.py").write_text("years of work\n")
    before = tree(out)
    r = cli("render", "--gpu", "h20", "-o", str(out))
    _one_paragraph_error(r, f"output path {out}", "no .envbuild-files record", "refusing to replace it",
                         "render by an envbuild without records", "-o/--output")
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_a_non_empty_directory_without_record_is_refused_an_empty_one_is_used(cli, tmp_path):
    full, empty = tmp_path / "full", tmp_path / "empty"
    full.mkdir()
    empty.mkdir()
    (full / "data.csv").write_text("1,2\n")
    _one_paragraph_error(cli("render", "--gpu", "h20", "-o", str(full)), "holds data.csv", "refusing to replace it")
    assert tree(full) == {"data.csv": b"1,2\n"}
    assert cli("render", "--gpu", "h20", "-o", str(empty)).returncode == 0
    assert (empty / "Dockerfile").is_file() and (empty / RECORD).is_file()


def test_an_edited_generated_file_stops_the_render_and_nothing_is_written(cli, tmp_path):
    out = tmp_path / "b"
    assert cli("render", "--gpu", "h100", "-o", str(out)).returncode == 0
    with open(out / "Dockerfile", "a") as f:
        f.write("RUN echo my change\n")
    (out / "envbuild" / "env.sh").write_text("# mine now\n")
    before = tree(out)
    r = cli("render", "--gpu", "h20", "-o", str(out))
    _one_paragraph_error(r, "changed since: Dockerfile, envbuild/env.sh", "refusing to overwrite your edits",
                         "nothing was written")
    assert tree(out) == before
    _no_temporaries(out)


def test_a_generated_file_replaced_by_a_symlink_counts_as_edited(h100, h20, tmp_path):
    out = write_build_dir(h100, tmp_path / "b")
    elsewhere = tmp_path / "elsewhere.def"
    elsewhere.write_text("someone else's\n")
    (out / "Singularity.def").unlink()
    (out / "Singularity.def").symlink_to(elsewhere)
    with pytest.raises(EnvbuildError, match="changed since: Singularity.def"):
        write_build_dir(h20, out)
    assert elsewhere.read_text() == "someone else's\n" and (out / "Singularity.def").is_symlink()


def test_a_deleted_generated_file_is_written_again(h100, h20, tmp_path):
    out = write_build_dir(h100, tmp_path / "b")
    (out / "Dockerfile").unlink()
    write_build_dir(h20, out)
    assert (out / "Dockerfile").read_bytes() == h20["Dockerfile"]


def test_a_user_file_where_envbuild_wants_to_write_is_refused(h20, tmp_path):
    out = write_build_dir(h20, tmp_path / "b")
    (out / "README.md").write_text("my notes\n")
    with pytest.raises(EnvbuildError, match="holds README.md, which envbuild did not write"):
        write_build_dir({**h20, "README.md": b"generated\n"}, out)
    assert (out / "README.md").read_text() == "my notes\n" and set(read_record(out)) == set(h20)


def test_files_no_longer_rendered_go_only_if_unchanged_and_their_directories_only_if_empty(tmp_path):
    out = write_build_dir({"a.txt": b"a", "old/x.txt": b"x", "gone/y.txt": b"y"}, tmp_path / "b")
    (out / "old" / "mine.txt").write_text("keep me")
    write_build_dir({"a.txt": b"A"}, out)
    assert tree(out) == {"a.txt": b"A", "old/mine.txt": b"keep me", RECORD: output.format_record(
        {"a.txt": {hashlib.sha256(b"A").hexdigest()}})}
    assert not (out / "gone").exists()


def test_a_damaged_record_is_not_trusted(h20, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("outside the build dir\n")
    out = tmp_path / "b"
    out.mkdir()
    (out / RECORD).write_text(f"{hashlib.sha256(victim.read_bytes()).hexdigest()}  ../victim.txt\n")
    with pytest.raises(EnvbuildError, match="is damaged at line 1"):
        write_build_dir(h20, out)
    assert victim.read_text() == "outside the build dir\n" and sorted(p.name for p in out.iterdir()) == [RECORD]


def test_a_recorded_directory_turned_into_a_symlink_is_not_written_through(h100, h20, tmp_path):
    out = write_build_dir(h100, tmp_path / "b")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "envbuild", elsewhere)
    (out / "envbuild").symlink_to(elsewhere)
    before = tree(elsewhere)
    with pytest.raises(EnvbuildError, match="holds envbuild, which envbuild did not write"):
        write_build_dir(h20, out)
    assert tree(elsewhere) == before


# ---------------------------------------------------------------- where -o points


def test_output_dot_works_and_leaves_no_stray_directory(tmp_path):
    """Measured before: `-o .` failed and left a `..old.*` directory on every run."""
    work = tmp_path / "work"
    work.mkdir()
    for gpu in ("h100", "h20"):
        r = _cli("render", "--gpu", gpu, "-o", ".", cwd=work)
        assert r.returncode == 0, r.stderr
    assert json.loads((work / "manifest.json").read_text())["gpu"] == "h20"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert {p.name for p in work.iterdir()} == {".dockerignore", RECORD, "Dockerfile", "Singularity.def",
                                                "Singularity.standalone.def", "envbuild", "manifest.json"}


def test_a_symlinked_output_is_followed_and_stays_a_symlink(tmp_path):
    """Measured before: the symlink was replaced by a real directory."""
    target = tmp_path / "scratch" / "builds"
    target.mkdir(parents=True)
    link = tmp_path / "b"
    link.symlink_to(target)
    for gpu in ("h100", "h20"):
        r = _cli("render", "--gpu", gpu, "-o", str(link))
        assert r.returncode == 0, r.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert f"-o {link} is a symlink; rendered into its target {target}" in " ".join(r.stderr.split())
    assert json.loads((target / "manifest.json").read_text())["gpu"] == "h20"


def test_a_dangling_symlinked_output_is_refused(tmp_path):
    link = tmp_path / "b"
    link.symlink_to(tmp_path / "missing" / "dir")
    r = _cli("render", "--gpu", "h20", "-o", str(link))
    _one_paragraph_error(r, f"output path {link} is a symlink to {tmp_path / 'missing' / 'dir'}, which does not exist")
    assert link.is_symlink() and not (tmp_path / "missing").exists()
