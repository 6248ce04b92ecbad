"""The build directory: envbuild replaces only what it wrote, never loses a user's file, and
a failure leaves the old tree as it was. Real files in tmp dirs throughout; disk full is a
real tmpfs (in a user + mount namespace, skipped where the kernel does not allow one) and a
permission error a real read-only directory. Ctrl-C and a killed process cannot be produced
at an exact point from outside, so those two are injected at the write/rename call."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
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


# ---------------------------------------------------------------- failures leave the old tree


def _failing_at(call_number, exc, real):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call_number:
            raise exc
        return real(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("call_number", [1, 4, 12])
def test_ctrl_c_while_writing_leaves_the_old_tree(h100, h20, tmp_path, monkeypatch, call_number):
    """Injected at the one write call: a KeyboardInterrupt after `call_number - 1` new files."""
    out = write_build_dir(h100, tmp_path / "b")
    (out / "torch.sif").write_bytes(b"SIF")
    before = tree(out)
    monkeypatch.setattr(output, "_write_temp", _failing_at(call_number, KeyboardInterrupt(), output._write_temp))
    with pytest.raises(KeyboardInterrupt):
        write_build_dir(h20, out)
    assert tree(out) == before
    _no_temporaries(out)


@pytest.mark.parametrize("call_number", [2, 5, 12, 13])
def test_ctrl_c_while_swapping_files_puts_the_old_ones_back(h100, h20, tmp_path, monkeypatch, call_number):
    """Injected at the rename: call 1 writes the in-between record, then files are swapped."""
    out = write_build_dir(h100, tmp_path / "b")
    before = tree(out)
    monkeypatch.setattr(output, "_replace", _failing_at(call_number, KeyboardInterrupt(), output._replace))
    with pytest.raises(KeyboardInterrupt):
        write_build_dir(h20, out)
    assert tree(out) == before
    _no_temporaries(out)


_FS_CALLS = ("open", "replace", "link", "unlink", "rename", "mkdir", "rmdir", "chmod")


def _signal_at(monkeypatch, moments: set[int]) -> list[str]:
    """A real SIGINT, sent to this process just before the n-th filesystem call (n in `moments`)
    of the write: its handler runs at the next bytecode, exactly there. Returns the calls' names."""
    calls: list[str] = []

    def hooked(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            if len(calls) in moments:
                os.kill(os.getpid(), signal.SIGINT)
            return real(*args, **kwargs)
        return call

    for name in _FS_CALLS:
        monkeypatch.setattr(os, name, hooked(name, getattr(os, name)))
    return calls


def one_of_each_kind(names: list[str]) -> set[int]:
    """The calls (1-based) that stand for all like them: the first two and the last two of each
    function, the first two and the last of each phase (a run of one function, or of two in
    turn: each file's open and chmod), the last six calls.

    >>> sorted(one_of_each_kind(["open", "chmod"] * 20 + ["link"] * 5 + ["unlink"]))
    [1, 2, 3, 4, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46]
    >>> sorted(one_of_each_kind(["open"] * 100))
    [1, 2, 95, 96, 97, 98, 99, 100]
    """
    picked = set(range(max(1, len(names) - 5), len(names) + 1))
    for name in set(names):
        at = [n for n, called in enumerate(names, 1) if called == name]
        picked |= {*at[:2], *at[-2:]}
    phase = [frozenset(names[i:i + 2]) for i in range(len(names))]
    start = 0
    for i in range(1, len(names) + 1):
        if i == len(names) or phase[i] != phase[start]:
            picked |= {start + 1, min(start + 2, i), i}
            start = i
    return picked


def _ctrl_c_at(moments, h100, h20, tmp_path, monkeypatch, signals):
    # Python's own Ctrl-C handler, whatever this process inherited: a suite started as a
    # background job (`cmd &` in a script) inherits SIGINT ignored, and Python then installs none.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_each(moments, h100, h20, tmp_path, monkeypatch, signals)
    finally:
        signal.signal(signal.SIGINT, inherited)


def _ctrl_c_each(moments, h100, h20, tmp_path, monkeypatch, signals):
    first = write_build_dir(h100, tmp_path / "count")
    with monkeypatch.context() as m:
        names = _signal_at(m, set())
        write_build_dir(h20, first)
    assert len(names) > 20
    for n in sorted(moments(names)):
        out = write_build_dir(h100, tmp_path / f"b{n}")
        (out / "torch.sif").write_bytes(b"SIF")  # the user's
        old = tree(out)
        with monkeypatch.context() as m:
            _signal_at(m, set(range(n, n + signals)))
            try:
                write_build_dir(h20, out)
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
        assert interrupted, f"the SIGINT before call {n} ({names[n - 1]}) was lost"
        now = tree(out)
        assert now == old or now == {**{k: v for k, v in h20.items()}, "torch.sif": b"SIF",
                                     RECORD: now.get(RECORD)}, f"call {n}: neither the old tree nor the new one"
        assert subprocess.run(["sha256sum", "-c", "--quiet", RECORD], cwd=out).returncode == 0, n
        _no_temporaries(out)
        shutil.rmtree(out)


SIGNALS = pytest.mark.parametrize("signals", [1, 2], ids=["one Ctrl-C", "a second Ctrl-C right after"])


@SIGNALS
def test_a_ctrl_c_at_each_kind_of_filesystem_call_of_the_write_completes_or_restores(h100, h20, tmp_path, monkeypatch,
                                                                                     signals):
    """SIGINT delivered before filesystem calls of a render over an older one, in turn (and a
    second one right after the first, as an impatient user sends): the directory ends as the old
    tree or the new one, its record verifies, and no temporary name is left. Before the write
    phase held signals, a Ctrl-C in the swap's cleanup left `.NAME.envbuild-old-*` files. Here
    one call of each kind and place (`one_of_each_kind`: 27 of 202); CI's whole run: every call."""
    _ctrl_c_at(one_of_each_kind, h100, h20, tmp_path, monkeypatch, signals)


@pytest.mark.whole
@SIGNALS
def test_a_ctrl_c_at_any_filesystem_call_of_the_write_completes_or_restores(h100, h20, tmp_path, monkeypatch, signals):
    _ctrl_c_at(lambda names: range(1, len(names) + 1), h100, h20, tmp_path, monkeypatch, signals)


def test_a_failure_in_a_new_directory_leaves_nothing(h20, tmp_path, monkeypatch):
    nospace = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(output, "_write_temp", _failing_at(5, nospace, output._write_temp))
    with pytest.raises(EnvbuildError, match=r"output path .*deep/b cannot be written: No space left on device"):
        write_build_dir(h20, tmp_path / "new" / "deep" / "b")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_render_leaves_a_directory_the_next_render_accepts(h100, h20, tmp_path, monkeypatch):
    """A process killed while swapping files cannot undo anything (the undo is disabled
    here): the in-between record still accepts old and new content and lists the
    temporary files, so the next render goes on and cleans up."""
    out = write_build_dir(h100, tmp_path / "b")
    (out / "build.log").write_text("log\n")
    monkeypatch.setattr(output, "_undo", lambda *args: None)
    monkeypatch.setattr(output, "_replace", _failing_at(6, SystemExit(137), output._replace))
    with pytest.raises(SystemExit):
        write_build_dir(h20, out)
    monkeypatch.undo()
    assert any(".envbuild-" in p.name for p in out.rglob("*"))  # the state a kill leaves
    write_build_dir(h20, out)
    assert tree(out) == {**h20, "build.log": b"log\n", RECORD: output.format_record(
        {rel: {hashlib.sha256(data).hexdigest()} for rel, data in h20.items()})}


def _without_root_override():
    """Run as a process the file modes apply to: root loses CAP_DAC_OVERRIDE via setpriv."""
    if os.geteuid() != 0:
        return ()
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: file modes do not stop root")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner")


