"""`publish --job` as a release engineer drives it: part of a job (--variant), every tool it will
need checked before anything is built, a heartbeat while a step runs, and the next command."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from conftest import ROOT, run_here
from envbuild.supply import heartbeat, jobplan, release
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.matrix import load_matrix

SHIPPED = {"ENVBUILD_MATRIX_DIR": str(ROOT / "matrices")}
JOB = "torch2.5-cu124-py3.10-amd64"
ARM_JOB = "torch2.15-cu132-py3.12-arm64"


@pytest.fixture(scope="module")
def m():
    return load_matrix(ROOT / "matrices")


@pytest.fixture(scope="module")
def job(m):
    return jobplan.find_job(m, JOB)


@pytest.mark.parametrize("given, chosen", [
    ((), ["a100:ib:", "h100:ib:", "h20:ib:", "l40s:ib:", "rtx4090:ib:", "v100:ib:", "a100:aws-efa:",
          "h100:aws-efa:"]),
    (("h20",), ["h20:ib:"]),
    (("h100:aws-efa",), ["h100:aws-efa:"]),
    (("h100:ib:", "h20", "h100:ib"), ["h100:ib:", "h20:ib:"]),
    (("v100::",), ["v100:ib:"]),
])
def test_variants_choose_part_of_a_job(m, job, given, chosen):
    j, variants, _ = job
    assert [v["variant"] for v in jobplan.select_variants(m, j, variants, given)] == chosen


@pytest.mark.parametrize("given, words", [
    ("h100", ["matches 2 variants", "h100:ib:, h100:aws-efa:", "--variant h100:ib"]),
    ("gh200", ["is not a variant of job torch2.5-cu124-py3.10-amd64", "this job's variants: a100:ib:"]),
    ("h100:ib:flash-attn", ["is not a variant of job", "it is a variant of job torch2.10-cu128-py3.12-amd64-flash-attn"]),
    ("h2o", ["nearest: h20:ib:"]),
    ("H20", ["is not GPU[:FABRIC][:EXT]"]),
    ("h20\nRUN id", ["is not GPU[:FABRIC][:EXT]", "'h20\\nRUN id'"]),
    ("h20:ib:x:y", ["is not GPU[:FABRIC][:EXT]"]),
    (":ib", ["is not GPU[:FABRIC][:EXT]"]),
    ("$(id)", ["is not GPU[:FABRIC][:EXT]"]),
])
def test_a_variant_that_names_no_one_variant_of_the_job_is_refused(m, job, given, words):
    j, variants, _ = job
    with pytest.raises(EnvbuildError) as e:
        jobplan.select_variants(m, j, variants, (given,))
    assert e.value.exit_code == 2 and "\n" not in e.value.message
    for w in words:
        assert w in e.value.message, e.value.message


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    d = tmp_path_factory.mktemp("key")
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(d / "key.pem")], check=True,
                   capture_output=True)
    return d / "key.pem"


def _publish(tmp_path, *args, env=None):
    return run_here("publish", "--job", JOB, "--registry", "127.0.0.1:9/acme", "--signing-key", "key.pem",
                    "--out", "out", *args, cwd=tmp_path, env={**SHIPPED, **(env or {})})


def test_a_bad_variant_builds_and_writes_nothing(tmp_path, key):
    (tmp_path / "key.pem").write_bytes(key.read_bytes())
    r = _publish(tmp_path, "--variant", "gh200")
    assert r.returncode == 2 and "--variant 'gh200' is not a variant of job" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.pem"]
    r = run_here("publish", "--list", "--variant", "h20", env=SHIPPED)
    assert r.returncode == 2 and "give --job ID too" in r.stderr


def test_a_missing_tool_is_named_before_anything_is_built(tmp_path, key):
    """mksquashfs writes the .sqsh after an hour's build: missing, the job said so after the hour."""
    (tmp_path / "key.pem").write_bytes(key.read_bytes())
    bare = tmp_path / "bin"
    bare.mkdir()
    r = _publish(tmp_path, "--variant", "h20", env={"PATH": str(bare)})
    assert r.returncode == 2 and "needs mksquashfs" in r.stderr and "apt-get install squashfs-tools" in r.stderr
    assert "nothing was built" in r.stderr and not (tmp_path / "out").exists()
    r = run_here("publish", "--job", JOB, "--registry", "127.0.0.1:9/acme", "--keyless", "--out", "out",
                 cwd=tmp_path, env={**SHIPPED, "PATH": str(bare)})
    assert r.returncode == 2 and "cosign, which signs keyless" in r.stderr and "mksquashfs" in r.stderr


def test_the_next_command_merges_each_tag_this_job_completes(m, job):
    j, variants, _ = job
    h20 = [v for v in variants if v["variant"] == "h20:ib:"]
    ok = jobplan.Outcome("h20:ib:", h20[0]["tag"], "linux/amd64", ok=True)
    assert jobplan.next_manifests(m, [ok], h20) == [(h20[0]["tag"], True)]
    failed = jobplan.Outcome("h20:ib:", h20[0]["tag"], "linux/amd64")
    assert jobplan.next_manifests(m, [failed], h20) == []


