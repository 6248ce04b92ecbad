"""What NCCL said, known only to its catalogue: doctor names the message, the releases that print
that wording, the source line and the rank, and guesses no cause; it is a lead, not a verdict.

Two real logs of the fixture set (tests/fixtures/logs/INDEX.yaml gives their threads) hold NCCL
WARN lines no curated signature explains; the short logs written here add what pasting does
(rank prefixes, timestamps, ANSI colours) to real NCCL wordings from the catalogue.
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import diagnose_log, diagnose_text, load_issues

ISSUES = load_issues(ROOT / "matrices")
LOGS = ROOT / "tests" / "fixtures" / "logs"


def said(findings):
    return {f.title: f for f in findings if not f.explained}


def test_real_ib_warnings_are_named_with_their_source_line():
    """NVIDIA/nccl#451: a container that cannot open two HCAs; the fallback is the verdict, the
    WARN lines NCCL printed before it are what it said, with where NCCL prints them."""
    findings = diagnose_log(str(LOGS / "nccl-451-ib-container-socket.log"), ISSUES)
    assert [f.issue.id for f in findings if f.explained] == ["nccl-socket-fallback"]
    leads = said(findings)
    device = leads["NCCL said: NET/IB : Unable to open device %s"]
    assert device.detail == "NCCL 2.20.5..2.30.7, src/transport/net_ib/init.cc:334; s1: mlx5_bond_0"
    assert device.text("cause").startswith("not yet explained:") and device.certainty == "certain"
    assert device.issue.source.endswith("/blob/v2.30.7-1/src/transport/net_ib/init.cc#L334")
    assert "NCCL said: Call to %s failed" in leads


def test_a_clean_log_with_nccl_warnings_gets_leads_and_exit_0(cli):
    """A healthy run's `Call to ibv_open_device failed` (a HCA the pod cannot open) is no verdict."""
    result = cli("doctor", "--json", LOGS / "imagereward-65-ib-partial-clean.log")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)["findings"]
    assert found and {f["family"] for f in found} == {"unexplained"}
    assert all(f["id"] == "nccl-said" and "src/" in f["detail"] for f in found)


def test_pasting_does_not_hide_what_nccl_said():
    """Rank prefixes, timestamps, hostnames and ANSI colours around a real NCCL 2.23-2.28 wording."""
    log = ("[rank3]:[2026-01-02 10:00:00] \x1b[31mnode7:1234:1299 [3] transport/net_ib.cc:212 NCCL WARN "
           "NET/IB : mlx5_0:1 Got async error event: port error\x1b[0m\n"
           "[rank0]: step 10 loss 1.0\n")
    (lead,) = said(diagnose_text(log, ISSUES)).values()
    assert lead.ranks == ["rank 3"] and lead.other_ranks == ["rank 0"]
    assert lead.title == "NCCL said: NET/IB : %s:%d Got async error event: %s"
    assert lead.detail == "NCCL 2.23.4..2.28.3, src/transport/net_ib.cc:212; s1: mlx5_0; d2: 1; s3: port error"


def test_a_curated_signature_takes_its_line_before_the_catalogue():
    log = "node1:4242:4300 [0] net.cc:349 NCCL WARN Failed to initialize any NET plugin\n"
    assert [f.issue.id for f in diagnose_text(log, ISSUES)] == ["nccl-net-not-found"]


def test_nccl_info_lines_and_unknown_warnings_are_not_leads():
    """NCCL_DEBUG=INFO prints hundreds of INFO lines in a healthy job; a WARN wording no shipped
    release prints is not attributed to NCCL."""
    log = ("node1:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.1<0>\n"
           "node1:1:2 [0] NCCL WARN this wording is in no NCCL release at all\n")
    assert said(diagnose_text(log, ISSUES)) == {}


