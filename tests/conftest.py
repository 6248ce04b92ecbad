"""Shared fixtures. Tests marked `docker` need the engine, registry and base image that
scripts/host-setup.sh starts; the rest run anywhere in seconds.

Behaviour tests (resolver, goldens, CLI) run against a small FROZEN matrix,
tests/fixtures/matrix, so adding a stack to matrices/ changes none of them; tests of the
production matrix itself (every row passes the rules, every combination lints, generated
files are current) use the `production_matrix` fixture."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import settings as hypothesis_settings

# The property tests: the same examples every run of the fast suite (a property that found a bug
# in one run and not the next would be a flaky test), fresh ones in the long opt-in run
# (ENVBUILD_PROPERTY_EXAMPLES, tests/property_settings.py), where exploring is the point.
hypothesis_settings.register_profile("fast", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", derandomize=False, database=None)
hypothesis_settings.load_profile("explore" if os.environ.get("ENVBUILD_PROPERTY_EXAMPLES") else "fast")

ROOT = Path(__file__).resolve().parent.parent
# pytest-xdist's workers start with COLUMNS=80 and LINES=24, and a rich Console created while
# COLUMNS is set keeps that width for good: envbuild's, made when a test first imports the CLI,
# would then ignore the COLUMNS a test hands `envbuild matrix --wide` (run_here's env), as it
# never does in a process of its own. Unset, its width is read at each print, as in a terminal.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
FIXTURE_MATRIX = ROOT / "tests" / "fixtures" / "matrix"
MATRIX_COMMANDS = {"render", "build", "matrix", "gpus", "extend", "extensions"}  # the commands that resolve stacks
# tests/ holds no test file of its own: each lies in the folder of its kind, and a file holds
# tests of one kind (a module with tests of two is two files: test_enroot.py and
# tests/docker/test_enroot_docker.py):
#   unit/       one module's functions, or one build-step or in-image script, on their own inputs
#   behaviour/  a command or a whole path (render, lock, publish plan, verify, doctor on logs, ...)
#               run in the test's process (the `cli` fixture) on the small fixture matrix
#   property/   hypothesis: generated input, hostile or valid (ENVBUILD_PROPERTY_EXAMPLES for many)
#   process/    what only real processes show: signals, Ctrl-C and kills, runs at once, hard
#               timeouts, a closed pipe, file ownership and modes as root
#   docker/     a Docker engine and the local registry (scripts/host-setup.sh): marked `docker` here
#   builds/     long opt-in image builds (hours, or hardware this machine lacks), each behind its
#               own ENVBUILD_* variable: marked `docker` here as well
# The other markers say what a test needs besides its kind, for the whole file (its pytestmark),
# in whichever folder its kind puts it: `network` (uv or pip against PyPI), `live` (PyPI as it is
# today, opt-in), `wheel` (the built wheel), `whole` (the exhaustive variant of a fast test: CI's
# whole run) and `arm64` (the emulated arm64 build, in builds/).
KINDS = ("unit", "behaviour", "property", "process", "docker", "builds")
NEEDS_DOCKER = {"docker", "builds"}
# The checkout first, then every kind's folder: a test imports another module's helpers by its
# name (`from test_hostile_input import refused`) wherever either lies, and `pytest tests/property`
# alone finds them too.
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / kind) for kind in KINDS)]


def suite_files() -> list[Path]:
    """Every test module of the suite: tests/KIND/*.py, for the checks that read the tests' sources."""
    return sorted(p for kind in KINDS for p in (ROOT / "tests" / kind).glob("*.py"))


def kind_of(path: Path) -> Optional[str]:
    """The kind of the test file at `path`: its folder under tests/ (None outside them)."""
    try:
        parts = Path(path).resolve().relative_to(ROOT / "tests").parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in KINDS else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The markers follow the folders: every test under tests/docker/ and tests/builds/ is marked
    `docker`, so a new test gets it by where it is put (tests/unit/test_test_layout.py fails a
    docker-needing test anywhere else). A test marked `whole` (the exhaustive variant of a fast
    one) runs where the docker tests run, in CI's whole run (scripts/test.sh runs every test);
    the README's fast command, -m "not docker", leaves all of them out."""
    for item in items:
        if kind_of(item.path) in NEEDS_DOCKER or item.get_closest_marker("whole"):
            item.add_marker(pytest.mark.docker)


@pytest.fixture(scope="session")
def matrix():
    """The frozen fixture matrix: what behaviour tests resolve against."""
    from envbuild.knowledge.matrix import load_matrix

    return load_matrix(FIXTURE_MATRIX)


@pytest.fixture(scope="session")
def production_matrix():
    """The shipped matrix (matrices/): only for properties every matrix must have."""
    from envbuild.knowledge.matrix import load_matrix

    return load_matrix()


def _cli_env(args, env, production) -> dict[str, str]:
    """The environment `envbuild ARGS` runs in: the fixture matrix unless `production`, no ENVBUILD_DEBUG."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("ENVBUILD_DEBUG", None)
    if production or (args and args[0] not in MATRIX_COMMANDS):
        full_env.pop("ENVBUILD_MATRIX_DIR", None)
    else:
        full_env.setdefault("ENVBUILD_MATRIX_DIR", str(FIXTURE_MATRIX))
    return full_env


def run_cli(*args, cwd=None, env=None, timeout=120, production=False):
    """Run the real console entry point of THIS checkout in a subprocess, against the fixture
    matrix unless `production`: for what only a process shows (signals, a child's file
    descriptors, a hard timeout) and for real builds; the rest use `run_here` (the `cli` fixture)."""
    full_env = _cli_env(args, env, production)
    artifacts = sys.modules.get("envbuild.oci.artifacts")
    if artifacts:  # a child starts with no registry client: one probed for another test's registry on this port is not it
        artifacts.client.cache_clear()
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [full_env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "envbuild", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_here(*args, cwd=None, env=None, production=False, input=None, timeout=None) -> subprocess.CompletedProcess:
    """`envbuild ARGS` in this process, as `python -m envbuild ARGS` runs it but for starting an
    interpreter (a second or more per run on two cores): the console's error handling
    (`envbuild.cli.run`: exit code, one-paragraph errors, no traceback), the child's argv,
    environment and working directory, stdin `input` (else empty), a `timeout` that fails the
    test rather than hang it. The result is run_cli's."""
    from click.testing import CliRunner

    from envbuild.cli import run

    full_env = _cli_env(args, env, production)
    changes = {**{k: v for k, v in full_env.items() if os.environ.get(k) != v},
               **{k: None for k in os.environ if k not in full_env}}
    argv, main_module, cwd_before = sys.argv, sys.modules["__main__"], os.getcwd()
    as_main = types.ModuleType("__main__")
    as_main.__package__ = "envbuild"  # click names the program from it: "python -m envbuild", as in a child
    with CliRunner().isolation(input=input, env=changes) as (out, err, _):
        sys.argv, sys.modules["__main__"] = [str(ROOT / "envbuild" / "__main__.py"), *map(str, args)], as_main
        try:
            os.chdir(cwd or ROOT)
            with alarm_deadline(timeout, f"envbuild {' '.join(map(str, args))}") if timeout else contextlib.nullcontext():
                run()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv, sys.modules["__main__"] = argv, main_module
            os.chdir(cwd_before)
    return subprocess.CompletedProcess([sys.executable, "-m", "envbuild", *args], code,
                                       out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace"))


@pytest.fixture
def cli():
    return run_here


def tree(path: Path) -> dict[str, bytes]:
    """All files under path, relative path -> bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def matrix_copy(tmp_path):
    """A writable copy of the built-in matrix, for tests that break it on purpose."""
    d = tmp_path / "matrices"
    shutil.copytree(FIXTURE_MATRIX, d)
    return d


class DeadlinePassed(BaseException):
    """Not an Exception (TimeoutError is an OSError): code under test that handles OSError, or
    everything, must not swallow the deadline and pass the test after all."""


@contextlib.contextmanager
def alarm_deadline(seconds: int, what: str):
    """Fail (not hang) when code under test ignores its own hard timeout."""
    def expired(*_):
        raise DeadlinePassed(what)

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def live_pids_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `text`: what a test left behind."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                status = (entry / "status").read_text()
            except OSError:
                continue
            if text in cmdline and "\nState:\tZ" not in status:
                pids.append(int(entry.name))
    return pids


def kill_processes_mentioning(text: str) -> list[int]:
    """SIGKILL what a test left running (found by `text` in its command line); their pids."""
    pids = live_pids_mentioning(text)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def cpu_target_env(name: str) -> dict[str, str]:
    """What the build plan hands cc-wrapper.sh for CPU target `name` (the production matrix's
    gpus.yaml cpu_targets): its compiler flag and its SIMD macro."""
    from envbuild.knowledge.matrix import load_matrix

    target = load_matrix().gpus_file.cpu_targets[name]
    return {"ENVBUILD_CPU_TARGET": name, "ENVBUILD_CPU_FLAG": target.flag, "ENVBUILD_CPU_SIMD": target.simd}


DOCKER = "/usr/bin/docker"  # Debian's client: BuildKit builds go through it (scripts/host-setup.sh)

# ---------------------------------------------------------------- real builds: the one place
# Every test that builds an image with envbuild (`build`, `extend --build`) calls run_build or
# run_extend_build, which add what a build on THIS machine needs; no test module names those
# flags itself (tests/unit/test_isolation.py fails one that does). So a module builds the same alone
# (`python -m pytest -m docker tests/docker/test_X.py`) as after another one, from an empty BuildKit
# cache too; a machine that differs says so once, in the ENVBUILD_TEST_* variables below.
DEBIAN_CA = "/etc/ssl/certs/ca-certificates.crt"  # a TLS proxy's CA is added to this bundle (update-ca-certificates)
CA_BUNDLE = os.environ.get("ENVBUILD_TEST_CA_CERT") or DEBIAN_CA
BASE_IMAGE = os.environ.get("ENVBUILD_TEST_BASE_IMAGE") or "local/debian:bookworm"  # scripts/host-setup.sh's import
INDEX_FLAGS = {"--pip-index-url": "ENVBUILD_TEST_PIP_INDEX_URL", "--torch-index-url": "ENVBUILD_TEST_TORCH_INDEX_URL",
               "--apt-mirror": "ENVBUILD_TEST_APT_MIRROR"}  # a mirror this machine must use, with its credentials
INDEXES = {flag: os.environ[variable] for flag, variable in INDEX_FLAGS.items() if os.environ.get(variable)}
RUN_ID = secrets.token_hex(3)  # one per pytest run: the names it gives in the shared engine and registry


def unique(name: str) -> str:
    """`name` made this run's own (an image repository, a registry path): the engine and the
    registry are shared by concurrent runs, and a name an earlier run used holds its leftovers."""
    return f"{name}-{RUN_ID}"


def machine_build_args(ca_cert=None, base_image=None, indexes=None, stack_bases=False) -> list[str]:
    """The flags a real build needs on this machine: the CA bundle (pip behind a TLS-intercepting
    proxy cannot verify PyPI without it), the base image (none with `stack_bases`: the stack's
    own), the index and mirror URLs with their credentials. What a test passes wins: its own
    bundle, base, or `indexes` ({"--pip-index-url": URL, ...})."""
    unknown = set(indexes or {}) - set(INDEX_FLAGS)
    assert not unknown, f"not an index flag: {sorted(unknown)}"
    base = [] if stack_bases else ["--base-image", base_image or BASE_IMAGE]
    return ["--ca-cert", str(ca_cert or CA_BUNDLE), *base,
            *(item for flag, url in {**INDEXES, **(indexes or {})}.items() for item in (flag, url))]


def run_build(*args, ca_cert=None, base_image=None, indexes=None, stack_bases=False, env=None,
              timeout=3600) -> subprocess.CompletedProcess:
    """`envbuild build ARGS` for real, with machine_build_args added (the production matrix
    unless ARGS name --matrix-dir)."""
    flags = machine_build_args(ca_cert, base_image, indexes, stack_bases)
    return run_cli("build", *args, *flags, env=env, timeout=timeout, production=True)


def run_extend_build(*args, ca_cert=None, indexes=None, env=None, timeout=1800) -> subprocess.CompletedProcess:
    """`envbuild extend ARGS --build` for real: FROM the stack image, so the base image is not
    named; the CA bundle and index URLs are."""
    flags = machine_build_args(ca_cert, None, indexes, stack_bases=True)
    return run_cli("extend", *args, "--build", *flags, env=env, timeout=timeout, production=True)


def build_ops_image(args: tuple[str, ...], ops, repo: str, tmp_path: Path, base_image: str) -> tuple[str, dict]:
    """`envbuild build ARGS` for real (the production matrix), which must pre-build exactly
    `ops`, then its smoke test on the CPU, which must pass with every op loaded, JIT refused.
    Returns the image and the no_jit check's part of each op ("OP ok 0.01s", "OP not loaded here ...")."""
    out = tmp_path / "image"
    r = run_build(*args, "--image-repo", repo, "-o", str(out), base_image=base_image, timeout=4 * 3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["ds_ops"]) == sorted(ops)
    image = f"{repo}:{manifest['tag']}"
    smoke = run_cli("smoke", image, "--json", timeout=1800, env={"ENVBUILD_STATE_DIR": str(tmp_path / "state")},
                    production=True)
    checks = {c["name"]: c for c in json.loads(smoke.stdout)["checks"]}
    print("no_jit:", checks["no_jit"]["detail"])
    assert smoke.returncode == 0 and checks["no_jit"]["ok"] and checks["ds_record"]["ok"], checks
    parts = {part.split()[0]: part for part in checks["no_jit"]["detail"].split("; ")}
    assert all(parts[op].startswith(f"{op} ok") for op in ops), parts
    return image, parts


def need_tool(name: str, package: str) -> str:
    """The path of a tool a test needs that the README's set-up (``pip install -e '.[test]'``) does
    not install: a test without it skips, saying which Debian package brings it; under
    scripts/test.sh (CI, ENVBUILD_TEST_TOOLS=1), which installs it, a missing tool fails."""
    found = shutil.which(name)
    if not found:
        (pytest.fail if os.environ.get("ENVBUILD_TEST_TOOLS") == "1" else pytest.skip)(
            f"{name} is not installed (Debian package {package}; scripts/test.sh installs it)")
    return found


def docker_socket() -> str:
    """The engine's unix socket as the docker CLI and SDK pick it: DOCKER_HOST, else the default."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    assert host.startswith("unix://"), f"DOCKER_HOST={host}: these tests need the engine's unix socket"
    return host[len("unix://"):]


def docker(*args, check=True, timeout=900, **kw) -> subprocess.CompletedProcess:
    """Run the docker client; with `check`, a failure raises with the end of its stderr."""
    r = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {r.stderr[-2000:]}")
    return r


def image_rows() -> list[tuple[str, str, str]]:
    """(repository, tag, digest) of every image reference in the engine; '<none>' where absent."""
    rows = docker("images", "--digests", "--format", "{{.Repository}} {{.Tag}} {{.Digest}}", check=False).stdout
    return [tuple(row.split()) for row in rows.splitlines()]


def remove_images(repo: str, registry: str | None = None) -> None:
    """Remove every reference to an image of `repo`, under any registry prefix (`push` tags
    REGISTRY/REPO:TAG, a pull by digest leaves REGISTRY/REPO@sha256:... with no tag): what a
    module built or pulled goes with it (BuildKit's cache stays, so the next run is fast). An
    image is removed by its references, never by ID, so one that another name still holds (the
    base image) stays; `repo` is this run's own (unique), so no one else's image goes, nor does
    REPO-SUFFIX (the names a module derives from its REPO) escape. With
    `registry` (a registry this run started, on its own port), only REGISTRY/REPO: a name like
    `envbuild` is not unique, the port is."""
    mine = []
    for name, tag, digest in image_rows():
        last = name.split("/")[-1]  # REPO, or REPO-SUFFIX: a module's own names under its unique REPO
        if (name != f"{registry}/{repo}") if registry else (last != repo and not last.startswith(f"{repo}-")):
            continue
        if tag != "<none>":
            mine.append(f"{name}:{tag}")
        if digest != "<none>":
            mine.append(f"{name}@{digest}")
    if mine:
        docker("rmi", *sorted(set(mine)), check=False)


@pytest.fixture(scope="module")
def images_removed(request):
    """At the end of a module (`pytest.mark.usefixtures("images_removed")`), its REPO's images
    go: remove_images(module.REPO)."""
    yield
    remove_images(request.module.REPO)


def ci_stack_id() -> str:
    """The production matrix's stack that CI builds for real (ci.real_build_stack)."""
    from envbuild.supply.ci import real_build_stack
    from envbuild.knowledge.matrix import load_matrix

    return real_build_stack(load_matrix()).id


@pytest.fixture(scope="session")
def docker_engine():
    """The engine DOCKER_HOST names (default: /var/run/docker.sock) answers and holds this
    machine's base image; else a failure that says what to run."""
    if docker("info", check=False, timeout=60).returncode != 0:
        pytest.fail(f"no Docker engine answers at {docker_socket()}; run scripts/host-setup.sh (scripts/test.sh does)")
    if docker("image", "inspect", BASE_IMAGE, check=False, timeout=60).returncode != 0:
        pytest.fail(f"base image {BASE_IMAGE} missing; run scripts/host-setup.sh")
    yield
    # Every name this run gave carries RUN_ID (unique): one still in the engine at the end is an
    # image a module left behind, several GB each on a machine that runs the suite again and again.
    left = [" ".join(row) for row in image_rows() if RUN_ID in row[0]]
    assert not left, f"images this run made are still in the engine (remove_images misses them): {left}"


@contextlib.contextmanager
def redis_server(where: Path, password: Optional[str] = None):
    """Debian's redis-server (a compile cache's store) on a free port of 127.0.0.1, without
    persistence; yields its port once it accepts connections, stops it after."""
    import socket

    server = need_tool("redis-server", "redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(where), *(["--requirepass", password] if password else [])],
                            stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def build_step(name: str):
    """A build-stage script of envbuild/buildsteps (stdlib only, run in the builder, so not a
    package pytest imports) as a fresh module; its folder on sys.path, as the scripts import
    each other (extensions.py imports sass_audit)."""
    import importlib.util

    if str(ROOT / "envbuild" / "buildsteps") not in sys.path:
        sys.path.insert(0, str(ROOT / "envbuild" / "buildsteps"))
    spec = importlib.util.spec_from_file_location(f"envbuild_step_{name.removesuffix('.py')}",
                                                  ROOT / "envbuild" / "buildsteps" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_yaml(text: str):
    """YAML as a test reads a file this checkout ships (the catalogues are hundreds of KB): the
    project's own parser, libyaml within its bounds."""
    from envbuild.base.files import parse_yaml

    return parse_yaml(text, "a file this checkout ships")
