"""The suite's own layout (tests/conftest.py says which folder each kind of test goes in): no test
module lies flat in tests/ or in a folder that is no kind, a test that needs the Docker engine
lies where the folder marks it `docker`, the other markers are a whole file's, and every
hypothesis property is in tests/property/. Read from the sources with ast, so a new module put
in the wrong place fails here, in the fast suite, not by running where it cannot."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest
from conftest import KINDS, NEEDS_DOCKER, ROOT, kind_of, suite_files

TESTS = ROOT / "tests"
NOT_TESTS = {"fixtures", "golden", "tools", "__pycache__"}  # data and helpers, no test modules
DOCKER_FIXTURES = {"docker_engine", "images_removed"}
DOCKER_HELPERS = {"docker", "DOCKER", "docker_socket", "image_rows", "remove_images", "build_ops_image"}
FILE_MARKERS = {"network", "live", "wheel", "whole", "arm64"}  # a whole file's: its pytestmark
# Properties that cannot move yet, each with the reason; an entry whose file holds none fails.
PROPERTIES_ELSEWHERE: dict[str, str] = {}  # a file that must keep a property outside tests/property, and why


def _misplaced(path: Path) -> list[str]:
    """What lies in the wrong place under `path` (a tests/ tree): test modules outside a kind's
    folder, and folders that are neither a kind nor data."""
    found = [f"{p.relative_to(path)}: a test module outside the folders of tests/ by kind ({', '.join(KINDS)})"
             for p in sorted(path.rglob("test_*.py"))
             if not (p.parent.parent == path and p.parent.name in KINDS)
             and NOT_TESTS.isdisjoint(p.relative_to(path).parts)]
    found += [f"{d.name}/: neither a kind ({', '.join(KINDS)}) nor one of {', '.join(sorted(NOT_TESTS))}"
              for d in sorted(path.iterdir()) if d.is_dir() and d.name not in {*KINDS, *NOT_TESTS}]
    return found


def _needs_docker(source: str) -> list[str]:
    """Where a module asks for the engine: a docker fixture requested, a conftest helper that
    runs the docker client, or the marker itself (the folder gives it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"line {node.lineno}: {node.name} requests {a.arg}" for a in node.args.args
                      if a.arg in DOCKER_FIXTURES]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("usefixtures"):
            found += [f"line {node.lineno}: usefixtures({a.value!r})" for a in node.args
                      if isinstance(a, ast.Constant) and a.value in DOCKER_FIXTURES]
        elif isinstance(node, ast.ImportFrom) and node.module == "conftest":
            found += [f"line {node.lineno}: from conftest import {a.name}" for a in node.names
                      if a.name in DOCKER_HELPERS | DOCKER_FIXTURES]
        elif isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.docker":
            found.append(f"line {node.lineno}: pytest.mark.docker (the folder gives it)")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "conftest" \
                and node.attr in DOCKER_HELPERS | DOCKER_FIXTURES:
            found.append(f"line {node.lineno}: conftest.{node.attr}")
    return found


def _file_markers(source: str) -> tuple[set[str], list[str]]:
    """The FILE_MARKERS a module sets, and where one is set on a test or class instead of the
    module's pytestmark."""
    marks, misplaced = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("pytest.mark.") \
                and node.attr in FILE_MARKERS:
            marks.add(node.attr)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                name = ast.unparse(decorator)
                if name.startswith("pytest.mark.") and name.split(".")[2].split("(")[0] in FILE_MARKERS:
                    misplaced.append(f"line {decorator.lineno}: @{name} on {node.name}: the module's pytestmark, "
                                     f"in a file of its own ({node.name} and its helpers)")
    return marks, misplaced


def _properties(source: str) -> list[str]:
    """The tests that run a hypothesis property (@given on the test or on a function inside it)."""
    def given(node):
        return any(isinstance(d, ast.Call) and ast.unparse(d.func).split(".")[-1] == "given"
                   for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for d in n.decorator_list)
    return [node.name for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
            and given(node)]


def test_every_test_module_lies_in_the_folder_of_its_kind():
    assert _misplaced(TESTS) == [], "\n".join(_misplaced(TESTS))
    assert {kind_of(p) for p in suite_files()} == set(KINDS)


def test_a_test_that_needs_docker_lies_in_tests_docker_or_tests_builds():
    found = [f"{p.relative_to(ROOT)} {where}" for p in suite_files() if kind_of(p) not in NEEDS_DOCKER
             for where in _needs_docker(p.read_text())]
    assert found == [], ("move these tests to tests/docker/ (or tests/builds/, for a long opt-in build):\n"
                         + "\n".join(found))


def test_the_other_markers_are_a_whole_files():
    here = Path(__file__).resolve()
    marks = {p: _file_markers(p.read_text()) for p in suite_files() if p.resolve() != here}
    found = [f"{p.relative_to(ROOT)} {where}" for p, (_, misplaced) in marks.items() for where in misplaced]
    assert found == [], "\n".join(found)
    arm64 = [p.relative_to(ROOT) for p, (names, _) in marks.items() if "arm64" in names and kind_of(p) != "builds"]
    assert arm64 == []  # the emulated arm64 build is a long opt-in build


