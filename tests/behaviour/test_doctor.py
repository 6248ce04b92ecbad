"""`envbuild doctor` against real logs from public issue threads, and its input handling.

The real logs are tests/fixtures/logs/*.log, each listed in INDEX.yaml with its source URL,
the cause the thread names and the verdict doctor must give; docs/doctor.md shows the same
table. The other tests use short logs written here for the behaviour no fixture shows alone
(a rank hidden by ranks that loaded, a lock line followed by healthy training, DeepSpeed's
cpu_adam named near a SIGILL); each says so.
"""

import bz2
import gzip
import json
import lzma
import os
import re
from pathlib import Path

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import LogReader, diagnose_log, diagnose_text, load_issues
from envbuild.doctor.reading import MAX_LINE
from envbuild.doctor.signatures import literal_guard
from envbuild.base.errors import EnvbuildError

ISSUES = load_issues(ROOT / "matrices")
LOGS = ROOT / "tests" / "fixtures" / "logs"
INDEX = load_yaml((LOGS / "INDEX.yaml").read_text())["logs"]


def ids(findings):
    """The curated verdicts: what NCCL only said (its catalogue's `nccl-said` leads, not yet
    explained) is measured by tests/behaviour/test_doctor_said.py, not scored as a verdict here."""
    return [f.issue.id for f in findings if f.explained]


def by_id(findings, issue_id):
    return next(f for f in findings if f.issue.id == issue_id)


# --- the real logs --------------------------------------------------------------------------


DOC = ROOT / "docs" / "doctor.md"
TABLE_START, TABLE_END = "<!-- doctor-table:start -->", "<!-- doctor-table:end -->"


def verdict(found) -> str:
    return ", ".join(f"`{i}`" for i in sorted(found)) or "nothing"


SETS = (("fit", None), ("held-out", "held-out"), ("held-out (issue 16)", "held-out-16"),
        ("held-out (issue 18: CUDA extensions)", "held-out-18"), ("issue 33: families (fit)", "fit-33"),
        ("held-out (issue 33)", "held-out-33"))
FIRST_TRY = {"held-out-16", "held-out-33"}  # sets scored on their first run, before any change


def said_now(entry) -> list[str]:
    return sorted(set(ids(diagnose_log(str(LOGS / entry["file"]), ISSUES))))


def precision_recall(rows) -> list[str]:
    """Per signature over every log: how often the thread's cause is it, how often doctor says it, how often both."""
    table = {}
    for expected, found in rows:
        for issue_id in set(expected) | set(found):
            cause, said, right = table.get(issue_id, (0, 0, 0))
            table[issue_id] = (cause + (issue_id in expected), said + (issue_id in found),
                               right + (issue_id in expected and issue_id in found))
    lines = ["| signature | logs whose cause it is | logs doctor flags with it | right | precision | recall |",
             "|---|---|---|---|---|---|"]
    for issue_id, (cause, said, right) in sorted(table.items()) + [("all", tuple(map(sum, zip(*table.values()))))]:
        name = f"`{issue_id}`" if issue_id != "all" else "**all**"
        precision = f"{right / said:.0%}" if said else "-"
        recall = f"{right / cause:.0%}" if cause else "-"
        lines.append(f"| {name} | {cause} | {said} | {right} | {precision} | {recall} |")
    clean = [found for expected, found in rows if not expected]
    lines += ["", f"Logs whose cause is no known signature: {len(clean)}; doctor flags "
                  f"{sum(1 for found in clean if found)} of them."]
    return lines


FAMILY = {issue.id: issue.family for issue in ISSUES}


def family_accuracy(rows) -> list[str]:
    """Per family over every log: how often the thread's cause is in it, how often doctor names it,
    how often both, and how often doctor's answer was exactly the expected signatures."""
    table: dict[str, list[int]] = {}
    for expected, found in rows:
        cause_families, said_families = {FAMILY[i] for i in expected}, {FAMILY[i] for i in found}
        for family in cause_families | said_families:
            counts = table.setdefault(family, [0, 0, 0, 0])
            counts[0] += family in cause_families
            counts[1] += family in said_families
            counts[2] += family in cause_families and family in said_families
            counts[3] += family in cause_families and sorted(found) == sorted(expected)
    lines = ["| family | logs whose cause is in it | logs doctor names it for | right family | exactly right | "
             "precision | recall |", "|---|---|---|---|---|---|---|"]
    for family, (cause, said, right, exact) in sorted(table.items()) + [("all", tuple(map(sum, zip(*table.values()))))]:
        name = f"`{family}`" if family != "all" else "**all**"
        precision = f"{right / said:.0%}" if said else "-"
        recall = f"{right / cause:.0%}" if cause else "-"
        lines.append(f"| {name} | {cause} | {said} | {right} | {exact} | {precision} | {recall} |")
    clean = [found for expected, found in rows if not expected]
    lines += ["", f"Clean logs (scary words, healthy run or a cause doctor does not know): {len(clean)}; doctor "
                  f"flags {sum(1 for found in clean if found)} of them."]
    return lines


