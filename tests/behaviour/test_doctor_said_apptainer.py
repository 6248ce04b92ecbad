"""What Apptainer said, known only to its catalogue (apptainer.yaml): doctor names the wording, the
releases that print it, the source file:line and the values it was filled with, and guesses no cause.

The real logs are tests/fixtures/apptainer-said (INDEX.yaml gives each one's thread: six messages of
the run path from six threads: --nvccli, the starter, the session directory, a SIF's squashfs, a pull,
a sandbox conversion); the short logs written here add what pasting does.
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import diagnose_log, diagnose_text, load_issues
from envbuild.doctor.said import drift
from envbuild.doctor.signatures import Quote

ISSUES = load_issues(ROOT / "matrices")
REAL = ROOT / "tests" / "fixtures" / "apptainer-said"
LOGS = ROOT / "tests" / "fixtures" / "logs"
INDEX = load_yaml((REAL / "INDEX.yaml").read_text())["logs"]
CATALOGUE = load_yaml((ROOT / "matrices" / "catalogues" / "apptainer.yaml").read_text())


def leads(findings) -> dict:
    return {f.title: f for f in findings if f.issue.id == "apptainer-said"}


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_apptainer_failures_are_reported_as_what_apptainer_said(entry):
    findings = diagnose_log(str(REAL / entry["file"]), ISSUES)
    assert [f for f in findings if f.explained] == [], entry["cause"]
    found = leads(findings)
    assert sorted(found) == sorted(entry["said"]), entry["cause"]
    for lead in found.values():
        assert lead.issue.family == "unexplained" and lead.text("cause").startswith("not yet explained:")
        assert lead.issue.source.startswith("https://github.com/apptainer/apptainer/blob/v1.5.3/")
        assert "apptainer --debug" in lead.text("fix")
    assert all(any(value in lead.detail for lead in found.values()) for value in entry["values"]), entry["values"]
    assert entry["source"].startswith("https://github.com/")


def test_a_lead_names_the_releases_the_source_line_and_the_values():
    (lead,) = leads(diagnose_log(str(REAL / "vip-745-session-directory.log"), ISSUES)).values()
    assert lead.detail.startswith("Apptainer 1.1.9..1.5.3, internal/pkg/runtime/engine/apptainer/container_linux.go:")
    assert "; s1: /usr/local/var/apptainer/mnt/session; s2: lstat /usr/local/var/apptainer" in lead.detail


def test_pasting_does_not_hide_what_apptainer_said():
    """A rank prefix, a Slurm task label, ANSI colours; the --nv warning stays the curated verdict."""
    log = ("[rank1]: \x1b[31mFATAL:  \x1b[0m container creation failed: failed to resolve session directory "
           "/var/apptainer/mnt/session: lstat /var/apptainer: no such file or directory\n"
           "0: WARNING: Could not find any nv libraries on this host!\n")
    findings = diagnose_text(log, ISSUES)
    assert {f.issue.id for f in findings if f.explained} == {"apptainer-nv-no-libs"}
    (lead,) = leads(findings).values()
    assert lead.title == "Apptainer said: failed to resolve session directory %s: %s" and lead.ranks == ["rank 1"]


def test_apptainer_s_warnings_and_info_are_catalogued_not_reported(cli, tmp_path):
    """A healthy job prints INFO and WARNING lines (missing squashfuse, skipped binds): no lead, exit 0."""
    log = tmp_path / "healthy.log"
    log.write_text("INFO:    squashfuse not found, will not be able to mount SIF or other squashfs files\n"
                   "INFO:    Converting SIF file to temporary sandbox...\n"
                   "WARNING: Skipping mount /etc/localtime [binds]: /etc/localtime doesn't exist in container\n")
    result = cli("doctor", "--json", log)
    assert (result.returncode, json.loads(result.stdout)["findings"]) == (0, [])


def test_the_clean_real_logs_get_no_apptainer_lead():
    clean = [e["file"] for e in load_yaml((LOGS / "INDEX.yaml").read_text())["logs"] if not e["expected"]]
    assert len(clean) >= 12
    assert [f for name in clean for f in leads(diagnose_log(str(LOGS / name), ISSUES))] == []


def test_the_nv_signature_s_quotes_hold_and_a_singularity_wording_would_not():
    """apptainer-nv-no-libs stands for Apptainer's two --nv warnings on every catalogued release;
    Singularity 3.x's `Could not find any NVIDIA binaries` (still in its pattern) no Apptainer release prints."""
    issue = next(i for i in ISSUES if i.id == "apptainer-nv-no-libs")
    assert {q.component for q in issue.quotes} == {"apptainer"} and drift([issue], {"apptainer": CATALOGUE}) == []
    old = issue.model_copy(update={"quotes": [Quote.model_validate(
        {"apptainer": "Could not find any NVIDIA binaries on this host!",
         "line": "WARNING: Could not find any NVIDIA binaries on this host!"})]})
    problems = "\n".join(drift([old], {"apptainer": CATALOGUE}))
    assert "which no catalogued Apptainer release prints" in problems
    assert "Apptainer 1.1.9, 1.2.5, 1.3.6, 1.4.5, 1.5.3 print none of the wordings it quotes" in problems
