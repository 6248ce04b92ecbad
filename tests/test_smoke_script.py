"""templates/files/smoke.py: the smoke test copied into every image.

It needs torch and DeepSpeed only inside the image; these tests run on a host without them,
so they cover its pure logic and its subprocess/timeout machinery (children that hang or die
before importing torch), loading the script from its file exactly as the image runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "templates" / "files" / "smoke.py"
HAS_TORCH = importlib.util.find_spec("torch") is not None

GOOD_MANIFEST = {
    "tag": "t-h100", "python": "3.11", "torch": "2.11.0", "cuda": "13.0", "deepspeed": "0.19.8",
    "nccl": "2.28.9", "ds_ops": ["cpu_adam", "fused_adam"], "torch_cuda_arch_list": "9.0",
    "env": {"NCCL_P2P_DISABLE": "1"}, "toolchain_kept": False, "gpu": "h100",
}


@pytest.fixture(scope="module")
def smoke():
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("envbuild_smoke_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._imported_at_load = set(sys.modules) - before
    return module


def run_script(*args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ENVBUILD_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def write_manifest(tmp_path, **changes):
    data = {**GOOD_MANIFEST, **changes}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data))
    return path


def args_ns(**kw):
    base = dict(timeout=3.0, nproc=2, size_mb=1.0, accelerator="cuda", json=True)
    return SimpleNamespace(**{**base, **kw})


# --------------------------------------------------------------------------- import, manifest
def test_imports_with_stdlib_only(smoke):
    assert not {m for m in smoke._imported_at_load if m.split(".")[0] in ("torch", "deepspeed")}
    assert callable(smoke.main)


def test_manifest_missing_is_usage_error(smoke, tmp_path):
    with pytest.raises(smoke.UsageError, match="manifest not found"):
        smoke.load_manifest(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read manifest"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"python": "3.11", "cuda": "13.0", "deepspeed": "0.19.8", "ds_ops": []}), "lacks keys: torch"),
])
def test_manifest_malformed_is_usage_error(smoke, tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(smoke.UsageError, match=message):
        smoke.load_manifest(str(path))


def test_manifest_valid_loads(smoke, tmp_path):
    assert smoke.load_manifest(str(write_manifest(tmp_path)))["ds_ops"] == ["cpu_adam", "fused_adam"]


def test_cli_missing_manifest_exits_2_with_message(tmp_path):
    r = run_script("--manifest", str(tmp_path / "absent.json"))
    assert r.returncode == 2
    assert "manifest not found" in r.stderr and "absent.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_missing_manifest_json_mode_prints_one_object(tmp_path):
    r = run_script("--json", env={"ENVBUILD_MANIFEST": str(tmp_path / "from-env.json")})
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and "from-env.json" in doc["error"]


def test_cli_bad_flag_exits_2():
    assert run_script("--no-such-flag").returncode == 2


# --------------------------------------------------------------------------- versions
@pytest.mark.parametrize("raw, norm", [
    ("2.11.0+cu130", "2.11.0"), ("0.19.8+4f2a1b", "0.19.8"), ((2, 28, 9), "2.28.9"), (" 13.0 ", "13.0"),
])
def test_normalize_version(smoke, raw, norm):
    assert smoke.normalize_version(raw) == norm


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
def test_version_matches(smoke, expected, actual, ok):
    assert smoke.version_matches(expected, actual) is ok


def test_major_minor(smoke):
    assert smoke.major_minor("13.0.2") == "13.0"
    assert smoke.major_minor("12.8") == "12.8"
    assert smoke.major_minor("3.11.7") != "3.1"


# --------------------------------------------------------------------------- GPU arch list
def test_parse_arch_list(smoke):
    assert smoke.parse_arch_list("8.0;9.0+PTX") == [(8, 0, False), (9, 0, True)]
    assert smoke.parse_arch_list("7.5 8.0  12.0+ptx") == [(7, 5, False), (8, 0, False), (12, 0, True)]
    assert smoke.parse_arch_list("") == []


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
def test_arch_satisfied(smoke, cc, arch_list, ok):
    assert smoke.arch_satisfied(cc, arch_list) is ok


# --------------------------------------------------------------------------- bandwidth
def test_bus_bandwidth_matches_nccl_tests(smoke):
    assert smoke.bus_bandwidth("all_reduce", 1e9, 1.0, 8) == pytest.approx(1.75)
    assert smoke.bus_bandwidth("all_gather", 1e9, 1.0, 8) == pytest.approx(0.875)
    assert smoke.bus_bandwidth("all_reduce", 64 * 2**20, 0.5, 2) == pytest.approx(64 * 2**20 / 0.5 / 1e9)
    assert smoke.bus_bandwidth("all_reduce", 1e9, 1.0, 1) == 0.0
    assert smoke.bus_bandwidth("all_gather", 1e9, 0.0, 8) == 0.0


# --------------------------------------------------------------------------- report shape
def test_run_check_turns_exceptions_into_failed_checks(smoke):
    def boom():
        raise ValueError("boom")

    def leave():
        raise SystemExit(3)

    c = smoke.run_check("x", boom)
    assert c == {"name": "x", "ok": False, "detail": "ValueError: boom", "seconds": c["seconds"]}
    assert isinstance(c["seconds"], float)
    assert smoke.run_check("y", leave)["ok"] is False
    assert smoke.run_check("z", lambda: (True, "fine", 1.23456)) == \
        {"name": "z", "ok": True, "detail": "fine", "seconds": 1.235}


def test_report_json_shape_and_exit_codes(smoke):
    good = [smoke.run_check("a", lambda: (True, "ok")), smoke.run_check("b", lambda: (True, "ok"))]
    report = smoke.build_report(GOOD_MANIFEST, "gpu", good, "/opt/envbuild/manifest.json")
    doc = json.loads(json.dumps(report))
    assert set(doc) == {"ok", "mode", "image", "checks"}
    assert doc["ok"] is True and doc["mode"] == "gpu"
    assert doc["image"]["tag"] == "t-h100" and doc["image"]["gpu"] == "h100"
    assert all(set(c) == {"name", "ok", "detail", "seconds"} for c in doc["checks"])
    assert smoke.exit_code(report) == 0

    bad = good + [smoke.run_check("c", lambda: (False, "broken"))]
    report = smoke.build_report(GOOD_MANIFEST, "cpu", bad)
    assert report["ok"] is False and smoke.exit_code(report) == 1
    assert smoke.exit_code(smoke.build_report(GOOD_MANIFEST, "cpu", [])) == 1


def test_render_text_is_an_aligned_table(smoke):
    checks = [{"name": "versions", "ok": True, "detail": "all pinned", "seconds": 1.5},
              {"name": "collectives", "ok": False, "detail": "timed out", "seconds": 120.0}]
    text = smoke.render_text(smoke.build_report(GOOD_MANIFEST, "cpu", checks))
    lines = text.splitlines()
    assert "t-h100" in lines[0] and "mode=cpu" in lines[0]
    assert lines[1].index("ok") == lines[2].index("FAIL")
    assert lines[1].index("all pinned") == lines[2].index("timed out")
    assert lines[-1] == "RESULT: FAILED"


# --------------------------------------------------------------------------- compilers, env
def make_exe(directory: Path, name: str, executable: bool = True) -> Path:
    directory.mkdir(exist_ok=True)
    p = directory / name
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755 if executable else 0o644)
    return p


def test_compilers_found_fail_the_check(smoke, tmp_path):
    nvcc = make_exe(tmp_path / "bin", "nvcc")
    ok, detail = smoke.check_compilers({"toolchain_kept": False}, path=str(tmp_path / "bin"))
    assert ok is False and f"nvcc={nvcc}" in detail


def test_compilers_default_path_is_the_environment(smoke, tmp_path, monkeypatch):
    make_exe(tmp_path / "bin", "ninja")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    ok, detail = smoke.check_compilers({})
    assert ok is False and "ninja=" in detail


def test_compilers_absent_or_not_executable_pass(smoke, tmp_path):
    make_exe(tmp_path / "bin", "gcc", executable=False)
    ok, detail = smoke.check_compilers({"toolchain_kept": False}, path=str(tmp_path / "bin"))
    assert ok is True and "none of" in detail


def test_compilers_allowed_when_toolchain_kept(smoke, tmp_path):
    make_exe(tmp_path / "bin", "g++")
    ok, detail = smoke.check_compilers({"toolchain_kept": True}, path=str(tmp_path / "bin"))
    assert ok is True and "g++=" in detail


def test_env_check(smoke):
    manifest = {"env": {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "PATH": "/opt/venv/bin:/usr/bin"}}
    ok, detail = smoke.check_env(manifest, {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
                                            "PATH": "/opt/venv/bin:/opt/venv/bin:/host/bin",
                                            "TORCH_EXTENSIONS_DIR": "/tmp/te-42"})
    assert ok is True and "TORCH_EXTENSIONS_DIR=/tmp/te-42" in detail and "overridden" not in detail
    ok, detail = smoke.check_env(manifest, {"NCCL_P2P_DISABLE": "0", "PATH": "/opt/venv/bin"})
    assert ok is False
    assert "NCCL_NVLS_ENABLE missing" in detail and "overridden: NCCL_P2P_DISABLE='0'" in detail
    assert "TORCH_EXTENSIONS_DIR=(unset)" in detail
    ok, detail = smoke.check_env(manifest, {"NCCL_P2P_DISABLE": "0", "NCCL_NVLS_ENABLE": "0", "PATH": "/usr/bin"})
    assert ok is False and "PATH does not start with /opt/venv/bin" in detail
    assert smoke.check_env({"env": {}}, {})[0] is True


# --------------------------------------------------------------------------- no-JIT sandbox
def test_planted_locks_and_write_detection(smoke, tmp_path):
    root = tmp_path / "te"
    root.mkdir()
    planted = smoke.plant_stale_locks(str(root), ["cpu_adam", "fused_adam"])
    assert planted == {"cpu_adam", "cpu_adam/lock", "fused_adam", "fused_adam/lock"}
    assert (root / "cpu_adam" / "lock").is_file()
    assert stat.S_IMODE(root.stat().st_mode) == 0o555
    assert smoke.tree_entries(str(root)) == planted
    for d in (root, root / "cpu_adam"):
        d.chmod(0o755)  # what root could do regardless of modes: a JIT build writing
    (root / "cpu_adam" / "build.ninja").write_text("")
    assert smoke.tree_entries(str(root)) - planted == {"cpu_adam/build.ninja"}


def fake_child(state="done", rc=0, ops=None, adam=None, extra=()):
    return {"state": state, "rc": rc, "ops": ops or {}, "adam": adam, "extra": list(extra), "log": "log tail"}


OK_OP = {"ok": True, "detail": "", "seconds": 0.01}


def test_no_jit_all_loaded(smoke):
    ok, detail = smoke.check_no_jit(fake_child(ops={"cpu_adam": OK_OP, "utils": OK_OP}), ["cpu_adam", "utils"], 120)
    assert ok is True and "cpu_adam ok" in detail and "utils ok" in detail


def test_no_jit_failed_op_is_reported(smoke):
    bad = {"ok": False, "detail": "RuntimeError: JIT compile attempted", "seconds": 0.2}
    ok, detail = smoke.check_no_jit(fake_child(ops={"cpu_adam": OK_OP, "fused_lamb": bad}),
                                    ["cpu_adam", "fused_lamb"], 120)
    assert ok is False and "fused_lamb FAILED" in detail and "JIT compile attempted" in detail


def test_no_jit_timeout_names_field_report_and_stuck_op(smoke):
    ok, detail = smoke.check_no_jit(fake_child(state="timeout", rc=None, ops={"cpu_adam": OK_OP}),
                                    ["cpu_adam", "fused_adam"], 120)
    assert ok is False and smoke.JIT_HANG_MSG in detail and "stuck on fused_adam" in detail


def test_no_jit_write_into_extensions_dir_fails(smoke):
    ok, detail = smoke.check_no_jit(fake_child(ops={"cpu_adam": OK_OP}, extra=["cpu_adam/build.ninja"]),
                                    ["cpu_adam"], 120)
    assert ok is False and "build.ninja" in detail


def test_no_jit_crashed_child_fails(smoke):
    ok, detail = smoke.check_no_jit(fake_child(rc=1, ops={}), ["cpu_adam"], 120)
    assert ok is False and "exited 1" in detail and "log tail" in detail


def test_cpu_adam_tolerance(smoke):
    assert smoke.check_cpu_adam({"adam": {"ok": True, "max_abs_diff": 6e-8, "seconds": 0.1}})[0] is True
    assert smoke.check_cpu_adam({"adam": {"ok": True, "max_abs_diff": 2e-5, "seconds": 0.1}})[0] is False
    assert smoke.check_cpu_adam({"state": "timeout", "rc": None})[0] is False


# --------------------------------------------------------------------------- timeouts (real subprocesses)
@pytest.fixture
def guard():
    """Fail (not hang) if the script's own deadline is broken; the test then kills what it left."""
    def expired(*_):
        raise TimeoutError("the smoke script ignored its own timeout")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def live_pids_mentioning(text: str) -> list[int]:
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


