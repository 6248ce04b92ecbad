"""The in-image smoke test: the envbuild.image package (envbuild_image inside images).

torch and DeepSpeed exist only inside the images; these tests run on a host without them, so
they cover the package's pure logic and its subprocess machinery (children that hang or die
before importing torch: tests/process/test_smoke_script_hangs.py). The script is run from a rendered build directory, laid out
exactly as the image holds it (smoke.py + lib/envbuild_image).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, alarm_deadline
from envbuild.image import arch, checks, cli, collectives, manifest as manifest_mod, nccl, paths, report, sandbox, versions
from envbuild.render.builddir import render_files, write_build_dir
from envbuild.resolve.resolver import Request, resolve

HAS_TORCH = importlib.util.find_spec("torch") is not None

GOOD_MANIFEST = {
    "tag": "t-h100", "python": "3.11", "torch": "2.11.0", "cuda": "13.0", "deepspeed": "0.19.8",
    "nccl": "2.28.9", "ds_ops": ["cpu_adam", "fused_adam"], "torch_cuda_arch_list": "9.0",
    "env": {"NCCL_P2P_DISABLE": "1"}, "toolchain_kept": False, "gpu": "h100",
}


@pytest.fixture(scope="module")
def build_dir(matrix, tmp_path_factory):
    """A rendered build directory: envbuild/smoke.py and envbuild/lib/envbuild_image as in the image."""
    return write_build_dir(render_files(resolve(matrix, Request(gpu="h20"))), tmp_path_factory.mktemp("b") / "out")


def run_script(build_dir, *args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ENVBUILD_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(build_dir / "envbuild" / "smoke.py"), *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=build_dir)


def write_manifest(tmp_path, **changes):
    data = {**GOOD_MANIFEST, **changes}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data))
    return path


def args_ns(**kw):
    base = dict(timeout=3.0, nproc=2, size_mb=1.0, accelerator="cuda", json=True)
    return SimpleNamespace(**{**base, **kw})


# --------------------------------------------------------------------------- package layout
def test_build_dir_holds_the_package_as_the_image_does(build_dir):
    lib = build_dir / "envbuild" / "lib" / paths.PACKAGE
    shipped = sorted(p.name for p in lib.iterdir())
    source = ROOT / "envbuild" / "image"
    assert shipped == sorted(p.name for p in source.glob("*.py"))
    assert {"cli.py", "node.py", "arch.py", "paths.py", "__main__.py"} <= set(shipped)
    for name in shipped:
        assert (lib / name).read_bytes() == (source / name).read_bytes()
    dockerfile = (build_dir / "Dockerfile").read_text()
    assert f"COPY envbuild/lib/{paths.PACKAGE} {paths.LIB}/{paths.PACKAGE}\n" in dockerfile  # the whole directory
    standalone = (build_dir / "Singularity.standalone.def").read_text()
    assert f"envbuild/lib/{paths.PACKAGE} {paths.LIB}/{paths.PACKAGE}\n" in standalone
    assert f"exec {paths.VENV_PYTHON} {paths.SMOKE}" in (build_dir / "Singularity.def").read_text()


def test_package_imports_with_the_standard_library_alone(build_dir):
    """Every module of the in-image package, imported under its in-image name in an isolated
    interpreter (no site-packages, no checkout on sys.path): only stdlib modules get loaded."""
    lib = build_dir / "envbuild" / "lib"
    code = f"""
import importlib, json, sys
sys.path[:0] = [{str(lib)!r}]
before = set(sys.modules)
for name in {sorted(p.stem for p in (lib / paths.PACKAGE).glob('*.py') if p.stem != '__main__')!r}:
    importlib.import_module({paths.PACKAGE!r} + ("" if name == "__init__" else "." + name))
