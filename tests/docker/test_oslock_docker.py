"""The OS lock for real: `envbuild lock --os` resolves the CI stack in its base image, a real apt
repository on 127.0.0.1 serves the locked .debs as the archive's snapshot would (the snapshot
services cannot be reached from here: the repository is made with dpkg-dev's dpkg-scanpackages
and apt-utils' apt-ftparchive over the .debs fetched from Debian, and signed with a key made for
the run), and the build installs exactly those, checks each .deb, and fails, tagging nothing, on
an altered .deb, a version the archive lacks and a base that is not the lock's. Then `envbuild
rebuild` of the image this module built, and `envbuild diff`.

About 8 minutes on two cores the first time (the image's torch layer), under a minute after."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import threading
import urllib.request
from functools import partial
from pathlib import Path

import pytest

from conftest import BASE_IMAGE, CA_BUNDLE, ROOT, ci_stack_id, docker, remove_images, run_build, run_cli, unique
from envbuild.knowledge import oslock

BASE = BASE_IMAGE
REPO = unique("envbuild-oslock-test")
BASE_ALIAS = f"{REPO}-base:bookworm"  # the lock's base name, moved to another image in one test
OPS = "cpu_adam"  # no CUDA op: the image needs no nvcc, so the build is the OS, torch and one CPU op


@pytest.fixture(scope="module")
def work(docker_engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("oslock")
    docker("tag", BASE, BASE_ALIAS)
    yield d
    remove_images(REPO)  # REPO is this run's own (conftest.unique): REPO-ok, REPO-base, ... go with it


@pytest.fixture(scope="module")
def locked(work):
    """A copy of the production matrix with an OS lock of the CI stack on BASE_ALIAS, resolved
    from the live Debian archive now (the snapshot service is what a lab would use)."""
    matrix_dir = work / "matrix"
    shutil.copytree(ROOT / "matrices", matrix_dir)
    r = run_cli("lock", "--os", "--stack", ci_stack_id(), "--base-image", BASE_ALIAS, "--apt-snapshot", "live",
                "--matrix-dir", str(matrix_dir), timeout=900, production=True)
    assert r.returncode == 0, r.stdout + r.stderr
    lock = oslock.load_os_lock(matrix_dir, ci_stack_id(), "x86_64")
    assert lock is not None and lock.stages["builder"].base_name == BASE_ALIAS
    return {"dir": matrix_dir, "lock": lock}


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # apt's requests are not the test's output
        pass


class Repository:
    """A signed apt repository of the lock's .debs in the archive's own layout, one directory
    per archive and moment (/<archive>/<moment>/dists, /pool), served on 127.0.0.1."""

    def __init__(self, root: Path, lock: oslock.OsLock):
        self.root, self.lock = root, lock
        self.gnupg = root / "gnupg"
        self.gnupg.mkdir(mode=0o700, parents=True)
        self._gpg("--batch", "--passphrase", "", "--quick-generate-key", "envbuild test archive <t@example.invalid>",
                  "ed25519", "sign", "1d")
        self.key = root / "key.asc"
        self.key.write_bytes(self._gpg("--export", "--armor"))
        self.debs = {(d.archive, d.filename): d for s in lock.stages.values() for d in s.debs}
        for (archive, filename), deb in sorted(self.debs.items()):
            dest = self.tree(archive) / filename
            dest.parent.mkdir(parents=True, exist_ok=True)
            with urllib.request.urlopen(f"http://deb.debian.org/{archive}/{filename}", timeout=120) as response:
                data = response.read()
            assert hashlib.sha256(data).hexdigest() == deb.sha256, f"the archive served another {filename}"
            dest.write_bytes(data)
        self.index()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(root / "www")))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/{{archive}}/{{timestamp}}"

    def tree(self, archive: str) -> Path:
        return self.root / "www" / archive / self.lock.snapshot

    def _gpg(self, *args: str) -> bytes:
        return subprocess.run(["gpg", "--homedir", str(self.gnupg), "--quiet", *args], check=True,
                              capture_output=True).stdout

    def index(self) -> None:
        """Packages by dpkg-scanpackages, Release by apt-ftparchive, InRelease by gpg --clearsign."""
        for archive, suites, components in self.lock.sources:
            tree = self.tree(archive)
            for suite in suites:
                for component in components:
                    where = tree / "dists" / suite / component / "binary-amd64"
                    where.mkdir(parents=True, exist_ok=True)
                    scan = subprocess.run(["dpkg-scanpackages", "--multiversion", "pool"], cwd=tree, check=True,
                                          capture_output=True).stdout
                    (where / "Packages").write_bytes(scan)
                    (where / "Packages.gz").write_bytes(gzip.compress(scan, mtime=0))
                release = subprocess.run(
                    ["apt-ftparchive", "-o", f"APT::FTPArchive::Release::Suite={suite}",
                     "-o", f"APT::FTPArchive::Release::Codename={suite}",
                     "-o", f"APT::FTPArchive::Release::Components={' '.join(components)}",
                     "-o", "APT::FTPArchive::Release::Architectures=amd64", "release", "."],
                    cwd=tree / "dists" / suite, check=True, capture_output=True).stdout
                (tree / "dists" / suite / "Release").write_bytes(release)
                inrelease = tree / "dists" / suite / "InRelease"
                inrelease.unlink(missing_ok=True)
                self._gpg("--batch", "--yes", "--clearsign", "-o", str(inrelease), str(tree / "dists" / suite / "Release"))

    def close(self) -> None:
        """Stop serving, and stop the gpg-agent that signing started in its home: a daemon a run
        leaves is one more on a CI runner that keeps its processes' machine."""
        self.server.shutdown()
        self.server.server_close()
        subprocess.run(["gpgconf", "--homedir", str(self.gnupg), "--kill", "all"], check=False, capture_output=True)

    def path_of(self, name: str) -> Path:
        deb = next(d for d in self.debs.values() if d.name == name)
        return self.tree(deb.archive) / deb.filename


