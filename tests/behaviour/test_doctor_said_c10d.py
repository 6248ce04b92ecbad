"""What c10d's C++ said, known only to its catalogue (read from the torch wheels' libraries): doctor
names the piece, the torch releases whose libraries hold it, the library and the compile unit it
sits among, and the values it was filled with; it guesses no cause and claims no source line (the
binary holds none). A lead, not a verdict, exactly like what NCCL or torch.distributed said.

tests/fixtures/c10d-said holds real logs of public threads (INDEX.yaml gives each one's URL).
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import diagnose_log, diagnose_text, load_issues

ISSUES = load_issues(ROOT / "matrices")
REAL = ROOT / "tests" / "fixtures" / "c10d-said"
INDEX = load_yaml((REAL / "INDEX.yaml").read_text())["logs"]
LOGS = ROOT / "tests" / "fixtures" / "logs"
CLEAN = [e["file"] for e in load_yaml((LOGS / "INDEX.yaml").read_text())["logs"] if "clean" in e["file"]]


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_c10d_failures_name_what_c10d_said(entry):
    """Each lead names the piece and its library; the values are the log's own."""
    findings = [f for f in diagnose_log(str(REAL / entry["file"]), ISSUES) if f.issue.id == "c10d-said"]
    leads = sorted(f"{f.title.removeprefix('c10d said: ')} {f.detail.split(', ', 1)[1].split(' ')[0]}" for f in findings)
    assert leads == sorted(entry["said"]), entry["cause"]
    for name, value in entry["values"].items():
        assert all(f"; {name}: {value}" in f.detail for f in findings), entry["cause"]
    assert all(f.text("cause").startswith("not yet explained:") and "no file or line" in f.detail for f in findings)
    assert entry["source"].startswith("https://github.com/")


def test_the_six_logs_come_from_six_threads():
    assert len({e["source"] for e in INDEX}) == len(INDEX) >= 5


def test_a_lead_names_the_releases_the_library_and_the_wheel_it_was_read_from():
    (lead,) = [f for f in diagnose_log(str(REAL / "sglang-20859-recvvalue-reset.log"), ISSUES) if not f.explained]
    catalogue = load_yaml((ROOT / "matrices" / "catalogues" / "c10d.yaml").read_text())
    newest = catalogue["releases"][-1]["release"]
    assert lead.detail.startswith("torch ") and f"..{newest}, libtorch_cpu.so (among c10d/" in lead.detail
    assert lead.issue.source == f"https://pypi.org/project/torch/{newest}/#files"
    assert lead.issue.family == "unexplained" and lead.ranks == ["rank 12"]


def test_a_curated_signature_takes_its_line_before_the_catalogue():
    """The watchdog's timeout is a curated verdict (nccl-watchdog-timeout), not a c10d lead."""
    log = ("[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
           "timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) "
           "ran for 600060 milliseconds before timing out.\n")
    findings = diagnose_text(log, ISSUES)
    assert findings and all(f.explained for f in findings)


def test_healthy_c10d_lines_are_not_leads(cli, tmp_path):
    """Settings, the shutdown warning and a clean watchdog exit are catalogued but not reported."""
    log = tmp_path / "healthy.log"
    log.write_text(
        "[rank0]:[W1201 10:00:00.000000000 ProcessGroupNCCL.cpp:1250] WARNING: NCCL communicator hasn't been destroyed. "
        "This may cause memory leaks. To avoid the risk, you can call `destroy_process_group` during normal exit or "
        "`_abort_process_group` when handling failures.\n"
        "[rank0]:[I1201 10:00:00.000000000 ProcessGroupNCCL.cpp:1300] Process group watchdog thread terminated normally\n"
        "[rank0]:[I1201 10:00:00.000000000 ProcessGroupNCCL.cpp:1000] HeartbeatMonitor environments: "
        "TORCH_NCCL_ENABLE_MONITORING (Whether to kill program when no watchdog heartbeat detected): 1\n")
    result = cli("doctor", "--json", log)
    assert (result.returncode, json.loads(result.stdout)["findings"]) == (0, [])


def test_no_clean_log_of_the_fixtures_gets_a_c10d_lead():
    assert len(CLEAN) >= 12
    assert [name for name in CLEAN if any(f.issue.id == "c10d-said" for f in diagnose_log(str(LOGS / name), ISSUES))] == []