new = sorted({{m.split(".")[0] for m in set(sys.modules) - before}})
print(json.dumps([m for m in new if m not in sys.stdlib_module_names and m != {paths.PACKAGE!r}]))
"""
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, cwd=build_dir)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_package_is_valid_for_the_oldest_python_in_the_matrix(matrix):
    """The package runs on every stack's Python: its grammar must be the oldest one's."""
    import ast

    oldest = min(tuple(int(x) for x in s.python.split(".")) for s in matrix.stacks)
    for module in (ROOT / "envbuild" / "image").glob("*.py"):
        ast.parse(module.read_text(), filename=str(module), feature_version=oldest)
    ast.parse((ROOT / "templates" / "files" / "smoke.py").read_text(), feature_version=oldest)


def test_python_dash_m_runs_the_same_program(build_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", paths.PACKAGE, "--manifest", str(tmp_path / "absent.json")],
                       env={**os.environ, "PYTHONPATH": str(build_dir / "envbuild" / "lib")},
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "manifest not found" in r.stderr


# --------------------------------------------------------------------------- manifest
def test_manifest_missing_is_usage_error(tmp_path):
    with pytest.raises(manifest_mod.UsageError, match="manifest not found"):
        manifest_mod.load_manifest(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read manifest"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"python": "3.11", "cuda": "13.0", "deepspeed": "0.19.8", "ds_ops": []}), "lacks keys: torch"),
])
def test_manifest_malformed_is_usage_error(tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(manifest_mod.UsageError, match=message):
        manifest_mod.load_manifest(str(path))


def test_manifest_valid_loads_and_path_precedence(tmp_path):
    assert manifest_mod.load_manifest(str(write_manifest(tmp_path)))["ds_ops"] == ["cpu_adam", "fused_adam"]
    assert manifest_mod.manifest_path("/x.json", {paths.MANIFEST_ENV: "/y.json"}) == "/x.json"
    assert manifest_mod.manifest_path(None, {paths.MANIFEST_ENV: "/y.json"}) == "/y.json"
    assert manifest_mod.manifest_path(None, {}) == paths.MANIFEST == "/opt/envbuild/manifest.json"


def test_cli_missing_manifest_exits_2_with_message(build_dir, tmp_path):
    r = run_script(build_dir, "--manifest", str(tmp_path / "absent.json"))
    assert r.returncode == 2
    assert "manifest not found" in r.stderr and "absent.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_missing_manifest_json_mode_prints_one_object(build_dir, tmp_path):
    r = run_script(build_dir, "--json", env={"ENVBUILD_MANIFEST": str(tmp_path / "from-env.json")})
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and "from-env.json" in doc["error"]


def test_cli_bad_flag_exits_2(build_dir):
    assert run_script(build_dir, "--no-such-flag").returncode == 2


# --------------------------------------------------------------------------- versions
@pytest.mark.parametrize("raw, norm", [
    ("2.11.0+cu130", "2.11.0"), ("0.19.8+4f2a1b", "0.19.8"), ((2, 28, 9), "2.28.9"), (" 13.0 ", "13.0"),
])
def test_normalize_version(raw, norm):
    assert versions.normalize_version(raw) == norm


@pytest.mark.parametrize("expected, actual, ok", [
    ("2.11.0", "2.11.0+cu130", True),
    ("2.11.0", "2.11.1", False),
    ("2.99.0", "2.13.0+cpu", False),
    ("3.11", "3.11.7", True),
    ("3.11.7", "3.11", False),
    ("0.19.8", "0.19.80", False),
    ("2.28.9", (2, 28, 9), True),
    ("2.28.9", None, False),
])
def test_version_matches(expected, actual, ok):
    assert versions.version_matches(expected, actual) is ok


def test_major_minor():
    assert versions.major_minor("13.0.2") == "13.0"
    assert versions.major_minor("12.8") == "12.8"
    assert versions.major_minor("3.11.7") != "3.1"


@pytest.mark.parametrize("have, floor, older", [
    ("535.104.05", "580.65.06", True),
    ("580.65.06", "580.65.06", False),
    ("580.82.07", "580.65.06", False),
    ("580.65.5", "580.65.06", True),      # '06' is 6: numeric, not text (and not octal)
    ("550.40.07", "550.40.7", False),
    ("384.98", "384.98.0", False),        # missing parts are 0
    ("1000.1", "999.99.99", False),       # 1000 > 999 as numbers, '1000' < '999' as text
])
def test_older_than_compares_numerically(have, floor, older):
    assert versions.older_than(have, floor) is older


# --------------------------------------------------------------------------- GPU arch list (one definition)
def test_parse_arch_list():
    assert arch.parse_arch_list("8.0;9.0+PTX") == [(8, 0, False), (9, 0, True)]
    assert arch.parse_arch_list("7.5 8.0  12.0+ptx") == [(7, 5, False), (8, 0, False), (12, 0, True)]
    assert arch.parse_arch_list("") == []


@pytest.mark.parametrize("cc, arch_list, ok", [
    ("9.0", "9.0", True),
    ("9.0", "8.0;9.0", True),
    ("8.6", "8.0;9.0", True),           # sm_80 SASS runs on 8.6 (same major)
    ("8.0", "8.6;9.0", False),          # sm_86 SASS cannot run on 8.0
    ("8.0", "9.0", False),
    ("9.0", "8.0+PTX", True),           # PTX for an older arch is JIT-ed by the driver
    ("10.0", "8.0;9.0+PTX", True),
    ("8.6", "9.0+PTX", False),          # PTX for a newer arch cannot run
    ("12.0", "8.0 9.0 10.0", False),
    ("9.0", "9.0a", True),
])
def test_arch_runs_on(cc, arch_list, ok):
    assert arch.arch_runs_on(cc, arch_list) is ok


def test_rules_use_the_in_image_arch_rule():
    """One definition: the resolver's gpu-arch rule is the smoke test's function."""
    from envbuild.knowledge import rules
    assert rules.arch_runs_on is arch.arch_runs_on


# --------------------------------------------------------------------------- bandwidth
def test_bus_bandwidth_matches_nccl_tests():
    bw = collectives.bus_bandwidth
    assert bw("all_reduce", 1e9, 1.0, 8) == pytest.approx(1.75)
    assert bw("all_gather", 1e9, 1.0, 8) == pytest.approx(0.875)
    assert bw("all_reduce", 64 * 2**20, 0.5, 2) == pytest.approx(64 * 2**20 / 0.5 / 1e9)
    assert bw("all_reduce", 1e9, 1.0, 1) == 0.0
    assert bw("all_gather", 1e9, 0.0, 8) == 0.0


# --------------------------------------------------------------------------- report shape
def test_run_check_turns_exceptions_into_failed_checks():
    def boom():
        raise ValueError("boom")

    def leave():
        raise SystemExit(3)

    c = report.run_check("x", boom)
    assert c == {"name": "x", "ok": False, "detail": "ValueError: boom", "seconds": c["seconds"]}
    assert isinstance(c["seconds"], float)
    assert report.run_check("y", leave)["ok"] is False
    assert report.run_check("z", lambda: (True, "fine", 1.23456)) == \
        {"name": "z", "ok": True, "detail": "fine", "seconds": 1.235}


def test_run_check_carries_data_and_skips():
    c = report.run_check("p2p", lambda: (True, "fine", None, {"busbw": 1.5}))
    assert c["data"] == {"busbw": 1.5} and c["ok"] is True and "skipped" not in c
    s = report.run_check("driver", lambda: report.Skipped("CPU mode", {"driver": None}))
    assert s["ok"] is True and s["skipped"] is True and s["detail"] == "skipped: CPU mode"
    assert s["data"] == {"driver": None}
    assert [report.status_word(x) for x in (c, s, {"ok": False})] == ["ok", "skip", "FAIL"]


def test_report_json_shape_and_exit_codes():
    good = [report.run_check("a", lambda: (True, "ok")), report.run_check("b", lambda: (True, "ok"))]
    rep = report.build_report(GOOD_MANIFEST, "gpu", good, "/opt/envbuild/manifest.json")
    doc = json.loads(json.dumps(rep))
    assert set(doc) == {"ok", "mode", "image", "checks"}
    assert doc["ok"] is True and doc["mode"] == "gpu"
    assert doc["image"]["tag"] == "t-h100" and doc["image"]["gpu"] == "h100"
    assert all(set(c) == {"name", "ok", "detail", "seconds"} for c in doc["checks"])
    assert report.exit_code(rep) == 0

    bad = good + [report.run_check("c", lambda: (False, "broken"))]
    rep = report.build_report(GOOD_MANIFEST, "cpu", bad)
    assert rep["ok"] is False and report.exit_code(rep) == 1
    assert report.exit_code(report.build_report(GOOD_MANIFEST, "cpu", [])) == 1


def test_render_text_is_an_aligned_table():
    rows = [{"name": "versions", "ok": True, "detail": "all pinned", "seconds": 1.5},
            {"name": "collectives", "ok": False, "detail": "timed out", "seconds": 120.0},
            {"name": "p2p", "ok": True, "skipped": True, "detail": "skipped: CPU mode", "seconds": 0.0}]
    text = report.render_text(report.build_report(GOOD_MANIFEST, "cpu", rows))
    lines = text.splitlines()
    assert "t-h100" in lines[0] and "mode=cpu" in lines[0]
    assert lines[1].index("ok") == lines[2].index("FAIL") == lines[3].index("skip")
    assert lines[1].index("all pinned") == lines[2].index("timed out") == lines[3].index("skipped: CPU mode")
    assert lines[-1] == "RESULT: FAILED"


# --------------------------------------------------------------------------- compilers, env
def make_exe(directory: Path, name: str, executable: bool = True) -> Path:
    directory.mkdir(exist_ok=True)
    p = directory / name
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755 if executable else 0o644)
    return p


def test_compilers_found_fail_the_check(tmp_path):
    nvcc = make_exe(tmp_path / "bin", "nvcc")
    ok, detail = checks.check_compilers({"toolchain_kept": False}, path=str(tmp_path / "bin"))
    assert ok is False and f"nvcc={nvcc}" in detail


def test_compilers_default_path_is_the_environment(tmp_path, monkeypatch):
    make_exe(tmp_path / "bin", "ninja")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    ok, detail = checks.check_compilers({})
    assert ok is False and "ninja=" in detail


def test_compilers_absent_or_not_executable_pass(tmp_path):
    make_exe(tmp_path / "bin", "gcc", executable=False)
    ok, detail = checks.check_compilers({"toolchain_kept": False}, path=str(tmp_path / "bin"))
    assert ok is True and "none of" in detail


def test_a_c_compiler_is_expected_for_torch_compile_but_never_ninja_or_nvcc(tmp_path):
    """Default images carry g++ for torch.compile (manifest runtime_compiler); ninja or nvcc
    would let a DeepSpeed op JIT-compile, so either one still fails the check."""
    make_exe(tmp_path / "bin", "g++")
    ok, detail = checks.check_compilers({"runtime_compiler": True}, path=str(tmp_path / "bin"))
    assert ok is True and "C compiler for torch.compile: g++=" in detail
    assert checks.check_compilers({"runtime_compiler": False}, path=str(tmp_path / "bin"))[0] is False
    make_exe(tmp_path / "bin", "ninja")
    ok, detail = checks.check_compilers({"runtime_compiler": True}, path=str(tmp_path / "bin"))
    assert ok is False and "ninja=" in detail and "JIT" in detail
    ok, detail = checks.check_compilers({"runtime_compiler": True}, path=str(tmp_path / "empty"))
    assert ok is False and "torch.compile cannot run" in detail


def test_torch_compile_check_reads_the_child_and_skips_without_a_compiler():
    """The child's outcome per device decides; an image built with --no-compiler skips."""
    from envbuild.image.report import Skipped

    assert isinstance(checks.check_torch_compile({"runtime_compiler": False}, dict), Skipped)
    good = {"state": "done", "rc": 0, "cpu": {"ok": True, "error": 0.0, "seconds": 3.2,
                                              "isa": "Inductor asimd, ATen DEFAULT"}}
    ok, detail = checks.check_torch_compile({"runtime_compiler": True}, lambda: good)
    assert (ok, detail) == (True, "cpu ok, max error 0.0e+00, 3.2s (Inductor asimd, ATen DEFAULT)")
    bad = {"state": "done", "rc": 0, "cpu": {"ok": False, "detail": "InductorError: Failed to find C compiler",
                                             "seconds": 1.0}}
    ok, detail = checks.check_torch_compile({"runtime_compiler": True}, lambda: bad)
    assert ok is False and "Failed to find C compiler" in detail
    ok, detail = checks.check_torch_compile({"runtime_compiler": True}, lambda: {"state": "timeout", "log": "x"})
    assert ok is False and "hard timeout" in detail