@pytest.fixture(scope="module")
def repository(work, locked):
    repo = Repository(work / "repo", locked["lock"])
    yield repo
    repo.close()


def build(work, locked, repository, name, *extra, no_cache=False):
    env = {"ENVBUILD_DOCKER_BUILD_ARGS": "--no-cache"} if no_cache else {}
    out = work / name
    r = run_build("--gpu", "h20", "--stack", ci_stack_id(), "--ds-ops", OPS, "--matrix-dir", str(locked["dir"]),
                  "--image-repo", f"{REPO}-{name}", "--apt-snapshot", repository.url, "--apt-key", str(repository.key),
                  "-o", str(out), *extra, base_image=BASE_ALIAS, env=env, timeout=3600)
    return r, out


def tagged(name: str) -> list[str]:
    return docker("images", "-q", f"{REPO}-{name}").stdout.split()


# The failures first, each from a clean cache: they stop in the first OS step, before torch.


def test_an_altered_deb_fails_the_build_naming_it_and_tags_nothing(work, locked, repository):
    deb = repository.path_of("g++")
    original = deb.read_bytes()
    try:
        deb.write_bytes(original + b"\0")  # another file under the same name, in a re-signed index
        repository.index()
        r, _ = build(work, locked, repository, "altered", no_cache=True)
    finally:
        deb.write_bytes(original)
        repository.index()
    assert r.returncode != 0
    assert "is not the file the OS lock pinned" in r.stderr and "g++_" in r.stderr, r.stderr[-3000:]
    assert tagged("altered") == []


def test_a_version_the_archive_lacks_fails_naming_it_and_the_moment(work, locked, repository):
    deb = repository.path_of("g++")
    aside = work / "aside.deb"
    shutil.move(deb, aside)
    try:
        repository.index()
        r, _ = build(work, locked, repository, "missing", no_cache=True)
    finally:
        shutil.move(aside, deb)
        repository.index()
    assert r.returncode != 0
    version = next(d.version for d in locked["lock"].stages["builder"].debs if d.name == "g++")
    assert f"lacks 1 version(s) the OS lock pins: g++={version}" in r.stderr, r.stderr[-3000:]
    assert locked["lock"].snapshot in r.stderr and tagged("missing") == []


