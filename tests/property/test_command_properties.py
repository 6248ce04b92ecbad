"""Every string option of the commands besides `render` (whose options are in
test_hostile_input.py) and `job` (test_jobs.py), as an adversarial user brings it: a generated
value with control characters, quotes, `$(...)`, newlines, NULs or an oversize length is exit 2
with one paragraph naming the option and nothing written, or carried as data (a build directory
whose files pass their linters and keep the layout of one rendered without the value), or it
passes its checks and stops where this machine has nothing to give: no Docker engine (its socket
is absent here), no registry (127.0.0.1:9 refuses connections), no resolver and no
vulnerability service (uv and pip-audit are replaced by a stop: PyPI is not asked). Never a traceback, exit 70 or exit 1.

ENVBUILD_PROPERTY_EXAMPLES raises the example counts (the fast suite runs few)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE_MATRIX, ROOT, alarm_deadline
from envbuild.builds.staging import SQUASHFS_MAGIC, SUPERBLOCK
from property_settings import EXAMPLES, examples
from test_hostile_input import Ran, envbuild, listing, refused
from test_hostile_input_properties import HOSTILE, assert_holds_as_data

# Where a command stops on this machine after its input passed every check: an exit 2 that
# names the machine, not the input. A registry that cannot be reached is exit 1, as for `push`
# (test_docker_e2e.py::test_unreachable_registry_is_a_clear_error).
STOPS = ("cannot reach the Docker engine", "Cannot connect to the Docker daemon", "NETWORK-STOP",
         "publish --job needs mksquashfs")
UNREACHABLE = re.compile(r"registry \S+ cannot be reached|NETWORK-STOP")
NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock", "HTTPS_PROXY": "http://127.0.0.1:9",
             "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
# publish reads matrices/publish.yaml, which only the shipped matrix has
SHIPPED = {"ENVBUILD_MATRIX_DIR": str(ROOT / "matrices")}
STACK = "torch2.11-cu130-py3.11-pypi"  # a locked stack of the fixture matrix
MANIFEST_TAG = "torch2.4.1-cu121-py3.10-ds0.15.4-h100"  # a tag of the shipped publish plan


@dataclass(frozen=True)
class Case:
    """`args` with {v} where the value goes (an option's value, a file name, a line of a file);
    `benign` a value the command takes; `names` the words a refusal must hold (any one)."""
    args: tuple[str, ...]
    benign: str
    names: tuple[str, ...]
    env: dict = field(default_factory=dict)
    file: str = ""  # the value goes into this file of the work directory (its {v}), not onto the command line


EXTEND = ("extend", "--gpu", "h100", "--stack", STACK)
CASES = {
    "extend": [
        Case((*EXTEND, "-r", "req.txt", "--name", "{v}"), "team", ("--name",)),
        Case((*EXTEND, "-r", "req.txt", "--from", "{v}"), f"envbuild:{STACK}", ("--from",)),
        Case((*EXTEND, "-r", "req.txt", "--as-of", "{v}"), "2026-01-02", ("--as-of",)),
        Case((*EXTEND, "-r", "req.txt", "-o", "{v}"), "out", ("-o", "--output")),
        Case((*EXTEND, "-r", "{v}"), "req.txt", ("-r",)),
        Case((*EXTEND, "-r", "hostile.txt"), "accelerate", ("hostile.txt",), file="hostile.txt"),
        Case((*EXTEND, "-r", "{v}"), "req.txt", ("-r",), file="{v}:accelerate\n"),
        # a requirement packaging takes with the value inside: a marker's quoted string, an arbitrary version
        Case((*EXTEND, "-r", "marker.txt"), "x86_64", ("marker.txt",),
             file="marker.txt:accelerate ; platform_machine != '{v}'\n"),
        Case((*EXTEND, "-r", "version.txt"), "1.0", ("version.txt",), file="version.txt:accelerate==={v}\n"),
        Case(("extend", "-f", "envbuild.yaml"), "team", ("envbuild.yaml",),
             file="envbuild.yaml:gpu: h100\nstack: " + STACK + "\nrequirements: [accelerate]\nname: {q}\n"),
        Case(("extend", "-f", "envbuild.yaml"), "h100", ("envbuild.yaml", "GPU"),
             file="envbuild.yaml:gpu: {q}\nstack: " + STACK + "\nrequirements: [accelerate]\n"),
        Case(("extend", "-f", "envbuild.yaml"), "einops", ("envbuild.yaml",),
             file="envbuild.yaml:gpu: h100\nstack: " + STACK + "\nrequirements: [{q}]\n"),
        Case(("extend", "-f", "envbuild.yaml"), f"envbuild:{STACK}", ("envbuild.yaml",),
             file="envbuild.yaml:gpu: h100\nstack: " + STACK + "\nrequirements: [accelerate]\nimage: {q}\n"),
    ],
    "lock": [
        Case(("lock", "--check", "--stack", "{v}"), STACK, ("--stack",)),
        Case(("nccl", "--stack", "{v}"), STACK, ("--stack",)),
        Case(("lock", "--os", "--stack", STACK, "--base-image", "{v}"), "debian:bookworm", ("--base-image",)),
        Case(("lock", "--os", "--stack", STACK, "--apt-snapshot", "{v}"),
             "http://127.0.0.1:9/{archive}/{timestamp}", ("--apt-snapshot",)),
        Case(("lock", "--check", "--stack", STACK, "--vulnerability-service", "{v}"), "osv",
             ("--vulnerability-service",)),
    ],
    "publish": [
        Case(("publish", "--job", "{v}", "--registry", "127.0.0.1:9/acme", "--signing-key", "key.pem"),
             "torch2.5-cu124-py3.10-amd64", ("--job",), SHIPPED),
        Case(("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "{v}", "--signing-key", "key.pem"),
             "127.0.0.1:9/acme", ("--registry",), SHIPPED),
        Case(("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme",
              "--signing-key", "{v}"), "key.pem", ("--signing-key",), SHIPPED),
        Case(("publish", "--manifest", "{v}", "--registry", "127.0.0.1:9/acme", "--key", "key.pub"),
             MANIFEST_TAG, ("--manifest",), SHIPPED),
        Case(("publish", "--manifest", MANIFEST_TAG, "--registry", "127.0.0.1:9/acme",
              "--key", "{v}"), "key.pub", ("--key",), SHIPPED),
        Case(("publish", "--manifest", MANIFEST_TAG, "--registry", "127.0.0.1:9/acme",
              "--keyless", "--certificate-identity-regexp", "{v}"), "^https://github.com/acme/", (
                 "--certificate-identity-regexp",), SHIPPED),
        Case(("publish", "--manifest", MANIFEST_TAG, "--registry", "127.0.0.1:9/acme",
              "--key", "key.pub", "--digests", "{v}"), "digests", ("--digests",), SHIPPED),
        Case(("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme",
              "--signing-key", "key.pem", "--out", "{v}"), "publish-out", ("--out",), SHIPPED),
        Case(("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme",
              "--signing-key", "key.pem", "--variant", "{v}"), "h20", ("--variant",), SHIPPED),
        Case(("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme",
              "--signing-key", "key.pem", "--layer-cache", "{v}"), "127.0.0.1:9/acme/envbuild-cache",
             ("--layer-cache",), SHIPPED),
        Case(("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme",
              "--signing-key", "key.pem", "--ext-cache", "{v}"), "cache.tar", ("--ext-cache",), SHIPPED),
        Case(("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme",
              "--signing-key", "key.pem", "--vulnerability-service", "{v}"), "osv", ("--vulnerability-service",),
             SHIPPED),
    ],
    "verify": [
        Case(("verify", "{v}", "--key", "key.pub", "--no-pull"), "127.0.0.1:9/acme/envbuild:t", ("IMAGE", "image")),
        Case(("verify", "127.0.0.1:9/acme/envbuild:t", "--key", "{v}", "--no-pull"), "key.pub", ("--key",)),
        Case(("verify", "127.0.0.1:9/acme/envbuild:t", "--certificate-identity-regexp", "{v}", "--no-pull"),
             "^https://github.com/acme/", ("--certificate-identity-regexp",)),
        Case(("verify", "127.0.0.1:9/acme/envbuild:t", "--certificate-identity-regexp", "x",
              "--certificate-oidc-issuer", "{v}", "--no-pull"), "https://token.actions.githubusercontent.com",
             ("--certificate-oidc-issuer",)),
        Case(("verify", "127.0.0.1:9/acme/envbuild:t", "--key", "key.pub", "--platform", "{v}", "--no-pull"),
             "linux/amd64", ("--platform",)),
    ],
    "ext-cache": [
        Case(("ext-cache", "save", "{v}", "--base-image", "debian:bookworm"), "cache.tar", ("FILE", "save")),
        Case(("ext-cache", "load", "{v}", "--base-image", "debian:bookworm"), "cache.tar", ("FILE", "load")),
        Case(("ext-cache", "save", "cache.tar", "--base-image", "{v}"), "debian:bookworm", ("--base-image",)),
        Case(("ext-cache", "save", "cache.tar", "--stack", "{v}"), STACK, ("--stack",)),
        Case(("ext-cache", "save", "cache.tar", "--for", "{v}", "--base-image", "debian:bookworm"), "build",
             ("--for",)),
    ],
    "stage": [
        Case(("stage", "{v}", "--to", "shared"), "127.0.0.1:9/acme/envbuild:t", ("stage", "--key")),
        Case(("stage", "127.0.0.1:9/acme/envbuild:t", "--to", "{v}", "--key", "key.pub"), "shared", ("--to",)),
        Case(("stage", "127.0.0.1:9/acme/envbuild:t", "--to", "shared", "--key", "key.pub", "--platform", "{v}"),
             "linux/amd64", ("--platform",)),
    ],
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("keys")
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(d / "key.pem")], check=True,
                   capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(d / "key.pem"), "-pubout", "-out", str(d / "key.pub")], check=True,
                   capture_output=True)
    return {name: (d / name).read_bytes() for name in ("key.pem", "key.pub")}


def workdir(base: Path, keys: dict[str, bytes]) -> Path:
    """The files the cases name: a requirements file, keys, a directory to stage into."""
    base.mkdir()
    (base / "req.txt").write_text("accelerate\n")
    for name, data in keys.items():
        (base / name).write_bytes(data)
    (base / "shared").mkdir()
    (base / "digests").mkdir()  # what the publish job of MANIFEST_TAG handed on
    (base / "digests" / f"{MANIFEST_TAG}-amd64").write_text("sha256:" + "0" * 64 + "\n")
    return base


# What uv resolves for an extension here (it is not run): one package the stack does not pin.
UV_SAYS = "accelerate==1.0.0 \\\n    --hash=sha256:" + "ab" * 32 + "\n    # via -r requirements.in\n"


def stop_network(monkeypatch) -> None:
    """uv and pip-audit are not run (PyPI is not asked): extend's resolution is UV_SAYS, lock's
    and publish's stop with an exit 2 the property knows."""
    from envbuild.resolve import extend, locking
    from envbuild.supply import release
    from envbuild.base.errors import EnvbuildError

    def stop(*_, **__):
        raise EnvbuildError("NETWORK-STOP: uv or pip-audit would run here")

    monkeypatch.setattr(extend, "compile_requirements", lambda *_, **__: UV_SAYS)
    monkeypatch.setattr(locking, "compile_requirements", stop)
    monkeypatch.setattr(locking, "fetch_deepspeed_requires", stop)
    monkeypatch.setattr(release, "audit_stack", stop)


@st.composite
def case_values(draw, command):
    case = draw(st.sampled_from(CASES[command]))
    hostile = draw(HOSTILE)
    if "{v}" in case.args:  # execve(2) ends each argument at a NUL: no command line holds one (a file can)
        hostile = hostile.replace("\0", "") or "x"
    return case, draw(st.sampled_from([hostile, case.benign + hostile, hostile + case.benign]))


def check_outcome(r, case: Case, value: str, before: dict, work: Path) -> None:
    """Exit 2: one paragraph, nothing written, the value's control characters escaped, and the
    option (or, for an argument, the value itself) named unless the run stopped on this machine."""
    from envbuild.base.grammar import control_characters, escaped

    assert r.code in (0, 2) or (r.code == 1 and UNREACHABLE.search(r.out + r.err)), (case.args, value, r.code,
                                                                                     r.out[-800:], r.err[-3000:])
    if r.code == 2 and "envbuild: error:" not in r.err:  # click's usage error: a value that reads as an option
        assert re.search(r"^Error: ", r.err, re.M) and "Traceback" not in r.err, r.err  # (--key), a directory (/)
        assert listing(work) == before
        return
    if r.code == 1:  # a lock that could not be made: its outcome line says why
        assert "Traceback" not in r.out + r.err and listing(work) == before, r.err
        return
    if r.code == 2:
        assert "envbuild: error:" in r.err, r.err[-2000:]
        error = r.err[r.err.index("envbuild: error:"):].strip()  # after the progress lines
        refused(Ran(2, r.out, error))  # one paragraph, no traceback (exit 1: checked above)
        stopped = any(s in r.message for s in STOPS) or bool(UNREACHABLE.search(r.message))
        after = listing(work)
        # publish --job makes its --out directory before the vulnerability gate: after a stop it may be there, empty
        left = {k for k in set(after) - set(before)
                if not (stopped and (work / k).is_dir() and not any(p.is_file() for p in (work / k).rglob("*")))}
        assert left == set() and {k: after[k] for k in before} == before, (case.args, value, r.message, left)
        raw = set(control_characters(value))
        if case.file and "{v}:" not in case.file:  # in a file, a line break of the value ends a line: not quoted
            raw -= set("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")
        assert not raw & set(error), (case.args, value, error)
        if not stopped:
            assert any(n in r.message for n in case.names) or escaped(value[:20]) in error \
                or escaped(str(Path(value))[:20]) in error, (case.args, value, error)  # a path as Path reads it


# The fast suite's examples where one costs most of a second (publish builds its plan from the
# shipped matrix each time); the long run tries ENVBUILD_PROPERTY_EXAMPLES of each.
FAST_EXAMPLES = {"publish": 5, "ext-cache": 8, "extend": 12}


@pytest.mark.parametrize("command", sorted(CASES))
def test_any_string_option_of_any_command_is_refused_naming_it_or_carried_or_stopped(
        tmp_path_factory, monkeypatch, keys, command):
    monkeypatch.setenv("ENVBUILD_MATRIX_DIR", str(FIXTURE_MATRIX))
    stop_network(monkeypatch)
    extend_baseline = {}
    if command == "extend":  # what the values of a property run are compared with
        base = workdir(tmp_path_factory.mktemp("w") / "work", keys)
        monkeypatch.chdir(base)
        r = envbuild(*EXTEND, "-r", "req.txt", "-o", "out", env=NO_DOCKER)
        assert r.code == 0, r.err
        extend_baseline = {p.name: p.read_text() for p in (base / "out").iterdir() if p.is_file() and p.suffix in ("", ".def")}

    @settings(max_examples=examples(FAST_EXAMPLES.get(command, EXAMPLES)), deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(case_value=case_values(command))
    def prop(case_value):
        case, value = case_value
        work = workdir(tmp_path_factory.mktemp("w") / "work", keys)
        monkeypatch.chdir(work)
        args = [a.replace("{v}", value) for a in case.args]
        if case.file.startswith("{v}:"):  # a file named by the value
            try:
                (work / value).write_text(case.file[4:])
            except (OSError, ValueError):  # a name no file can have: the option is refused without it
                pass
        elif case.file:
            name, text = case.file.split(":", 1) if ":" in case.file else (case.file, "{v}\n")
            quoted = yaml.safe_dump(value, default_style='"', width=2**31).strip()  # {q}: the value as a YAML string
            (work / name).write_text(text.replace("{v}", value).replace("{q}", quoted))
        before = listing(work)
        with alarm_deadline(60, f"envbuild {' '.join(args)[:200]!r} blocked"):
            r = envbuild(*args, env={**NO_DOCKER, **case.env})
        if r.code == 0 and command == "extend":
            built = [p.parent for p in work.rglob("Dockerfile")]
            assert len(built) == 1, built
            assert_holds_as_data(built[0], extend_baseline)
        event(f"{case.args[:2]} exit {r.code}")
        check_outcome(r, case, value, before, work)

    prop()


# What the properties found, each as it was found: every one failed on the main branch before.
FOUND = [
    (("ext-cache", "load", "a\n\nb", "--base-image", "debian:bookworm"), {}, ["a\\n\\nb: no such file"]),
    (("ext-cache", "save", "cache.tar", "--for", "a\n\nb", "--base-image", "debian:bookworm"), {}, ["--for a\\n\\nb"]),
    (("ext-cache", "save", "a\n\n\"", "--base-image", "debian:bookworm"), {}, ['a\\n\\n": its path has a comma']),
    (("lock", "--check", "--stack", "a\n\nb"), {}, ["--stack 'a\\n\\nb': no such stack"]),
    (("lock", "--os", "--stack", STACK, "--apt-snapshot", "a\n\nb"), {}, ["--apt-snapshot 'a\\n\\nb'"]),
    (("lock", "--os", "--stack", STACK, "--apt-snapshot", "http://127.0.0.1:9/{archive}/{timestamp}"), {},
     ["cannot reach the Docker engine"]),
    (("lock", "--check", "--stack", STACK, "--vulnerability-service", "bogus"), {}, ["--vulnerability-service 'bogus'"]),
    (("verify", "\n127.0.0.1:9/acme/envbuild:t", "--key", "key.pub", "--no-pull"), {},
     ["IMAGE '\\n127.0.0.1:9/acme/envbuild:t' is not a valid image reference"]),
    (("stage", "\n127.0.0.1:9/acme/envbuild:t", "--to", "shared"), {}, ["SOURCE '\\n127.0.0.1:9/acme/envbuild:t'"]),
    (("stage", "a\n\nb", "--to", "shared"), {}, ["a\\n\\nb: no such local image"]),
    (("extend", *EXTEND[1:], "-r", "req.txt", "--as-of", "a\n\nb"), {}, ["--as-of 'a\\n\\nb'"]),
    (("extend", "--gpu", "a\n\nb", "-r", "req.txt"), {}, ["unknown GPU 'a\\n\\nb'"]),
    (("extend", "-f", "image.yaml"), {}, ["-f image.yaml: image is empty"]),
    (("extend", "-f", "nul.yaml"), {}, ["requirements 'a\\x00b.txt' holds a NUL byte"]),  # was exit 70 (ValueError)
    (("publish", "--job", "a\n\nb", "--registry", "127.0.0.1:9/acme", "--signing-key", "key.pem"), SHIPPED,
     ["--job 'a\\n\\nb': no such job"]),
    (("publish", "--manifest", "a\n\nb", "--registry", "127.0.0.1:9/acme", "--key", "key.pub"), SHIPPED,
     ["--manifest 'a\\n\\nb': no published tag"]),
    (("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme", "--signing-key", "key.pem",
      "--vulnerability-service", "bogus"), SHIPPED, ["--vulnerability-service 'bogus'"]),
    (("publish", "--manifest", MANIFEST_TAG, "--registry", "127.0.0.1:9/acme", "--key", "key.pub", "--digests", "none"),
     SHIPPED, ["--digests none is not a directory"]),
]


@pytest.mark.parametrize("args, env, words", FOUND, ids=[" ".join(a)[:60] for a, _, _ in FOUND])
def test_what_the_properties_found_is_exit_2_one_paragraph_nothing_written(tmp_path, monkeypatch, keys, args, env,
                                                                          words):
    monkeypatch.setenv("ENVBUILD_MATRIX_DIR", str(FIXTURE_MATRIX))
    stop_network(monkeypatch)
    work = workdir(tmp_path / "work", keys)
    (work / "image.yaml").write_text(f"gpu: h100\nstack: {STACK}\nrequirements: [accelerate]\nimage: ''\n")
    (work / "nul.yaml").write_text(f"gpu: h100\nstack: {STACK}\nrequirements: \"a\\0b.txt\"\n")  # a file name with a NUL
    monkeypatch.chdir(work)
    before = listing(work)
    with alarm_deadline(60, f"envbuild {' '.join(args)[:200]!r} blocked"):
        r = envbuild(*args, env={**NO_DOCKER, **env})
    refused(r, *words)
    assert listing(work) == before


# ---------------------------------------------------------------- a lock file's lines

LOCK = "locks/torch2.11-cu130-py3.12.x86_64.txt"  # the lock `render --gpu h20` installs from


@pytest.fixture(scope="module")
def lock_baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("lock") / "o"
    r = envbuild("render", "--gpu", "h20", "--matrix-dir", str(FIXTURE_MATRIX), "-o", str(out))
    assert r.code == 0, r.err
    return {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.suffix in ("", ".def")}


@settings(max_examples=examples(4), deadline=None, database=None,  # a render and hadolint each
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(line=st.integers(min_value=0), at=st.integers(min_value=0), value=HOSTILE, replace=st.booleans())
def test_any_lock_entry_is_refused_naming_the_lock_or_rendered_as_data(tmp_path_factory, lock_baseline, line, at,
                                                                      value, replace):
    """A lab's lock file with a hostile value in any line (a pin, a hash, a header, a comment),
    replacing it or inserted into it: exit 2 naming the lock file and nothing written, or a
    render whose files pass their linters and keep the layout of the lock as it was."""
    matrix = tmp_path_factory.mktemp("m") / "matrices"
    shutil.copytree(FIXTURE_MATRIX, matrix)
    lines = (matrix / LOCK).read_text().splitlines(keepends=True)
    i = line % len(lines)
    lines[i] = value + "\n" if replace else lines[i][:at % len(lines[i])] + value + lines[i][at % len(lines[i]):]
    (matrix / LOCK).write_text("".join(lines))
    out = matrix.parent / "out"
    r = envbuild("render", "--gpu", "h20", "--matrix-dir", str(matrix), "-o", str(out))
    event(f"lock line exit {r.code}")
    assert r.code in (0, 2), (r.code, r.err[-3000:])
    if r.code == 2:
        refused(r, LOCK.split("/")[1])
        assert not out.exists()
        return
    assert_holds_as_data(out, lock_baseline)


# ---------------------------------------------------------------- a .sqsh that is none


@st.composite
def sqsh_bytes(draw):
    """Random bytes, nothing, or a squashfs superblock that passes the header checks (magic,
    version 4, a valid block size, a size within the file) over random tables."""
    rest = draw(st.binary(max_size=4096))
    if not draw(st.booleans()):
        return rest
    fields = [draw(st.integers(0, 2**16 - 1)) for _ in range(6)] + [draw(st.integers(0, 2**64 - 1)) for _ in range(7)]
    head = SUPERBLOCK.pack(SQUASHFS_MAGIC, fields[0], 0, 131072, fields[1], 0, 17, fields[2], fields[3], 4, 0,
                           fields[6] & 0xFFFF_FFFF_FFFF_FFFF, SUPERBLOCK.size + len(rest), *fields[7:12], fields[12])
    return head + rest


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=sqsh_bytes(), name=HOSTILE.map(lambda v: v.replace("\0", "").replace("/", "")[:200]))
@example(data=SUPERBLOCK.pack(SQUASHFS_MAGIC, 0, 0, 131072, 0, 0, 17, 0, 0, 4, 0, 0, SUPERBLOCK.size, *[0] * 6),
         name="0")  # zeros but the magic, block size, version and size: `unsquashfs -s` passed it, and it was staged
def test_a_sqsh_that_is_none_is_refused_and_nothing_is_staged(tmp_path_factory, data, name):
    """`stage X.sqsh --to DIR` of random bytes, an empty file or a forged superblock, under any
    file name: exit 2 naming the file, and DIR as it was."""
    work = tmp_path_factory.mktemp("stage")
    (work / "shared").mkdir()
    source = work / f"{name}.sqsh"
    source.write_bytes(data)
    r = envbuild("stage", str(source), "--to", str(work / "shared"))
    refused(r, "nothing was staged")
    from envbuild.base.grammar import escaped

    assert escaped(str(source)) in r.err
    assert not list((work / "shared").iterdir())