def test_compilers_allowed_when_toolchain_kept(tmp_path):
    make_exe(tmp_path / "bin", "g++")
    ok, detail = checks.check_compilers({"toolchain_kept": True}, path=str(tmp_path / "bin"))
    assert ok is True and "g++=" in detail


def test_env_check():
    manifest = {"env": {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "PATH": f"/opt/venv/bin:{paths.SYSTEM_PATH}"}}
    ok, detail = checks.check_env(manifest, {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
                                             "PATH": "/opt/venv/bin:/opt/venv/bin:/host/bin",
                                             "TORCH_EXTENSIONS_DIR": "/tmp/te-42"})
    assert ok is True and "TORCH_EXTENSIONS_DIR=/tmp/te-42" in detail and "overridden" not in detail
    ok, detail = checks.check_env(manifest, {"NCCL_P2P_DISABLE": "0", "PATH": "/opt/venv/bin"})
    assert ok is False
    assert "NCCL_NVLS_ENABLE missing" in detail and "overridden: NCCL_P2P_DISABLE='0'" in detail
    assert "TORCH_EXTENSIONS_DIR=(unset)" in detail
    ok, detail = checks.check_env(manifest, {"NCCL_P2P_DISABLE": "0", "NCCL_NVLS_ENABLE": "0", "PATH": "/usr/bin"})
    assert ok is False and "PATH does not start with /opt/venv/bin" in detail
    assert checks.check_env({"env": {}}, {})[0] is True