def test_another_image_under_the_locks_base_name_fails_before_installing(work, locked, repository):
    other = work / "other-base"
    other.mkdir()
    (other / "Dockerfile").write_text(f"FROM {BASE}\nRUN apt-get update -qq && apt-get install -y -qq less\n")
    docker("build", "--network", "host", "-t", BASE_ALIAS, str(other), env={**os.environ, "DOCKER_BUILDKIT": "1"})
    try:
        r, _ = build(work, locked, repository, "otherbase", no_cache=True)
    finally:
        docker("tag", BASE, BASE_ALIAS)
    assert r.returncode != 0
    assert "before installing, this stage does not match its OS lock" in r.stderr and "less" in r.stderr, \
        r.stderr[-3000:]
    assert tagged("otherbase") == []


@pytest.fixture(scope="module")
def image(work, locked, repository):
    r, out = build(work, locked, repository, "ok")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    return {"ref": f"{REPO}-ok:{manifest['tag']}", "out": out, "manifest": manifest}


def test_the_image_holds_exactly_the_locked_packages(image, locked):
    lock = locked["lock"]
    log = (image["out"] / "build.log").read_text()
    assert log.count("OS packages from the OS lock:") >= 3  # builder, runtime, the fabric's verbs
    status = docker("run", "--rm", "--entrypoint", "dpkg-query", image["ref"], "-W",
                    "-f=${Package} ${Architecture} ${Version}\\n").stdout.split("\n")
    installed = {tuple(line.split()) for line in status if line.strip()}
    allowed = {(n, a, v) for n, a, v in lock.stages["runtime"].base} | {
        (d.name, d.arch, d.version) for d in lock.stages["runtime"].debs}
    assert installed <= allowed, sorted(installed - allowed)[:5]
    assert {("python3.11", "amd64")} <= {(n, a) for n, a, _ in installed}
    recorded = docker("run", "--rm", "--entrypoint", "cat", image["ref"], "/opt/envbuild/os-lock.txt").stdout
    assert recorded == lock.text
    assert image["manifest"]["os_lock"]["sha256"] == lock.sha256
    assert image["manifest"]["os_lock"]["stages"] == ["builder", "runtime"]


def test_rebuild_from_the_images_record_gives_the_same_content(work, image, locked, repository):
    r = run_cli("rebuild", image["ref"], "--matrix-dir", str(locked["dir"]), "--ca-cert", CA_BUNDLE,
                "--apt-snapshot", repository.url, "--apt-key", str(repository.key), "-o", str(work / "rebuilt"),
                "--json", timeout=3600, production=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["equal"] and doc["compared"]["files"] > 1000 and doc["compared"]["os"] > 100
    assert "re-rendered" in r.stderr and f"{REPO}-ok-rebuild:" in r.stderr


def test_rebuild_with_another_matrix_stops_before_building(work, image):
    r = run_cli("rebuild", image["ref"], "-o", str(work / "never"), production=True)  # the built-in matrix
    assert r.returncode == 2 and "rendered from a matrix with sha256" in r.stderr and "--matrix-dir" in r.stderr
    assert not (work / "never").exists()


def test_rebuild_of_an_image_envbuild_did_not_make_is_refused(work):
    r = run_cli("rebuild", BASE, "-o", str(work / "never2"))
    assert r.returncode == 2 and "has no envbuild record" in r.stderr and not (work / "never2").exists()


def test_diff_names_what_changed(work, image):
    derived = work / "derived"
    derived.mkdir()
    (derived / "Dockerfile").write_text(f"FROM {image['ref']}\nENV EXTRA=1\n"
                                        "RUN rm /opt/envbuild/os-lock.txt && /opt/venv/bin/pip uninstall -y -q hjson\n")
    docker("build", "--network", "host", "-t", f"{REPO}-derived:1", str(derived),
           env={**os.environ, "DOCKER_BUILDKIT": "1"})
    r = run_cli("diff", image["ref"], f"{REPO}-derived:1", "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    keys = {(d["section"], d["key"]) for d in doc["differences"]}
    assert ("env", "EXTRA") in keys and ("files", "opt/envbuild/os-lock.txt") in keys and ("python", "hjson") in keys
    assert doc["differing"]["os"] == 0
    same = run_cli("diff", image["ref"], image["ref"])
    assert same.returncode == 0 and "the same content" in same.stdout


def test_diff_of_an_image_that_does_not_exist_is_exit_2():
    r = run_cli("diff", f"{REPO}-none:1", BASE)
    assert r.returncode == 2 and "does not exist on this machine" in r.stderr