def render_table() -> str:
    """The measurement of docs/doctor.md: every INDEX entry, before and now, the scores, precision and recall."""
    lines, scores, rows = [], [], []
    for name, key in SETS:
        entries = [e for e in INDEX if e.get("set") == key]
        first_try = key in FIRST_TRY
        head = "| log | thread | cause (per the thread) | expected | before |" + (" first try |" if first_try else "") + " now |"
        lines += ["", f"**{name}** set", "", head, "|---" * (7 if first_try else 6) + "|"]
        right_before = right_first = right_now = 0
        for e in entries:
            now = said_now(e)
            rows.append((e["expected"], now))
            ok_before, ok_now = sorted(e["before"]) == sorted(e["expected"]), sorted(now) == sorted(e["expected"])
            right_before += ok_before
            right_now += ok_now
            cause = e["cause"].replace("|", "\\|")
            thread = re.sub(r"/(?:issues|pull)/", "#", e["source"].removeprefix("https://github.com/"))
            row = (f"| [{e['file']}](../tests/fixtures/logs/{e['file']}) | [{thread}]({e['source']}) "
                   f"| {cause} | {verdict(e['expected'])} | {verdict(e['before'])} {'✓' if ok_before else '✗'} |")
            if first_try:
                ok_first = sorted(e["first_try"]) == sorted(e["expected"])
                right_first += ok_first
                row += f" {verdict(e['first_try'])} {'✓' if ok_first else '✗'} |"
            lines.append(row + f" {verdict(now)} {'✓' if ok_now else '✗'} |")
        first = f", first try {right_first}/{len(entries)}" if first_try else ""
        scores.append(f"- {name}: before {right_before}/{len(entries)}{first}, now {right_now}/{len(entries)}")
    held16 = [(e["expected"], e["first_try"]) for e in INDEX if e.get("set") == "held-out-16"]
    held33 = [(e["expected"], e["first_try"]) for e in INDEX if e.get("set") == "held-out-33"]
    fit33 = [row for row, e in zip(rows, [e for _, key in SETS for e in INDEX if e.get("set") == key])
             if e.get("set") == "fit-33"]
    return "\n".join([
        "Scores (right / total):", *scores, "",
        f"Accuracy by family now, over all {len(rows)} logs:", "", *family_accuracy(rows), "",
        f"Accuracy by family of the issue-33 held-out set ({len(held33)} logs), first try (before any change made "
        "after reading them):", "", *family_accuracy(held33), "",
        f"Accuracy by family of the issue-33 fit set ({len(fit33)} logs, written against):", "",
        *family_accuracy(fit33), "",
        f"Precision and recall now, per signature, over all {len(rows)} logs:", "", *precision_recall(rows), "",
        f"Precision and recall of the issue-16 signatures on their {len(held16)} held-out logs, first try "
        "(before any change made after reading them):", "", *precision_recall(held16), *lines])


def test_docs_table_is_what_doctor_says_today():
    """docs/doctor.md's table is regenerated from INDEX.yaml and a live run; it cannot drift."""
    text = DOC.read_text()
    table = text[text.index(TABLE_START) + len(TABLE_START):text.index(TABLE_END)].strip()
    assert table == render_table(), "regenerate: python3 -c 'import sys; sys.path[:0]=[\"tests/behaviour\", \"tests\", \".\"]; import test_doctor as t; print(t.render_table())'"


def test_index_lists_every_fixture_once_with_a_source():
    listed = [entry["file"] for entry in INDEX]
    assert sorted(listed) == sorted(p.name for p in LOGS.glob("*.log")) and len(set(listed)) == len(listed)
    assert all(re.match(r"https://github\.com/[^/]+/[^/]+/(?:issues|pull)/\d+$", e["source"]) for e in INDEX)
    known = {i.id for i in ISSUES}
    fields = ("expected", "before", "first_try", "doctor_says")
    assert all(set(e.get(f, [])) <= known for e in INDEX for f in fields) and all(e["cause"] for e in INDEX)
    assert all(e.get("set") in {key for _, key in SETS} for e in INDEX)
    assert all(("first_try" in e) == (e.get("set") in FIRST_TRY) for e in INDEX)
    assert all(sorted(e["doctor_says"]) != sorted(e["expected"]) for e in INDEX if "doctor_says" in e)
    # No public log shows these two; each is tested with a short log written here (and says so).
    # peer-crashed is shown by the per-rank logs of a real gloo run made here (tests/fixtures/ranks).
    written_here = {"cpu-adam-illegal-instruction", "nccl-net-not-found", "peer-crashed"}
    # A signature comparing a log with its image runs only with a manifest: tests/behaviour/test_doctor_image.py
    # measures it on its own real logs (tests/fixtures/nccl-version).
    with_image = {i.id for i in ISSUES if i.image}
    # Signatures written from a catalogue are measured on real logs of their own threads
    # (tests/fixtures/said, package-said and launcher-said: INDEX.yaml; tests/behaviour/test_doctor_said*.py).
    from_catalogue = {i for folder in ("said", "package-said", "launcher-said")
                      for e in load_yaml((ROOT / "tests" / "fixtures" / folder / "INDEX.yaml").read_text())["logs"]
                      for i in e["verdicts"]}
    assert len(INDEX) >= 25 and known - with_image <= {i for e in INDEX for i in e["expected"]} | written_here | from_catalogue


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_real_log_verdict(entry):
    """Doctor says what the thread names as the cause; `doctor_says` marks the documented misses."""
    findings = diagnose_log(str(LOGS / entry["file"]), ISSUES)
    assert sorted(set(ids(findings))) == sorted(entry.get("doctor_says", entry["expected"])), entry["cause"]
    if "ranks" in entry:
        assert [r for f in findings for r in f.ranks] == entry["ranks"]