def test_env_check_needs_every_image_path_entry_in_order():
    """--keep-toolchain: a PATH that lost the kept nvcc directory fails (it used to pass:
    only the first entry was checked)."""
    kept = {"env": {"PATH": f"/opt/venv/bin:/usr/local/cuda/bin:{paths.SYSTEM_PATH}"}}
    assert checks.check_env(kept, {"PATH": "/opt/venv/bin:/usr/local/cuda/bin:/host/bin"})[0] is True
    ok, detail = checks.check_env(kept, {"PATH": "/opt/venv/bin:/usr/bin:/bin"})
    assert ok is False and "PATH does not start with /opt/venv/bin:/usr/local/cuda/bin" in detail


# --------------------------------------------------------------------------- no-JIT sandbox
def test_planted_locks_and_write_detection(tmp_path):
    root = tmp_path / "te"
    root.mkdir()
    planted = sandbox.plant_stale_locks(str(root), ["cpu_adam", "fused_adam"])
    assert planted == {"cpu_adam", "cpu_adam/lock", "fused_adam", "fused_adam/lock"}
    assert (root / "cpu_adam" / "lock").is_file()
    assert stat.S_IMODE(root.stat().st_mode) == 0o555
    assert sandbox.tree_entries(str(root)) == planted
    for d in (root, root / "cpu_adam"):
        d.chmod(0o755)  # what root could do regardless of modes: a JIT build writing
    (root / "cpu_adam" / "build.ninja").write_text("")
    assert sandbox.tree_entries(str(root)) - planted == {"cpu_adam/build.ninja"}
    sandbox.make_writable(str(root))


