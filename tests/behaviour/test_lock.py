"""Hash-locked stacks (envbuild/knowledge/lock.py, made by envbuild/resolve/locking.py: `envbuild
lock`): the locks in matrices/locks agree with their rows, the build installs their parts with
hash checking. uv making them again byte for byte (PyPI) is tests/behaviour/test_lock_network.py;
the builds that install from a lock are in tests/docker/test_docker_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, run_here, tree
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.lock import disagreements, expected_fields, load_lock, lock_path, parse_lock, stack_lock
from envbuild.plan import stack_plan
from envbuild.resolve.locking import deepspeed_install_requires
from envbuild.resolve.resolver import Request, resolve

CI_STACK = "torch2.11-cu130-py3.11-pypi"  # the fixture matrix's PyPI-toolchain stack (locked)
UPSTREAM = ROOT / "tests" / "fixtures" / "upstream"


def test_every_production_stack_is_locked_unless_it_needs_pytorchs_own_index(production_matrix):
    """A stale lock fails here, naming the command that refreshes it. Stacks whose torch
    comes from download.pytorch.org (not reachable from the machines that made these locks)
    may lack one; the weekly matrix-refresh workflow runs `envbuild lock` where it is."""
    missing, stale = [], []
    for stack in production_matrix.stacks:
        for arch in production_matrix.stack_arches(stack):
            try:
                lock = stack_lock(production_matrix, stack, arch)
            except EnvbuildError as e:
                stale.append(str(e))
                continue
            release = production_matrix.torch_release(stack.torch)
            if lock is None and production_matrix.torch_index(release, stack.cuda) is None:
                missing.append(f"{stack.id} ({arch}): run `envbuild lock --stack {stack.id}`")
    assert not stale, "\n".join(stale)
    assert not missing, "\n".join(missing)


def test_a_lock_lists_every_input_and_deepspeeds_own_requirements(production_matrix):
    stack = next(s for s in production_matrix.stacks if s.id == "torch2.15-cu132-py3.11-pypi")
    lock = stack_lock(production_matrix, stack)
    pins = lock.pins()
    for name in ["torch", "torchvision", "deepspeed", "triton", "ninja", "setuptools", "pip", "numpy", "pydantic",
                 "nvidia-ml-py"] + [r.split(">")[0] for r in production_matrix.deepspeed_file.build_requires]:
        assert name in pins, name
    assert lock.pins("toolchain")["cuda-toolkit"] == stack.cuda_toolkit
    assert lock.build_only == ("ninja",)
    assert lock.header["exclude-newer"].endswith("T00:00:00Z") and lock.header["index"] == "https://pypi.org/simple"
    for package in lock.sections["venv"] + lock.sections["toolchain"]:
        assert "--hash=sha256:" in package.block, package.name


def test_deepspeeds_requirements_come_from_its_sdist_with_the_cuda_only_addition():
    """setup.py reads requirements/requirements.txt and appends nvidia-ml-py for a CUDA torch:
    the metadata uv reads from the sdist's PKG-INFO misses that one."""
    sdist = UPSTREAM / "deepspeed-0.19.8.tar.gz"  # a trimmed copy of the PyPI sdist (SOURCE.txt)
    files = {str(p.relative_to(sdist)): p.read_bytes() for p in sdist.rglob("*") if p.is_file()}
    requires = deepspeed_install_requires(files, "deepspeed-0.19.8.tar.gz")
    assert requires[-1] == "nvidia-ml-py" and "torch>=2.0.0" in requires and "ninja" in requires
    with pytest.raises(EnvbuildError, match="no requirements/requirements.txt"):
        deepspeed_install_requires({"setup.py": b""}, "x.tar.gz")


