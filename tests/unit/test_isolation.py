"""Every test passes when run alone: a test that builds an image builds with what this machine
needs (conftest.run_build / run_extend_build add the CA bundle, the base image and the index
URLs), never with what an earlier module left in BuildKit's cache. Read from the test sources
with ast, so a new module that calls `envbuild build` its own way fails here, in the fast suite,
not on the first machine behind a TLS proxy that runs it alone."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from conftest import ROOT

HELPERS = {"run_build", "run_extend_build"}
CLI_RUNNERS = {"run_cli", "cli"}  # how tests call the envbuild CLI (conftest.run_cli, the `cli` fixture)
MACHINE_FLAGS = {"--ca-cert", "--base-image", *conftest.INDEX_FLAGS}


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _strings(nodes) -> list[str | None]:
    """Each node's string value, None where it is not a string literal."""
    return [n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None for n in nodes]


def _builds(words: list[str | None]) -> bool:
    """An envbuild command line (from its subcommand on) that builds an image."""
    return bool(words) and (words[0] == "build" or (words[0] == "extend" and "--build" in words))


def bypasses(source: str) -> list[str]:
    """Where a test module builds an image other than through conftest's helpers, or names the
    machine's build settings itself: 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and node.value == "--build":
            found.append(f"line {line}: '--build' (envbuild extend --build): call conftest.run_extend_build")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and conftest.DEBIAN_CA in node.value:
            found.append(f"line {line}: the CA bundle's path: use conftest.CA_BUNDLE")
        if not isinstance(node, ast.Call):
            continue
        for argv in (a for a in node.args if isinstance(a, (ast.List, ast.Tuple))):  # Popen([.., "envbuild", "build"])
            words = _strings(argv.elts)
            if "envbuild" in words and _builds(words[words.index("envbuild") + 1:]):
                found.append(f"line {line}: an envbuild build command line: call conftest.run_build")
        name = _name(node.func)
        words = _strings(node.args)
        if name in CLI_RUNNERS and _builds(words):
            found.append(f"line {line}: {name}({words[0]!r}, ...) builds an image: call conftest.run_build")
        elif name == "invoke" and len(node.args) > 1 and isinstance(node.args[1], (ast.List, ast.Tuple)) \
                and _builds(_strings(node.args[1].elts)):
            found.append(f"line {line}: CliRunner.invoke of a build: call conftest.run_build")
        elif name in HELPERS and MACHINE_FLAGS & set(words):
            flags = sorted(MACHINE_FLAGS & set(words))
            found.append(f"line {line}: {name} given {', '.join(flags)} itself: pass ca_cert=, base_image= "
                         f"or indexes= (what the machine needs is conftest's)")
    return found


def test_no_test_module_builds_an_image_around_conftest():
    here = Path(__file__).resolve()
    modules = sorted(p for p in [*(ROOT / "tests").glob("*.py"), *conftest.suite_files(),
                                 *(ROOT / "tests" / "tools").glob("*.py")]
                     if p.name != "conftest.py" and p.resolve() != here)
    assert len(modules) > 50, modules  # the suite's modules, wherever they lie: not an empty glob
    found = [f"{p.relative_to(ROOT)} {where}" for p in modules for where in bypasses(p.read_text())]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("source", [
    'run_cli("build", "--gpu", "h20", "-o", str(out), production=True)',
    'cli("build", "--gpu", "h20")',
    'run_cli("extend", "-r", "r.txt", "--gpu", "h20", "--build")',
    '_extend(tmp_path, "-r", "r.txt", "--build")',
    'subprocess.Popen([sys.executable, "-m", "envbuild", "build", "--gpu", "h20"])',
    'subprocess.run(["envbuild", "extend", "-r", "r.txt", "--build"])',
    'CliRunner().invoke(main, ["build", "--gpu", "h20"])',
    'subprocess.check_output(("envbuild", "build", "--gpu", "h20"))',
    'run_build("--gpu", "h20", "--ca-cert", "/my/ca.pem")',
    'run_build("--gpu", "h20", "--base-image", "debian:12")',
    'run_extend_build("-r", "r.txt", "--pip-index-url", "https://u:p@mirror/simple")',
    f'docker("run", "-v", "{conftest.DEBIAN_CA}:/ca.pem", image)',
])
def test_the_check_finds_each_way_around_the_one_place(source):
    assert bypasses(source)


@pytest.mark.parametrize("source", [
    'run_build("--gpu", "h20", "--image-repo", REPO, "-o", str(out), ca_cert=bundle, env=state)',
    'run_extend_build("-r", "r.txt", "--gpu", "h20", ca_cert=bundle, indexes={"--pip-index-url": url})',
    'run_cli("render", "--gpu", "h20", "--base-image", mirror, "--ca-cert", "/nonexistent/ca.pem")',
    'run_cli("extend", "-r", "r.txt", "--gpu", "h20", "-o", str(out))',
    'docker("build", "-q", "-t", tag, "-", input=dockerfile)',
    'subprocess.run([sys.executable, "-m", "build", "--wheel"])',
    'assert argv[:2] == ["envbuild", "build"]',
])
def test_what_needs_no_build_args_passes_the_check(source):
    """Renders, refusals, extend without --build, a plain `docker build` FROM a test image, a
    wheel build, a parsed command line compared: none builds an image of a stack."""
    assert bypasses(source) == []


def test_the_machine_build_args_carry_the_ca_bundle_and_base_image_and_what_a_test_passes_wins():
    assert conftest.machine_build_args()[:4] == ["--ca-cert", conftest.CA_BUNDLE, "--base-image", conftest.BASE_IMAGE]
    own = conftest.machine_build_args(ca_cert="/w/bundle.pem", base_image="127.0.0.1:5000/b:1",
                                      indexes={"--pip-index-url": "https://u:t@m/simple"})
    assert own[:4] == ["--ca-cert", "/w/bundle.pem", "--base-image", "127.0.0.1:5000/b:1"]
    assert own[own.index("--pip-index-url") + 1] == "https://u:t@m/simple" and own.count("--pip-index-url") == 1
    assert "--base-image" not in conftest.machine_build_args(stack_bases=True)
    with pytest.raises(AssertionError, match="not an index flag"):
        conftest.machine_build_args(indexes={"--index-url": "https://x"})


def test_a_machine_that_differs_sets_its_values_once_in_the_environment(tmp_path):
    """ENVBUILD_TEST_* as a CI machine behind another proxy or mirror sets them: every build gets them."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ENVBUILD_TEST_")},
           "PYTHONPATH": str(ROOT / "tests"), "ENVBUILD_TEST_CA_CERT": "/ci/proxy-ca.pem",
           "ENVBUILD_TEST_BASE_IMAGE": "mirror.example/debian:bookworm",
           "ENVBUILD_TEST_PIP_INDEX_URL": "https://ci:tok@mirror.example/simple"}
    r = subprocess.run([sys.executable, "-c", "import conftest; print(conftest.machine_build_args())"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert r.stdout.strip() == str(["--ca-cert", "/ci/proxy-ca.pem", "--base-image", "mirror.example/debian:bookworm",
                                    "--pip-index-url", "https://ci:tok@mirror.example/simple"])


def test_run_build_and_run_extend_build_add_the_machine_args(monkeypatch):
    calls = []
    monkeypatch.setattr(conftest, "run_cli", lambda *args, **kw: calls.append((args, kw)))
    conftest.run_build("--gpu", "h20", "-o", "out", env={"A": "1"})
    conftest.run_extend_build("-r", "r.txt", "--gpu", "h20", ca_cert="/w/bundle.pem")
    (build, build_kw), (extend, _) = calls
    assert build[:4] == ("build", "--gpu", "h20", "-o") and build_kw["production"] and build_kw["env"] == {"A": "1"}
    assert list(build[5:]) == conftest.machine_build_args()
    assert extend[:5] == ("extend", "-r", "r.txt", "--gpu", "h20") and "--build" in extend
    assert list(extend[extend.index("--build") + 1:]) == conftest.machine_build_args("/w/bundle.pem", stack_bases=True)


def test_unique_names_differ_between_runs():
    """Two pytest runs at once on the shared engine and registry never share a repository."""
    code = "import conftest; print(conftest.unique('envbuild-test'))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    names = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            check=True).stdout.strip() for _ in range(2)}
    assert len(names) == 2 and all(n.startswith("envbuild-test-") for n in names), names