def fake_child(state="done", rc=0, ops=None, adam=None, extra=()):
    return {"state": state, "rc": rc, "ops": ops or {}, "adam": adam, "extra": list(extra), "log": "log tail"}


OK_OP = {"ok": True, "detail": "", "seconds": 0.01}


def test_no_jit_all_loaded():
    ok, detail = checks.check_no_jit(fake_child(ops={"cpu_adam": OK_OP, "utils": OK_OP}), ["cpu_adam", "utils"], 120)
    assert ok is True and "cpu_adam ok" in detail and "utils ok" in detail


def test_no_jit_failed_op_is_reported():
    bad = {"ok": False, "detail": "RuntimeError: JIT compile attempted", "seconds": 0.2}
    ok, detail = checks.check_no_jit(fake_child(ops={"cpu_adam": OK_OP, "fused_lamb": bad}),
                                     ["cpu_adam", "fused_lamb"], 120)
    assert ok is False and "fused_lamb FAILED" in detail and "JIT compile attempted" in detail


def test_no_jit_says_why_an_op_was_not_loaded_on_a_host_without_the_driver():
    deferred = {"ok": True, "detail": "not loaded here: it links the GPU driver's libcuda.so.1", "seconds": 0.1}
    ok, detail = checks.check_no_jit(fake_child(ops={"cpu_adam": OK_OP, "async_io": deferred}),
                                     ["cpu_adam", "async_io"], 120)
    assert ok is True and "async_io ok 0.100s (not loaded here: it links the GPU driver's libcuda.so.1)" in detail