def test_openrlhf_208_two_spaces_after_using_is_still_the_lock():
    """Field report 2, pasted exactly: `Using  .cache/...` (two spaces) three times, nothing after."""
    finding = by_id(diagnose_log(str(LOGS / "openrlhf-208-lock.log"), ISSUES), "torch-extensions-lock")
    assert finding.line_no == 1 and finding.count == 3 and "3 of 3" in finding.detail


def test_failed_compile_is_not_called_a_stale_lock():
    for name in ("deepspeed-885-jit-failed.log", "deepspeed-1127-jit-failed.log"):
        text = (LOGS / name).read_text()
        assert "as PyTorch extensions root" in text
        assert ids(diagnose_log(str(LOGS / name), ISSUES)) == ["jit-compile-failed"]


def test_zero3_cache_has_only_variant_matches_deepspeeds_real_message():
    finding = by_id(diagnose_log(str(LOGS / "visual-rft-51-zero3.log"), ISSUES), "zero3-trace-cache")
    assert finding.count == 8 and "Invalidate trace cache @ step 0 and module 1458: cache has only 0" in finding.excerpt


def test_excerpt_is_the_carriage_return_segment_that_matched():
    """tqdm redraws with \\r; the excerpt is the message, not the progress bar before it."""
    text = "  0%|          | 0/200 [00:00<?, ?it/s]\rInvalidate trace cache @ step 0 and module 1458: cache has only 0 modules\n"
    assert by_id(diagnose_text(text, ISSUES), "zero3-trace-cache").excerpt.startswith("Invalidate")


# --- the JIT lock, rank by rank (short logs written here) --------------------------------


def test_hung_rank_is_not_hidden_by_ranks_that_loaded():
    log = "".join(f"[rank{r}]:Using /root/.cache/torch_extensions/py310_cu121 as PyTorch extensions root...\n"
                  for r in range(4))
    log += "".join(f"[rank{r}]:Loading extension module fused_adam...\n[rank{r}]:Time to load fused_adam op: 0.1 seconds\n"
                   for r in (0, 1, 3))
    finding = by_id(diagnose_text(log, ISSUES), "torch-extensions-lock")
    assert finding.ranks == ["rank 2"] and finding.other_ranks == ["rank 0", "rank 1", "rank 3"]
    assert finding.line_no == 3 and "1 of 4" in finding.detail


def test_unprefixed_ranks_are_counted():
    """8 ranks print the lock line, 7 loads follow: one load never finished."""
    log = "Using /root/.cache/torch_extensions/py39_cu117 as PyTorch extensions root...\n" * 8
    log += "Loading extension module fused_adam...\nTime to load fused_adam op: 0.2 seconds\n" * 7
    assert "1 of 8" in by_id(diagnose_text(log, ISSUES), "torch-extensions-lock").detail
    # The eighth load started: the lock is passed, but DeepSpeed never printed its `Time to load`.
    stalled = diagnose_text(log + "Loading extension module fused_adam...\n", ISSUES)
    assert ids(stalled) == ["jit-load-stalled"] and "1 of 8" in stalled[0].detail
    assert diagnose_text(log + "Loading extension module fused_adam...\nTime to load fused_adam op: 0.2 seconds\n",
                         ISSUES) == []


