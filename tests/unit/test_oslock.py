"""The OS lock (envbuild/knowledge/oslock.py) without an engine: its grammar, what a stage may install,
which stages a request gets locked, the parts os.sh reads, and the refusals. The builds that
install from a lock (and fail on a missing or altered .deb, or another base) are in
tests/docker/test_oslock_docker.py."""

from __future__ import annotations

import re
import shutil

import pytest
from click.testing import CliRunner

from conftest import ROOT
from envbuild.knowledge import oslock
from envbuild.base.errors import EnvbuildError
from envbuild.plan import stack_plan
from envbuild.resolve import oslocking
from envbuild.resolve.resolver import Request, os_lock_stages, resolve

FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_MATRIX = FIXTURES / "matrix"
LOCKED_STACK = "torch2.11-cu130-py3.11-pypi"  # the fixture matrix's stack with an OS lock (on local/debian:bookworm)
RESOLVER_OUT = FIXTURES / "oslock" / "os-resolve.bookworm-ibverbs.out"
SHA = "ab" * 32


def fixture_lock() -> oslock.OsLock:
    return oslock.load_os_lock(FIXTURE_MATRIX, LOCKED_STACK, "x86_64")


def lock_text(*lines: str, source: str = "debian bookworm / main") -> str:
    return "\n".join(["# envbuild os lock", "# stack: s1", "# arch: x86_64", "# snapshot: 20261126T000000Z",
                      f"# source: {source}", "# [builder]", "# base: local/debian:bookworm", "# base-id: sha256:aa",
                      *lines]) + "\n"


def invoke(*args):
    """The CLI in-process against the fixture matrix: (exit code, output, the EnvbuildError if any)."""
    from envbuild.cli import main

    result = CliRunner().invoke(main, list(args), env={"ENVBUILD_MATRIX_DIR": str(FIXTURE_MATRIX), "COLUMNS": "200"})
    error = result.exception if isinstance(result.exception, EnvbuildError) else None
    return (error.exit_code if error else result.exit_code), result.output, error


# ---------------------------------------------------------------- the file


def test_the_fixture_lock_is_what_lock_os_writes():
    lock = fixture_lock()
    assert lock.header["stack"] == LOCKED_STACK and oslock.TIMESTAMP.match(lock.snapshot)
    assert set(lock.stages) == {"builder", "runtime"}
    for stage in lock.stages.values():
        assert stage.base_name == "local/debian:bookworm" and stage.base_id.startswith("sha256:")
        assert {d.name for d in stage.debs} >= {"g++"} or {d.name for d in stage.debs} >= {"python3.11"}
    # format(parse(text)) == text: the writer and the reader agree on every line
    assert oslock.format_os_lock(lock.header, lock.sources, lock.stages) == lock.text


@pytest.mark.parametrize("line, what", [
    (f"deb g++ amd64 4:12.2.0-3 {SHA[:63]} 1640 debian pool/main/g/g++.deb", "sha256"),
    (f"deb g++ amd64 4:12.2.0-3;id {SHA} 1640 debian pool/main/g/g++.deb", "not 'base NAME"),
    (f"deb g++ amd64 4:12.2.0-3 {SHA} 1640 debian pool/main/../../../etc/x.deb", "climb"),
    (f"deb g++ amd64 4:12.2.0-3 {SHA} 1640 debian-security pool/main/g/g++.deb", "no '# source:' line has"),
    ("base libc6 amd64 $(id)", "not 'base NAME"),
    ("base libc6 amd64", "not 'base NAME"),
])
def test_a_line_outside_the_grammar_is_refused_naming_it(line, what):
    with pytest.raises(EnvbuildError, match=re.escape(what)):
        oslock.parse_os_lock(lock_text(line), "x.txt")


@pytest.mark.parametrize("text, what", [
    ("# envbuild lock\n", "not an envbuild OS lock"),
    (lock_text().replace("# snapshot: 20261126T000000Z", "# snapshot: yesterday"), "not a moment"),
    (lock_text().replace("# snapshot: 20261126T000000Z", "# snapshot: 20261399T999999Z"), "not a moment"),
    (lock_text(source="debian bookworm main"), "a source is"),
    (lock_text().replace("# base-id: sha256:aa\n", ""), "no '# base-id:' line"),
    (lock_text("# [runtime]", "# [runtime]"), "repeated section"),
])
def test_a_malformed_lock_is_refused(text, what):
    with pytest.raises(EnvbuildError, match=re.escape(what)):
        oslock.parse_os_lock(text, "x.txt")


