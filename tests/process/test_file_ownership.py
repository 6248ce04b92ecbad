"""envbuild removes or replaces only regular files it wrote, recognised by its own format: for
every command option that names a file envbuild writes or replaces, each kind of thing a user
may have there (a device node, a FIFO, a symlink to a file of theirs, a dangling symlink, a
symlink to a file envbuild wrote, a text file of theirs, a tar of theirs) survives as it was,
and the command exits 2 with one paragraph naming it. Run as root, as the tests are: root may
unlink anything, so nothing but envbuild's own checks stands between a command and the file.

`publish --job` runs here with its builds replaced (a job's run is a Docker build per variant)
and the ext-cache copy's engine replaced by one that writes what the copy image would: the
ext-cache decisions (load, save, FILE.key) are the real ones."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, alarm_deadline
from envbuild.builds import staging
from envbuild.builds import extcache
from envbuild.supply import jobcache, release
from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import escaped
from test_hostile_input import envbuild, refused

JOB = "torch2.5-cu124-py3.10-amd64-flash-attn"  # a job of the shipped plan with a CUDA extension
SHIPPED = {"ENVBUILD_MATRIX_DIR": str(ROOT / "matrices"), "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
KINDS = ["device", "fifo", "symlink-to-mine", "dangling-symlink", "symlink-to-a-saved-file", "my-text", "my-tar"]
README = b"# My project\n\nNotes I keep by hand.\n"
MARKED = b"envbuild-ext-cache\n"  # the marker's content, as the copy script writes it (checked below)


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_marker_the_tests_write_is_the_one_the_copy_script_writes():
    assert f"echo {MARKED.decode().strip()} > /out/{extcache.MARKER}" in extcache.SAVE_STEPS


def saved_file(path: Path, wheel: str = "flash-attn/0123456789abcdef/f-2.8-cp310.whl") -> Path:
    """What `ext-cache save` writes: the marker (with its content) and a stamped wheel."""
    return _tar(path, {extcache.MARKER: MARKED, wheel: b"wheel", wheel.replace(".whl", ".sha256"): b"s\n"})


def put(kind: str, path: Path) -> None:
    """A thing of `kind` at `path`; what it points at lives in `path`'s directory's `mine/`."""
    mine = path.parent / "mine"
    mine.mkdir(exist_ok=True)
    (mine / "README.md").write_bytes(README)
    if kind == "device":  # the same device as /dev/null, made here: never one under /dev
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-to-mine":
        path.symlink_to(mine / "README.md")
    elif kind == "dangling-symlink":
        path.symlink_to(mine / "not-yet-there")
    elif kind == "symlink-to-a-saved-file":
        path.symlink_to(saved_file(mine / "saved.tar"))
    elif kind == "my-text":
        path.write_bytes(README)
    elif kind == "my-tar":
        _tar(path, {"notes.txt": b"mine", "data/run1.csv": b"1,2,3\n"})


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root`, unfollowed: its type, device number, link target and bytes."""
    seen = {}
    for directory, dirs, names in os.walk(root):
        for name in dirs + names:
            p = Path(directory) / name
            st = os.lstat(p)
            seen[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_rdev if stat.S_ISCHR(st.st_mode) else 0,
                                               os.readlink(p) if p.is_symlink() else None,
                                               p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return seen


class CopyEngine:
    """The ext-cache copy's engine: writes what the copy image writes (a saved file; a load's count)."""

    def check_usable(self):
        pass

    def build(self, context, tags, build_secrets, log, extra_args=()):
        kind, dest = dict(p.split("=", 1) for p in extra_args[list(extra_args).index("--output") + 1].split(",")).values()
        if kind == "tar":
            saved_file(Path(dest), "flash-attn/fedcba9876543210/f-2.8-cp310.whl")
        else:
            Path(dest).mkdir(parents=True)
            (Path(dest) / extcache.LOADED).write_text("1\n")


@pytest.fixture
def work(tmp_path, tmp_path_factory, monkeypatch):
    """The cwd, with a signing key; the ext-cache copy on CopyEngine, a publish job's builds
    replaced by one rendered variant with an extension (what its save takes the keys of)."""
    monkeypatch.chdir(tmp_path)
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", "key.pem"], check=True, capture_output=True)
    monkeypatch.setattr(extcache, "get_engine", CopyEngine)

    def run_job(ctx, job, variants):
        spec = ctx.out / "build" / "h100" / "envbuild" / "extensions.json"
        spec.parent.mkdir(parents=True)
        spec.write_text('{"extensions": [{"name": "flash-attn", "cache_key": "fedcba9876543210"}]}')
        return []

    monkeypatch.setattr(release, "run_job", run_job)
    tools = tmp_path_factory.mktemp("bin")  # the job's builds are replaced: so is the tool its .sqsh needs
    (tools / "mksquashfs").write_text("#!/bin/sh\nexit 1\n")
    (tools / "mksquashfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def run(*args: str):
    """`envbuild ARGS` here, failing (not hanging) where main opened a FIFO to write it."""
    with alarm_deadline(60, f"envbuild {' '.join(args)} blocked"):
        return envbuild(*args, env=SHIPPED)


def publish(*more: str):
    return run("publish", "--job", JOB, "--registry", "127.0.0.1:9/acme", "--signing-key", "key.pem",
                    "--out", "publish-out", *more)


def _unchanged_and_refused(r, work: Path, before: dict, named: Path) -> None:
    refused(r, escaped(str(named)))
    assert snapshot(work) == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["ext-cache save", "ext-cache load", "publish --ext-cache"])
def test_a_file_envbuild_did_not_write_survives_every_ext_cache_command(work, command, kind):
    """`ext-cache save FILE`, `ext-cache load FILE` and `publish --job --ext-cache FILE` with a
    device, FIFO, symlink or file of the user's at FILE: exit 2 naming it, every entry as it was
    (main unlinked /dev/null and README.md in publish, and replaced a symlink in save)."""
    if command == "ext-cache load" and kind == "symlink-to-a-saved-file":
        pytest.skip("load reads through a link to a file save wrote, and writes nothing")
    put(kind, work / "cache.tar")
    before = snapshot(work)
    if command == "publish --ext-cache":
        r = publish("--ext-cache", "cache.tar")
    else:
        r = run(*command.split(), "cache.tar", "--base-image", "debian:bookworm")
    _unchanged_and_refused(r, work, before, Path("cache.tar"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_file_envbuild_did_not_write_is_never_overwritten(work, kind):
    """FILE.key beside a publish job's --ext-cache FILE (main wrote the cache key over it)."""
    put(kind, work / "cache.tar.key")
    before = snapshot(work)
    _unchanged_and_refused(publish("--ext-cache", "cache.tar"), work, before, Path("cache.tar.key"))


def test_a_file_and_key_envbuild_wrote_are_replaced_and_the_key_follows_the_wheels(work):
    """The other side: what an earlier job saved (even cut short) is replaced by this run's."""
    whole = saved_file(work / "cache.tar").read_bytes()
    (work / "cache.tar").write_bytes(whole[:1536])  # the marker's blocks, then cut off: recognised still
    (work / "cache.tar.key").write_text("0123456789abcdef\n")
    r = publish("--ext-cache", "cache.tar")
    assert r.code == 0, r.err
    assert extcache.wheels_in(work / "cache.tar") == ("flash-attn/fedcba9876543210/f-2.8-cp310.whl",)
    assert (work / "cache.tar.key").read_text() != "0123456789abcdef\n"
    assert not [p for p in work.iterdir() if ".envbuild-" in p.name]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("step", ["load", "save"])
def test_the_jobs_ext_cache_steps_refuse_and_keep_a_file_envbuild_did_not_write(work, step, kind):
    """jobcache.ext_cache_load / ext_cache_save called on their own (as a caller other than the
    CLI would): exit 2 naming the file, nothing removed (main's load unlinked a file it refused,
    its save unlinked whatever was there)."""
    from envbuild.knowledge.matrix import load_matrix

    put(kind, work / "cache.tar")
    spec = work / "out" / "build" / "h100" / "envbuild" / "extensions.json"
    spec.parent.mkdir(parents=True)
    spec.write_text('{"extensions": [{"name": "flash-attn", "cache_key": "fedcba9876543210"}]}')
    before = snapshot(work)
    job = {"extensions": "flash-attn", "stack": "x"}
    with pytest.raises(EnvbuildError) as refusal, alarm_deadline(60, f"ext_cache_{step} blocked"):
        if step == "load":
            jobcache.ext_cache_load(load_matrix(FIXTURE_MATRIX), job, Path("cache.tar"), "debian:bookworm", print)
        else:
            jobcache.ext_cache_save(load_matrix(FIXTURE_MATRIX), job, Path("cache.tar"), work / "out", "debian:bookworm",
                                    print)
    assert refusal.value.exit_code == 2 and "cache.tar" in refusal.value.message
    assert "\n\n" not in refusal.value.message
    assert snapshot(work) == before


def test_a_saved_file_load_refuses_is_kept_for_the_jobs_save_to_replace(work):
    """A file save wrote that load cannot take (a member out of its directory) is not removed
    by load; the job's save replaces it."""
    from envbuild.knowledge.matrix import load_matrix

    _tar(work / "cache.tar", {extcache.MARKER: MARKED, "../x/y/z.whl": b"w"})
    before = snapshot(work)
    said = []
    jobcache.ext_cache_load(load_matrix(FIXTURE_MATRIX), {"extensions": "flash-attn", "stack": "x"}, Path("cache.tar"),
                            "debian:bookworm", said.append)
    assert snapshot(work) == before and "was refused" in said[0]


# ---------------------------------------------------------------- stage --to DIR: NAME.sqsh and NAME.sha256


def _produce(data: bytes):
    def produce(tmp: Path) -> str:
        tmp.write_bytes(data)
        from envbuild.base.files import sha256_file

        return sha256_file(tmp)
    return produce


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["image.sqsh", "image.sqsh.sha256"])
def test_stage_never_replaces_what_it_did_not_write_in_the_directory(tmp_path, which, kind):
    """`stage ... --to DIR` with a thing of the user's at DIR/NAME.sqsh or DIR/NAME.sha256: exit
    2 naming it, DIR as it was (main replaced a dangling link at NAME.sqsh, and wrote its checksum
    over the user's NAME.sqsh.sha256 where NAME.sqsh was not there yet)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    put(kind, shared / which)
    before = snapshot(tmp_path)
    with pytest.raises(EnvbuildError) as refusal, alarm_deadline(60, "stage blocked"):
        staging.stage(shared, "image.sqsh", 0, _produce(b"hsqs" + bytes(200)), wait=5)
    assert refusal.value.exit_code == 2 and which in refusal.value.message, refusal.value.message
    after = snapshot(tmp_path)
    assert after.pop("shared/.envbuild-stage.lock", None) is not None  # the lock NFS honours: stage's own
    assert after == before


@pytest.mark.parametrize("kind", KINDS)
def test_export_never_replaces_what_is_at_its_output(work, kind):
    """`export IMAGE -o FILE` with anything at FILE: exit 2 naming it, before Docker is asked."""
    put(kind, work / "image.sqsh")
    before = snapshot(work)
    _unchanged_and_refused(run("export", "local/img:1", "--enroot", "-o", "image.sqsh"), work, before,
                           Path("image.sqsh"))


@pytest.mark.parametrize("kind", KINDS)
def test_ci_never_replaces_what_is_at_its_output(work, kind):
    """`ci -o FILE` (and the matrix-refresh workflow it writes beside it)."""
    put(kind, work / "publish.yml")
    before = snapshot(work)
    _unchanged_and_refused(run("ci", "-o", "publish.yml"), work, before, Path("publish.yml"))


@pytest.mark.parametrize("kind", ["device", "fifo", "symlink-to-mine", "dangling-symlink", "symlink-to-a-saved-file"])
def test_write_atomic_replaces_no_link_device_or_fifo(tmp_path, kind):
    """The files a job writes into its --out (report.json, digests, attestations), stage's
    checksum and the smoke records all go through write_atomic: main renamed over whatever was
    at the name (a device node, a FIFO, the user's symlink)."""
    from envbuild.base.files import write_atomic

    put(kind, tmp_path / "report.json")
    before = snapshot(tmp_path)
    with pytest.raises(EnvbuildError) as refusal:
        write_atomic(tmp_path / "report.json", b"{}\n")
    assert refusal.value.exit_code == 2 and "report.json" in refusal.value.message
    assert snapshot(tmp_path) == before
