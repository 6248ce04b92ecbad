"""`envbuild diff` and `envbuild rebuild` without an engine: what an image's contents are read as
(envbuild/contents.py), how two are compared (imagediff.py), and what a record must hold for a
rebuild (rebuild.py). The real images are in tests/test_oslock_docker.py."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile

import pytest
from click.testing import CliRunner

from envbuild import __version__
from envbuild.contents import read_contents
from envbuild.engine import ImageConfig
from envbuild.errors import EnvbuildError
from envbuild.imagediff import ImageRecord, compare, summary
from envbuild.rebuild import Record, check_record, read_record
from envbuild.render import MANIFEST_NAME, render_digest, render_files
from envbuild.resolve import Request, resolve

SITE = "opt/venv/lib/python3.11/site-packages"
STATUS = (b"Package: libc6\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.36-9\n\n"
          b"Package: gone\nStatus: deinstall ok config-files\nArchitecture: amd64\nVersion: 1\n\n")


def image_tar(files: dict, mtime: int = 0, modes: dict | None = None, links: dict | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), mtime, (modes or {}).get(name, 0o644)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, mtime
            tar.addfile(info)
    return buf.getvalue()


def base_files(**changes) -> dict:
    files = {"var/lib/dpkg/status": STATUS, f"{SITE}/six.py": b"x = 1\n",
             f"{SITE}/six-1.16.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: six\nVersion: 1.16.0\n",
             f"{SITE}/six-1.16.0.dist-info/RECORD": b"six.py,sha256=x,6\nsix-1.16.0.dist-info/METADATA,,\n"}
    files.update(changes)
    return files


def record(tar: bytes, env=("PATH=/bin",), labels=(("a", "1"),), layers=(("RUN x", 10),)) -> ImageRecord:
    config = ImageConfig("sha256:" + "0" * 64, env, labels, ("/e",), ("bash",), "", "", layers)
    return ImageRecord("ref", config.id, config, read_contents(io.BytesIO(tar)))


def test_contents_read_packages_distributions_and_files():
    c = read_contents(io.BytesIO(image_tar(base_files(), links={"usr/bin/python3": "python3.11"})))
    assert c.debs == {"libc6:amd64": "2.36-9"}  # a removed package keeps no entry
    assert c.dists["six"].version == "1.16.0" and c.dists["six"].location == SITE
    assert c.files["usr/bin/python3"].kind == "symlink" and c.files["usr/bin/python3"].content == "python3.11"


def test_two_images_of_the_same_bytes_written_at_other_times_are_equal():
    a, b = record(image_tar(base_files(), mtime=1)), record(image_tar(base_files(), mtime=1_700_000_000))
    assert compare(a, b) == [] and summary(a, b, [])["equal"]


def test_a_changed_file_of_a_distribution_changes_it_at_the_same_version():
    a = record(image_tar(base_files()))
    b = record(image_tar(base_files(**{f"{SITE}/six.py": b"x = 2\n"})))
    found = {(d.section, d.key) for d in compare(a, b)}
    assert ("python", "six") in found and ("files", f"{SITE}/six.py") in found


@pytest.mark.parametrize("changes, expected", [
    ({"var/lib/dpkg/status": STATUS.replace(b"2.36-9", b"2.36-10")},  # the package, and dpkg's file that says so
     [("os", "libc6:amd64"), ("files", "var/lib/dpkg/status")]),
    ({"etc/new": b"1"}, [("files", "etc/new")]),
])
def test_each_kind_of_change_is_named_in_its_section(changes, expected):
    diffs = compare(record(image_tar(base_files())), record(image_tar(base_files(**changes))))
    assert [(d.section, d.key) for d in diffs] == expected


def test_mode_env_labels_config_and_layers_are_compared():
    a = record(image_tar(base_files()))
    b = record(image_tar(base_files(), modes={f"{SITE}/six.py": 0o755}), env=("PATH=/bin", "X=1"),
               labels=(("a", "2"),), layers=(("RUN x", 12), ("ENV X=1", 0)))
    b = dataclasses.replace(b, config=dataclasses.replace(b.config, entrypoint=("/other",)))
    sections = {d.section for d in compare(a, b)}
    assert sections == {"files", "env", "labels", "config", "layers"}


# ---------------------------------------------------------------- the record and rebuild


@pytest.fixture
def manifest(matrix):
    r = resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", base_image="local/debian:bookworm",
                                env=(("NCCL_DEBUG", "INFO"),), ds_ops="cpu_adam"))
    return json.loads(render_files(r)[MANIFEST_NAME])


def test_the_recorded_request_renders_the_same_files_again(matrix, manifest):
    """What rebuild relies on: the record's request resolves and renders to the recorded digest."""
    request = check_record(Record(manifest, "image", None), matrix)
    r = resolve(matrix, request)
    r = dataclasses.replace(r, base_images=manifest["base_images"])
    assert render_digest(render_files(r)) == manifest["render"]["sha256"]
    assert request.env == (("NCCL_DEBUG", "INFO"),)


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(envbuild="99.0.0"), ["made by envbuild 99.0.0", "(older)", "pip install envbuild==99.0.0"]),
    (lambda m: m.update(envbuild="0.0.1"), ["made by envbuild 0.0.1", "pip install envbuild==0.0.1"]),
    (lambda m: m.pop("request"), ["did not record its request"]),
    (lambda m: m.update(matrix={"sha256": "f" * 64}), ["rendered from a matrix with sha256 ffffffff", "--matrix-dir"]),
    (lambda m: m.update(extend={"from": "envbuild:x"}), ["`envbuild extend` layer", "envbuild:x"]),
    (lambda m: m["request"].update(colour="blue"), None),  # a field this envbuild does not know is ignored
])
def test_a_record_this_envbuild_cannot_reproduce_says_what_to_do(matrix, manifest, edit, words):
    edit(manifest)
    if words is None:
        check_record(Record(manifest, "image", None), matrix)
        return
    with pytest.raises(EnvbuildError) as e:
        check_record(Record(manifest, "image", None), matrix)
    assert all(w in e.value.message for w in words), e.value.message
    assert e.value.exit_code == 2


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe\x00", "not UTF-8"), (b"{", "not valid JSON"), (b"[]", "no `envbuild` and `tag`"), (b'{"envbuild": "0.1.0"}', "no `envbuild` and"),
])
def test_a_file_that_is_no_record_is_refused(tmp_path, content, words):
    path = tmp_path / "manifest.json"
    path.write_bytes(content)
    with pytest.raises(EnvbuildError, match=words):
        read_record(str(path))


def test_rebuild_of_a_file_that_is_no_record_is_exit_2_and_builds_nothing(tmp_path):
    from envbuild.cli import main

    result = CliRunner().invoke(main, ["rebuild", "/etc/passwd", "-o", str(tmp_path / "out")])
    assert isinstance(result.exception, EnvbuildError) and result.exception.exit_code == 2
    assert "not an envbuild record" in result.exception.message and not (tmp_path / "out").exists()


def test_the_manifest_records_request_matrix_and_files(manifest, matrix):
    assert manifest["envbuild"] == __version__ and manifest["matrix"]["sha256"] == matrix.sha256
    assert manifest["request"]["gpu"] == "h20" and manifest["request"]["env"] == [["NCCL_DEBUG", "INFO"]]
    assert len(manifest["render"]["sha256"]) == 64