def test_the_steps_parts_cover_the_lock_exactly_once(matrix):
    plan = stack_plan(resolve(matrix, Request(gpu="h20", stack=CI_STACK)))
    lock = plan.lock
    parts = {name: parse_lock("# [venv]\n" + text, name).pins() for name, text in plan.generated_files.items()
             if name.startswith("envbuild/lock/") and "toolchain" not in name}
    assert parts["envbuild/lock/deepspeed.txt"] == {"deepspeed": "0.19.8"}
    assert {**parts["envbuild/lock/venv.txt"], **parts["envbuild/lock/deepspeed.txt"]} == lock.pins()
    assert len(parts["envbuild/lock/venv.txt"]) + 1 == len(lock.pins())


def test_a_lock_that_disagrees_with_its_row_stops_the_render_with_the_refresh_command(matrix_copy, tmp_path):
    path = lock_path(matrix_copy, CI_STACK, "x86_64")
    path.write_text(path.read_text().replace("\ntorch==2.11.0 ", "\ntorch==2.10.0 "))
    out = tmp_path / "out"
    result = run_here("render", "--gpu", "h20", "--stack", CI_STACK, "-o", str(out),
                     env={"ENVBUILD_MATRIX_DIR": str(matrix_copy)})
    assert result.returncode == 2, result.stderr
    assert "stale" in result.stderr and f"envbuild lock --stack {CI_STACK}" in result.stderr
    assert "torch 2.10.0 in the lock, 2.11.0 in the stack" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_disagreements_name_each_field():
    lock = parse_lock("# stack: a\n# arch: x86_64\n# python: 3.12\n# [venv]\ntorch==2.15.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    assert disagreements(lock, {"stack": "a", "arch": "x86_64", "python": "3.11", "torch": "2.15.0",
                                "deepspeed": "0.19.8"}) == [
        "python 3.12 in the lock, 3.11 in the stack", "deepspeed missing in the lock, 0.19.8 in the stack"]


@pytest.mark.parametrize("text, message", [
    ("# [venv]\ntorch>=2.0 \\\n    --hash=sha256:" + "0" * 64 + "\n", "not a pinned requirement"),
    ("# [nope]\n", "unknown lock section"),
    ("# stack: a\n", r"no \[venv\] section"),
])
def test_a_malformed_lock_is_refused_with_its_line(text, message):
    with pytest.raises(EnvbuildError, match=message):
        parse_lock(text, "x.txt")


def test_the_lock_render_summary_and_the_manifest_agree(matrix, tmp_path):
    out = tmp_path / "b"
    result = run_here("render", "--gpu", "h20", "--stack", CI_STACK, "-o", str(out))
    assert result.returncode == 0, result.stderr
    lock = load_lock(FIXTURE_MATRIX, CI_STACK, "x86_64")
    assert f"sha256 {lock.sha256[:12]}" in result.stdout
    assert (out / "envbuild" / "lock.txt").read_text() == lock.text
    result = run_here("render", "--gpu", "v100", "--stack", "torch2.11-cu126-py3.12", "-o", str(tmp_path / "c"))
    said = " ".join(result.stdout.split())
    assert result.returncode == 0 and "lock none: its torch comes from download.pytorch.org" in said
    assert "cannot be locked from a machine without it" in said


def test_lock_refuses_an_unknown_stack_and_writes_nothing(matrix_copy):
    before = tree(matrix_copy)
    result = run_here("lock", "--stack", "torch2.11-cu130-py3.11-pypy", "--matrix-dir", str(matrix_copy))
    assert result.returncode == 2
    assert "--stack 'torch2.11-cu130-py3.11-pypy': no such stack" in result.stderr
    assert "Nearest: torch2.11-cu130-py3.11-pypi" in result.stderr and "Traceback" not in result.stderr
    assert tree(matrix_copy) == before


def test_lock_will_not_overwrite_a_file_it_did_not_write(matrix_copy):
    path = lock_path(matrix_copy, CI_STACK, "x86_64")
    path.write_text("# my own notes\n# [venv]\n")
    result = run_here("lock", "--stack", CI_STACK, "--matrix-dir", str(matrix_copy))
    assert result.returncode == 1 and "was not written by envbuild lock" in result.stdout
    assert path.read_text() == "# my own notes\n# [venv]\n"


