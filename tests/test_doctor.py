"""`envbuild doctor` recognises the field reports' signatures in real-looking logs."""

import pytest

from conftest import ROOT
from envbuild.doctor import diagnose, load_issues

ISSUES = load_issues(ROOT / "matrices")

HANG = """[2024-01-01 10:00:00] [INFO] [real_accelerator.py:161:get_accelerator] Setting ds_accelerator to cuda
Using /root/.cache/torch_extensions/py39_cu117 as PyTorch extensions root...
"""
FINISHED = HANG + "Loading extension module fused_adam...\nTime to load fused_adam op: 0.5 seconds\n"
ZERO3 = "step 55651\nInvalidate trace cache @ step 55651: expected module 319, but got module 636\n" * 3


@pytest.mark.parametrize("log, expected", [
    (HANG, ["torch-extensions-lock"]),
    (FINISHED, []),
    (ZERO3, ["zero3-trace-cache"]),
    ("[rank3]:[E ProcessGroupNCCL.cpp:607] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
     "OpType=ALLGATHER, Timeout(ms)=600000)", ["nccl-watchdog-timeout"]),
    ("RuntimeError: CUDA error: no kernel image is available for execution on the device", ["no-kernel-image"]),
    ("all good\nloss 1.23\n", []),
])
def test_diagnose(log, expected):
    assert [f.issue.id for f in diagnose(log, ISSUES)] == expected


def test_doctor_cli(cli, tmp_path):
    log = tmp_path / "train.log"
    log.write_text(ZERO3)
    r = cli("doctor", str(log), env={"COLUMNS": "200"})
    assert r.returncode == 3 and "3 times" in r.stdout and "log_trace_cache_warnings" in r.stdout
    log.write_text("fine\n")
    assert cli("doctor", str(log)).returncode == 0
    r = cli("doctor", str(tmp_path / "missing.log"))
    assert r.returncode == 2 and "cannot be read" in r.stderr