@pytest.mark.parametrize("value, what", [
    ("http://mirror.example:99999/snapshot/{archive}/{timestamp}", "port"),
    ("http://mirror.example:x/snapshot/{archive}/{timestamp}", "port"),
    ("http://{archive}.mirror.example/{timestamp}", "path, not its host"),
    ("http://mirror.example/{archive}/{timestamp}/{suite}", "only placeholders"),
])
def test_an_apt_snapshot_no_build_can_fetch_from_is_refused_where_it_is_given(value, what):
    with pytest.raises(EnvbuildError, match=re.escape(what)):
        oslock.check_snapshot_template("--apt-snapshot", value)


def test_the_part_os_sh_reads_has_the_sources_the_base_and_the_debs():
    lock = fixture_lock()
    part = lock.stage_part("runtime", "http://snapshot.debian.org/archive/{archive}/" + lock.snapshot,
                             "/usr/share/keyrings/debian-archive-keyring.gpg", False)
    kinds = [line.split()[0] for line in part.splitlines()[1:]]
    assert kinds[:4] == ["snapshot", "moment", "keyring", "valid-until"]
    assert part.count("\nsource ") == 3  # bookworm, bookworm-updates, bookworm-security
    assert kinds.count("base") == len(lock.stages["runtime"].base)
    assert kinds.count("deb") == len(lock.stages["runtime"].debs)


def test_resolver_output_is_read_with_each_deb_in_its_archive():
    roots = {"debian": "http://deb.debian.org/debian", "debian-security": "http://deb.debian.org/debian-security"}
    resolved = oslocking.parse_resolver_output(RESOLVER_OUT.read_text(), roots, "fixture")
    assert resolved.apt == "2.6.1" and len(resolved.base) > 80
    assert {d.name for d in resolved.debs} == {"libibverbs1", "ibverbs-providers", "libnl-3-200", "libnl-route-3-200"}
    assert {d.archive for d in resolved.debs} == {"debian"}
    libnl = next(d for d in resolved.debs if d.name == "libnl-3-200")
    assert libnl.version == "3.7.0-0.2+b1" and libnl.filename.endswith("_3.7.0-0.2+b1_amd64.deb")  # %2b decoded


def test_resolver_output_naming_another_archive_is_refused():
    with pytest.raises(EnvbuildError, match="from none of the lock's archives"):
        oslocking.parse_resolver_output(RESOLVER_OUT.read_text(), {"debian": "http://elsewhere/debian"}, "fixture")


# ---------------------------------------------------------------- what a stage may install


# ---------------------------------------------------------------- which stages a request gets locked


def test_a_request_on_the_locks_base_is_locked_and_names_the_snapshot(matrix):
    r = resolve(matrix, Request(gpu="h20", stack=LOCKED_STACK, base_image="local/debian:bookworm"))
    assert r.os_locked == ("builder", "runtime") and r.os_unlocked is None
    manifest = stack_plan(r).manifest
    assert manifest["os_lock"]["snapshot"] == fixture_lock().snapshot and manifest["os_lock"]["packages"] > 100
    assert dict(stack_plan(r).labels.pairs)["io.envbuild.os-lock"] == f"sha256:{fixture_lock().sha256}"


def test_another_base_floats_and_says_why(matrix):
    r = resolve(matrix, Request(gpu="h20", stack=LOCKED_STACK))  # the row's debian:bookworm-slim
    assert r.os_locked == () and r.os_lock is None
    assert "debian:bookworm-slim is not the one the lock was resolved on (local/debian:bookworm)" in r.os_unlocked
    assert stack_plan(r).manifest["os_lock"] == {"unlocked": r.os_unlocked}


