"""What Slurm, enroot and pyxis said, known only to their catalogues: doctor names the wording, the
releases that print it, the source file:line and the values it was filled with, and guesses no
cause; a lead, not a verdict, exactly like what NCCL said.

The real logs are those of tests/fixtures/logs (INDEX.yaml gives each one's thread); the short logs
written here add what pasting does to real wordings of the catalogues.
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import diagnose_log, diagnose_text, load_issues

ISSUES = load_issues(ROOT / "matrices")
LOGS = ROOT / "tests" / "fixtures" / "logs"
LAUNCHERS = ("slurm-said", "enroot-said", "pyxis-said")


def leads(findings) -> dict:
    return {f.title: f for f in findings if f.issue.id in LAUNCHERS}


@pytest.mark.parametrize("file, verdict, said", [
    ("pyxis-127-sqsh-path.log", "pyxis-squashfs-path",
     {"pyxis said: pyxis: child %d failed with error code: %d", "pyxis said: pyxis: printing enroot log file:",
      "Slurm said: Failed to invoke spank plugin stack", "Slurm said: %s: %s %s: Exited with exit code %d"}),
    ("enroot-256-squashfs.log", "pyxis-container-failed",
     {"pyxis said: pyxis: child %d failed with error code: %d", "pyxis said: pyxis: printing enroot log file:",
      "Slurm said: Failed to invoke spank plugin stack"}),
    ("executorlib-761-pmix-plugin.log", "slurm-pmi", {"Slurm said: Invalid MPI type '%s', --mpi=list for acceptable types"}),
])
def test_real_launcher_failures_keep_their_verdict_and_name_what_the_launcher_said(file, verdict, said):
    findings = diagnose_log(str(LOGS / file), ISSUES)
    assert {f.issue.id for f in findings if f.explained} == {verdict}
    assert set(leads(findings)) == said
    assert all(not f.explained and f.issue.family == "unexplained" and f.text("cause").startswith("not yet explained:")
               for f in leads(findings).values())


def test_a_lead_names_the_component_releases_source_line_and_values():
    (lead,) = [f for f in diagnose_log(str(LOGS / "pyxis-127-sqsh-path.log"), ISSUES)
               if f.title == "pyxis said: pyxis: child %d failed with error code: %d"]
    assert lead.issue.id == "pyxis-said"
    assert lead.detail.startswith("pyxis 0.19.0..0.24.0, ") and "; d1: 10028; d2: 1" in lead.detail
    assert lead.issue.source.startswith("https://github.com/NVIDIA/pyxis/blob/v0.24.0/")
    assert "does not guess" in lead.text("cause")


def test_pasting_does_not_hide_what_the_launchers_said():
    """A hostname after slurmstepd, a rank prefix, pmix's own prefix and strerror suffix, enroot's
    ANSI-coloured [ERROR] (run by hand: inside pyxis's relay the curated pyxis-enroot-error takes
    it), Slurm's %m and a slurmd log's bracketed prefix."""
    log = ("[rank1]: slurmstepd-gpu07: error:  mpi/pmix_v4: pmixp_usock_create_srv: gpu07 [1]: pmixp_utils.c:97: "
           "Cannot create UNIX socket: Too many open files (24)\n"
           "\x1b[31m[ERROR]\x1b(B\x1b[m Could not acquire rootfs lock\n"
           "srun: error: Unable to create step for job 4242: Job/step already completing or completed\n"
           "[2025-01-02T10:00:00.000] [4242.0] error: *** STEP 4242.0 ON gpu07 CANCELLED AT 2025-01-02T10:00:00 ***\n")
    found = leads(diagnose_text(log, ISSUES))
    pmix = found["Slurm said: Cannot create UNIX socket"]
    assert "; s1: Too many open files; d2: 24" in pmix.detail and pmix.ranks == ["rank 1"]
    assert found["enroot said: Could not acquire rootfs lock"].issue.id == "enroot-said"
    step = found["Slurm said: Unable to create step for job %u: %m"]
    assert step.detail.startswith("Slurm 22.05.11..24.11.7, src/srun/launch.c:")
    assert "; u1: 4242; s2: Job/step already completing or completed" in step.detail
    assert "Slurm said: *** %s ON %s CANCELLED AT %s ***" in found


def test_info_lines_other_programs_errors_and_unknown_wordings_are_not_leads(cli, tmp_path):
    """srun's info and pyxis's spank_log lines are in healthy jobs; `error:` from another program, or a
    wording no catalogued release prints, is not attributed to a launcher."""
    log = tmp_path / "clean.log"
    log.write_text("pyxis: imported docker image: nvcr.io#nvidia/pytorch:24.05-py3\n"
                   "srun: Step created for StepId=4242.0\n"
                   "srun: Job 4242 step creation temporarily disabled, retrying (Requested nodes are busy)\n"
                   "gcc: error: Unable to create step for job in a way no release words\n"
                   "CUDA error: Cannot create UNIX socket\n"
                   "[INFO] Extracting squashfs filesystem...\n")
    result = cli("doctor", "--json", log)
    assert (result.returncode, json.loads(result.stdout)["findings"]) == (0, [])


def test_a_launcher_lead_alone_does_not_make_the_exit_status_a_verdict(cli, tmp_path):
    log = tmp_path / "job.out"
    log.write_text("srun: error: Unable to create step for job 4242: Invalid generic resource (gres) specification\n")
    result = cli("doctor", "--json", log)
    (lead,) = json.loads(result.stdout)["findings"]
    assert result.returncode == 0 and lead["id"] == "slurm-said" and lead["family"] == "unexplained"


def test_the_clean_real_logs_get_no_launcher_lead():
    clean = [e["file"] for e in load_yaml((LOGS / "INDEX.yaml").read_text())["logs"] if not e["expected"]]
    assert len(clean) >= 12
    assert [f for name in clean for f in leads(diagnose_log(str(LOGS / name), ISSUES))] == []


def test_a_malformed_launcher_catalogue_is_a_one_paragraph_error_naming_it(tmp_path):
    from envbuild.doctor.said import load_said
    from envbuild.base.errors import EnvbuildError
    (tmp_path / "catalogues").mkdir()
    (tmp_path / "catalogues" / "slurm.yaml").write_text(
        "messages: [{level: ERROR, call: error, text: 'a message long enough to be matched alone', line: 3}]\n")
    with pytest.raises(EnvbuildError, match="catalogue"):
        load_said(tmp_path)


TIME_LIMIT = ROOT / "tests" / "fixtures" / "launcher-said"
TIME_LIMIT_INDEX = load_yaml((TIME_LIMIT / "INDEX.yaml").read_text())["logs"]


@pytest.mark.parametrize("entry", TIME_LIMIT_INDEX, ids=[e["file"] for e in TIME_LIMIT_INDEX])
def test_real_time_limit_cancellations_are_the_curated_verdict_naming_the_job(entry):
    """Six threads of six projects: slurmstepd's `*** JOB|STEP N ON HOST CANCELLED AT T DUE TO TIME
    LIMIT ***` (req.c) is `slurm-time-limit` (family resources), naming the job or step and the
    node, and no longer only what Slurm said."""
    findings = diagnose_log(str(TIME_LIMIT / entry["file"]), ISSUES)
    assert sorted({f.issue.id for f in findings if f.explained}) == entry["verdicts"], entry["cause"]
    assert sorted({f.title for f in findings if not f.explained}) == entry["said"], entry["cause"]
    verdict = next(f for f in findings if f.explained)
    for name, value in entry["parts"].items():
        assert value in [v for f in findings if f.explained for v in f.parts.get(name, [])], (name, entry["cause"])
    assert verdict.issue.family == "resources" and "--time" in verdict.text("fix")
    assert entry["source"].startswith("https://github.com/")


def test_without_the_curated_signature_a_time_limit_was_only_what_slurm_said():
    without = [i for i in ISSUES if i.id != "slurm-time-limit"]
    findings = diagnose_log(str(TIME_LIMIT / "canu-1052-time-limit.log"), without)
    (lead,) = leads(findings).values()
    assert lead.title == "Slurm said: *** %s ON %s CANCELLED AT %s DUE TO TIME LIMIT ***"
    assert lead.detail.startswith("Slurm 22.05.11..24.11.7, src/slurmd/slurmstepd/req.c:")


def test_a_sigkill_after_the_time_limit_is_slurm_s_not_the_oom_killer():
    log = ("[rank0]: step 4000 loss 1.2\n"
           "slurmstepd: error: *** STEP 77.0 ON gpu3 CANCELLED AT 2026-01-02T10:00:00 DUE TO TIME LIMIT ***\n"
           "torch.distributed.elastic.multiprocessing.api: failed (exitcode: -9) local_rank: 0 (pid: 12) of binary: python\n")
    assert {f.issue.id for f in diagnose_text(log, ISSUES) if f.explained} == {"slurm-time-limit"}


def test_the_clean_real_logs_get_neither_new_signature():
    """0 hits of the signatures added from the catalogues on the clean logs (scary words, healthy runs)."""
    clean = [e["file"] for e in load_yaml((LOGS / "INDEX.yaml").read_text())["logs"] if not e["expected"]]
    assert len(clean) >= 12
    hits = [(name, f.issue.id) for name in clean for f in diagnose_log(str(LOGS / name), ISSUES)
            if f.issue.id in ("slurm-time-limit", "triton-shared-memory")]
    assert hits == []