@pytest.fixture
def driver_linked_op(tmp_path):
    """A real shared object linked as async_io is: -lcuda against an empty stub with the driver's
    soname (what cuda-toolkit.sh makes), plus a second library when asked."""
    from envbuild.image import children

    def build(also: str = ""):
        stubs = tmp_path / "stubs"
        stubs.mkdir(exist_ok=True)
        for soname in ("libcuda.so.1", *([also] if also else [])):
            name = soname.split(".so")[0] + ".so"
            subprocess.run(["gcc", "-shared", "-nostdlib", f"-Wl,-soname,{soname}", "-o", str(stubs / name),
                            "-x", "c", "/dev/null"], check=True)
        op = tmp_path / "op.so"
        (tmp_path / "op.c").write_text("int op(void) { return 1; }\n")
        libs = ["-lcuda"] + ([f"-l{also.split('.so')[0][3:]}"] if also else [])
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,--no-as-needed", "-o", str(op), str(tmp_path / "op.c"),
                        f"-L{stubs}", *libs], check=True)
        return str(op)
    return children, build


def test_ldd_names_the_driver_as_the_only_missing_library(driver_linked_op):
    """No driver here: the op's only missing library is libcuda.so.1, so the smoke test may defer
    its load to a GPU node; a second missing library is the op's own fault and is named."""
    children, build = driver_linked_op
    if os.path.exists("/usr/lib/x86_64-linux-gnu/libcuda.so.1") or not shutil.which("gcc"):
        pytest.skip("this host has the NVIDIA driver's libcuda.so.1, or no gcc")
    assert children.missing_libraries(build()) == {"libcuda.so.1"}
    assert children.missing_libraries(build("libmissing.so.7")) == {"libcuda.so.1", "libmissing.so.7"}
    assert children.missing_libraries("/nonexistent.so") == set()


def test_an_op_is_deferred_only_when_the_driver_is_all_it_misses(driver_linked_op, tmp_path, monkeypatch):
    """driver_only_failure finds the op's module file as Python would (no import), asks ldd, and
    defers only a libcuda.so.1 error whose library misses nothing else."""
    children, build = driver_linked_op
    if os.path.exists("/usr/lib/x86_64-linux-gnu/libcuda.so.1") or not shutil.which("gcc"):
        pytest.skip("this host has the NVIDIA driver's libcuda.so.1, or no gcc")
    mods = tmp_path / "mods"
    mods.mkdir()
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.setattr(children, "find_builder", lambda op: SimpleNamespace(absolute_name=lambda: f"{op}_mod"))
    error = ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")
    os.replace(build(), mods / "clean_mod.so")
    assert "only missing library" in children.driver_only_failure("clean", error)
    os.replace(build("libmissing.so.7"), mods / "broken_mod.so")
    assert children.driver_only_failure("broken", error) == ""  # libmissing.so.7 is the op's own fault
    assert children.driver_only_failure("clean", OSError("libaio.so.1: cannot open shared object file")) == ""


def test_no_jit_timeout_names_field_report_and_stuck_op():
    ok, detail = checks.check_no_jit(fake_child(state="timeout", rc=None, ops={"cpu_adam": OK_OP}),
                                     ["cpu_adam", "fused_adam"], 120)
    assert ok is False and checks.JIT_HANG_MSG in detail and "stuck on fused_adam" in detail


def test_no_jit_write_into_extensions_dir_fails():
    ok, detail = checks.check_no_jit(fake_child(ops={"cpu_adam": OK_OP}, extra=["cpu_adam/build.ninja"]),
                                     ["cpu_adam"], 120)
    assert ok is False and "build.ninja" in detail


def test_no_jit_crashed_child_fails():
    ok, detail = checks.check_no_jit(fake_child(rc=1, ops={}), ["cpu_adam"], 120)
    assert ok is False and "exited 1" in detail and "log tail" in detail


def test_cpu_adam_tolerance():
    assert checks.check_cpu_adam({"adam": {"ok": True, "max_abs_diff": 6e-8, "seconds": 0.1}})[0] is True
    assert checks.check_cpu_adam({"adam": {"ok": True, "max_abs_diff": 2e-5, "seconds": 0.1}})[0] is False
    assert checks.check_cpu_adam({"state": "timeout", "rc": None})[0] is False