def test_expected_fields_follow_the_row(matrix):
    stack = next(s for s in matrix.stacks if s.id == CI_STACK)
    assert expected_fields(matrix, stack) == {
        "stack": CI_STACK, "arch": "x86_64", "python": "3.11", "platform": "x86_64-manylinux_2_36",
        "torch": "2.11.0", "torchvision": "0.26.0", "deepspeed": "0.19.8"}
    assert Path(load_lock(matrix.directory, CI_STACK, "x86_64").path).name == f"{CI_STACK}.x86_64.txt"


def test_a_lock_that_cannot_be_checked_from_here_is_not_called_stale(matrix_copy):
    """No index reachable (a proxy that refuses every connection): `lock --check` says the locks
    cannot be checked from here, not that they are stale, suggests no refresh, and points to no
    option `lock` does not have."""
    dead = "http://127.0.0.1:9"
    env = {"HTTPS_PROXY": dead, "https_proxy": dead, "HTTP_PROXY": dead, "http_proxy": dead,
           "XDG_CACHE_HOME": str(matrix_copy.parent / "xdg")}  # no cached index pages either
    result = run_here("lock", "--check", "--stack", CI_STACK, "--matrix-dir", str(matrix_copy), env=env, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("unreachable") and "stale" not in result.stdout, result.stdout
    said = " ".join(result.stderr.split())
    assert "2 of 2 locks cannot be checked from here" in said and "says nothing about whether they are current" in said
    # it names the index that could not be reached (this stack resolves from PyPI only), not the proxy
    assert "pypi.org cannot be reached" in result.stdout and "Run it where pypi.org is reachable" in said, said
    assert "127.0.0.1" not in said
    assert "--offline" not in result.stdout + result.stderr and "Refresh with" not in said


def test_unreachable_is_told_from_no_solution():
    from envbuild.resolve.locking import LockOutcome, lock_summary, unreachable

    assert unreachable("error: Request failed after 3 retries\n  Caused by: error sending request for url "
                       "(https://download.pytorch.org/whl/cu126/torch/)\n  Caused by: tcp connect error")
    assert not unreachable("× No solution found when resolving dependencies:\n  ╰─▶ Because torch==2.6.0 ...")
    outcomes = [LockOutcome("a", "x86_64", Path("a"), "stale"), LockOutcome("b", "x86_64", Path("b"), "unreachable",
                                                                           "refused", ("download.pytorch.org",)),
                LockOutcome("c", "x86_64", Path("c"), "current")]
    said = lock_summary(outcomes, check=True)
    assert said[0].startswith("1 of 3 locks are stale") and "envbuild lock --stack a" in said[0]
    assert said[1].startswith("1 of 3 locks cannot be checked from here") and "download.pytorch.org is reachable" in said[1]
    assert lock_summary([outcomes[2]], check=True) == []


@pytest.mark.parametrize("message, hosts", [
    # uv, PyTorch's index down (the stack's own index named)
    ("error: Request failed after 3 retries\n  Caused by: error sending request for url "
     "(https://download.pytorch.org/whl/cu126/torch/)\n  Caused by: tcp connect error", ["download.pytorch.org"]),
    # uv, a wheel on PyPI's file host
    ("error: Failed to fetch: `https://files.pythonhosted.org/packages/ab/cd/six-1.17.0-py2.py3-none-any.whl`",
     ["files.pythonhosted.org"]),
    # envbuild's own PyPI read behind a dead proxy: the proxy is not the index
    ("GET https://pypi.org/simple/deepspeed/ failed: [Errno 111] Connection refused (proxy http://127.0.0.1:9). "
     "PyPI must be reachable.", ["pypi.org"]),
    # a DNS error names no host: every index the stack resolves from
    ("error: dns error: failed to lookup address information: Temporary failure in name resolution",
     ["download.pytorch.org", "pypi.org"]),
])
def test_an_unreachable_lock_names_the_index_host(message, hosts):
    from envbuild.resolve.locking import PYPI_SIMPLE, unreachable, unreachable_hosts

    assert unreachable(message)
    assert unreachable_hosts(message, ("https://download.pytorch.org/whl/cu126", PYPI_SIMPLE)) == hosts


def test_lock_check_names_the_host_of_the_index_it_could_not_reach(matrix, monkeypatch):
    """lock_stacks itself: the outcome of a stack whose index failed names that index's host
    (uv stands in for a refused index: it cannot be made to fail that way here without the network)."""
    import envbuild.resolve.locking as lock

    def refuse(inputs, date):
        raise EnvbuildError("error: Request failed after 3 retries\n  Caused by: error sending request for url "
                            f"({inputs.indexes[0]}/torch/)\n  Caused by: tcp connect error")

    monkeypatch.setattr(lock, "fetch_deepspeed_requires", lambda version, progress=None: ([], "stub"))
    monkeypatch.setattr(lock, "write_lock", refuse)
    stack = next(s for s in matrix.stacks if matrix.torch_index(matrix.torch_release(s.torch), s.cuda))
    [outcome] = [o for o in lock.lock_stacks(matrix, (stack.id,), check=True) if o.arch == "x86_64"]
    host = "download.pytorch.org"
    assert outcome.state == "unreachable" and outcome.hosts == (host,), outcome
    assert f"{host} cannot be reached" in outcome.detail
    assert f"Run it where {host} is reachable" in " ".join(lock.lock_summary([outcome], check=True))


def test_render_and_matrix_say_honestly_whether_a_stack_is_locked(tmp_path):
    import json

    unlocked = json.loads(run_here("render", "--gpu", "v100", "--stack", "torch2.6-cu126-py3.12", "--json", "-o",
                                  str(tmp_path / "a")).stdout)["lock"]
    assert unlocked["locked"] is False and "download.pytorch.org" in unlocked["why"]
    locked = json.loads(run_here("render", "--gpu", "h20", "--stack", CI_STACK, "--json", "-o",
                                str(tmp_path / "b")).stdout)["lock"]
    assert locked["locked"] is True and len(locked["sha256"]) == 64
    wide = run_here("matrix", "--wide", env={"COLUMNS": "400"}).stdout
    row = next(line for line in wide.splitlines() if f" {CI_STACK} " in line)
    assert "x86_64, aarch64" in row
    assert "none (torch from download.pytorch.org)" in " ".join(
        line for line in wide.splitlines() if " torch2.6-cu126-py3.12 " in line)


def test_an_unlocked_default_offers_the_newest_locked_stack_the_rules_allow(tmp_path):
    """V100's newest stack takes its torch from download.pytorch.org (sm_70 left PyPI's default
    wheels at torch 2.11), so it cannot be locked here: render names the newest stack for V100
    that is locked, and that stack renders locked. A GPU whose default is locked is offered none."""
    import json

    v100 = json.loads(run_here("render", "--gpu", "v100", "--json", "-o", str(tmp_path / "a"), production=True).stdout)
    alternative = v100["lock"]["locked_alternative"]
    assert v100["lock"]["locked"] is False and f"--stack {alternative}" in v100["lock"]["why"]
    chosen = json.loads(run_here("render", "--gpu", "v100", "--stack", alternative, "--json", "-o",
                                str(tmp_path / "b"), production=True).stdout)
    assert chosen["lock"]["locked"] is True and "7.0" in chosen["torch_cuda_arch_list"]
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.resolve.resolver import explain_rows

    production = load_matrix()
    allowed = [sid for sid, verdict, _ in explain_rows(production, Request(gpu="v100")) if verdict != "rejected"]
    newer = allowed[:allowed.index(alternative)]
    assert newer and not any(load_lock(production.directory, sid, "x86_64") for sid in newer)
    h20 = json.loads(run_here("render", "--gpu", "h20", "--json", "-o", str(tmp_path / "c"), production=True).stdout)["lock"]
    assert h20["locked"] is True and "locked_alternative" not in h20
