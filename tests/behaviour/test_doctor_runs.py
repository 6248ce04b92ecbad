"""`envbuild doctor` over several inputs: per-rank log directories, the flight recorder's dumps,
and hostile files (FIFOs, devices, binary data, a gzip bomb; an endless stream from a real
process is tests/process/test_doctor_runs_endless_stream.py).

The per-rank logs (tests/fixtures/ranks/torchrun-gloo-libcudnn) and the flight-recorder dumps
(tests/fixtures/flight_recorder) were made here by real torch 2.13.0 runs on the CPU (gloo); their
READMEs say how. Short logs written here for one behaviour say so.
"""

import gzip
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from envbuild.doctor import Budget, LogReader, examine, load_catalogue, parse_size
from envbuild.doctor.flight import load_dump, read_recording
from envbuild.base.errors import EnvbuildError

ISSUES, FAMILIES = load_catalogue(ROOT / "matrices")
RANKS = ROOT / "tests" / "fixtures" / "ranks" / "torchrun-gloo-libcudnn" / "logs"
DUMPS = ROOT / "tests" / "fixtures" / "flight_recorder"


def report_of(cli, *args):
    r = cli("doctor", "--json", *map(str, args))
    return r, json.loads(r.stdout) if r.stdout.startswith("{") else None


# --- per-rank logs ----------------------------------------------------------------------------


def test_a_torchrun_log_directory_names_the_first_rank_to_fail(cli):
    """Rank 2 could not load a cuDNN library; ranks 1 and 3 saw their peer go; rank 0 was stopped."""
    r, report = report_of(cli, RANKS)
    assert r.returncode == 3
    assert report["order"]["first_to_fail"] == ["rank 2"] and report["order"]["followed"] == ["rank 1", "rank 3"]
    assert report["order"]["no_finding"] == ["rank 0"]
    assert [e["id"] for e in report["ranks"]["rank 2"]] == ["shared-library-missing"]
    assert report["ranks"]["rank 3"][0]["file"].endswith("3/stderr.log.gz")  # read through gzip
    assert {i["format"] for i in report["inputs"]} == {"text", "gzip"} and all(i["complete"] for i in report["inputs"])
    text = cli("doctor", str(RANKS)).stdout
    assert "first to fail: rank 2 (shared-library-missing" in text and "only followed: rank 1, rank 3" in text


def test_slurm_per_task_files_are_labelled_by_their_task_number(tmp_path, cli):
    """The same run's logs renamed as `srun --output=%x-%t.out --error=%x-%t.err` writes them."""
    for rank in range(4):
        source = next((RANKS / "attempt_0" / str(rank)).iterdir())
        target = tmp_path / f"train-{rank}.{'err' if rank % 2 else 'out'}{'.gz' if source.suffix == '.gz' else ''}"
        shutil.copy(source, target)
    (tmp_path / "train-0.err").write_text("")  # stdout and stderr of one task are one stream
    r, report = report_of(cli, tmp_path)
    assert report["order"]["first_to_fail"] == ["rank 2"]  # the torchrun prefix inside the lines wins
    assert {i["rank"] for i in report["inputs"]} == {"task 0", "task 1", "task 2", "task 3"}


def test_timestamps_order_ranks_that_failed_on_their_own(tmp_path, cli):
    """Short logs written here: two ranks fail for their own reasons; the earlier timestamp is first."""
    (tmp_path / "job-0.out").write_text("2024-05-01 12:00:00,100 INFO step 10\n"
                                        "2024-05-01 12:00:05,000 ERROR exited with code 137\n")
    (tmp_path / "job-1.out").write_text("2024-05-01 12:00:01,250 ERROR ImportError: libcudnn.so.9: cannot open "
                                        "shared object file: No such file or directory\n")
    (tmp_path / "job-2.out").write_text("2024-05-01 12:00:09,000 [Rank 2] Watchdog caught collective operation timeout\n")
    r, report = report_of(cli, tmp_path)
    assert report["order"]["first_to_fail"] == ["task 1"] and report["order"]["followed"] == ["rank 2"]  # its own prefix
    assert report["order"]["decided_by"].startswith("timestamps on the failure lines (2024-05-01 12:00:01.25")


