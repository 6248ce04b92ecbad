"""`envbuild matrix catalogue --apptainer-source`: what Apptainer's run path prints, derived from its
sources by the container stack's Go reader, offline.

tests/fixtures/catalogue/apptainer holds real files at two releases (SOURCE.txt: URL and sha256 of each;
tags.txt: each tag's commit): --nv's warnings moved from cmd/internal/cli to internal/pkg/runtime/launch
in 1.2. The catalogue envbuild ships is checked to be what the tool writes.
"""

from __future__ import annotations

import hashlib


from conftest import ROOT, load_yaml
from envbuild.refresh import container_catalogue as containers

FIXTURES = ROOT / "tests" / "fixtures" / "catalogue" / "apptainer"
SPEC = containers.component("apptainer")


def derived() -> dict:
    return containers.derive(SPEC, containers.open_sources("apptainer", FIXTURES))


def entry(data: dict, text: str) -> dict:
    (found,) = [m for m in data["messages"] if m["text"] == text]
    return found


def test_the_fixture_files_are_the_real_ones_they_name():
    lines = [line for line in (FIXTURES / "SOURCE.txt").read_text().splitlines() if " sha256 " in line]
    assert len(lines) == 6
    for line in lines:
        path, url, _, digest = line.split()
        assert url == f"{containers.APPTAINER_URL}/blob/{path}"
        assert hashlib.sha256((FIXTURES / path).read_bytes()).hexdigest() == digest, path


def test_sylog_and_returned_errors_carry_level_call_file_line_and_releases():
    data = derived()
    nv = entry(data, "Could not find any %s libraries on this host!")
    assert (nv["level"], nv["call"], nv["releases"]) == ("WARN", "sylog.Warningf", "1.1.9..1.5.3")
    assert nv["file"] == "internal/pkg/runtime/launch/launcher_linux.go"  # where the newest release prints it
    source = (FIXTURES / "v1.5.3" / nv["file"]).read_text().splitlines()
    assert "Could not find any %s libraries" in source[nv["line"] - 1]
    cli = entry(data, "nvidia-container-cli failed with %v: %s")
    assert (cli["call"], cli["level"]) == ("fmt.Errorf", "ERROR")
    assert {m["level"] for m in data["messages"]} == {"FATAL", "ERROR", "WARN", "INFO"}
    assert data["releases"][0] == {"release": "1.1.9", "tag": "v1.1.9", "commit": "7d8a56c48cad4db9a5a8edac3532a97146fd019e"}


def test_only_apptainer_s_logger_is_read_not_the_toolkit_s():
    """Apptainer's `sylog.Errorf` is its message; a toolkit-style `logger.Errorf` in its tree is not read, nor Debugf."""
    source = ('sylog.Errorf("failed to bind %s", p)\nlogger.Errorf("not apptainer\'s")\n'
              'sylog.Debugf("debug only")\nsylog.Fatalf("%s", err)\n')
    found = containers.go_extract(source, "x.go", containers.APPTAINER_CALL)
    assert [(m["call"], m["text"], m["line"]) for m in found] == [("sylog.Errorf", "failed to bind %s", 1),
                                                                  ("sylog.Fatalf", "%s", 4)]


def test_the_shipped_catalogue_is_what_the_tool_writes():
    path = ROOT / "matrices" / "catalogues" / "apptainer.yaml"
    data = load_yaml(path.read_text())
    assert containers.render(SPEC, data) == path.read_text()
    assert all(m["file"] and m["line"] > 0 and m["releases"] for m in data["messages"])
    assert all(m["file"].startswith(containers.APPTAINER_ROOTS) for m in data["messages"])
    assert [r["release"].rsplit(".", 1)[0] for r in data["releases"]] == list(containers.APPTAINER_LINES)


def test_the_command_writes_then_finds_it_current(tmp_path, cli):
    args = ("matrix", "catalogue", "--apptainer-source", FIXTURES, "--matrix-dir", tmp_path)
    first = cli(*args, "--write")
    assert first.returncode == 0, first.stderr
    written = (tmp_path / "catalogues" / "apptainer.yaml").read_text()
    assert written.startswith("# What Apptainer can print") and "not_catalogued:" in written  # 1.2-1.4 absent here
    again = cli(*args)
    assert (again.returncode, again.stdout) == (0, "") and "current" in again.stderr


def test_a_git_apptainer_source_without_its_tags_is_a_one_paragraph_error(tmp_path, cli):
    import subprocess
    subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "app")], check=True)
    result = cli("matrix", "catalogue", "--apptainer-source", tmp_path / "app", "--matrix-dir", tmp_path / "m")
    assert result.returncode == 2 and "apptainer/apptainer" in result.stderr and "Traceback" not in result.stderr
