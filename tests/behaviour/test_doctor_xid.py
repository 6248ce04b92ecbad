"""NVIDIA Xid lines in a job's log: doctor names the Xid, its names in the driver's source and the driver's
published meaning (matrices/catalogues/xid.yaml), as a verdict of family gpu-hardware.

The real logs are tests/fixtures/xid (INDEX.yaml gives each one's thread: seven threads, Xids 13, 31, 43,
45, 62, 79, 94 and 109); the short logs written here add what pasting does, and the clean set gets nothing.
"""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import ROOT
from envbuild.doctor import diagnose_log, diagnose_text, load_issues

ISSUES = load_issues(ROOT / "matrices")
REAL = ROOT / "tests" / "fixtures" / "xid"
LOGS = ROOT / "tests" / "fixtures" / "logs"
INDEX = yaml.safe_load((REAL / "INDEX.yaml").read_text())["logs"]


def xids(findings) -> dict:
    return {int(f.title.split()[2].rstrip(":")): f for f in findings if f.issue.id == "gpu-xid"}


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_xid_lines_are_named_with_their_meaning(entry):
    findings = diagnose_log(str(REAL / entry["file"]), ISSUES)
    assert sorted({f.issue.id for f in findings if f.explained}) == entry["verdicts"], entry["cause"]
    found = xids(findings)
    assert sorted(found) == sorted(entry["xids"]), entry["cause"]
    for number, finding in found.items():
        assert finding.issue.family == "gpu-hardware" and finding.explained
        assert f"Xid {number}" in finding.text("cause")
    assert entry["source"].startswith("https://github.com/")


def test_a_verdict_names_the_xid_its_source_names_the_gpu_and_what_the_driver_said():
    (bus,) = xids(diagnose_log(str(REAL / "open-gpu-kernel-modules-1151-xid-79.log"), ISSUES)).values()
    assert bus.title == "GPU Xid 79: GPU has fallen off the bus (ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS)"
    assert bus.detail == ("the driver's nverror.h: ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS in "
                          "520.61.07..595.45.04; GPU 0000:2b:00")
    assert "(GPU has fallen off the bus.)" in bus.text("cause") and bus.certainty == "certain"
    assert bus.issue.source.startswith("https://github.com/NVIDIA/open-gpu-kernel-modules/blob/595.45.04/src/common/")


def test_an_xid_the_header_does_not_name_is_still_named_by_its_number():
    found = xids(diagnose_log(str(REAL / "gpud-46-xid-13-109.log"), ISSUES))
    assert found[109].title == "GPU Xid 109" and "CTX SWITCH TIMEOUT" in found[109].text("cause")
    assert "does not name" in found[109].text("cause")


def test_a_cleanup_xid_follows_the_one_before_it():
    """Xid 45 is the driver tearing down channels after another error: it decides no first rank alone."""
    (cleanup,) = xids(diagnose_log(str(REAL / "open-gpu-kernel-modules-1150-xid-45.log"), ISSUES)).values()
    assert cleanup.issue.follows and cleanup.certainty == "likely"


def test_pasting_does_not_hide_an_xid():
    """journalctl's host prefix, a rank label, an older driver's form without `PCI:`, a MIG instance."""
    log = ("[rank2]: Jan 18 11:38:05 node7 kernel: [ 269.517039] NVRM: Xid (0000:01:00): 48, An uncorrectable "
           "double bit error\n"
           "NVRM: Xid (PCI:0000:9b:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No\n")
    found = xids(diagnose_text(log, ISSUES))
    assert sorted(found) == [48, 94] and found[48].ranks == ["rank 2"]
    assert "0000:9b:00" in found[94].detail


def test_words_about_xids_are_no_xid(cli, tmp_path):
    """Prose, a grep, the driver's load line and its multi-line fallen-off-the-bus notice name no Xid event."""
    log = tmp_path / "clean.log"
    log.write_text("checking for Xid errors: `dmesg | grep 'NVRM: Xid'` found none\n"
                   "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"
                   "XID 79 is documented as GPU has fallen off the bus\n")
    result = cli("doctor", "--json", log)
    assert (result.returncode, json.loads(result.stdout)["findings"]) == (0, [])


def test_the_clean_real_logs_get_no_xid():
    clean = [e["file"] for e in yaml.safe_load((LOGS / "INDEX.yaml").read_text())["logs"] if not e["expected"]]
    assert len(clean) >= 12
    assert [f for name in clean for f in xids(diagnose_log(str(LOGS / name), ISSUES))] == []
