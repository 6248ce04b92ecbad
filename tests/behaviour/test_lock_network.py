"""`envbuild lock --check` against PyPI (marked `network`): uv resolves the committed lock's stack
again as of the lock's date and makes the same file. The rest of the locks, offline, is
tests/behaviour/test_lock.py."""

from __future__ import annotations

import shutil
import sys

import pytest

from conftest import FIXTURE_MATRIX, ROOT, run_here
from envbuild.knowledge.lock import lock_path
from envbuild.resolve.locking import normalized
from test_lock import CI_STACK

pytestmark = pytest.mark.network


def test_lock_makes_the_same_file_again(tmp_path):
    """Same inputs, same file: uv resolves the committed lock's stack again as of the lock's
    date (--exclude-newer) and `--check` compares. Reaches PyPI, as the real builds do. `--check`
    also audits the lock (tests/behaviour/test_audit.py): against the local OSV endpoint of real advisories,
    since PyPI's per-release JSON answers 404 from this machine's network."""
    sys.path.insert(0, str(ROOT / "tests" / "tools"))
    from osv_server import OsvServer

    matrix_dir = tmp_path / "m"
    shutil.copytree(FIXTURE_MATRIX, matrix_dir)
    with OsvServer() as osv:
        _lock_check_round_trip(matrix_dir, {"ENVBUILD_VULNERABILITY_SERVICE": osv.url})


def _lock_check_round_trip(matrix_dir, env):
    result = run_here("lock", "--check", "--stack", CI_STACK, "--matrix-dir", str(matrix_dir), timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("current") and "stale" not in result.stdout
    # An edited lock is not current, and --check says which command refreshes it.
    path = lock_path(matrix_dir, CI_STACK, "x86_64")
    text = path.read_text()
    path.write_text(text.replace("# [venv]\n", "# [venv]\nsix==1.17.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"))
    result = run_here("lock", "--check", "--stack", CI_STACK, "--matrix-dir", str(matrix_dir), timeout=300, env=env)
    (said,) = [line for line in result.stdout.splitlines() if line.endswith(str(path))]  # the extensions' locks too
    assert result.returncode == 1 and said.startswith("stale"), result.stdout
    assert f"envbuild lock --stack {CI_STACK}" in result.stderr
    # Writing puts back exactly the committed file.
    result = run_here("lock", "--stack", CI_STACK, "--matrix-dir", str(matrix_dir), timeout=300)
    assert result.returncode == 0, result.stderr
    assert normalized(path.read_text()) == normalized(text)
