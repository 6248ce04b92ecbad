"""What the NVIDIA container stack said, known only to its catalogues (container-toolkit.yaml,
libnvidia-container.yaml): doctor names the wording, the releases that print it, the source file:line
and the values it was filled with, and guesses no cause; a lead, not a verdict.

The real logs are tests/fixtures/container-said (INDEX.yaml gives each one's thread: five of
libnvidia-container's messages from five threads, two of the toolkit's from two more); the short
logs written here add what pasting does.
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import diagnose_log, diagnose_text, load_issues

ISSUES = load_issues(ROOT / "matrices")
REAL = ROOT / "tests" / "fixtures" / "container-said"
LOGS = ROOT / "tests" / "fixtures" / "logs"
INDEX = load_yaml((REAL / "INDEX.yaml").read_text())["logs"]
SAID = ("container-toolkit-said", "libnvidia-container-said")


def leads(findings) -> dict:
    return {f.title: f for f in findings if f.issue.id in SAID}


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_container_failures_are_reported_as_what_the_stack_said(entry):
    findings = diagnose_log(str(REAL / entry["file"]), ISSUES)
    assert [f for f in findings if f.explained] == [], entry["cause"]
    found = leads(findings)
    assert sorted(found) == sorted(entry["said"]), entry["cause"]
    for lead in found.values():
        assert lead.issue.family == "unexplained" and lead.text("cause").startswith("not yet explained:")
        assert lead.issue.source.startswith(("https://github.com/NVIDIA/libnvidia-container/blob/",
                                             "https://github.com/NVIDIA/nvidia-container-toolkit/blob/v"))
    assert all(any(value in lead.detail for lead in found.values()) for value in entry["values"]), entry["values"]
    assert entry["source"].startswith("https://github.com/")


def test_a_lead_names_the_releases_the_source_line_and_its_commit():
    (lead,) = leads(diagnose_log(str(REAL / "conf-net-5-ldcache-open-failed.log"), ISSUES)).values()
    assert lead.issue.id == "libnvidia-container-said"
    assert lead.detail.startswith("libnvidia-container 1.14.3..1.17.2, src/utils.c:")
    assert "; s1: /sbin/ldconfig.real;" in lead.detail
    assert lead.issue.source.startswith("https://github.com/NVIDIA/libnvidia-container/blob/"
                                        "63d366ee3b4183513c310ac557bf31b05b83328f/src/utils.c#L")


def test_one_go_message_printed_with_v_and_w_is_one_lead_over_all_its_releases():
    """`%v` (1.14, 1.15) and `%w` (1.16 on) print the same: one lead, 1.14.6..1.20.0."""
    (lead,) = leads(diagnose_log(str(REAL / "toolkit-1239-cdi-unresolvable.log"), ISSUES)).values()
    assert lead.detail.startswith("NVIDIA Container Toolkit 1.14.6..1.20.0, internal/oci/runtime_modifier.go:")


def test_pasting_does_not_hide_what_the_stack_said():
    """A rank prefix, docker's escaped quoting, and a wording the curated signature takes (it stays a verdict)."""
    log = ("[rank0]: docker: Error response from daemon: ... stderr: nvidia-container-cli: mount error: "
           "mount operation failed: /proc/driver/nvidia: permission denied\\\\n\\\"\": unknown.\n"
           "nvidia-container-cli: initialization error: driver rpc error: failed to process request: unknown.\n")
    findings = diagnose_text(log, ISSUES)
    assert {f.issue.id for f in findings if f.explained} == {"container-runtime-no-driver"}
    (lead,) = leads(findings).values()
    assert lead.title == "libnvidia-container said: mount operation failed: %s" and lead.ranks == ["rank 0"]


def test_the_clean_real_logs_get_no_container_lead(cli, tmp_path):
    clean = [e["file"] for e in load_yaml((LOGS / "INDEX.yaml").read_text())["logs"] if not e["expected"]]
    assert len(clean) >= 12
    assert [f for name in clean for f in leads(diagnose_log(str(LOGS / name), ISSUES))] == []
    log = tmp_path / "healthy.log"
    log.write_text("INFO[0000] Loading config from /etc/nvidia-container-runtime/config.toml\n"
                   "INFO[0000] Using low-level runtime /usr/bin/runc\nnvidia-container-cli: version 1.17.2\n")
    result = cli("doctor", "--json", log)
    assert (result.returncode, json.loads(result.stdout)["findings"]) == (0, [])


def test_the_toolkit_s_own_cuda_check_is_the_curated_verdict():
    """CSV mode (Jetson): the toolkit's `requirements not met: unsatisfied condition: cuda>=X (cuda=Y)`
    is the same refusal as nvidia-container-cli's requirement error."""
    log = ("docker: Error response from daemon: failed to create shim task: OCI runtime create failed: failed to "
           "create NVIDIA Container Runtime: failed to construct OCI spec modifier: requirements not met: "
           "unsatisfied condition: cuda>=12.4 (cuda=12.2): unknown.\n")
    assert {f.issue.id for f in diagnose_text(log, ISSUES) if f.explained} == {"container-cuda-requirement"}
