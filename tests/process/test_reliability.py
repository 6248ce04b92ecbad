"""envbuild's own reliability where runs meet each other or are cut short, as real processes:
runs at once into one directory never interleave; an interrupted or killed run leaves nothing a
later run does not clean; a lock another process holds makes a run wait, then refuses it
clearly; a full stream and a signal a library wraps are clear exits, not internal errors.

Each command's bad input is tests/behaviour/test_reliability_refusals.py; the output-directory
rules for any sequence of renders and user edits, tests/property/test_reliability_properties.py;
the disk-full (tmpfs), permission-error and Ctrl-C-inside-a-write cases of the writer,
tests/process/test_output_failures.py; the build path's faults (engine, registry, smoke),
tests/docker/test_docker_e2e.py."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, run_cli


def _listing(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


# ---------------------------------------------------------------- runs at once, interrupted runs

def _render_proc(out: Path, gpu: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ENVBUILD_MATRIX_DIR": str(FIXTURE_MATRIX)}
    env.pop("ENVBUILD_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "envbuild", "render", "--gpu", gpu, "-o", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _verifies(out: Path) -> bool:
    return subprocess.run(["sha256sum", "-c", "--quiet", ".envbuild-files"], cwd=out,
                          capture_output=True).returncode == 0


def _temporaries(out: Path) -> list[str]:
    return [str(p) for p in out.rglob("*") if ".envbuild-tmp-" in p.name or ".envbuild-old-" in p.name]


def test_eight_renders_into_one_directory_all_succeed_and_the_tree_verifies(tmp_path):
    out = tmp_path / "d"
    procs = [_render_proc(out, gpu) for gpu in ["h20", "h100", "v100", "a100"] * 2]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert [rc for rc, _ in results] == [0] * 8, results
    assert _verifies(out) and _temporaries(out) == []
    again = run_cli("render", "--gpu", "h20", "-o", str(out))
    assert again.returncode == 0, again.stderr  # not refused as "edited"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_interrupted_renders_leave_nothing_a_later_render_does_not_clean(tmp_path, sig):
    out = tmp_path / "d"
    assert run_cli("render", "--gpu", "h20", "-o", str(out)).returncode == 0
    (out / "build.log").write_text("mine\n")
    codes = {}
    for i in range(12):  # from start-up through writing (a render takes about a second here)
        p = _render_proc(out, "h100" if i % 2 else "h20")
        time.sleep(0.25 + i * 0.1)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
        if p.returncode in (1, -2) and "KeyboardInterrupt" in err and not any(
                f"envbuild/{room}" in err for room in ("cli", "output", "files", "render", "plan", "resolve")):
            continue  # Python itself was still starting (site, runpy): before any envbuild code ran
        # 130, or death by SIGINT (-2 here), which a shell reports as 130 too (CPython re-raises
        # SIGINT at exit when a Ctrl-C interrupted it): either way one line, no traceback.
        code = 130 if p.returncode == -2 and "envbuild: interrupted" in err else p.returncode
        codes[code] = err[-1500:]
        if sig == signal.SIGINT and code == 130:
            assert "Traceback" not in err and err.strip().endswith("envbuild: interrupted"), err
    last = run_cli("render", "--gpu", "h20", "-o", str(out))
    assert last.returncode == 0, last.stderr
    assert _verifies(out) and _temporaries(out) == []
    assert (out / "build.log").read_text() == "mine\n"
    # nothing but done, interrupted, terminated (SIGTERM unwinds: 143) or killed
    assert set(codes) <= {0, 130, 143, -9, -15}, codes


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_disk_under_a_write_with_no_path_is_exit_2_not_an_internal_error():
    """ENOSPC on an open stream has no file name (a full disk under a build's log, a pipe to a
    full file); /dev/full gives the real error. It is the machine's state, not a bug: exit 2,
    one paragraph saying where to free space."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "envbuild", "matrix", "--json"], stdout=full,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("envbuild: error: No space left on device while writing: free space")
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("lock_file", [None, ".envbuild-stage.lock"])
def test_a_held_lock_makes_a_second_run_wait_then_refuses_it_clearly(tmp_path, lock_file):
    """Both kinds of lock (flock on the directory; a POSIX lock on a file in it, for NFS) are
    held by another process here: a POSIX lock never blocks its own process."""
    from envbuild.base.errors import EnvbuildError
    from envbuild.base.files import locked
    hold = ("import sys, time; from pathlib import Path; from envbuild.base.files import locked\n"
            f"with locked(Path(sys.argv[1]), lock_file={lock_file!r}):\n"
            "    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        said = []
        with pytest.raises(EnvbuildError, match=rf"another envbuild has been staging into {tmp_path} for over 0 s"):
            with locked(tmp_path, "staging into", wait=0.3, lock_file=lock_file, progress=said.append):
                pytest.fail("the lock was taken while another process held it")
        assert said == [f"waiting for another envbuild staging into {tmp_path}"]
    finally:
        holder.kill()
        holder.wait()
    with locked(tmp_path, "staging into", wait=5, lock_file=lock_file):  # the kernel dropped the dead holder's lock
        pass


@pytest.mark.parametrize("wrapped", [SystemExit(143), KeyboardInterrupt()], ids=["SIGTERM", "SIGINT"])
def test_a_signal_that_lands_while_a_class_is_made_is_a_signal_not_an_internal_error(monkeypatch, capsys, wrapped):
    """Python 3.11 wraps what a descriptor's __set_name__ raises in a RuntimeError: a SIGTERM (or
    Ctrl-C) that lands while pydantic builds a model class arrived as 'internal error' and exit 70
    (seen once in CI's run of the interrupted-renders test). The signal's own exit stands."""
    import envbuild.cli.app as app

    def interrupted(**_):
        try:
            raise wrapped
        except BaseException as signal_error:
            raise RuntimeError("Error calling __set_name__ on 'PydanticDescriptorProxy' instance") from signal_error

    monkeypatch.setattr(app.main, "main", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        app.run()
    assert exit_info.value.code == (143 if isinstance(wrapped, SystemExit) else 130)
    assert "internal error" not in capsys.readouterr().err


def test_a_ctrl_c_a_library_rewraps_without_a_chain_is_still_an_interruption(tmp_path):
    """pydantic-core, building a model's validator when the Ctrl-C lands, raises its own
    SchemaError with no chain to the KeyboardInterrupt (seen once in the loop above: exit 70,
    "internal error"). The entry point remembers the Ctrl-C, so whatever error follows it ends
    the run as interrupted: 130, one line."""
    script = tmp_path / "rewrap.py"
    script.write_text(
        "import os, signal, time\n"
        "import envbuild.cli.app as app\n"
        "def rewrapped(**_):\n"
        "    caught = False\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(5)\n"
        "    except KeyboardInterrupt:\n"
        "        caught = True\n"
        "    if caught:  # raised anew, outside the handler: no __context__ leads back to the Ctrl-C\n"
        "        raise RuntimeError('Error building \"model\" validator')\n"
        "app.main.main = rewrapped\n"
        "import envbuild.console\n"
        "envbuild.console.main()\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 130 and r.stderr.strip() == "envbuild: interrupted", (r.returncode, r.stderr)