def test_lock_line_followed_by_healthy_training_is_not_a_hang():
    """Without a 'Loading extension module' line (it went to another stream), training went on."""
    log = "Using /tmp/ext as PyTorch extensions root...\n"
    log += "".join(f"{{'loss': {2 - i / 100:.4f}, 'learning_rate': 1e-05, 'epoch': {i / 100:.2f}}}\n" for i in range(50))
    assert diagnose_text(log, ISSUES) == []
    progress = "Using /tmp/ext as PyTorch extensions root...\n" + "Epoch 0:  12%| 40/330 [00:32<03:55, loss=2.61, v_num=0]\n"
    assert diagnose_text(progress, ISSUES) == []
    quiet = "Using /tmp/ext as PyTorch extensions root...\n" + "[INFO] still setting up\n" * 1500
    assert diagnose_text(quiet, ISSUES) == []


def test_lock_line_followed_by_a_few_lines_of_other_output_is_still_a_hang():
    log = ("[rank1]:Using /tmp/ext as PyTorch extensions root...\n"
           "[rank0]:Using /tmp/ext as PyTorch extensions root...\n[rank0]:Loading extension module cpu_adam...\n"
           + "[rank0]:[INFO] [config.py:1000:print] some option ... 1\n" * 100)
    finding = by_id(diagnose_text(log, ISSUES), "torch-extensions-lock")
    assert finding.ranks == ["rank 1"] and finding.other_ranks == ["rank 0"]


def test_srun_and_pdsh_prefixes_name_the_rank():
    srun = "0: Using /x/torch_extensions as PyTorch extensions root...\n1: Using /x/torch_extensions as PyTorch extensions root...\n0: Loading extension module utils...\n"
    assert by_id(diagnose_text(srun, ISSUES), "torch-extensions-lock").ranks == ["task 1"]
    pdsh = ("gpu1504: Using /x/torch_extensions as PyTorch extensions root...\n"
            "gpu1505: Using /x/torch_extensions as PyTorch extensions root...\n"
            "gpu1505: Loading extension module fused_adam...\n")
    assert by_id(diagnose_text(pdsh, ISSUES), "torch-extensions-lock").ranks == ["host gpu1504"]
    ray = "(WorkerDict pid=2148) RuntimeError: CUDA error: no kernel image is available for execution on the device\n"
    assert by_id(diagnose_text(ray, ISSUES), "no-kernel-image").ranks == ["WorkerDict pid 2148"]


def test_weak_prefixes_need_most_lines():
    """'RuntimeError: ' or a lone '3: ' in ordinary text is not a rank prefix."""
    text = "RuntimeError: CUDA error: no kernel image is available for execution on the device\n" + "plain line\n" * 5
    assert by_id(diagnose_text(text, ISSUES), "no-kernel-image").ranks == []


# --- illegal instruction -----------------------------------------------------------------


def test_sigill_is_blamed_on_cpu_adam_only_when_the_log_names_it():
    """Short logs written here: no real log in INDEX names cpu_adam next to a SIGILL."""
    before = "Loading extension module cpu_adam...\nTime to load cpu_adam op: 2.6 seconds\n" + "x\n" * 10 + "Illegal instruction (core dumped)\n"
    assert ids(diagnose_text(before, ISSUES)) == ["cpu-adam-illegal-instruction"]
    after = ("Fatal Python error: Illegal instruction\n\nCurrent thread 0x00007f (most recent call first):\n"
             '  File "/venv/lib/python3.10/site-packages/deepspeed/ops/adam/cpu_adam.py", line 148 in step\n')
    assert ids(diagnose_text(after, ISSUES)) == ["cpu-adam-illegal-instruction"]
    far = "Loading extension module cpu_adam...\n" + "x\n" * 200 + "Illegal instruction (core dumped)\n"
    assert ids(diagnose_text(far, ISSUES)) == ["illegal-instruction"]
    launcher = "[ERROR] [launch.py:321:sigkill_handler] ['python', 'train.py'] exits with return code = -4\n"
    assert ids(diagnose_text(launcher, ISSUES)) == ["illegal-instruction"]


def test_generic_sigill_cause_does_not_blame_deepspeed():
    finding = by_id(diagnose_log(str(LOGS / "ktransformers-265-sigill.log"), ISSUES), "illegal-instruction")
    assert "cpu_adam" not in finding.issue.cause and "does not have" in finding.issue.cause


# --- multi-node and container signatures (issue 16) ---------------------------------------


def test_socket_fallback_needs_rdma_in_the_log_and_respects_ib_disable():
    """nccl-tests#188's real lines are a fallback without its NCCL_IB_DISABLE=1 line and fine with it;
    the AWS log (nccl#226) names no RDMA device, so sockets there are no fallback until one is named."""
    text = (LOGS / "nccl-tests-188-ib-disabled-socket-clean.log").read_text()
    assert diagnose_text(text, ISSUES) == []
    on_purpose_removed = "\n".join(line for line in text.splitlines() if "NCCL_IB_DISABLE" not in line)
    assert ids(diagnose_text(on_purpose_removed, ISSUES)) == ["nccl-socket-fallback"]
    aws = (LOGS / "nccl-226-aws-socket-clean.log").read_text()
    assert diagnose_text(aws, ISSUES) == []
    hca = "[0] NCCL INFO NCCL_IB_HCA set to mlx5_0:1,mlx5_1:1\n"  # llamafactory-6111's wording
    assert ids(diagnose_text(hca + aws, ISSUES)) == ["nccl-socket-fallback"]