@pytest.mark.parametrize("op, label", [("fused_adam", "FusedAdam - torch.optim.Adam"),
                                       ("fused_lamb", "FusedLamb - LAMB in torch"),
                                       ("fused_lion", "FusedLion - Lion in torch")])
def test_gpu_optimizer_numerics_verdict(op, label):
    ok = {op: {"ok": True, "detail": "", "seconds": 0.1, "max_abs_diff": 1e-9}}
    bad = {op: {"ok": True, "detail": "", "seconds": 0.1, "max_abs_diff": 0.5}}
    assert checks.check_gpu_optimizer(ok, op)[0] is True and label in checks.check_gpu_optimizer(ok, op)[1]
    assert checks.check_gpu_optimizer(bad, op)[0] is False
    assert checks.check_gpu_optimizer({"state": "hung", "rc": None}, op)[0] is False


# --------------------------------------------------------------------------- real subprocesses (hangs: tests/process)
@pytest.fixture
def guard():
    """Fail (not hang) if the package's own deadline is broken; the test then kills what it left."""
    with alarm_deadline(30, "the smoke test ignored its own timeout"):
        yield


def test_children_run_the_package_cli_by_import():
    argv = sandbox.self_command("--child", "ops")
    assert argv[:3] == [sys.executable, "-u", "-c"] and argv[-2:] == ["--child", "ops"]
    assert "from envbuild.image.cli import main" in argv[3] and repr(str(ROOT)) in argv[3]


@pytest.mark.parametrize("nproc", [1, 2])
def test_one_rank_reports_no_bus_bandwidth(tmp_path, guard, nproc):
    """A single-GPU node runs NCCL with one rank: nothing crosses a bus, and a 'busbw 0.00 GB/s'
    would read as a broken link (seen on a one-H100 machine)."""
    def stand_in(rank, result):
        body = {"ok": True, "size_bytes": 2**26, "all_reduce_s": 0.001, "all_gather_s": 0.002}
        return [sys.executable, "-c", f"import json; json.dump({body!r}, open({result!r}, 'w'))"]

    ok, detail = collectives.check_collectives("nccl", nproc, args_ns(timeout=60.0), str(tmp_path), command=stand_in)
    assert ok is True
    assert ("busbw" in detail) is (nproc == 2)
    assert ("no bus bandwidth" in detail) is (nproc == 1)


# --------------------------------------------------------------------------- stdout discipline
def test_json_mode_keeps_stdout_for_the_report():
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from envbuild.image.cli import stdout_reserved
with stdout_reserved(True) as out:
    print("library chatter")
    os.write(1, b"C-level chatter\\n")
    print('{{"ok": true}}', file=out)
print("after")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ['{"ok": true}', "after"]
    assert "library chatter" in r.stderr and "C-level chatter" in r.stderr


