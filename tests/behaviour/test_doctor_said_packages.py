"""What DeepSpeed and Triton said, known only to their catalogues: doctor names the wording, the
releases that print it, the source file:line and the values it was filled with, and guesses no
cause; a lead, not a verdict, exactly like what torch.distributed said. Triton's `out of resource:
shared memory`, seen in six real threads, now has a curated signature (`triton-shared-memory`).

tests/fixtures/package-said holds real logs of public threads (INDEX.yaml gives each one's URL);
tests/fixtures/logs/deepspeed-4889-jit-failed.log is DeepSpeed's launcher on a real failed JIT
build. The short logs written here add what pasting does to real wordings of the catalogues.
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import diagnose_log, diagnose_text, load_issues

ISSUES = load_issues(ROOT / "matrices")
REAL = ROOT / "tests" / "fixtures" / "package-said"
LOGS = ROOT / "tests" / "fixtures" / "logs"
INDEX = load_yaml((REAL / "INDEX.yaml").read_text())["logs"]
PACKAGES = ("deepspeed-said", "triton-said")


def leads(findings) -> dict:
    return {f.title: f for f in findings if f.issue.id in PACKAGES}


WITHOUT = [i for i in ISSUES if i.id != "triton-shared-memory"]  # doctor before the curated signature


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_triton_shared_memory_failures_get_the_curated_verdict_naming_the_sizes(entry):
    """Six real threads (five of Triton 3.x's wording, one older): the curated `triton-shared-memory`
    (family resources) names what the kernel needs and what the GPU allows, says no image prevents
    it, and takes the line from the catalogue, so no triton-said lead is left."""
    findings = diagnose_log(str(REAL / entry["file"]), ISSUES)
    assert sorted({f.issue.id for f in findings if f.explained}) == entry["verdicts"], entry["cause"]
    assert [f.title for f in findings if not f.explained] == entry["said"], entry["cause"]
    (verdict,) = [f for f in findings if f.explained]
    assert {name: values for name, values in verdict.parts.items()} == {k: [v] for k, v in entry["parts"].items()}
    assert verdict.issue.family == "resources" and "no image can prevent it" in verdict.text("cause")
    assert f"needs {entry['parts']['required']} bytes" in verdict.detail and "num_stages" in verdict.text("fix")
    assert entry["source"].startswith("https://github.com/")


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_without_the_curated_signature_they_are_what_triton_said(entry):
    """The catalogue's lead stays what it was: the wording of the shipped releases with its values;
    the older wording (painless-35) is attributed to none of them."""
    findings = diagnose_log(str(REAL / entry["file"]), WITHOUT)
    assert not [f for f in findings if f.explained], entry["cause"]
    assert len(findings) == (1 if entry["values"] else 0), entry["cause"]
    for name, value in entry["values"].items():
        assert all(f"; {name}: {value}" in f.detail for f in findings), entry["cause"]
    assert all(f.issue.id == "triton-said" and f.text("cause").startswith("not yet explained:") for f in findings)
    assert all(f.title.startswith("Triton said: out of resource: %s, Required: %s") for f in findings)


def test_a_triton_lead_names_the_releases_the_wheel_file_and_the_line_in_the_repository():
    (lead,) = leads(diagnose_log(str(REAL / "monkeyocr-86-out-of-resource.log"), WITHOUT)).values()
    assert lead.detail.startswith("Triton 3.0.0..3.9.0, triton/runtime/errors.py:22; ")
    assert lead.issue.source == "https://github.com/triton-lang/triton/blob/v3.9.0/python/triton/runtime/errors.py#L22"
    assert "raised as OutOfResources" in lead.text("cause") and "does not guess" in lead.text("cause")


def test_deepspeeds_launcher_on_a_real_failed_build_is_a_lead_beside_the_verdict():
    """DeepSpeed#4889: the JIT build failed (the verdict); the launcher's `exits with return code` is what DeepSpeed said."""
    findings = diagnose_log(str(LOGS / "deepspeed-4889-jit-failed.log"), ISSUES)
    assert {f.issue.id for f in findings if f.explained} == {"jit-compile-failed"}
    (lead,) = leads(findings).values()
    assert lead.title == "DeepSpeed said: %s exits with return code = %s" and lead.issue.id == "deepspeed-said"
    assert lead.detail.startswith("DeepSpeed 0.15.4..0.19.8, deepspeed/launcher/launch.py:259; ")
    assert lead.issue.source == "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/launcher/launch.py#L259"


def test_pasting_does_not_hide_what_deepspeed_said():
    """A rank prefix, a timestamp and ANSI colours around a real wording of builder.py."""
    log = ("[rank1]:[2026-01-02 10:00:00] \x1b[31mRuntimeError: Unable to JIT load the evoformer_attn op due to it not "
           "being compatible due to hardware/software issue. None\x1b[0m\n[rank0]: step 10 loss 1.0\n")
    (lead,) = leads(diagnose_text(log, ISSUES)).values()
    assert lead.ranks == ["rank 1"] and lead.other_ranks == ["rank 0"]
    assert lead.detail.startswith("DeepSpeed 0.15.4..0.19.8, op_builder/builder.py:")
    assert "; s1: evoformer_attn; s2: None" in lead.detail


def test_deepspeeds_start_up_warnings_and_prints_are_not_leads(cli, tmp_path):
    """What every healthy DeepSpeed start prints (the op builders' [WARNING]s, the time to load an op)
    is catalogued (WARNING, PRINT) but not reported."""
    log = tmp_path / "clean.log"
    log.write_text(" [WARNING]  async_io requires the dev libaio .so object and headers but these were not found.\n"
                   " [WARNING]  sparse_attn requires a torch version >= 1.5 and < 2.0 but detected 2.4\n"
                   "Time to load fused_adam op: 0.0021 seconds\n")
    result = cli("doctor", "--json", log)
    assert (result.returncode, json.loads(result.stdout)["findings"]) == (0, [])


def test_the_clean_real_logs_get_no_deepspeed_or_triton_lead():
    clean = [e["file"] for e in load_yaml((LOGS / "INDEX.yaml").read_text())["logs"] if not e["expected"]]
    assert len(clean) >= 12
    assert [f for name in clean for f in leads(diagnose_log(str(LOGS / name), ISSUES))] == []


def test_a_malformed_package_catalogue_is_a_one_paragraph_error_naming_it(tmp_path):
    from envbuild.doctor.said import load_said
    from envbuild.base.errors import EnvbuildError
    (tmp_path / "catalogues").mkdir()
    (tmp_path / "catalogues" / "triton.yaml").write_text(
        "messages: [{level: RAISE, error: X, text: 'a message long enough to be matched alone', line: 3}]\n")
    with pytest.raises(EnvbuildError, match="catalogue"):
        load_said(tmp_path)