def test_network_error_gives_way_to_the_shm_memlock_or_oom_cause():
    """An `unhandled system error` next to a verbs or shared-memory failure is reported as that failure."""
    assert ids(diagnose_log(str(LOGS / "horovod-98-create-qp.log"), ISSUES)) == ["rdma-memlock"]
    shm = (LOGS / "nccl-342-docker-shm.log").read_text() + "NCCL failure common.cu:874 'unhandled system error'\n"
    assert ids(diagnose_text(shm, ISSUES)) == ["shm-too-small"]
    assert ids(diagnose_text("NCCL failure common.cu:874 'unhandled system error'\n", ISSUES)) == ["nccl-system-error"]


def test_stylegan_plugin_line_is_a_stall_only_without_done():
    """StyleGAN prints `Done.` or `Failed!` on the same line once the plugin is loaded (stylegan3#48)."""
    done = 'Setting up PyTorch plugin "bias_act_plugin"... Done.\n'
    assert diagnose_text(done, ISSUES) == []
    assert ids(diagnose_text('Setting up PyTorch plugin "bias_act_plugin"... \n', ISSUES)) == ["jit-load-stalled"]
    assert ids(diagnose_text('Setting up PyTorch plugin "filtered_lrelu_plugin"... Failed!\n', ISSUES)) == \
        ["jit-compile-failed"]


def test_a_load_followed_by_program_output_is_not_a_stall():
    """Short logs written here: torch prints nothing after a load, the program does."""
    assert ids(diagnose_text("Loading extension module dvr...\nstep 1\n", ISSUES)) == ["jit-load-stalled"]
    after = "Loading extension module dvr...\n" + "".join(f"evaluating sample {i}\n" for i in range(10))
    assert diagnose_text(after, ISSUES) == []
    training = "Loading extension module dvr...\n{'loss': 0.52, 'learning_rate': 1e-05, 'epoch': 0.01}\n"
    assert diagnose_text(training, ISSUES) == []


def test_loads_after_a_failed_build_are_the_failed_build():
    """Ranks that waited on the builder print `Loading extension module` after it failed (DeepSpeed#5623)."""
    log = ("RuntimeError: Error building extension 'fused_adam'\n"
           "Loading extension module fused_adam...\nLoading extension module fused_adam...\n")
    assert ids(diagnose_text(log, ISSUES)) == ["jit-compile-failed"]


def test_compiler_errors_count_only_in_an_extension_build():
    """The same GCC 11 errors: an extension build (exllama#65) or a plain CMake build (instant-ngp#1547)."""
    errors = (LOGS / "instant-ngp-1547-cmake-errors-clean.log").read_text()
    assert diagnose_text(errors, ISSUES) == []
    command = "[2/5] /usr/bin/nvcc  -DTORCH_EXTENSION_NAME=exllama_ext -DTORCH_API_INCLUDE_EXTENSION_H\n"
    assert ids(diagnose_text(errors + command, ISSUES)) == ["jit-compiler-error"]


def test_xformers_warning_is_a_mismatch_only_when_the_torch_differs():
    same = "    PyTorch 2.4.0+cu121 with CUDA 1201 (you have 2.4.0+cu121)\n"
    other = "    PyTorch 2.4.0+cu121 with CUDA 1201 (you have 2.4.1+cu121)\n"
    assert diagnose_text(same, ISSUES) == [] and ids(diagnose_text(other, ISSUES)) == ["extension-torch-abi"]


def test_abi_signature_leaves_torch_itself_and_torchvision_to_others():
    """torch's own libraries missing a symbol is a broken torch (pytorch#32638), not an extension:
    the symbol family names that (two torch installs mixed), not extension-torch-abi."""
    torch_itself = ("ImportError: /usr/lib/python3.8/site-packages/torch/lib/libtorch_python.so: undefined symbol: "
                    "_ZN5torch4cuda4nccl6detail16throw_nccl_errorE12ncclResult_t\n")
    findings = diagnose_text(torch_itself, ISSUES)
    assert ids(findings) == ["undefined-symbol"] and findings[0].title.startswith("One of torch's own libraries")


# --- reading -------------------------------------------------------------------------------


LOCK = "Using  .cache/torch_extensions/py310_cu118 as PyTorch extensions root...\n"