def test_a_tag_two_platforms_serve_waits_for_the_other_job(m):
    """h100's tag also serves gh200's arm64 image (publish.yaml multiarch): one job is half of it."""
    j, variants, _ = jobplan.find_job(m, "torch2.15-cu132-py3.12-amd64")
    h100 = [v for v in variants if v["variant"] == "h100:ib:"]
    ok = jobplan.Outcome("h100:ib:", h100[0]["tag"], "linux/amd64", ok=True)
    assert jobplan.next_manifests(m, [ok], h100) == [(h100[0]["tag"], False)]


def test_a_long_step_says_it_is_alive_and_what_buildkit_runs(monkeypatch):
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 0.05)
    said, activity = [], {}
    lock = threading.Lock()

    def say(text):
        with lock:
            said.append(text)

    def step():
        activity["build"] = "[builder 4/9] RUN deepspeed.sh"
        time.sleep(0.4)
        return "done"

    o = jobplan.Outcome("h20:ib:", "t", "linux/amd64")
    ctx = release.JobContext(None, "r", "r/envbuild", None, None, "pypi", None, say=say, activity=activity)
    assert release._timed(o, "build", step, ctx) == "done"
    assert said[0] == "h20:ib:: build: started"
    beats = [s for s in said if "still running" in s]
    assert beats and all("(now: [builder 4/9] RUN deepspeed.sh)" in s for s in beats[1:])
    count = len(said)
    time.sleep(0.2)
    assert len(said) == count  # the heartbeat ends with its step
    assert o.seconds["build"] >= 0.4


def test_the_plan_says_per_variant_what_is_cached_and_builds_nothing(tmp_path):
    out = tmp_path / "publish-out"
    out.mkdir()
    (out / "report.json").write_text('{"job": "x", "outcomes": [{"variant": "h20:ib:", "seconds": {"build": 1712.4}}]}')
    r = run_here("publish", "--job", JOB, "--registry", "127.0.0.1:9/acme", "--plan", "--variant", "h20",
                 "--out", str(out), cwd=tmp_path, env=SHIPPED)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"job {JOB}: 1 variant(s), linux/amd64, layer cache 127.0.0.1:9/acme/envbuild-cache"
    assert lines[1].startswith("h20:ib:  torch2.5.1-cu124-py3.10-")
    assert "builder stage  cannot tell (registry unreachable" in r.stdout and "-h20-amd64-builder)" in r.stdout
    assert lines[2].startswith("  published      cannot tell (registry unreachable") and lines[2].endswith("-h20-amd64)")
    assert f"last run       build 1712 s ({out / 'report.json'})" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]  # nothing built, nothing written


@pytest.mark.parametrize("report", ['[' * 100 + ']' * 100, '{"outcomes": [{"variant": "h20:ib:", "seconds": 5}]}',
                                    '{"outcomes": "x"}', "\xff"])
def test_a_report_the_plan_cannot_read_gives_no_figure(tmp_path, report):
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.json").write_text(report, errors="surrogateescape") if report != "\xff" else \
        (out / "report.json").write_bytes(b"\xff")
    r = run_here("publish", "--job", JOB, "--registry", "127.0.0.1:9/acme", "--plan", "--variant", "h20",
                 "--layer-cache", "off", "--out", str(out), cwd=tmp_path, env=SHIPPED)
    assert r.returncode == 0 and "last run" not in r.stdout and "every stage    built (--layer-cache off)" in r.stdout


def test_the_plan_names_each_variants_deepspeed_wheel_and_whether_the_ext_cache_holds_it(tmp_path):
    """DeepSpeed's wheel is keyed by what decides its bytes: the H20 and the H100 (both sm_90)
    share it, and a --ext-cache file that holds the key means it is not compiled."""
    import io
    import re
    import tarfile

    args = ("publish", "--job", JOB, "--registry", "127.0.0.1:9/acme", "--plan", "--variant", "h20", "--variant",
            "h100:ib", "--layer-cache", "off", "--out", str(tmp_path / "o"))
    r = run_here(*args, cwd=tmp_path, env=SHIPPED)
    assert r.returncode == 0, r.stderr
    keys = re.findall(r"deepspeed      wheel (deepspeed/[0-9a-f]{16}): compiled unless", r.stdout)
    assert len(keys) == 2 and keys[0] == keys[1], r.stdout
    cache = tmp_path / "ext-cache.tar"
    with tarfile.open(cache, "w") as tar:
        for name, data in ((".envbuild-ext-cache", b"envbuild-ext-cache\n"),
                           (f"{keys[0]}/deepspeed-0.16.5-cp310-cp310-linux_x86_64.whl", b"wheel"),
                           (f"{keys[0]}/deepspeed-0.16.5-cp310-cp310-linux_x86_64.sha256", b"0" * 64 + b"\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    r = run_here(*args, "--ext-cache", str(cache), cwd=tmp_path, env=SHIPPED)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"deepspeed      wheel {keys[0]}: in {cache}, not compiled") == 2, r.stdout