def test_a_stack_without_an_os_lock_says_how_to_make_one(matrix):
    r = resolve(matrix, Request(gpu="h20"))
    assert r.os_lock is None and f"envbuild lock --os --stack {r.stack.id}" in r.os_unlocked


def test_the_locks_digest_wins_over_a_tag():
    lock = fixture_lock()
    pinned = oslock.StageLock("ubuntu:24.04@sha256:" + "c" * 64, "sha256:x", (), (), ())
    digested = oslock.OsLock(lock.path, lock.text, lock.header, lock.sources,
                             {"builder": pinned, "runtime": pinned})
    locked, why = os_lock_stages(digested, {"builder": "ubuntu:24.04", "runtime": "ubuntu:22.04"}, "s", "x86_64")
    assert locked == ("builder",) and "the runtime base ubuntu:22.04 is not the one" in why


# ---------------------------------------------------------------- refusals


def test_apt_mirror_on_a_locked_stack_is_refused_and_nothing_written(tmp_path):
    code, _, error = invoke("render", "--gpu", "h20", "--stack", LOCKED_STACK, "--base-image", "local/debian:bookworm",
                            "--apt-mirror", "http://mirror.example", "-o", str(tmp_path / "out"))
    assert code == 2 and "--apt-snapshot" in error.message and not (tmp_path / "out").exists()


def test_apt_snapshot_without_an_os_lock_is_refused(tmp_path):
    code, _, error = invoke("render", "--gpu", "h20", "--apt-snapshot", "http://m/{archive}/{timestamp}",
                            "-o", str(tmp_path / "out"))
    assert code == 2 and "has no OS lock" in error.message and not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, what", [
    ("ftp://m/{archive}", "not an http(s) URL"), ("http://m/snapshot", "has no {archive}"),
    ("http://m/{archive}/$(id)", "contains"), ("http://m/{archive}/{when}", "the only placeholders"),
    ("http://m/{archive}\n#", "contains"),
])
def test_a_bad_apt_snapshot_is_refused_naming_it(tmp_path, value, what):
    code, _, error = invoke("render", "--gpu", "h20", "--apt-snapshot", value, "-o", str(tmp_path / "out"))
    assert code == 2 and what in error.message and "--apt-snapshot" in error.message


def test_apt_key_must_be_a_public_key(tmp_path):
    fake = tmp_path / "key.asc"
    fake.write_text("not a key\n")
    code, _, error = invoke("render", "--gpu", "h20", "--stack", LOCKED_STACK, "--base-image", "local/debian:bookworm",
                            "--apt-key", str(fake), "-o", str(tmp_path / "out"))
    assert code == 2 and "not an OpenPGP public key" in error.message


def test_lock_options_for_os_locks_need_os():
    code, _, error = invoke("lock", "--base-image", "local/debian:bookworm", "--stack", LOCKED_STACK)
    assert code == 2 and "add --os" in error.message


def test_lock_os_of_a_family_without_an_archive_is_refused(tmp_path):
    matrix_dir = tmp_path / "m"
    shutil.copytree(FIXTURE_MATRIX, matrix_dir)
    bases = (matrix_dir / "bases.yaml").read_text()
    (matrix_dir / "bases.yaml").write_text(re.sub(r"(?m)^    apt:\n(?:      .*\n)+", "", bases))
    from envbuild.knowledge.matrix import load_matrix

    with pytest.raises(EnvbuildError, match="no `apt` archive"):
        oslocking.lock_os_stacks(None, load_matrix(matrix_dir), (LOCKED_STACK,))


def test_a_build_whose_archive_cannot_be_reached_is_exit_2_before_anything_is_written(tmp_path):
    """The lock's moment of the archive must answer before the build directory is written (the
    build would otherwise run minutes and then call every version missing)."""
    code, _, error = invoke("build", "--gpu", "h20", "--stack", LOCKED_STACK, "--base-image", "local/debian:bookworm",
                            "--apt-snapshot", "http://user:secret@127.0.0.1:9/{archive}/{timestamp}",
                            "-o", str(tmp_path / "out"))
    assert code == 2 and "cannot be reached from here" in error.message and "127.0.0.1:9/debian/" in error.message
    assert "secret" not in error.message and not (tmp_path / "out").exists()