@pytest.mark.parametrize("suffix, pack", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_compressed_logs_are_read(tmp_path, suffix, pack):
    path = tmp_path / f"train.log{suffix}"
    path.write_bytes(pack(LOCK.encode()))
    assert ids(diagnose_log(str(path), ISSUES)) == ["torch-extensions-lock"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-8-sig"])
def test_utf16_and_bom_logs_are_read(tmp_path, encoding):
    path = tmp_path / "train.log"
    path.write_bytes(LOCK.replace("\n", "\r\n").encode(encoding))
    assert ids(diagnose_log(str(path), ISSUES)) == ["torch-extensions-lock"]


def test_ansi_escapes_are_stripped_and_never_echoed(tmp_path, cli):
    path = tmp_path / "color.log"
    path.write_bytes(b"\x1b[1;31mRuntimeError: CUDA error: no \x1b[0mkernel image is available for execution "
                     b"on the device\x1b]0;title\x07\x1b[K\r\n")
    r = cli("doctor", str(path))
    assert r.returncode == 3 and "no-kernel-image" in r.stdout and "\x1b" not in r.stdout and "\x07" not in r.stdout
    finding = json.loads(cli("doctor", "--json", str(path)).stdout)["findings"][0]
    assert finding["excerpt"] == "RuntimeError: CUDA error: no kernel image is available for execution on the device"


def test_long_lines_are_cut_and_memory_stays_bounded(tmp_path):
    path = tmp_path / "long.log"
    with open(path, "w") as f:
        f.write("x" * (20 * MAX_LINE))
        f.write(" RuntimeError: CUDA error: no kernel image is available for execution on the device\n")
        f.write(LOCK)
    reader = LogReader(str(path))
    lines = list(reader.lines())
    assert [len(line) for line in lines] == [MAX_LINE, len(LOCK) - 1] and reader.cut_lines == 1


def test_literal_guards_are_necessary_substrings():
    """The fast pre-check may skip a line only if the expression cannot match it."""
    for issue in ISSUES:
        for name in ("pattern", "unless", "context", "resolved_by", "evidence", "moved_on"):
            regex = issue.regex(name)
            if regex and regex.guard:
                assert all(len(word) >= 3 for word in regex.guard)
    assert literal_guard(r"foo|\bx") is None and literal_guard(r"(?:PyTorch|CUDA) version mismatch!") == (" version mismatch!",)


# --- the command ---------------------------------------------------------------------------


ZERO3 = "step 55651\nInvalidate trace cache @ step 55651: expected module 319, but got module 636\n" * 3


def test_doctor_cli_text_and_exit_codes(cli, tmp_path):
    log = tmp_path / "train.log"
    log.write_text(ZERO3)
    r = cli("doctor", str(log), env={"COLUMNS": "200"})
    assert r.returncode == 3 and "3 times" in r.stdout and "log_trace_cache_warnings" in r.stdout
    log.write_text("fine\n")
    r = cli("doctor", str(log))
    assert r.returncode == 0 and "no known signature" in r.stdout


def test_doctor_cli_json(cli):
    r = cli("doctor", "--json", str(LOGS / "llamafactory-6269-nccl.log"))
    assert r.returncode == 3
    report = json.loads(r.stdout)
    (finding,) = report["findings"]
    assert set(finding) >= {"id", "family", "title", "certainty", "parts", "line", "count", "rank", "excerpt", "cause",
                            "fix", "source"}
    assert finding["id"] == "nccl-watchdog-timeout" and finding["line"] == 1 and finding["count"] == 5
    assert finding["rank"] == ["rank 0", "rank 3", "rank 4"] and finding["family"] == "collective"
    assert report["inputs"][0]["complete"] and report["flight_recorder"] is None
    # every rank that says something only reports the collective it waited in: none failed on its own
    assert report["order"]["first_to_fail"] == [] and report["order"]["followed"] == ["rank 0", "rank 3", "rank 4"]
    empty = cli("doctor", "--json", str(LOGS / "lmflow-219-loaded.log"))
    assert empty.returncode == 0 and json.loads(empty.stdout)["findings"] == []


def test_doctor_cli_reads_standard_input(cli):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "envbuild", "doctor", "-"], cwd=ROOT, input=gzip.compress(LOCK.encode()),
                       capture_output=True)
    assert r.returncode == 3 and b"torch-extensions-lock" in r.stdout


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing.log", "cannot be read"),
    (lambda d: d, "holds no log or flight-recorder dump"),
    (lambda d: (d / "core").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(200)) and d / "core", "ELF"),
    (lambda d: (d / "zeros").write_bytes(bytes(100_000)) and d / "zeros", "binary"),
    (lambda d: (d / "cut.gz").write_bytes(gzip.compress(os.urandom(400_000).hex().encode())[:200_000]) and d / "cut.gz",
     "damaged gzip"),
])
def test_doctor_cli_bad_input_exits_2(cli, tmp_path, make, words):
    r = cli("doctor", str(make(tmp_path)))
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_dev_zero_is_refused_quickly(cli):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    r = cli("doctor", "/dev/zero", timeout=30)
    assert r.returncode == 2 and "is a character device, not a regular file" in r.stderr