def test_when_every_rank_only_waited_the_quiet_rank_is_likely_the_culprit(tmp_path, cli):
    """Short logs written here: ranks 0 and 1 report the watchdog, rank 2 printed nothing known."""
    for rank in (0, 1):
        (tmp_path / f"rank_{rank}.log").write_text(f"[rank{rank}]:[E ProcessGroupNCCL.cpp:607] [Rank {rank}] "
                                                   "Watchdog caught collective operation timeout\n")
    (tmp_path / "rank_2.log").write_text("[rank2]:epoch 3 step 200 loss 1.93\n")
    r, report = report_of(cli, tmp_path)
    assert report["order"] == {"first_to_fail": ["rank 2"], "followed": ["rank 0", "rank 1"], "no_finding": ["rank 2"],
                               "certainty": "likely", "decided_by": report["order"]["decided_by"]}


def test_named_files_and_a_directory_together(tmp_path, cli):
    (tmp_path / "a.log").write_text("fine\n")
    r, report = report_of(cli, tmp_path / "a.log", DUMPS / "never-entered")
    assert r.returncode == 3 and report["findings"] == [] and report["flight_recorder"]["hangs"]


# --- the flight recorder ----------------------------------------------------------------------


@pytest.mark.parametrize("form", ["never-entered", "never-entered-json"])
def test_the_dumps_name_the_collective_and_the_rank_that_never_entered_it(form):
    (hang,) = read_recording(sorted(str(p) for p in (DUMPS / form).iterdir())).hangs
    assert (hang.op, hang.seq, hang.pg) == ("gloo:all_gather", 4, "0 (default_pg)")
    assert hang.entered == [0, 1, 3] and hang.never_entered == [2] and hang.no_dump == []
    assert hang.last == {2: "#3 gloo:all_reduce (completed)"}


def test_a_rank_that_called_another_collective_is_named(cli):
    r, report = report_of(cli, DUMPS / "mismatch")
    (hang,) = report["flight_recorder"]["hangs"]
    assert hang["op"] == "gloo:all_gather" and hang["entered"] == [0, 2] and hang["other_op"] == {"1": "gloo:all_reduce"}


def test_a_rank_without_a_dump_is_named(tmp_path):
    for rank in (0, 1, 3):
        shutil.copy(DUMPS / "never-entered" / f"rank_{rank}", tmp_path)
    (hang,) = read_recording(sorted(str(p) for p in tmp_path.iterdir())).hangs
    assert hang.no_dump == [2] and hang.never_entered == []


def test_healthy_dumps_are_no_hang(cli):
    r = cli("doctor", str(DUMPS / "healthy"))
    assert r.returncode == 0 and "no hang recorded" in r.stdout


def test_the_cli_names_the_hang(cli):
    r = cli("doctor", str(DUMPS / "never-entered"))
    assert r.returncode == 3
    assert "collective #4 gloo:all_gather (input sizes [[1]]) did not complete" in r.stdout
    assert "never entered it: rank 2" in r.stdout and "entered it:       rank 0, rank 1, rank 3" in r.stdout


