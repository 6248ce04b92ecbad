"""`envbuild stage` run four times at once into one shared directory, as real processes: the image
is copied once, and every run finds the same verified file. Staging otherwise is
tests/behaviour/test_enroot.py."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT
from envbuild.builds.enroot import sha256_file
from test_enroot import _sqsh


def test_staging_twice_at_once_copies_once_and_both_find_the_same_verified_file(tmp_path):
    source, shared = _sqsh(tmp_path / "img.sqsh"), tmp_path / "shared"
    shared.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "envbuild", "stage", str(source), "--to", str(shared)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    said = [out.split()[0] + (" " + out.split()[1] if out.startswith("already") else "") for out, _ in outs]
    assert sorted(said) == ["already staged"] * 3 + ["staged"], said
    staged = shared / "img.sqsh"
    assert sha256_file(staged) == sha256_file(source)
    assert subprocess.run(["sha256sum", "-c", "img.sqsh.sha256"], cwd=shared, capture_output=True).returncode == 0
    assert sorted(p.name for p in shared.iterdir()) == [".envbuild-stage.lock", "img.sqsh", "img.sqsh.sha256"]