def test_hung_collective_is_killed_with_likely_causes(smoke, tmp_path, monkeypatch, guard):
    monkeypatch.setenv(smoke.HANG_ENV, "collective")
    t0 = time.monotonic()
    try:
        ok, detail = smoke.check_collectives("nccl", 2, args_ns(timeout=3.0), str(tmp_path))
    finally:
        leftovers = live_pids_mentioning(str(tmp_path))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    assert ok is False
    assert 3.0 <= elapsed < 20
    for hint in ("timed out after 3s", "NCCL_P2P_DISABLE=1", "H20", "--shm-size", "--ipc=host",
                 "NCCL_NVLS_ENABLE=0", "fabric-manager", "NCCL_DEBUG=INFO"):
        assert hint in detail
    assert leftovers == []


def test_dead_rank_fails_fast_with_its_output(smoke, tmp_path, monkeypatch, guard):
    monkeypatch.setattr(smoke, "_self_cmd",
                        lambda *a: [sys.executable, "-c", "import sys; print('rank broke'); sys.exit(3)"])
    t0 = time.monotonic()
    ok, detail = smoke.check_collectives("gloo", 2, args_ns(timeout=60.0), str(tmp_path))
    assert ok is False and "exited 3" in detail and "rank broke" in detail
    assert time.monotonic() - t0 < 30


