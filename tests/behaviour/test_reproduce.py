"""`envbuild diff` and `envbuild rebuild` without an engine: what an image's contents are read as
(envbuild/builds/contents.py), how two are compared (imagediff.py), and what a record must hold for a
rebuild (rebuild.py). The real images are in tests/docker/test_oslock_docker.py."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import tarfile

import pytest
from click.testing import CliRunner

from envbuild import __version__
from envbuild.builds.contents import read_contents
from envbuild.engine import ImageConfig
from envbuild.base.errors import EnvbuildError
from envbuild.builds.imagediff import ImageRecord, compare, summary
from envbuild.builds.rebuild import Record, check_record, read_record
from envbuild.render.builddir import MANIFEST_NAME, render_digest, render_files
from envbuild.resolve.resolver import Request, resolve

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


# ---------------------------------------------------------------- a record is hostile until checked (issue 40)


from conftest import FIXTURE_MATRIX  # noqa: E402
from test_hostile_input import envbuild, refused  # noqa: E402

BIG, DEEP = "9" * 5000, "[" * 200 + "]" * 200  # JSON text Python's json.dumps cannot write


@functools.lru_cache(maxsize=None)
def recorded_manifest() -> str:
    """A real record (the fixture matrix's), as `render` writes it."""
    from envbuild.knowledge.matrix import load_matrix

    r = resolve(load_matrix(FIXTURE_MATRIX), Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi",
                                                    base_image="local/debian:bookworm", ds_ops="cpu_adam"))
    return render_files(r)[MANIFEST_NAME].decode()


def with_field(path: str, value) -> str:
    """The record with `path` set to `value`; for a base, the render digest an attacker would
    compute for it (the digest is no gate). BIG and DEEP go in as JSON text."""
    doc = json.loads(recorded_manifest())
    node, *_, last = [doc, *path.split(".")]
    for key in path.split(".")[:-1]:
        node = node.setdefault(key, {}) if isinstance(node.get(key), dict) or key not in node else node[key]
    placeholder = value in (BIG, DEEP)
    node[last] = "@@VALUE@@" if placeholder else value
    if path.startswith("base_images.") and isinstance(value, str) and not placeholder:
        doc["render"]["sha256"] = _digest_with_bases(doc["base_images"])
    text = json.dumps(doc)
    return text.replace('"@@VALUE@@"', value) if placeholder else text


def _digest_with_bases(bases: dict) -> str:
    from envbuild.knowledge.matrix import load_matrix

    m = load_matrix(FIXTURE_MATRIX)
    r = resolve(m, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", base_image="local/debian:bookworm",
                           ds_ops="cpu_adam"))
    try:
        return render_digest(render_files(dataclasses.replace(r, base_images=bases)))
    except Exception:  # a renderer that refuses the base itself: any digest will do
        return "0" * 64


class NoEngine:
    """An engine that records every use: a record refused before any engine work leaves `calls` empty."""

    def __init__(self):
        self.calls: list[str] = []

    def __getattr__(self, name):
        self.calls.append(name)
        raise EnvbuildError("ENGINE-REACHED", exit_code=1)


@contextlib.contextmanager
def no_engine_work():
    """The engine, the build and the OS-lock network check, each recorded and stopped."""
    engine, stops = NoEngine(), []

    def stop(what):
        def called(*_, **__):
            stops.append(what)
            raise EnvbuildError(f"{what}-REACHED", exit_code=1)
        return called

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("envbuild.builds.rebuild.get_engine", lambda: engine)
        mp.setattr("envbuild.builds.imagediff.get_engine", lambda: engine)
        mp.setattr("envbuild.builds.rebuild.build_image", stop("BUILD"))
        mp.setattr("envbuild.builds.rebuild.check_reachable", stop("NETWORK"))
        yield engine, stops


def test_a_well_formed_record_reaches_the_build(tmp_path):
    """What the property of tests/property/test_reproduce_properties.py relies on: with the record as written, rebuild does get to the build."""
    (tmp_path / "manifest.json").write_text(recorded_manifest())
    with no_engine_work() as (engine, stops):
        r = envbuild("rebuild", str(tmp_path / "manifest.json"), "--matrix-dir", str(FIXTURE_MATRIX),
                     "-o", str(tmp_path / "out"))
    assert r.code == 1 and stops == ["NETWORK"], (r.code, r.err)  # the fixture's OS lock: its snapshot first


@pytest.mark.parametrize("version, shown", [("1!2.0", "pip install 'envbuild==1!2.0'"),
                                            ("99.0.0+local.1", "pip install envbuild==99.0.0+local.1")])
