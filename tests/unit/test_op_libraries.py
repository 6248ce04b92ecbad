"""Torch op libraries (extensions.yaml `op_libraries`): a .so that registers its ops with
TORCH_LIBRARY and defines no PyInit_* (xformers/_C.so) cannot be imported, however sound it is,
and its package only warns when it does not load; the build's check and the smoke test load it
with torch.ops.load_library instead. torch is not installed on this host: a stand-in `torch`
whose ops.load_library is what torch's does (ctypes.CDLL, its OSError wrapped around the
loader's) loads a real shared library compiled here with gcc; in the image the real torch runs
the same code."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, build_step
from envbuild.base.errors import EnvbuildError
from envbuild.image import children
from envbuild.knowledge.matrix import load_matrix

BUILD_PYTHON = ROOT / "envbuild" / "buildsteps"
if str(BUILD_PYTHON) not in sys.path:
    sys.path.insert(0, str(BUILD_PYTHON))  # the build step imports sass_audit from beside it
import sass_audit  # noqa: E402  (a build step script: stdlib only)

XFORMERS_C = ROOT / "tests" / "fixtures" / "extensions" / "wheels" / "xformers-0.0.35" / "_C.dynamic.so"

# torch/_ops.py's load_library: ctypes.CDLL(path), its error re-raised as an OSError naming the path
FAKE_TORCH = '''import ctypes


class _Ops:
    def load_library(self, path):
        try:
            ctypes.CDLL(path)
        except Exception as e:
            raise OSError(f"Could not load this library: {path}") from e


ops = _Ops()
'''
# what a TORCH_LIBRARY block compiles to: a static initializer that registers, no PyInit_*
OP_LIBRARY_C = "static int registered;\n__attribute__((constructor)) static void add(void) { registered = 1; }\n" \
               "int fakeop_registered(void) { return registered; }\n"


def _gcc(source: str, out: Path, *flags: str) -> None:
    c = out.with_suffix(".c")
    c.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(c), *flags], check=True)
    c.unlink()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages holding distribution fakeop 1.0: a package, its torch op library _C.so
    (compiled here), a library _broken.so whose NEEDED library is gone, and a RECORD with their
    hashes; the stand-in torch beside it. Both are on sys.path and on the children's PYTHONPATH."""
    if not shutil.which("gcc"):
        pytest.skip("no gcc here to compile a shared library")
    site, fake = tmp_path / "site", tmp_path / "faketorch"
    (site / "fakeop").mkdir(parents=True)
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (site / "fakeop" / "__init__.py").write_text("")
    _gcc(OP_LIBRARY_C, site / "fakeop" / "_C.so")
    _gcc("int gone(void) { return 1; }\n", tmp_path / "libgone.so")
    _gcc("int gone(void);\nint broken(void) { return gone(); }\n", site / "fakeop" / "_broken.so",
         f"-L{tmp_path}", "-lgone")
    (tmp_path / "libgone.so").unlink()  # the loader cannot find what _broken.so needs
    info = site / "fakeop-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeop\nVersion: 1.0\n")
    record = []
    for rel in ("fakeop/__init__.py", "fakeop/_C.so", "fakeop/_broken.so"):
        digest = base64.urlsafe_b64encode(hashlib.sha256((site / rel).read_bytes()).digest()).rstrip(b"=").decode()
        record.append(f"{rel},sha256={digest},{(site / rel).stat().st_size}")
    (info / "RECORD").write_text("\n".join([*record, "fakeop-1.0.dist-info/METADATA,,", "fakeop-1.0.dist-info/RECORD,,"]) + "\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", f"{fake}:{site}")
    for name in ("fakeop", "fakeop._C"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location("torch", fake / "torch" / "__init__.py")
    torch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch)
    monkeypatch.setitem(sys.modules, "torch", torch)  # the smoke test runs in-process
    return site


def _entry(**changes) -> dict:
    return {"name": "fakeop", "version": "1.0", "packages": ["fakeop"], "modules": [],
            "op_libraries": ["fakeop/_C.so"], **changes}


# ---------------------------------------------------------------- the build's check


def test_an_op_library_fails_an_import_and_the_build_loads_it_with_torch_ops_load_library(site, capsys):
    """The catalogue's old xformers entry (`modules: [xformers._C]`) made the build import the op
    library: it fails with no PyInit__C although the library loads; `op_libraries` loads it."""
    step = build_step("extensions.py")
    assert "PyInit" not in " ".join(sass_audit.elf_dynamic(site / "fakeop" / "_C.so")[2])
    with pytest.raises(SystemExit):
        step.check_imports(_entry(modules=["fakeop._C"], op_libraries=[]))
    err = capsys.readouterr().err
    assert "fakeop: `import fakeop._C` failed: ImportError: dynamic module does not define module export function (PyInit__C)" in err
    checks = step.import_checks(_entry())
    assert [what for what, _, _ in checks] == ["import fakeop", "torch.ops.load_library(fakeop/_C.so)"]
    assert checks[1][2] == [str(site / "fakeop" / "_C.so")]
    step.check_imports(_entry())
    assert "fakeop: torch.ops.load_library(fakeop/_C.so) OK" in capsys.readouterr().err


