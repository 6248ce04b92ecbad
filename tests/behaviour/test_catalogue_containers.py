"""`envbuild matrix catalogue --container-toolkit-source/--libnvidia-container-source`: what the NVIDIA
container stack prints, derived from its sources, offline.

tests/fixtures/catalogue/{container-toolkit,libnvidia-container} hold real files at two releases each
(SOURCE.txt: URL and sha256 of each; tags.txt: the toolkit's tags and, for libnvidia-container, the
commit each pins). The catalogues envbuild ships are checked to be what the tool writes.
"""

from __future__ import annotations

import hashlib

import pytest

from conftest import ROOT, load_yaml
from envbuild.refresh import container_catalogue as containers

FIXTURES = ROOT / "tests" / "fixtures" / "catalogue"
NAMES = ("container-toolkit", "libnvidia-container")


def derived(name: str) -> dict:
    return containers.derive(containers.component(name), containers.open_sources(name, FIXTURES / name))


def entry(data: dict, text: str) -> dict:
    (found,) = [m for m in data["messages"] if m["text"] == text]
    return found


@pytest.mark.parametrize("name", NAMES)
def test_the_fixture_files_are_the_real_ones_they_name(name):
    lines = [line for line in (FIXTURES / name / "SOURCE.txt").read_text().splitlines() if " sha256 " in line]
    assert len(lines) == 6
    for line in lines:
        path, url, _, digest = line.split()
        assert url.startswith(containers.component(name).url + "/blob/") and url.endswith(path.split("/", 1)[1])
        assert hashlib.sha256((FIXTURES / name / path).read_bytes()).hexdigest() == digest, path


def test_go_messages_carry_their_release_range_call_file_and_line():
    data = derived("container-toolkit")
    assert entry(data, "could not apply required modification to OCI specification: %v")["releases"] == "1.14.6"
    new = entry(data, "could not apply required modification to OCI specification: %w")
    assert (new["call"], new["level"], new["releases"]) == ("fmt.Errorf", "ERROR", "1.20.0")
    source = (FIXTURES / "container-toolkit" / "v1.20.0" / new["file"]).read_text().splitlines()
    assert "could not apply required modification" in source[new["line"] - 1]
    assert entry(data, "error getting hook config: %v")["level"] == "FATAL"  # log.Panicln("...:", err)
    assert data["releases"][0] == {"release": "1.14.6", "tag": "v1.14.6",
                                   "commit": "5605d191332dcfeea802c4497360d60a65c7887e"}


def test_libnvidia_container_messages_are_read_at_the_pinned_commit():
    data = derived("libnvidia-container")
    assert [r["commit"] for r in data["releases"]] == ["1eb5a30a6ad0415550a9df632ac8832bf7e2bbba",
                                                         "63d366ee3b4183513c310ac557bf31b05b83328f"]
    assert (entry(data, "initialization error: %s")["call"], entry(data, "%s rpc error")["call"]) == ("warnx", "error_set_rpc")
    assert entry(data, "load library failed")["releases"] == "1.14.3..1.17.2"


@pytest.mark.parametrize("source, text", [
    ('return fmt.Errorf("failed to create NVIDIA Container Runtime: %v", err)',
     "failed to create NVIDIA Container Runtime: %v"),
    ('log.Panicln("couldn\'t find binary nvidia-container-cli in", os.Getenv("PATH"), ":", err)',
     "couldn't find binary nvidia-container-cli in %v %v %v"),
    ('errors.New("a" +\n\t"b \\"c\\"")', 'ab "c"'),
    ('fmt.Errorf(`raw %q\\n`, x)', "raw %q\\n"),
])
def test_go_strings_are_read_as_the_compiler_reads_them(source, text):
    (message,) = containers.go_extract(source, "x.go")
    assert (message["text"], message["line"]) == (text, 1)


@pytest.mark.parametrize("source", ['// return fmt.Errorf("commented out")', "fmt.Errorf(msg, x)",
                                    'fmt.Errorf(prefix + "x")', 'logger.Debugf("debug only")'])
def test_what_is_not_a_go_message_is_left_out(source):
    assert containers.go_extract(source, "x.go") == []


@pytest.mark.parametrize("name", NAMES)
def test_the_shipped_catalogues_are_what_the_tool_writes(name):
    path = ROOT / "matrices" / "catalogues" / f"{name}.yaml"
    data = load_yaml(path.read_text())
    assert containers.render(containers.component(name), data) == path.read_text()
    assert all(m["file"] and m["line"] > 0 and m["releases"] for m in data["messages"])
    assert [r["release"].rsplit(".", 1)[0] for r in data["releases"]] + [r["release"] for r in data["not_catalogued"]] \
        == list(containers.LINES)


def test_the_command_writes_then_finds_it_current(tmp_path, cli):
    args = ("matrix", "catalogue", "--container-toolkit-source", FIXTURES / "container-toolkit",
            "--libnvidia-container-source", FIXTURES / "libnvidia-container", "--matrix-dir", tmp_path)
    first = cli(*args, "--write")
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "catalogues" / "libnvidia-container.yaml").read_text().startswith("# What libnvidia-container")
    again = cli(*args)
    assert (again.returncode, again.stdout) == (0, "") and "current" in again.stderr


def test_a_git_libnvidia_container_source_needs_the_toolkit_s_pins(tmp_path, cli):
    import subprocess
    subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "lnc")], check=True)
    result = cli("matrix", "catalogue", "--libnvidia-container-source", tmp_path / "lnc", "--matrix-dir", tmp_path / "m")
    assert result.returncode == 2 and "--container-toolkit-source" in result.stderr and "Traceback" not in result.stderr