@pytest.mark.skipif(HAS_TORCH, reason="checks the torch-less failure path")
def test_full_run_without_torch_fails_cleanly(build_dir, tmp_path):
    manifest = write_manifest(tmp_path, ds_ops=["cpu_adam"])
    r = run_script(build_dir, "--json", "--manifest", str(manifest), "--timeout", "30", timeout=120,
                   env={"ENVBUILD_NODE_ROOT": str(tmp_path / "no-gpu-here"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    names = [c["name"] for c in doc["checks"]]
    assert names == ["cpu_arch", "versions", "nccl", "nccl_copies", "ds_record", "no_jit", "cpu_adam", "compilers", "guard", "lock",
                     "torch_compile", "env", "fabric", "transport", "driver", "node_env", "collectives", "p2p"]
    assert doc["ok"] is False and doc["mode"] == "cpu"
    assert "No module named 'torch'" in doc["checks"][1]["detail"]
    by_name = {c["name"]: c for c in doc["checks"]}
    for name in ("driver", "node_env", "p2p"):
        assert by_name[name]["ok"] and by_name[name]["skipped"], by_name[name]
    assert "Traceback" not in r.stderr


def test_run_all_orders_checks_and_skips_gpu_ones_on_cpu(tmp_path, monkeypatch):
    """run_all with every check replaced by a recorder (no torch here): the order, and which
    checks exist in CPU mode."""
    calls = []

    def record(name):
        def fn(*a):
            calls.append(name)
            return True, name
        return fn

    for name in ("check_versions", "check_ds_record", "check_compilers", "check_env", "check_gpu_arch"):
        monkeypatch.setattr(checks, name, record(name))
    for name in ("check_loaded", "check_copies"):
        monkeypatch.setattr(nccl, name, record(name))
    monkeypatch.setattr(checks, "run_ops_child", lambda *a: fake_child(ops={"cpu_adam": OK_OP},
                                                                       adam={"ok": True, "max_abs_diff": 0.0,
                                                                             "seconds": 0.1}))
    monkeypatch.setattr(collectives, "check_collectives", record("check_collectives"))
    monkeypatch.setenv("ENVBUILD_NODE_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    rep = cli.run_all({**GOOD_MANIFEST, "ds_ops": ["cpu_adam"]}, args_ns(), "m.json", gpus=0)
    assert [c["name"] for c in rep["checks"]] == ["cpu_arch", "versions", "nccl", "nccl_copies", "ds_record", "no_jit", "cpu_adam", "compilers",
                                                  "guard", "lock", "torch_compile", "env", "fabric", "transport", "driver", "node_env",
                                                  "collectives", "p2p"]
    assert rep["ok"] and rep["mode"] == "cpu" and "check_gpu_arch" not in calls


def test_gpu_mode_checks_each_cuda_optimizer_against_its_reference(monkeypatch, tmp_path):
    """On a GPU each pre-built CUDA optimizer gets its own numerics check (FusedLamb and FusedLion
    were only loaded before: a mis-built kernel could load and compute garbage)."""
    from envbuild.image import transport

    step = {"ok": True, "detail": "", "seconds": 0.1, "max_abs_diff": 1e-9}
    ops = ["fused_adam", "fused_lamb", "fused_lion"]
    child = dict(fake_child(ops={op: OK_OP for op in ops}), **{op: dict(step) for op in ops})
    monkeypatch.setattr(checks, "run_ops_child", lambda *a: child)
    for module, name in ((checks, "check_versions"), (checks, "check_ds_record"), (checks, "check_gpu_arch"),
                         (collectives, "check_collectives"), (transport, "check_transport")):
        monkeypatch.setattr(module, name, lambda *a: (True, "stand-in"))
    monkeypatch.setenv("ENVBUILD_NODE_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    rep = cli.run_all({**GOOD_MANIFEST, "ds_ops": ops}, args_ns(), "m.json", gpus=1)
    by_name = {c["name"]: c for c in rep["checks"]}
    assert rep["mode"] == "gpu"
    for op, label in (("fused_adam", "FusedAdam"), ("fused_lamb", "FusedLamb"), ("fused_lion", "FusedLion")):
        assert by_name[op]["ok"] is True and label in by_name[op]["detail"]


def test_guard_check_needs_the_built_torch_and_deepspeed_pinned_and_read(tmp_path):
    from envbuild.image.report import Skipped

    pins = tmp_path / "constraint.txt"
    pins.write_text("deepspeed==0.19.8\nnvidia-nccl-cu13==2.30.7\ntorch==2.15.0\ntriton==3.9.0\n")
    manifest = {"constraints": str(pins), "torch": "2.15.0", "deepspeed": "0.19.8"}
    environ = {"PIP_CONSTRAINT": str(pins), "UV_CONSTRAINT": str(pins)}
    ok, detail = checks.check_guard(manifest, environ)
    assert ok is True and "4 pins" in detail and "torch==2.15.0" in detail
    ok, detail = checks.check_guard({**manifest, "torch": "2.14.1"}, environ)
    assert ok is False and "torch==2.15.0 (want 2.14.1)" in detail
    ok, detail = checks.check_guard(manifest, {"PIP_CONSTRAINT": str(pins)})
    assert ok is False and "UV_CONSTRAINT is not" in detail
    ok, detail = checks.check_guard({**manifest, "constraints": str(tmp_path / "gone.txt")}, environ)
    assert ok is False and "nothing stops a pip install" in detail
    assert isinstance(checks.check_guard({}, environ), Skipped)