def test_a_cuda_error_name_is_named_with_its_header_documentation():
    """cupy prints the runtime's name (`cudaErrorNoDevice: no CUDA-capable device is detected`);
    the catalogue gives its value, the header line and what the header says it means."""
    log = "cupy_backends.cuda.api.runtime.CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected\n"
    (lead,) = said(diagnose_text(log, ISSUES)).values()
    assert lead.title == "CUDA said: cudaErrorNoDevice (100)" and lead.issue.id == "cuda-said"
    assert lead.detail.startswith("CUDA 12.1.105..13.2.86, include/driver_types.h:")
    assert "no CUDA-capable devices were detected" in lead.text("cause")
    assert lead.text("cause").startswith("not yet explained:")


def test_a_cuda_error_a_curated_signature_knows_is_its_verdict():
    log = "jax: CUDA_ERROR_SYSTEM_NOT_READY: system not yet initialized\n"
    assert [f.issue.id for f in diagnose_text(log, ISSUES)] == ["fabric-manager"]


def test_a_name_that_is_no_cuda_error_is_not_a_lead():
    assert said(diagnose_text("cudaErrorMadeUpForThisTest happened\nCUDA_ERROR_\n", ISSUES)) == {}


REAL = ROOT / "tests" / "fixtures" / "said"
INDEX = load_yaml((REAL / "INDEX.yaml").read_text())["logs"]


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_nccl_failures_get_their_verdict_and_what_nccl_said(entry):
    """Real logs of public threads: the curated verdicts, and every other NCCL WARN named with its source file."""
    findings = diagnose_log(str(REAL / entry["file"]), ISSUES)
    assert sorted({f.issue.id for f in findings if f.explained}) == sorted(entry["verdicts"]), entry["cause"]
    leads = sorted(f"{f.title.removeprefix('NCCL said: ')} {f.detail.split(', ')[1].split(':')[0]}"
                   for f in findings if not f.explained)
    assert leads == sorted(entry["said"]), entry["cause"]
    assert entry["source"].startswith("https://github.com/")


@pytest.mark.parametrize("file, status, peer, words", [
    ("nccl-1405-ib-completion.log", "12", "10.216.210.236<54862>", "ran out of retries"),
    ("nccl-1664-ibp-completion.log", "12", "7.6.13.83<36315>", "ran out of retries"),
    ("nccl-1814-ib-completion-then-flush.log", "5", "172.36.143.59<44206>", "already broken"),
    ("nccl-928-ib-completion-old-wording.log", "4", "fe80::966d:ae03:8b:df78%ib0<53249>", "refused access"),
])
def test_an_ib_completion_error_names_its_status_and_peer(file, status, peer, words):
    findings = [f for f in diagnose_log(str(REAL / file), ISSUES) if f.issue.id == "ib-completion-error"]
    (finding,) = [f for f in findings if f.parts["status"] == [status]]
    assert words in finding.title and peer in finding.title and finding.certainty == "likely"


MEASURE_START, MEASURE_END = "<!-- catalogue-measure: tests/behaviour/test_doctor_said.py -->", "<!-- /catalogue-measure -->"
# How each launcher call's message reaches a log (srun's and slurmstepd's prefixes, enroot's).
LAUNCHER_LINE = {"error": "srun: error: ", "fatal": "srun: fatal: ", "slurm_error": "slurmstepd: error: ",
                 "PMIXP_ERROR": "slurmstepd: error:  mpi/pmix_v4: f: host [0]: x.c:1: ",
                 "PMIXP_ERROR_STD": "slurmstepd: error:  mpi/pmix_v4: f: host [0]: x.c:1: ",
                 "PMIXP_ERROR_NO": "slurmstepd: error:  mpi/pmix_v4: f: host [0]: x.c:1: ",
                 "PMIXP_ABORT": "slurmstepd: error:  mpi/pmix_v4: f: host [0]: x.c:1: ",
                 "common::err": "[ERROR] ", "common::log": "[ERROR] ", "err": "enroot-mount: ", "errx": "enroot-mount: "}
