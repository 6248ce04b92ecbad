"""What torch.distributed said, known only to its catalogue: doctor names the wording, the torch
releases that print it, the source file:line and the values it was filled with, and guesses no
cause; a lead, not a verdict, exactly like what NCCL said.

tests/fixtures/torch-said holds real logs of public threads (INDEX.yaml gives each one's URL);
the short logs written here add what pasting does to real wordings of the catalogue.
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import diagnose_log, diagnose_text, load_issues

ISSUES = load_issues(ROOT / "matrices")
REAL = ROOT / "tests" / "fixtures" / "torch-said"
INDEX = load_yaml((REAL / "INDEX.yaml").read_text())["logs"]
EXITCODE = "torch.distributed said: failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"


def said(findings):
    return {f.title: f for f in findings if not f.explained}


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_torch_failures_name_what_torch_distributed_said(entry):
    """Each lead names the wording and its source file; the values are the log's own."""
    findings = diagnose_log(str(REAL / entry["file"]), ISSUES)
    assert not [f for f in findings if f.explained], entry["cause"]
    leads = sorted(f"{f.title.removeprefix('torch.distributed said: ')} {f.detail.split(', ')[1].split(':')[0]}"
                   for f in findings)
    assert leads == sorted(entry["said"]), entry["cause"]
    for name, value in entry["values"].items():
        assert all(f"; {name}: {value}" in f.detail for f in findings), entry["cause"]
    assert all(f.issue.id == "torch-said" and f.text("cause").startswith("not yet explained:") for f in findings)
    assert entry["source"].startswith("https://github.com/")


def test_a_lead_names_the_releases_the_source_line_and_the_line_at_its_tag():
    (lead,) = said(diagnose_log(str(REAL / "chinese-vicuna-113-exitcode-1.log"), ISSUES)).values()
    assert lead.title == EXITCODE
    assert lead.detail.startswith("torch 2.4.1..2.11.0, torch/distributed/elastic/multiprocessing/api.py:986; s1: 1;")
    assert lead.issue.source == ("https://github.com/pytorch/pytorch/blob/v2.11.0/"
                                 "torch/distributed/elastic/multiprocessing/api.py#L986")
    assert "does not guess" in lead.text("cause") and lead.issue.family == "unexplained"


def test_pasting_does_not_hide_what_torch_distributed_said():
    """torch >= 2.4's own log prefix, a rank prefix, a timestamp and ANSI colours around a real wording."""
    log = ("[rank3]:[2026-01-02 10:00:00] \x1b[31mE0102 10:00:00.123000 4242 torch/distributed/elastic/multiprocessing/"
           "api.py:986] failed (exitcode: 1) local_rank: 3 (pid: 4250) of binary: /usr/bin/python3\x1b[0m\n"
           "[rank0]: step 10 loss 1.0\n")
    (lead,) = said(diagnose_text(log, ISSUES)).values()
    assert lead.title == EXITCODE and lead.ranks == ["rank 3"] and lead.other_ranks == ["rank 0"]
    assert "; s1: 1; s2: 3; s3: 4250; s4: /usr/bin/python3" in lead.detail


def test_torchrun_warnings_of_a_healthy_job_and_unknown_wordings_are_not_leads(cli, tmp_path):
    """torchrun's OMP_NUM_THREADS notice and SIGTERM warnings are catalogued (WARNING) but not
    reported; a wording no shipped release raises is not attributed to torch."""
    log = tmp_path / "clean.log"
    log.write_text(
        "WARNING:torch.distributed.run:\n*****************************************\n"
        "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
        "being overloaded, please further tune the variable for optimal performance in your application as needed.\n"
        "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 153929 closing signal SIGTERM\n"
        "RuntimeError: The connection to the C10d store has been lost in a way no torch release words\n")
    result = cli("doctor", "--json", log)
    assert (result.returncode, json.loads(result.stdout)["findings"]) == (0, [])


def test_a_catalogue_only_lead_does_not_make_the_exit_status_a_verdict(cli):
    result = cli("doctor", "--json", REAL / "pytorch-107021-c10d-store.log")
    (lead,) = json.loads(result.stdout)["findings"]
    assert result.returncode == 0 and lead["id"] == "torch-said" and lead["family"] == "unexplained"


def test_a_malformed_torch_catalogue_is_a_one_paragraph_error_naming_it(tmp_path):
    from envbuild.doctor.said import load_said
    from envbuild.base.errors import EnvbuildError
    (tmp_path / "catalogues").mkdir()
    (tmp_path / "catalogues" / "torch.yaml").write_text(
        "messages: [{level: RAISE, error: X, text: 'a message long enough to be matched alone', line: 3}]\n")
    with pytest.raises(EnvbuildError, match="catalogue"):
        load_said(tmp_path)


def test_a_curated_signature_takes_its_line_before_the_catalogue():
    """exitcode -9 is the kernel's SIGKILL (the OOM killer): a curated verdict, not a lead."""
    log = "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 1) of binary: py\n"
    findings = diagnose_text(log, ISSUES)
    assert findings and all(f.explained for f in findings)