def test_wait_signature_cannot_take_context(tmp_path):
    (tmp_path / "known_issues.yaml").write_text("issues:\n  - id: x\n    title: t\n    kind: wait\n    pattern: a\n"
                                                "    resolved_by: b\n    excused_by: c\n    cause: c\n    fix: f\n"
                                                "    source: s\n")
    with pytest.raises(EnvbuildError, match="excused_by"):
        load_issues(tmp_path)


def test_malformed_known_issues_is_an_error(tmp_path):
    (tmp_path / "known_issues.yaml").write_text("issues:\n  - id: x\n    title: t\n    kind: wait\n    pattern: a\n"
                                                "    cause: c\n    fix: f\n    source: s\n")
    with pytest.raises(EnvbuildError, match="resolved_by"):
        load_issues(tmp_path)


# --- families: the specific part named (issue 33) ------------------------------------------


@pytest.mark.parametrize("log, issue_id, words", [
    ("nnabla-1063-libcudart.log", "shared-library-missing", "A CUDA library cannot be found: libcudart.so.11.0"),
    ("nlut-15-libtorch-cuda-cu.log", "shared-library-missing", "torch's own libraries cannot be found: libtorch_cuda_cu.so"),
    ("nccl-872-libmpi.log", "shared-library-missing", "The MPI runtime cannot be found: libmpi.so.40"),
    ("friendo-bot-68-libgl-gthread.log", "shared-library-missing", "OS graphics library cannot be found: libgthread-2.0.so.0"),
    ("chatgpt-46-glibc-appimage.log", "glibc-too-old", "needs GLIBC_2.33, 2.32, 2.34"),
    ("ktransformers-439-glibcxx-332.log", "glibcxx-too-old", "needs GLIBCXX_3.4.32"),
    ("ragflow-4466-nvjitlink.log", "undefined-symbol", "needs a newer nvJitLink"),
    ("tomotwin-42-cublaslt.log", "undefined-symbol", "Two cuBLAS releases are mixed"),
    ("xformers-1057-cxx-runtime-symbol.log", "undefined-symbol", "newer GCC than the libstdc++ loaded"),
    ("tinygrad-kmod-47-nvml.log", "nvml-driver-mismatch", "user-space NVML 570.124"),
    ("hubert-1-no-nccl-windows.log", "cpu-only-torch", "has no NCCL"),
    ("nvidia-docker-1137-driver-error.log", "container-runtime-no-driver", "driver error: failed to process request"),
    ("mmpretrain-960-port-22.log", "rendezvous-port-in-use", "a port of a system service: 22"),
    ("torchx-540-master-unresolved.log", "rendezvous-host-unresolved", "codeflare-ray-jiajie-csqcn-head-sjvwx"),
    ("verl-2550-ipv6-literal.log", "rendezvous-host-unresolved", "IPv6 literal in brackets"),
    ("openrlhf-1040-clients-joined.log", "rendezvous-node-missing", "1 of 3 joined in 1801 s"),
    ("pyxis-127-sqsh-path.log", "pyxis-squashfs-path", "hello-world.sqsh"),
    ("pyxis-168-registry-401.log", "pyxis-enroot-error", "another registry"),
    ("triton-8539-ptxas-sm121a.log", "triton-ptxas-too-old", "sm_121a"),
    ("apex-368-cuda-home-list.log", "no-cuda-toolkit", "CUDA_HOME is malformed"),
    ("aws-ofi-nccl-889-efa-empty.log", "ofi-provider-unusable", "provider efa"),
    ("nccl-1676-gdr-disabled.log", "gpudirect-rdma-off", "mlx5_0, mlx5_1, mlx5_2"),
])
def test_a_family_names_the_part_the_log_shows(log, issue_id, words):
    """The library, version, port, host or architecture comes from the log, not from the signature."""
    findings = [f for f in diagnose_log(str(LOGS / log), ISSUES) if f.issue.id == issue_id]
    assert any(words in f"{f.title} | {f.detail}" for f in findings), [f.title for f in findings]


def test_a_family_that_cannot_tell_says_likely_and_shows_the_line(cli):
    """802 is the fabric manager on NVSwitch systems, and something else elsewhere: the report says so."""
    r = cli("doctor", str(LOGS / "cupy-2845-802.log"))
    assert r.returncode == 3 and "cause:  likely (the log does not say which)" in r.stdout
    assert "> cupy.cuda.runtime.CUDARuntimeError: cudaErrorSystemNotReady" in r.stdout
    certain = cli("doctor", str(LOGS / "pyxis-127-sqsh-path.log"))
    assert "likely" not in certain.stdout