def test_the_suggested_pip_command_is_one_quoted_word(tmp_path, version, shown):
    """The record's envbuild version went unquoted into the pip command a user copies."""
    import shlex

    doc = json.loads(recorded_manifest())
    doc["envbuild"] = version
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with no_engine_work() as (engine, stops):
        r = envbuild("rebuild", str(tmp_path / "manifest.json"), "--matrix-dir", str(FIXTURE_MATRIX))
    refused(r, shown)
    command = r.message.split("run this again: ", 1)[1].rstrip(".")
    assert shlex.split(command) == ["pip", "install", f"envbuild=={version}"] and not engine.calls


@pytest.mark.parametrize("args, named", [
    (["diff", "envbuild:a", "127.0.0.1:5000/x:t\nRUN id"], "B"),
    (["diff", "envbuild:a\n", "envbuild:b"], "A"),
    (["diff", "envbuild:a", "Upper/Case:t"], "B"),
    (["rebuild", "127.0.0.1:5000/x:t$(id)"], "IMAGE"),
    (["rebuild", "127.0.0.1:99999/x:t"], "IMAGE"),
])
def test_diff_and_rebuild_refuse_a_bad_reference_before_the_engine(tmp_path, monkeypatch, args, named):
    """A bad reference was found out only after the engine had inspected (or pulled) the other one."""
    monkeypatch.chdir(tmp_path)
    with no_engine_work() as (engine, stops):
        r = envbuild(*args, "--matrix-dir", str(FIXTURE_MATRIX)) if args[0] == "rebuild" else envbuild(*args)
    refused(r, named)
    assert engine.calls == [] and stops == [] and list(tmp_path.iterdir()) == []


class PullingEngine:
    """An engine without the image until it is pulled."""

    def __init__(self):
        self.pulled: list[str] = []

    def inspect(self, ref):
        if ref not in self.pulled:
            raise EnvbuildError(f"no such image {ref}")
        return type("Info", (), {"id": "sha256:" + "1" * 64})()

    def pull(self, ref):
        self.pulled.append(ref)

    def config(self, ref):
        return ImageConfig("sha256:" + "1" * 64, (), (), (), (), "", "", ())

    def export(self, ref):
        return contextlib.nullcontext(io.BytesIO(image_tar(base_files())))


@pytest.mark.parametrize("ref", ["127.0.0.1:5000/envbuild:tag", "localhost:5000/team/envbuild:t",
                                 "registry.example.com:443/a/b:c"])
def test_a_host_port_reference_is_pulled(ref):
    """The port's colon was taken for the tag's, so a registry on a port was never pulled from."""
    from envbuild.builds.imagediff import read_image

    engine, pulled = PullingEngine(), []
    assert read_image(ref, engine, pulled).ref == ref
    assert engine.pulled == [ref] and pulled == [ref]


def test_a_name_without_a_registry_is_not_pulled():
    from envbuild.builds.imagediff import read_image

    with pytest.raises(EnvbuildError, match="names no registry"):
        read_image("envbuild:tag", PullingEngine())


def _rebuild_with_fake_build(tmp_path, events: list[str], *flags: str):
    """`rebuild` of a record whose build the engine serves with `events` for its one RUN step."""
    from envbuild.builds.build import BuildResult

    (tmp_path / "manifest.json").write_text(recorded_manifest())
    built = {}

    def build_image(path, tag, repo, secrets, on_step=None, extra_args=(), engine=None):
        built["extra_args"] = extra_args
        for name in ("[runtime 1/3] FROM local/debian:bookworm", "[runtime 2/3] RUN step.sh"):
            on_step("start", name)
            on_step(events[0] if "RUN" in name else "done", name)
        return BuildResult("sha256:" + "2" * 64, [f"{repo}:{tag}"], path / "build.log", 0.0, [])

    same = record(image_tar(base_files()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("envbuild.builds.rebuild.get_engine", lambda: type("E", (), {"inspect": lambda self, ref: True})())
        mp.setattr("envbuild.builds.rebuild.build_image", build_image)
        mp.setattr("envbuild.builds.rebuild.check_reachable", lambda *a, **k: None)
        mp.setattr("envbuild.builds.rebuild.read_image", lambda ref, engine=None: same)
        r = envbuild("rebuild", str(tmp_path / "manifest.json"), "--matrix-dir", str(FIXTURE_MATRIX),
                     "-o", str(tmp_path / "out"), *flags)
    return r, built


def test_a_rebuild_served_from_the_cache_says_it_was_not_rebuilt(tmp_path):
    """With a warm cache the 'rebuilt' image was the original, compared with itself: 'the same content'."""
    r, built = _rebuild_with_fake_build(tmp_path, ["cached"], "--cache")
    assert r.code == 1 and "not rebuilt: served from cache" in r.out and "the same content" not in r.out, r
    assert "--no-cache" not in built["extra_args"]


def test_a_rebuild_builds_every_step_again_by_default(tmp_path):
    r, built = _rebuild_with_fake_build(tmp_path, ["done"])
    assert r.code == 0 and "the same content" in r.out, r
    assert "--no-cache" in built["extra_args"]
