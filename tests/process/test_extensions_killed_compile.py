"""The premise of resuming an interrupted extension compile, on the real ninja: an object whose
compile was killed half-way (its process group SIGKILLed, as a cancelled docker build does) is
compiled again, finished ones are not. The resume logic itself is tests/unit/test_extensions.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import build_step

NINJA_FILE = """rule compile
  command = sh -c 'echo partial > $out; if [ -e $in.hang ]; then sleep 60; fi; echo done >> $out'
build a.o: compile a.cu
build b.o: compile b.cu
build c.o: compile c.cu
"""
NINJA = (sys.executable, "-m", "ninja")  # PyPI's ninja, a test dependency: what the builder's torch uses


def test_ninja_compiles_again_only_what_a_kill_cut_off(tmp_path):
    """The premise of resuming, on the real ninja: an object whose command was killed half-way
    (its file written, not finished) is compiled again; finished ones are not. torch's
    BuildExtension compiles every extension through ninja."""
    step = build_step("extensions.py")
    build = tmp_path / "tree" / "build" / "temp.linux-x86_64-cpython-311"
    build.mkdir(parents=True)
    (build / "build.ninja").write_text(NINJA_FILE)
    for name in ("a", "b", "c"):
        (build / f"{name}.cu").write_text(name)
    (build / "c.cu.hang").write_text("")
    first = subprocess.Popen([*NINJA, "-j", "3"], cwd=build, stdout=subprocess.PIPE, start_new_session=True)
    for _ in range(200):
        if len(step.finished_objects(tmp_path / "tree")) == 2:
            break
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # what a cancelled docker build does to the RUN step
    first.wait()
    assert (build / "c.o").read_text() == "partial\n"
    before = step.finished_objects(tmp_path / "tree")
    assert sorted(before) == ["a.o", "b.o"]
    (build / "c.cu.hang").unlink()
    (build / "b.cu").write_text("b, edited")  # newer than its object: ninja compiles it again
    second = subprocess.run([*NINJA, "-j", "3", "-d", "explain"], cwd=build, capture_output=True, text=True)
    assert second.returncode == 0 and "[2/2]" in second.stdout and "a.o" not in second.stdout
    assert (build / "c.o").read_text() == "partial\ndone\n"
    after = step.finished_objects(tmp_path / "tree")
    assert sorted(after) == ["a.o", "b.o", "c.o"]
    assert step.kept_objects(before, after) == ["a.o"]  # what the build reports as kept, not all it found