def test_a_permission_error_half_way_leaves_the_old_tree(cli, tmp_path):
    out = tmp_path / "b"
    assert cli("render", "--gpu", "h100", "-o", str(out)).returncode == 0
    before = tree(out)
    (out / "envbuild").chmod(0o555)  # the top-level files are staged, then envbuild/ refuses
    try:
        r = _cli("render", "--gpu", "h20", "-o", str(out), prefix=_without_root_override())
    finally:
        (out / "envbuild").chmod(0o755)
    _one_paragraph_error(r, f"output path {out} cannot be written: Permission denied", "nothing was changed")
    assert tree(out) == before
    _no_temporaries(out)


DISK_FULL = textwrap.dedent("""
    import json, os, subprocess, sys
    sys.path.insert(0, sys.argv[2])
    from conftest import tree
    mnt, out = sys.argv[1], os.path.join(sys.argv[1], "b")
    def cli(gpu):
        return subprocess.run([sys.executable, "-m", "envbuild", "render", "--gpu", gpu, "-o", out],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": sys.argv[3]})
    first = cli("h100")
    before = tree(__import__("pathlib").Path(out))
    fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT)  # fill the disk, then leave 8 KiB
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        os.close(fd)
    os.truncate(os.path.join(mnt, "filler"), os.path.getsize(os.path.join(mnt, "filler")) - 8192)
    second = cli("h20")
    after = tree(__import__("pathlib").Path(out))
    print(json.dumps({"first": first.returncode, "rc": second.returncode, "stderr": second.stderr,
                      "same": before == after, "names": sorted(os.listdir(mnt)),
                      "left": [n for n in after if ".envbuild-tmp-" in n or ".envbuild-old-" in n]}))
""")


def test_disk_full_on_a_real_tmpfs_leaves_the_old_tree(tmp_path):
    if not shutil.which("unshare"):
        pytest.skip("no unshare: cannot mount a small tmpfs without root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user+mount namespace here for a small tmpfs: {probe.stderr.strip()}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" "$3" "$1" '
                        '"$4" "$5"', "sh", str(mnt), sys.executable, str(script), str(ROOT / "tests"), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["first"] == 0
    assert result["rc"] == 2 and "cannot be written: No space left on device" in result["stderr"], result
    assert result["same"] and result["left"] == [] and result["names"] == ["b", "filler"], result