def test_net_not_found_names_the_network():
    """Short log written here from the message NCCL's net.cc prints (no public thread pastes it alone)."""
    log = "nid006352:34157:34217 [1] net.cc:626 NCCL WARN Error: network AWS Libfabric not found.\n"
    assert by_id(diagnose_text(log, ISSUES), "nccl-net-not-found").title.endswith("AWS Libfabric")


def test_a_repeated_hit_makes_its_parts_once(monkeypatch):
    """NCCL INFO logs repeat the same lines by the thousand: a hit whose captures were seen before reuses
    the parts made of them (each value made printable once), and the finding still counts every hit."""
    import envbuild.doctor.trackers as trackers
    made = []
    monkeypatch.setattr(trackers, "printable", lambda value: made.append(value) or value)
    loaded = "node1:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin NCCL RDMA Plugin v8 (v8)\n"
    missing = "node2:2:2 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation\n"
    found = by_id(diagnose_text(loaded + missing * 500, ISSUES), "net-plugin-partial")
    assert (found.count, found.parts) == (500, {"plugin": ["libnccl-net.so"]})
    assert made == ["libnccl-net.so"]


def test_harmless_plugin_and_library_lines_are_not_findings():
    """NCCL's own INFO lines about a missing optional plugin, and TensorFlow's CPU-only cudart warning."""
    for log in ("nccl-162-net-plugin-info-clean.log", "nccl-1292-plugin-symbol-clean.log",
                "aws-k8s-tester-464-libfabric-warn-clean.log"):
        assert diagnose_log(str(LOGS / log), ISSUES) == [], log
    tf_cpu = ("W tensorflow/stream_executor/platform/default/dso_loader.cc:60] Could not load dynamic library "
              "'libcudart.so.11.0'; dlerror: libcudart.so.11.0: cannot open shared object file: No such file or directory\n"
              "I tensorflow/stream_executor/cuda/cudart_stub.cc:29] Ignore above cudart dlerror if you do not have a GPU "
              "set up on your machine.\n")  # TensorFlow 2.x's own pair of lines on a machine without a GPU
    assert diagnose_text(tf_cpu, ISSUES) == []


# --- wrapped, flattened and interleaved pastes ----------------------------------------------


FAMILY_LOGS = [e for e in INDEX if e.get("set") in {"fit-33", "held-out-33"} and e["expected"]]


def wrapped(text: str, width: int) -> str:
    """The log as a terminal of `width` columns shows it: every long line cut into pieces."""
    return "\n".join(line[i:i + width] for line in text.split("\n") for i in range(0, max(len(line), 1), width))


@pytest.mark.parametrize("width", [80, 120, 200])
def test_family_logs_wrapped_by_a_terminal_give_the_same_answer(width):
    for e in FAMILY_LOGS:
        text = (LOGS / e["file"]).read_text(errors="replace")
        assert sorted(set(ids(diagnose_text(wrapped(text, width), ISSUES)))) == sorted(e["expected"]), e["file"]


def test_family_logs_flattened_into_one_line_give_the_same_answer():
    """A paste that lost its newlines (a web form, a chat message)."""
    for e in FAMILY_LOGS:
        text = (LOGS / e["file"]).read_text(errors="replace")
        flat = " ".join(line.strip() for line in text.split("\n"))
        assert sorted(set(ids(diagnose_text(flat, ISSUES)))) == sorted(e["expected"]), e["file"]


def test_interleaved_ranks_are_not_joined_and_keep_their_labels():
    """Two ranks' messages, each wrapped by the terminal, one rank's lines after the other's: each
    finding is its own rank's, and no message is glued to another rank's line."""
    a = "OSError: libcudnn_graph.so.9: cannot open shared object file: No such file or directory"
    b = ("RuntimeError: The server socket has failed to listen on any local network address. port: 29500, "
         "useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use.")
    log = "\n".join([wrapped(f"[rank2]:{a}", 60), wrapped(f"[rank0]:{b}", 60), "[rank1]:step 3 loss 0.25",
                     wrapped(f"[rank3]:{a}", 60)]) + "\n"
    findings = diagnose_text(log, ISSUES)
    assert by_id(findings, "shared-library-missing").ranks == ["rank 2", "rank 3"]
    assert by_id(findings, "rendezvous-port-in-use").ranks == ["rank 0"]
    assert by_id(findings, "shared-library-missing").other_ranks == ["rank 0", "rank 1"]


def test_a_flattened_paste_of_several_ranks_is_cut_at_each_rank_prefix():
    log = ("[rank1]:[E ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation timeout "
           "[rank3]:OSError: libcudnn.so.8: cannot open shared object file: No such file or directory\n")
    findings = diagnose_text(log, ISSUES)
    assert by_id(findings, "shared-library-missing").ranks == ["rank 3"]
    assert by_id(findings, "nccl-watchdog-timeout").ranks == ["rank 1"]