def test_every_property_is_in_tests_property():
    elsewhere = {str(p.relative_to(TESTS)): _properties(p.read_text()) for p in suite_files()
                 if kind_of(p) != "property"}
    found = {path: names for path, names in elsewhere.items() if names and path not in PROPERTIES_ELSEWHERE}
    assert found == {}, f"hypothesis tests (@given) go in tests/property: {found}"
    stale = [path for path in PROPERTIES_ELSEWHERE if not elsewhere.get(path)]
    assert stale == [], f"no longer holds a property, remove it from PROPERTIES_ELSEWHERE: {stale}"


@pytest.mark.parametrize("where, words", [
    ("test_x.py", "test_x.py: a test module outside the folders"),
    ("integration/test_x.py", "integration/: neither a kind"),
    ("unit/more/test_x.py", "unit/more/test_x.py: a test module outside"),
])
def test_the_layout_check_finds_a_misplaced_module(tmp_path, where, words):
    for name in [*KINDS, *NOT_TESTS]:
        (tmp_path / name).mkdir()
    (tmp_path / "unit" / "test_fine.py").write_text("")
    (tmp_path / "fixtures" / "upstream" / "test_data.py").parent.mkdir()
    (tmp_path / "fixtures" / "upstream" / "test_data.py").write_text("")
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text("")
    found = _misplaced(tmp_path)
    assert found and all(where.split("/")[0] in f for f in found) and any(words in f for f in found), found


@pytest.mark.parametrize("source", [
    "def test_x(docker_engine):\n    pass\n",
    "@pytest.fixture\ndef built(docker_engine, tmp_path):\n    pass\n",
    "pytestmark = pytest.mark.usefixtures('images_removed')\n",
    "from conftest import docker, unique\n",
    "import conftest\ndef test_x():\n    conftest.remove_images('r')\n",
    "def test_x():\n    from conftest import DOCKER\n",
    "@pytest.mark.docker\ndef test_x():\n    pass\n",
])
def test_the_docker_check_finds_each_way_a_test_asks_for_the_engine(source):
    assert len(_needs_docker(source)) == 1, source


@pytest.mark.parametrize("source", [
    "from envbuild.engine import docker as docker_engine\ndef test_x():\n    docker_engine.docker_cli()\n",
    "from conftest import run_here, ROOT\ndef test_x(tmp_path, cli):\n    pass\n",
    "import conftest\ndef test_x(monkeypatch):\n    conftest.run_build('--gpu', 'h20')\n",  # run_cli stubbed: no engine
])
def test_what_needs_no_engine_passes_the_docker_check(source):
    assert _needs_docker(source) == []


def test_the_marker_check_wants_the_module_to_say_it():
    assert _file_markers("pytestmark = pytest.mark.network\ndef test_x():\n    pass\n") == ({"network"}, [])
    assert _file_markers("@pytest.mark.skipif(True, reason='x')\ndef test_x():\n    pass\n") == (set(), [])
    names, (found,) = _file_markers("@pytest.mark.network\ndef test_x():\n    pass\n")
    assert names == {"network"} and "@pytest.mark.network on test_x" in found


def test_the_property_check_finds_a_property_run_inside_a_test():
    assert _properties("@given(st.text())\ndef test_a(s):\n    pass\n") == ["test_a"]
    assert _properties("def test_b(x):\n    @settings()\n    @given(st.data())\n    def prop(data):\n"
                       "        pass\n    prop()\n") == ["test_b"]
    assert _properties("@pytest.mark.parametrize('given', [1])\ndef test_c(given):\n    pass\n") == []


def test_the_folder_gives_the_docker_marker():
    """conftest's hook, on items from each folder: tests/docker/ and tests/builds/ get `docker`,
    a `whole` test gets it wherever it lies, the rest (and envbuild's doctests) do not."""
    def item(path, whole=False):
        added = []
        return SimpleNamespace(path=ROOT / path, added=added, add_marker=lambda m: added.append(m.name),
                               get_closest_marker=lambda name: whole if name == "whole" else None)

    items = {path: item(path) for path in ["tests/docker/test_x.py", "tests/builds/test_x.py", "tests/unit/test_x.py",
                                           "tests/property/test_x.py", "envbuild/plan/stack.py"]}
    items["whole"] = item("tests/behaviour/test_x_whole.py", whole=True)
    conftest.pytest_collection_modifyitems(list(items.values()))
    assert {k: v.added for k, v in items.items()} == {
        "tests/docker/test_x.py": ["docker"], "tests/builds/test_x.py": ["docker"], "tests/unit/test_x.py": [],
        "tests/property/test_x.py": [], "envbuild/plan/stack.py": [], "whole": ["docker"]}
