"""`envbuild matrix catalogue`: NCCL's messages derived from its sources, offline.

tests/fixtures/catalogue/nccl holds two real NCCL files at two tags (SOURCE.txt: URL and sha256
of each), so the extraction, the release ranges and the command run without a network. The
catalogue envbuild ships (matrices/catalogues/nccl.yaml) is checked against matrices/nccl.yaml:
a release the matrix ships is catalogued or said not to be.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, load_yaml
from envbuild.base.errors import EnvbuildError
from envbuild.refresh import nccl_catalogue as catalogue

FIXTURE = ROOT / "tests" / "fixtures" / "catalogue" / "nccl"
SHIPPED = ROOT / "matrices" / "catalogues" / "nccl.yaml"


def derived(releases=("2.26.5", "2.27.3", "2.28.3")) -> dict:
    return catalogue.derive(catalogue.open_sources(FIXTURE), list(releases))


def entry(data: dict, text: str) -> dict:
    (found,) = [m for m in data["messages"] if m["text"] == text]
    return found


def test_the_fixture_files_are_the_real_ones_they_name():
    """A fixture edited by hand would test an extraction of text NCCL never printed."""
    for line in (FIXTURE / "SOURCE.txt").read_text().splitlines():
        if " sha256 " in line:
            path, url, _, digest = line.split()
            assert url.startswith("https://github.com/NVIDIA/nccl/blob/v")
            assert hashlib.sha256((FIXTURE / path).read_bytes()).hexdigest() == digest, path


def test_a_wording_carries_its_release_range_file_and_line():
    """NCCL 2.27 replaced `Error: network %s not found.` with `Failed to initialize any NET plugin`:
    each is known only in the releases that print it, at the line of the newest one."""
    data = derived()
    old, new = entry(data, "Error: network %s not found."), entry(data, "Failed to initialize any NET plugin")
    assert (old["level"], old["releases"], new["level"], new["releases"]) == ("WARN", "2.26.5", "WARN", "2.27.3")
    source = (FIXTURE / "v2.27.3-1" / new["file"]).read_text().splitlines()
    assert 'WARN("Failed to initialize any NET plugin")' in source[new["line"] - 1]
    both = entry(data, "%s/Plugin: Could not find:%s. %s")
    assert (both["level"], both["releases"]) == ("INFO", "2.26.5..2.27.3")


def test_a_release_without_sources_is_said_not_catalogued():
    data = derived()
    assert [r["release"] for r in data["releases"]] == ["2.26.5", "2.27.3"]
    assert data["not_catalogued"] == [{"release": "2.28.3", "why": "the sources read have no tag v2.28.3-N"}]
    assert data["releases"][0] == {"release": "2.26.5", "tag": "v2.26.5-1",
                                   "commit": "3000e3c797b4b236221188c07aa09c1f3a0170d4"}


def test_the_same_sources_give_the_same_bytes():
    first, second = catalogue.render(derived()), catalogue.render(derived())
    assert first == second
    assert catalogue.render(load_yaml(first)) == first


@pytest.mark.parametrize("source, level, text", [
    ('  INFO(NCCL_INIT|NCCL_NET, "NET/Plugin: No plugin found (%s)", name);', "INFO", "NET/Plugin: No plugin found (%s)"),
    ('INFO(SUBSYS(a, b), "x %d " PRIu64 " y\\n", n);', "INFO", "x %d lu y\n"),
    ('WARN("Cuda failure "\n       "\'%s\'", cudaGetErrorString(e));', "WARN", "Cuda failure '%s'"),
    ('WARN(#name "() failed: %s", err);', "WARN", "%s() failed: %s"),
    ('WARN(  // why\n  "NET/IB: a \\"quoted\\" %zu");', "WARN", 'NET/IB: a "quoted" %zu'),
])
def test_format_strings_are_read_as_the_compiler_joins_them(source, level, text):
    (message,) = catalogue.extract(source, "src/x.cc")
    assert (message.level, message.text, message.line) == (level, text, 1)


@pytest.mark.parametrize("source", [
    "#define WARN(...) ncclDebugLog(NCCL_LOG_WARN, __VA_ARGS__)",
    "WARN(message);",  # not a literal: nothing to catalogue
    "// WARN(\"commented out\")",
    "NCCL_WARN(\"another macro\")",
])
def test_what_is_not_a_call_with_a_literal_is_left_out(source):
    assert catalogue.extract(source, "src/x.cc") == []


def test_nccl_result_messages_come_from_ncclGetErrorString():
    source = ('const char* ncclGetErrorString(ncclResult_t code) {\n  switch (code) {\n'
              '  case ncclSystemError:\n    return "unhandled system error (run with NCCL_DEBUG=INFO for details)";\n'
              '  default:\n    return "unknown result code";\n  }\n}\n')
    found = catalogue.extract(source, "src/init.cc")
    assert [(m.level, m.text, m.line) for m in found] == [
        ("RESULT", "unhandled system error (run with NCCL_DEBUG=INFO for details)", 4),
        ("RESULT", "unknown result code", 6)]


def test_the_shipped_catalogue_covers_every_release_the_matrix_ships():
    """A release refresh adds to matrices/nccl.yaml is catalogued (or said not to be) before this passes."""
    data = load_yaml(SHIPPED.read_text())
    shipped = catalogue.shipped_releases(load_yaml((ROOT / "matrices" / "nccl.yaml").read_text()))
    assert [r["release"] for r in data["releases"]] + [r["release"] for r in data["not_catalogued"]] == shipped
    assert catalogue.render(data) == SHIPPED.read_text()
    assert len(data["messages"]) > 1000


def _matrix(tmp_path: Path, releases) -> Path:
    directory = tmp_path / "m"
    directory.mkdir(parents=True)
    wheel = {"file": "w.whl", "sha256": "0" * 64, "url": "https://files.pythonhosted.org/w.whl"}
    (directory / "nccl.yaml").write_text(yaml.safe_dump({"packages": [{"package": "nvidia-nccl-cu12", "releases": [
        {"version": v, "wheels": [wheel]} for v in releases]}]}))
    return directory


def test_the_command_writes_then_finds_it_current(tmp_path, cli):
    """A refresh with no new release gives an empty diff, exit 0; a new release is exit 1 with
    the wordings it brings and drops, until --write."""
    directory = _matrix(tmp_path, ["2.26.5"])
    first = cli("matrix", "catalogue", "--source", FIXTURE, "--matrix-dir", directory, "--write")
    assert first.returncode == 0, first.stderr
    written = (directory / "catalogues" / "nccl.yaml").read_text()
    again = cli("matrix", "catalogue", "--source", FIXTURE, "--matrix-dir", directory)
    assert (again.returncode, again.stdout) == (0, "")
    assert "current" in again.stderr
    directory_2 = _matrix(tmp_path / "b", ["2.26.5", "2.27.3.post1"])
    (directory_2 / "catalogues").mkdir()
    (directory_2 / "catalogues" / "nccl.yaml").write_text(written)
    newer = cli("matrix", "catalogue", "--source", FIXTURE, "--matrix-dir", directory_2)
    assert newer.returncode == 1
    assert '+  - {level: "WARN", text: "Failed to initialize any NET plugin"' in newer.stdout
    assert "release 2.27.3 added: " in newer.stderr and " removed messages against 2.26.5" in newer.stderr and "2.26.5: 0 new and 0 removed" not in newer.stderr


def test_a_source_that_is_neither_git_nor_saved_files_is_exit_2(tmp_path, cli):
    directory = _matrix(tmp_path, ["2.26.5"])
    (tmp_path / "empty").mkdir()
    result = cli("matrix", "catalogue", "--source", tmp_path / "empty", "--matrix-dir", directory)
    assert result.returncode == 2 and "tags.txt" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(EnvbuildError, match="line 1"):
        (tmp_path / "empty" / "tags.txt").write_text("v2.26.5-1 not-a-sha\n")
        catalogue.open_sources(tmp_path / "empty")


@pytest.mark.parametrize("line", ["../../etc 0123456789012345678901234567890123456789", "v2.27.3-1 main"])
def test_a_saved_tag_list_names_tags_and_shas_only(tmp_path, line):
    """A tag is a directory name under the saved sources: one like `../../etc` would read outside them."""
    (tmp_path / "tags.txt").write_text(line + "\n")
    with pytest.raises(EnvbuildError, match="tags.txt line 1"):
        catalogue.open_sources(tmp_path)


def test_an_empty_matrix_dir_is_refused_not_read_as_the_built_in_one(cli):
    result = cli("matrix", "catalogue", "--source", FIXTURE, "--matrix-dir", "")
    assert result.returncode == 2 and "--matrix-dir is empty" in result.stderr
