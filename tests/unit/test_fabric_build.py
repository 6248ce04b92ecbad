"""A fabric built from source is a data entry: the test fabric of tests/fixtures/fabric-build
(two tiny sources, one built by make and one by configure, a link, an export and a probe),
added to a copy of the fixture matrix, resolves and renders with no code that knows it; every
value of a build reaches the rendered step quoted, and a value outside its grammar is refused
at load (exit 2, the field named). tests/docker/test_fabric_build_docker.py builds it."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shlex
import shutil
import tarfile
from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, run_here
from envbuild.knowledge.matrix import load_matrix
from envbuild.plan import stack_plan
from envbuild.resolve.resolver import Request, resolve

FIXTURE = ROOT / "tests" / "fixtures" / "fabric-build"
SOURCES = ("libgreet", "greet-tool")
PORT = "127.0.0.1:8399"  # the port the fixture entry names; a test serving the sources replaces it


def source_tar(name: str) -> bytes:
    """The fixture source `name` as a tar stream made the same way every time (sorted, mtime 0,
    owner root, modes from the executable bit), so its sha256 is the entry's pin."""
    folder, raw = FIXTURE / name, io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in [folder, *sorted(folder.rglob("*"))]:
            rel = path.relative_to(folder).as_posix()
            info = tarfile.TarInfo(f"{name}-1.0" + ("" if rel == "." else f"/{rel}"))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                data = path.read_bytes()
                info.size, info.mode = len(data), 0o755 if os.access(path, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def write_sources(folder: Path) -> None:
    """The fixture sources as the .tar.gz files the entry's URLs name, into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        (folder / f"{name}-1.0.tar.gz").write_bytes(gzip.compress(source_tar(name), mtime=0))


def matrix_with_test_fabric(folder: Path, port: str = PORT, edit=lambda text: text) -> Path:
    """A copy of the fixture matrix with the test fabric appended to fabrics.yaml (its last list),
    its sources on `port`, `edit` applied to the entry."""
    shutil.copytree(FIXTURE_MATRIX, folder)
    entry = edit((FIXTURE / "fabric.yaml").read_text().replace(PORT, port))
    with open(folder / "fabrics.yaml", "a", encoding="utf-8") as f:
        f.write(entry)
    return folder


def fabric_steps(matrix_dir: Path):
    """The builder's fabric step and the runtime's install step of the test fabric's image."""
    plan = stack_plan(resolve(load_matrix(matrix_dir), Request(gpu="h20", fabric="greet", ds_ops="cpu_adam")))
    build = next(s for s in plan.builder.steps if s.name == "fabric")
    return plan, build, plan.runtime.after_copy[0]


def test_the_pins_are_the_sha256_of_the_fixture_sources_tar_streams():
    text = (FIXTURE / "fabric.yaml").read_text()
    for name in SOURCES:
        assert hashlib.sha256(source_tar(name)).hexdigest() in text, f"re-pin {name} in {FIXTURE / 'fabric.yaml'}"


def test_a_source_built_fabric_added_as_data_renders_with_no_code_change(tmp_path):
    matrix_dir = matrix_with_test_fabric(tmp_path / "m")
    plan, build, install = fabric_steps(matrix_dir)
    words = list(build.args)
    assert [words[i + 1] for i, w in enumerate(words) if w == "source"] == ["libgreet", "greet-tool"]
    # {prefix} and {prefix:libgreet} are filled in at render time, in the order the entry gives
    assert words[words.index("greet-tool"):].index("--with-greet=/opt/greet") > 0
    assert "LDFLAGS=-L/opt/greet/lib -Wl,-rpath,/opt/greet/lib" in words and "PREFIX=/opt/greet" in words
    assert ("define", "HAVE_LIBGREET") == tuple(words[words.index("define"):][:2])
    assert plan.runtime.from_builder[-2:] == ("/opt/greet", "/opt/greet-tool")
    assert install.args == ("/etc/ld.so.conf.d/000-greet.conf", "/opt/greet", "/opt/greet-tool")
    r = run_here("render", "--gpu", "h20", "--fabric", "greet", "--matrix-dir", str(matrix_dir), "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    dockerfile = (tmp_path / "o" / "Dockerfile").read_text()
    assert f"bash /opt/envbuild-setup/fabric.sh {shlex.join(words)}\n" in dockerfile
    assert "'LDFLAGS=-L/opt/greet/lib -Wl,-rpath,/opt/greet/lib'" in dockerfile  # one word, quoted
    assert "COPY --from=builder /opt/greet-tool /opt/greet-tool" in dockerfile


OPTIONS = 'options: ["--with-greet={prefix:libgreet}",'


@pytest.mark.parametrize("old, new, field, said", [
    (OPTIONS, 'options: ["--with-greet=/x; id",', "sources[1] (greet-tool).options", "';' would be shell code"),
    (OPTIONS, 'options: ["--x=$(id)",', "sources[1] (greet-tool).options", "'$' '(' ')' would be shell code"),
    (OPTIONS, 'options: ["--x=a\\nRUN id",', "sources[1] (greet-tool).options", "control character '\\n'"),
    (OPTIONS, 'options: ["--x=`id`",', "sources[1] (greet-tool).options", "'`' would be shell code"),
    (OPTIONS, 'options: ["--x={home}",', "sources[1] (greet-tool).options", "unknown placeholder {home}"),
    (f'"http://{PORT}/libgreet', '"ftp://mirror/libgreet', "sources[0] (libgreet).url", "expected an https URL"),
    (f'"http://{PORT}/libgreet', '"http://example.com/libgreet', "sources[0] (libgreet).url", "expected an https URL"),
    ("after: [libgreet]", "after: []", "build", "names a source not in its `after`"),
    ("build: make", "build: bazel", "sources[0] (libgreet).build", "'autotools', 'cmake' or 'make'"),
    ("drop: [/opt/greet/include]", "drop: [/etc]", "build", "'/etc' is not inside a source's prefix"),
    ("- run: /opt/greet-tool/bin/greet fabric", "- run: greet; id", "probes[1].run", "absolute path"),
    ('to: "/opt/greet/lib/libgreet.so.[0-9]*"', 'to: "$(id)"', "links[0].to", "expected an absolute glob"),
    ('to: "/opt/greet/lib/libgreet.so.[0-9]*"', 'to: "{prefix}/lib/x"', "links[0].to", "the one placeholder"),
    ("name: HAVE_LIBGREET", "name: HAVE LIBGREET", ").name", "expected a C identifier"),
])
def test_a_build_value_outside_its_grammar_is_refused_at_load_naming_the_field(tmp_path, old, new, field, said):
    """A lab's fabrics.yaml is input: a configure flag, URL, path or glob that a shell would read
    as code, or that names what is not declared, stops every command at load, before anything
    is rendered."""
    def edit(text: str) -> str:
        assert old in text
        return text.replace(old, new, 1)

    matrix_dir = matrix_with_test_fabric(tmp_path / "m", edit=edit)
    r = run_here("render", "--gpu", "h20", "--matrix-dir", str(matrix_dir), "-o", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert "fabrics[4] (greet-fabric).build" in r.stderr and field in r.stderr and said in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()