# How the container stack's messages reach a log: nvidia-container-cli's own (warnx ...) after its name, the
# library's inside one of them; the toolkit's Go errors chained after the runtime's.
CONTAINER_LINE = {"libnvidia-container": ("nvidia-container-cli: ", "nvidia-container-cli: mount error: "),
                  "container-toolkit": ("failed to create NVIDIA Container Runtime: ",) * 2,
                  "apptainer": ("FATAL:   container creation failed: ",) * 2}


def container_line(component: str, message: dict) -> str:
    """A line the container stack prints with a catalogued wording (sample values filled in)."""
    from envbuild.doctor.said import CONTAINERS, CONVERSION, GO, _torch_line, go_printed
    own, inner = CONTAINER_LINE[component]
    prefix = own if message["call"] in ("warnx", "warn", "errx", "err") else inner
    text = go_printed(_torch_line(message["text"])) if component in GO else message["text"]
    suffix = CONTAINERS[component][2].get(message["call"], ("", ""))[1]
    return prefix + CONVERSION.sub(lambda c: SAMPLE.get(c.group("kind"), "0"), text + suffix)


SAMPLE = {"s": "x", "d": "0", "i": "0", "u": "0", "x": "1a", "X": "1A", "p": "0x1", "f": "1.0", "g": "1.0", "c": "c", "%": "%"}


def family_accuracy() -> list[tuple[str, int, int]]:
    """Per family, over the project's real logs (tests/fixtures/logs, said, package-said, launcher-said, xid): the
    logs whose thread names a cause of that family (or nothing, for the clean ones), and how many of
    them doctor gives exactly the verdicts the thread names."""
    from envbuild.doctor import load_catalogue
    issues, _ = load_catalogue(ROOT / "matrices")
    from envbuild.doctor.said import XID_FAMILY
    family = {i.id: i.family for i in issues} | {"gpu-xid": XID_FAMILY}  # the Xids' verdicts come from their catalogue
    counts: dict[str, list[int]] = {}
    folders = ((LOGS, "expected"), (REAL, "verdicts"), (ROOT / "tests" / "fixtures" / "package-said", "verdicts"),
               (ROOT / "tests" / "fixtures" / "launcher-said", "verdicts"), (ROOT / "tests" / "fixtures" / "xid", "verdicts"))
    for folder, key in folders:
        for entry in load_yaml((folder / "INDEX.yaml").read_text())["logs"]:
            got = sorted({f.issue.id for f in diagnose_log(str(folder / entry["file"]), issues) if f.explained})
            for name in {family[i] for i in entry[key]} or {"(clean: nothing to find)"}:
                count = counts.setdefault(name, [0, 0])
                count[0] += 1
                count[1] += got == sorted(entry[key])
    return [(name, n, right) for name, (n, right) in sorted(counts.items())]


def catalogue_share() -> list[tuple[str, int, int]]:
    """Per component and level, the catalogued messages a curated signature matches (a rendering of
    each wording with sample values, or the error's name), of all catalogued."""
    import re

    from envbuild.doctor.said import CONTAINERS, CONVERSION, LAUNCHERS, PYTHON, TORCH_REPORTED, _torch_line, printed
    patterns = [re.compile(i.pattern) for i in ISSUES]
    nccl = load_yaml((ROOT / "matrices" / "catalogues" / "nccl.yaml").read_text())
    cuda = load_yaml((ROOT / "matrices" / "catalogues" / "cuda.yaml").read_text())
    lines: dict[str, list[str]] = {}
    for m in nccl["messages"]:
        text = CONVERSION.sub(lambda c: SAMPLE.get(c.group("kind"), "0"), m["text"])
        label = {"RESULT": "NCCL ncclResult_t messages"}.get(m["level"], f"NCCL {m['level']} format strings")
        lines.setdefault(label, []).append(text if m["level"] == "RESULT" else f"host:1:2 [0] NCCL {m['level']} {text}")
    for e in cuda["errors"]:
        lines.setdefault(f"CUDA {'cudaError_t' if e['api'] == 'runtime' else 'CUresult'} names", []).append(e["name"])
    for name, (title, levels, _, _) in LAUNCHERS.items():
        for m in load_yaml((ROOT / "matrices" / "catalogues" / f"{name}.yaml").read_text())["messages"]:
            if m["level"] in levels:
                text = CONVERSION.sub(lambda c: SAMPLE.get(c.group("kind"), "0"), printed(m["text"]))
                lines.setdefault(f"{title} {m['level']} format strings", []).append(LAUNCHER_LINE[m["call"]] + text)
    for name, (title, _, _) in PYTHON.items():  # what each package raises or logs as an error
        for m in load_yaml((ROOT / "matrices" / "catalogues" / f"{name}.yaml").read_text())["messages"]:
            if m["level"] in TORCH_REPORTED:
                text = CONVERSION.sub(lambda c: SAMPLE.get(c.group("kind"), "0"), _torch_line(m["text"]))
                lines.setdefault(f"{title} {m['level']} messages", []).append(text)
    for name, (title, levels, _) in CONTAINERS.items():
        for m in load_yaml((ROOT / "matrices" / "catalogues" / f"{name}.yaml").read_text())["messages"]:
            if m["level"] in levels:
                lines.setdefault(f"{title} {m['level']} messages", []).append(container_line(name, m))
    return [(label, len(set(texts)), sum(any(p.search(t) for p in patterns) for t in set(texts)))
            for label, texts in sorted(lines.items())]