def test_an_op_library_that_does_not_load_fails_the_build_naming_it_and_the_loaders_error(site, capsys):
    step = build_step("extensions.py")
    with pytest.raises(SystemExit):
        step.check_imports(_entry(op_libraries=["fakeop/_broken.so"]))
    err = capsys.readouterr().err
    assert "fakeop: `torch.ops.load_library(fakeop/_broken.so)` failed: OSError: Could not load this library" in err
    assert "libgone.so: cannot open shared object file" in err


def test_a_catalogue_entry_naming_a_missing_op_library_fails_the_build_naming_it(site, capsys):
    step = build_step("extensions.py")
    with pytest.raises(SystemExit):
        step.check_imports(_entry(op_libraries=["fakeop/_D.so"]))
    err = capsys.readouterr().err
    assert f"fakeop: its torch op library fakeop/_D.so is not installed (no {site / 'fakeop' / '_D.so'})" in err


# ---------------------------------------------------------------- the smoke test


def test_the_smoke_test_imports_modules_and_loads_op_libraries(site):
    old = children._import_extension(_entry(modules=["fakeop._C"], op_libraries=[]))
    assert not old["ok"] and "PyInit__C" in old["detail"], old
    assert children._import_extension(_entry())["ok"], children._import_extension(_entry())
    missing = children._import_extension(_entry(op_libraries=["fakeop/_D.so"]))
    assert not missing["ok"] and missing["detail"] == f"torch op library fakeop/_D.so is not installed (no {site / 'fakeop' / '_D.so'})"
    broken = children._import_extension(_entry(op_libraries=["fakeop/_broken.so"]))
    assert not broken["ok"] and broken["detail"].startswith("torch.ops.load_library(fakeop/_broken.so) failed: OSError: ")
    assert "libgone.so: cannot open shared object file" in broken["detail"]


def test_an_op_library_replaced_after_install_is_named_by_the_smoke_test(site):
    """With no compiled module left (xformers), the RECORD comparison still covers its .so."""
    (site / "fakeop" / "_C.so").write_bytes((site / "fakeop" / "_C.so").read_bytes() + b"\0")
    result = children._import_extension(_entry())
    assert not result["ok"] and "fakeop/_C.so differs from the wheel's RECORD" in result["detail"], result


# ---------------------------------------------------------------- the catalogue


def test_xformers_c_is_declared_an_op_library_not_a_module(matrix, production_matrix):
    """The PyPI wheel's xformers/_C.so (its dynamic symbols, tests/fixtures/extensions/wheels/)
    defines no PyInit__C: `import xformers._C` cannot pass, so it is an op library, and no
    extension imports an op library it declares."""
    assert not [s for s in sass_audit.elf_dynamic(XFORMERS_C)[2] if s.startswith("PyInit")]
    for m in (matrix, production_matrix):
        xformers = m.extension("xformers")
        assert xformers.op_libraries == ["xformers/_C.so"] and "xformers._C" not in xformers.modules
        for ext in m.extensions.values():
            dotted = {lib.removesuffix(".so").replace("/", ".") for lib in ext.op_libraries}
            assert not dotted & {*ext.modules, *ext.packages}, ext.name


@pytest.mark.parametrize("bad", ["/usr/lib/x.so", "../x.so", "xformers/../../x.so", "xformers/_C.py",
                                 "xformers/_C.so;rm -rf /", "xformers\\_C.so", "", "xformers/.hidden.so"])
def test_an_op_library_outside_site_packages_or_not_a_library_is_refused(matrix_copy, bad):
    path = matrix_copy / "extensions.yaml"
    data = yaml.safe_load(path.read_text())
    next(e for e in data["extensions"] if e["name"] == "xformers")["op_libraries"] = [bad]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "op_libraries" in str(e.value) and "relative to site-packages" in str(e.value)


def test_a_module_that_is_an_op_library_is_refused_naming_both(matrix_copy):
    """The catalogue's old xformers entry, `modules: [xformers._C]`, beside its op library."""
    path = matrix_copy / "extensions.yaml"
    data = yaml.safe_load(path.read_text())
    next(e for e in data["extensions"] if e["name"] == "xformers")["modules"] = ["xformers._C"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "xformers: modules names xformers._C, which op_libraries loads as xformers/_C.so" in str(e.value)