def test_hung_op_loader_reports_jit_hang(smoke, tmp_path, monkeypatch, guard):
    monkeypatch.setenv(smoke.HANG_ENV, "no_jit")
    try:
        res = smoke.run_ops_child({"ds_ops": ["cpu_adam"]}, args_ns(timeout=2.0), str(tmp_path))
    finally:
        leftovers = live_pids_mentioning(str(tmp_path))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert res["state"] == "timeout" and res["extra"] == []
    ok, detail = smoke.check_no_jit(res, ["cpu_adam"], 2.0)
    assert ok is False and "field report 1" in detail
    assert leftovers == []
    # the read-only tree was made removable again
    assert os.access(tmp_path / "torch_extensions" / "cpu_adam", os.W_OK)


# --------------------------------------------------------------------------- stdout discipline
def test_json_mode_keeps_stdout_for_the_report(tmp_path):
    code = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("s", {str(SCRIPT)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
with m.stdout_reserved(True) as out:
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
def test_full_run_without_torch_fails_cleanly(tmp_path):
    manifest = write_manifest(tmp_path, ds_ops=["cpu_adam"])
    r = run_script("--json", "--manifest", str(manifest), "--timeout", "30", timeout=120)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    names = [c["name"] for c in doc["checks"]]
    assert names == ["versions", "ds_record", "no_jit", "cpu_adam", "compilers", "env", "collectives"]
    assert doc["ok"] is False and doc["mode"] == "cpu"
    assert "No module named 'torch'" in doc["checks"][0]["detail"]
    assert "Traceback" not in r.stderr


def test_fused_adam_numerics_verdict(smoke):
    ok = {"fused_adam": {"ok": True, "detail": "", "seconds": 0.1, "max_abs_diff": 1e-9}}
    bad = {"fused_adam": {"ok": True, "detail": "", "seconds": 0.1, "max_abs_diff": 0.5}}
    assert smoke.check_fused_adam(ok)[0] is True and "FusedAdam" in smoke.check_fused_adam(ok)[1]
    assert smoke.check_fused_adam(bad)[0] is False
    assert smoke.check_fused_adam({"state": "hung", "rc": None})[0] is False