class _RunsCode:
    """Pickles as a call of os.system: what a hostile dump would carry."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_dump_that_asks_for_code_is_refused_without_running_it(tmp_path, cli):
    marker = tmp_path / "ran"
    hostile = tmp_path / "dumps" / "rank_0"
    hostile.parent.mkdir()
    hostile.write_bytes(pickle.dumps({"entries": [_RunsCode(f"touch {marker}")], "version": "2.10"}, protocol=4))
    r = cli("doctor", str(hostile))
    assert r.returncode == 2 and "asks for" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()
    shutil.copy(DUMPS / "never-entered" / "rank_1", hostile.parent)  # in a directory it is skipped, the rest read
    r = cli("doctor", str(hostile.parent))
    assert r.returncode == 3 and "Skipped:" in r.stdout and not marker.exists()


@pytest.mark.parametrize("data, words", [
    (b"{" * 200_000, "cannot be read"),                               # JSON nested past the recursion limit
    (b"\x80\x04\x95" + os.urandom(300), "cannot be read"),            # a pickle header and noise
    (json.dumps({"version": "2.10"}).encode(), "no list of entries"),  # JSON, but not a dump
])
def test_a_broken_dump_is_one_paragraph(tmp_path, data, words):
    path = tmp_path / "rank_0"
    path.write_bytes(data if not data.startswith(b"{\"") else data)
    with pytest.raises(EnvbuildError, match=words):
        load_dump(str(path))


def test_a_huge_dump_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "rank_0"
    with open(path, "wb") as f:
        f.truncate(65 << 20)  # sparse: no disk used
    with pytest.raises(EnvbuildError, match="larger than"):
        load_dump(str(path))


# --- hostile inputs and bounds ------------------------------------------------------------------


def test_a_fifo_is_refused_without_blocking(tmp_path, cli):
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    r = cli("doctor", str(fifo), timeout=30)
    assert r.returncode == 2 and "is a FIFO (named pipe), not a regular file" in r.stderr and "doctor -" in r.stderr
    (tmp_path / "rank_1.log").write_text("OSError: libcudnn.so.8: cannot open shared object file: No such file\n")
    r = cli("doctor", str(tmp_path), timeout=30)  # a FIFO inside a directory is skipped, the logs are read
    assert r.returncode == 3 and "Skipped: " in r.stdout and "FIFO" in r.stdout


def test_binary_files_in_a_directory_are_skipped_and_named(tmp_path, cli):
    (tmp_path / "core.1234").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(500))
    (tmp_path / "model.bin").write_bytes(bytes(20_000))
    (tmp_path / "rank_0.log").write_bytes("RuntimeError: Distributed package doesn't have NCCL built in\r\n"
                                          .encode("utf-16"))
    r, report = report_of(cli, tmp_path)
    skipped = {Path(s["path"]).name: s["why"] for s in report["skipped"]}
    assert set(skipped) == {"core.1234", "model.bin"} and "ELF" in skipped["core.1234"] and "binary" in skipped["model.bin"]
    assert [f["id"] for f in report["findings"]] == ["cpu-only-torch"]
    assert report["inputs"][0]["format"] == "text, utf-16"


def test_a_gzip_bomb_stops_at_the_size_limit(tmp_path, cli):
    bomb = tmp_path / "bomb.log.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        for _ in range(256):
            f.write(b"\n" * (1 << 20))  # 256 MiB of newlines in about 250 KB
    assert bomb.stat().st_size < 1 << 20
    r, report = report_of(cli, bomb, "--max-bytes", "32M")
    (info,) = report["inputs"]
    assert r.returncode == 0 and not info["complete"] and info["bytes"] == 32 << 20 and "size limit" in info["stopped"]
    assert "Not read to the end" in cli("doctor", str(bomb), "--max-bytes", "32M").stdout


def test_the_budget_counts_bytes_and_time_over_all_inputs():
    now = [0.0]
    budget = Budget(max_bytes=10, max_seconds=5, clock=lambda: now[0])
    assert budget.take(b"12345") == (b"12345", None)
    data, why = budget.take(b"1234567")
    assert data == b"12345" and "size limit" in why
    now[0] = 6
    assert budget.take(b"x") == (b"", "the time limit (5 s, --max-seconds)")


@pytest.mark.parametrize("text, size", [("16G", 16 << 30), ("512k", 512 << 10), ("1.5MiB", 3 << 19), ("100", 100)])
def test_sizes_are_read_as_users_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["lots", "-1G", "0", "1X"])
def test_a_bad_size_is_one_paragraph(cli, bad):
    r = cli("doctor", str(RANKS), "--max-bytes", bad)
    assert r.returncode == 2 and "--max-bytes" in r.stderr and "16G" in r.stderr and "Traceback" not in r.stderr


def test_a_log_cut_short_in_transfer_keeps_what_came_first(tmp_path):
    """A gzip stream that ends early after data: the lines before are read, the report says where it stopped."""
    noise = os.urandom(800_000).hex()
    data = gzip.compress(b"OSError: libcudnn.so.8: cannot open shared object file: No such file or directory\n"
                         + "\n".join(noise[i:i + 100] for i in range(0, len(noise), 100)).encode(), compresslevel=1)
    path = tmp_path / "cut.log.gz"
    path.write_bytes(data[:len(data) * 3 // 4])
    report = examine([str(path)], ISSUES, FAMILIES)
    assert [f.issue.id for f in report.findings] == ["shared-library-missing"]
    assert "damaged gzip stream" in report.inputs[0].stopped


def test_a_reader_never_opens_what_it_cannot_read_to_the_end_on_a_slow_fifo(tmp_path):
    """The regular-file check happens on the descriptor: a FIFO with a writer that never writes is
    refused at once. (Both ends are opened here without threads: a thread racing the reader for
    the FIFO once left the suite blocked in open() when the machine was loaded.)"""
    fifo = tmp_path / "slow"
    os.mkfifo(fifo)
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writer's open returns at once
    write_end = os.open(fifo, os.O_WRONLY)  # a writer that never writes
    try:
        with pytest.raises(EnvbuildError, match="FIFO"):
            LogReader(str(fifo))
    finally:
        os.close(write_end)
        os.close(read_end)


# --- the signature file itself ---------------------------------------------------------------


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes("issues: []\n".encode("utf-16")), "not UTF-8"),
    (lambda p: p.write_text("issues: " + "[" * 50_000 + "]" * 50_000 + "\n"), "nesting deeper than 64 levels"),
    (lambda p: p.write_text("issues: {}\n"), "a list `issues:`"),
    (lambda p: os.mkfifo(p), "FIFO"),
    (lambda p: p.symlink_to("/dev/zero"), "character device"),
])
def test_a_hostile_known_issues_file_is_refused(tmp_path, make, words):
    make(tmp_path / "known_issues.yaml")
    with pytest.raises(EnvbuildError, match=words):
        load_catalogue(tmp_path)


# --- input from another machine: bounds, /proc, nothing read (issue 40) -------------------------


def _dump(entries, **more) -> dict:
    return {"version": "2.10", "entries": entries, **more}


def _entry(seq=1, op="nccl:all_reduce", **more) -> dict:
    return {"process_group": ["0", "default_pg"], "pg_id": 0, "collective_seq_id": seq, "profiling_name": op,
            "state": "scheduled", "input_sizes": [[1024]], **more}


def _one_paragraph(r):
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("write", [
    lambda p: p.write_bytes(pickle.dumps(_dump([_entry(seq=10 ** 5000)]), protocol=4)),
    lambda p: p.write_bytes(pickle.dumps(_dump([_entry(input_sizes=[[10 ** 5000]])], pg_id=10 ** 5000), protocol=4)),
    lambda p: p.write_text('{"version": "2.10", "entries": [{"collective_seq_id": ' + "9" * 5000 + "}]}"),
])
def test_a_dump_holding_a_5000_digit_integer_is_one_paragraph(tmp_path, cli, write):
    """A 5,000-digit integer in a pickled dump reached str() in the report: exit 70."""
    write(tmp_path / "rank_0")
    r = cli("doctor", str(tmp_path / "rank_0"))
    assert r.returncode in (2, 3) and "Traceback" not in r.stderr and "internal error" not in r.stderr
    if r.returncode == 2:
        _one_paragraph(r)
        assert "rank_0" in r.stderr


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="no /proc")
def test_proc_files_are_refused_when_named_and_skipped_in_a_directory(tmp_path, cli):
    """/proc/self/mem fails its read (EIO: exit 70); /proc/self/status says 0 bytes and gives some."""
    for path, words in (("/proc/self/mem", "cannot be read"), ("/proc/self/status", "says it holds 0 bytes")):
        r = cli("doctor", path, timeout=30)
        _one_paragraph(r)
        assert path in r.stderr and words in r.stderr
    (tmp_path / "mem.log").symlink_to("/proc/self/mem")
    (tmp_path / "status.log").symlink_to("/proc/self/status")
    (tmp_path / "rank_1.log").write_text("OSError: libcudnn.so.8: cannot open shared object file: No such file\n")
    r = cli("doctor", str(tmp_path), timeout=30)
    assert r.returncode == 3 and r.stdout.count("Skipped: ") == 2 and "mem.log: cannot be read" in r.stdout


@pytest.mark.parametrize("bad", ["9" * 400, "1025T", "0.0000001"])
def test_max_bytes_out_of_range_names_the_option_and_the_range(cli, bad):
    r = cli("doctor", str(RANKS), "--max-bytes", bad)
    _one_paragraph(r)
    assert "--max-bytes" in r.stderr and "1024T" in r.stderr


def test_max_seconds_nan_is_refused(cli):
    r = cli("doctor", str(RANKS), "--max-seconds", "nan")
    _one_paragraph(r)
    assert "--max-seconds" in r.stderr


@pytest.mark.parametrize("make", [
    lambda d: (d / "empty.log").write_bytes(b"") and None or d / "empty.log",
    lambda d: [(d / f"job-{i}.err").write_bytes(b"") for i in range(3)] and d,
    lambda d: (d / "rank_0").write_bytes(pickle.dumps(_dump([{"no": "fields"}]), protocol=4)) and d,
])
def test_a_run_that_read_nothing_says_so_with_exit_2(tmp_path, cli, make):
    """Empty logs, or a directory whose one dump was refused: doctor said "no known signature found", exit 0."""
    r = cli("doctor", str(make(tmp_path)))
    _one_paragraph(r)
    assert "doctor read nothing" in r.stderr and r.stdout == ""


def test_nothing_found_while_a_dump_was_unread_is_not_exit_0(tmp_path, cli):
    """A job's healthy-looking log beside a dump that could not be read: its rank's verdict is unknown."""
    (tmp_path / "train.log").write_text("step 1 loss 0.5\n")
    (tmp_path / "rank_0").write_bytes(pickle.dumps(_dump([_entry()], x=10 ** 5000), protocol=4)[:40])  # cut short
    r = cli("doctor", str(tmp_path))
    _one_paragraph(r)
    assert "could not be read" in r.stderr and "Skipped: " in r.stdout and "rank_0" in r.stdout


def test_a_rank_whose_dump_was_unread_is_not_called_one_that_wrote_none(tmp_path, cli):
    for rank in (0, 1, 3):
        shutil.copy(DUMPS / "never-entered" / f"rank_{rank}", tmp_path)
    (tmp_path / "rank_2").write_bytes(b"\x80\x04\x95" + bytes(50))
    r, report = report_of(cli, tmp_path)
    (hang,) = report["flight_recorder"]["hangs"]
    assert r.returncode == 3 and hang["no_dump"] == [] and report["flight_recorder"]["unread_ranks"] == [2]
    assert "dump not read:     rank 2" in cli("doctor", str(tmp_path)).stdout


def test_a_dumps_newlines_add_no_line_of_their_own_to_the_report(tmp_path, cli):
    evil = "nccl:all_reduce\nINJECTED never entered it: rank 7\r\x1b[2K\x85\u2028"
    entries = [_entry(op=evil, process_group=["0\nINJECTED", "pg\n"], state="s\nINJECTED")]
    (tmp_path / "rank_0").write_bytes(pickle.dumps(_dump(entries, version="2.\nINJECTED"), protocol=4))
    r = cli("doctor", str(tmp_path / "rank_0"))
    assert r.returncode == 3 and "\\nINJECTED" in r.stdout
    assert not any(line.lstrip().startswith("INJECTED") for line in r.stdout.splitlines())
    assert not re.search("[\r\x1b\x85\u2028]", r.stdout)


@pytest.mark.parametrize("form", ["json", "pickle"])
def test_a_16_mb_dump_of_nested_lists_is_read_in_bounded_memory(tmp_path, form):
    """A 16 MB dump of [[],[],...] cost about 880 MB (a parsed value is about 60 bytes); it is
    refused from its value count before it is parsed. Peak RSS of the child, measured by a parent
    of its own (RUSAGE_CHILDREN is the largest child a process waited for)."""
    count = 16 << 20
    if form == "json":
        data = b'{"entries": [' + b"[]," * (count // 3) + b"[]]}"
    else:  # PROTO 4, {}, 'entries', [], MARK, N times [], APPENDS, SETITEM, STOP
        data = b"\x80\x04}\x8c\x07entries](" + b"]" * count + b"es."
    (tmp_path / "rank_0").write_bytes(data)
    probe = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'envbuild', 'doctor', sys.argv[1]],"
             " capture_output=True, text=True); print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
             " print(r.stderr)")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "rank_0")], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    code, peak_kib = map(int, out.split("\n")[0].split())
    assert code == 2 and "more than" in out and peak_kib < 300 * 1024, out
