"""A failure part-way through writing a build directory leaves the old tree as it was: Ctrl-C
(a real SIGINT, sent to this process before each kind of filesystem call of the write, or a
KeyboardInterrupt injected at the write or rename call), a killed render (whose leftovers the
next render accepts and cleans), a real permission error (as root without CAP_DAC_OVERRIDE)
and a disk that fills (a real tmpfs in a user and mount namespace, skipped where the kernel
does not allow one). What the directory holds otherwise is tests/behaviour/test_output.py."""

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

import pytest

from conftest import ROOT, tree
from envbuild.render import output
from envbuild.base.errors import EnvbuildError
from envbuild.render.output import RECORD, write_build_dir
from test_output import _cli, _no_temporaries, _one_paragraph_error
from test_output import h100, h20  # noqa: F401  (fixtures)


def _failing_at(call_number, exc, real):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call_number:
            raise exc
        return real(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("call_number", [1, 4, 12])
def test_ctrl_c_while_writing_leaves_the_old_tree(h100, h20, tmp_path, monkeypatch, call_number):  # noqa: F811
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
def test_ctrl_c_while_swapping_files_puts_the_old_ones_back(h100, h20, tmp_path, monkeypatch, call_number):  # noqa: F811
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


def _ctrl_c_at(moments, h100, h20, tmp_path, monkeypatch, signals):  # noqa: F811
    # Python's own Ctrl-C handler, whatever this process inherited: a suite started as a
    # background job (`cmd &` in a script) inherits SIGINT ignored, and Python then installs none.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_each(moments, h100, h20, tmp_path, monkeypatch, signals)
    finally:
        signal.signal(signal.SIGINT, inherited)


def _ctrl_c_each(moments, h100, h20, tmp_path, monkeypatch, signals):  # noqa: F811
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
def test_a_ctrl_c_at_each_kind_of_filesystem_call_of_the_write_completes_or_restores(h100, h20, tmp_path, monkeypatch,  # noqa: F811
                                                                                     signals):
    """SIGINT delivered before filesystem calls of a render over an older one, in turn (and a
    second one right after the first, as an impatient user sends): the directory ends as the old
    tree or the new one, its record verifies, and no temporary name is left. Before the write
    phase held signals, a Ctrl-C in the swap's cleanup left `.NAME.envbuild-old-*` files. Here
    one call of each kind and place (`one_of_each_kind`: 27 of 202); CI's whole run: every call."""
    _ctrl_c_at(one_of_each_kind, h100, h20, tmp_path, monkeypatch, signals)


def test_a_failure_in_a_new_directory_leaves_nothing(h20, tmp_path, monkeypatch):  # noqa: F811
    nospace = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(output, "_write_temp", _failing_at(5, nospace, output._write_temp))
    with pytest.raises(EnvbuildError, match=r"output path .*deep/b cannot be written: No space left on device"):
        write_build_dir(h20, tmp_path / "new" / "deep" / "b")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_render_leaves_a_directory_the_next_render_accepts(h100, h20, tmp_path, monkeypatch):  # noqa: F811
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