def render_measurement() -> str:
    rows = ["| family | real logs | doctor right |", "|---|---|---|"]
    rows += [f"| `{name}` | {n} | {right} ({100 * right // n}%) |" for name, n, right in family_accuracy()]
    rows += ["", "| catalogue | distinct messages | with a curated signature |", "|---|---|---|"]
    rows += [f"| {label} | {n} | {curated} ({100 * curated / n:.1f}%) |" for label, n, curated in catalogue_share()]
    return "\n".join(rows)


def test_docs_state_accuracy_by_family_and_the_curated_share_of_each_catalogue():
    text = (ROOT / "docs" / "doctor.md").read_text()
    table = text[text.index(MEASURE_START) + len(MEASURE_START):text.index(MEASURE_END)].strip()
    assert table == render_measurement(), "regenerate: python3 -c 'import sys; sys.path[:0]=[\"tests/behaviour\", \"tests\", \".\"]; " \
                                          "import test_doctor_said as t; print(t.render_measurement())'"


@pytest.mark.parametrize("text", [
    "messages: [{level: WARN, text: 'Call to %s failed'}]\n",  # no file, line or releases
    "messages: [{level: WARN, text: 'Call to %s failed', file: a.cc, line: seven, releases: '2.30.7'}]\n",
    "messages: [unclosed\n",
])
def test_a_malformed_catalogue_is_a_one_paragraph_error_naming_it(tmp_path, text):
    from envbuild.doctor.said import load_said
    from envbuild.base.errors import EnvbuildError
    (tmp_path / "catalogues").mkdir()
    (tmp_path / "catalogues" / "nccl.yaml").write_text(text)
    with pytest.raises(EnvbuildError, match="catalogue"):
        load_said(tmp_path)


def test_per_rank_logs_give_one_lead_per_wording_with_every_rank_and_no_rank_order(tmp_path, cli):
    """Two ranks' logs print the same NCCL warning: one lead naming both ranks; it decides no
    first rank to fail (a lead is not a verdict) and the run is exit 0."""
    for rank in (0, 1):
        (tmp_path / f"job-{rank}.out").write_text(
            f"step 1\nnode{rank}:1:2 [0] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'\n")
    (tmp_path / "job-2.out").write_text("step 1\nstep 2\n")
    result = cli("doctor", "--json", tmp_path)
    report = json.loads(result.stdout)
    (lead,) = report["findings"]
    assert result.returncode == 0 and lead["id"] == "nccl-said"
    assert (lead["rank"], lead["other_ranks"], lead["count"]) == (["task 0", "task 1"], ["task 2"], 2)
    assert report["order"] is None or not report["order"]["first_to_fail"]
