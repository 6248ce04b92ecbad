"""Cross-command guarantees at the trust boundary (docs/reliability.md): results never vanish
silently, and what a user hands over as a secret is shown nowhere. A reader that stops early is
tests/process/test_trust_boundary_closed_pipe.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, _cli_env


def _closed_stdout(*args, cwd):
    env = {**_cli_env(args, None, False), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "envbuild", *args], cwd=cwd, env=env, stderr=subprocess.PIPE,
                          text=True, timeout=120, preexec_fn=lambda: os.close(1))


@pytest.mark.parametrize("args", [("render", "--gpu", "h20", "-o", "out"), ("matrix",), ("extensions",),
                                  ("render", "--gpu", "h20", "--print-tag")])
def test_a_closed_standard_output_is_refused_before_anything_is_done(tmp_path, args):
    """`envbuild ... >&-`: Python sets sys.stdout to None and every print vanishes; the run was
    exit 0 with its results (the tag, the next commands) thrown away."""
    r = _closed_stdout(*args, cwd=tmp_path)
    assert r.returncode == 2 and "standard output is closed" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


def test_a_full_standard_output_is_a_failure_not_exit_0(tmp_path):
    # buffered, as on a user's machine (PYTHONUNBUFFERED hid Python's own flush at exit: exit 120)
    env = {k: v for k, v in {**_cli_env(("matrix",), None, False), "PYTHONPATH": str(ROOT)}.items()
           if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "envbuild", "matrix"], cwd=tmp_path, env=env, stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2 and "No space left" in r.stderr and "Traceback" not in r.stderr, r.stderr


TOKEN = "tok-9f8e7d6c5b4a"
URL_OPTIONS = {"--pip-index-url": "https://ci:{t}@pypi.example/simple",
               "--torch-index-url": "https://ci:{t}@torch.example/whl/cu128",
               "--apt-mirror": "http://ci:{t}@deb.example",
               "--source-mirror": "http://ci:{t}@127.0.0.1:8765"}


@pytest.mark.parametrize("flag", sorted(URL_OPTIONS))
@pytest.mark.parametrize("shape", ["accepted", "refused"])
def test_a_url_s_credentials_reach_no_output_and_no_rendered_file(tmp_path, flag, shape):
    """The credential in a mirror URL is the user's secret: a render that takes it (a build
    secret) and a refusal that quotes the URL both show it nowhere."""
    from conftest import run_here, tree

    url = URL_OPTIONS[flag].format(t=TOKEN) + ("/x y" if shape == "refused" else "")
    args = ["render", "--gpu", "h20", "-o", str(tmp_path / "out"), flag, url]
    if flag == "--source-mirror":
        args += ["--fabric", "aws-efa"]
    r = run_here(*args)
    assert (r.returncode == 0) == (shape == "accepted"), r.stderr
    assert TOKEN not in r.stdout + r.stderr
    assert all(TOKEN.encode() not in data for data in (tree(tmp_path / "out") if (tmp_path / "out").exists()
                                                      else {}).values())


def test_an_unknown_fabric_with_a_newline_is_one_paragraph(tmp_path):
    """matrix.fabric() quoted the value raw: a newline split the error (and reached a record's refusal)."""
    from conftest import run_here

    r = run_here("render", "--gpu", "h20", "--fabric", "ib\nRUN id", "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'ib\\nRUN id'" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
