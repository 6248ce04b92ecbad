"""`envbuild matrix catalogue --xid-source`: NVIDIA's Xid numbers and names from the driver's nverror.h,
with the driver's own published meanings, offline.

tests/fixtures/catalogue/xid holds the real header at two releases (SOURCE.txt: URL and sha256;
tags.txt: each tag's commit): 520.61.07, the last with the published strings, and 595.45.04. The
catalogue envbuild ships is checked to be what the tool writes.
"""

from __future__ import annotations

import hashlib


from conftest import ROOT, load_yaml
from envbuild.refresh import xid_catalogue as xid

FIXTURES = ROOT / "tests" / "fixtures" / "catalogue" / "xid"


def derived() -> dict:
    return xid.derive(xid.open_sources(FIXTURES))


def entries(data: dict, number: int) -> dict:
    return {m["name"]: m for m in data["messages"] if m["xid"] == number}


def test_the_fixture_files_are_the_real_ones_they_name():
    lines = [line for line in (FIXTURES / "SOURCE.txt").read_text().splitlines() if " sha256 " in line]
    assert len(lines) == 2
    for line in lines:
        path, url, _, digest = line.split()
        assert url == f"{xid.URL}/blob/{path}"
        assert hashlib.sha256((FIXTURES / path).read_bytes()).hexdigest() == digest, path


def test_each_xid_has_its_names_releases_line_and_published_meaning():
    data = derived()
    (bus,) = entries(data, 79).values()
    assert (bus["name"], bus["releases"], bus["meaning"]) == (
        "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "520.61.07..595.45.04", "GPU has fallen off the bus")
    assert "(79)" in (FIXTURES / "595.45.04" / xid.HEADER_FILE).read_text().splitlines()[bus["line"] - 1]
    assert entries(data, 48)["ROBUST_CHANNEL_GPU_ECC_DBE"]["meaning"] == "ECC Error (DBE Error)"
    thirty = entries(data, 30)  # renamed: a name each, with the releases that define it so
    assert (thirty["ROBUST_CHANNEL_BAD_ADDR_ACCESS"]["releases"], thirty["ROBUST_CHANNEL_UNUSED_ERROR_30"]["releases"]) \
        == ("520.61.07", "595.45.04")
    assert entries(data, 154)["GPU_RECOVERY_ACTION_CHANGED"]["meaning"] == ""  # past the published table
    assert not [m for m in data["messages"] if m["name"].endswith(("_LAST_ERROR",)) or "RECOVERY_LEVEL" in m["name"]]
    assert data["meanings"]["release"] == "520.61.07"


def test_the_published_table_is_indexed_by_xid():
    table = xid.meanings((FIXTURES / "520.61.07" / xid.HEADER_FILE).read_text())
    assert (table[13][0], table[79][0], table[95][0]) == ("Graphics Engine Error (GR Exception Error)",
                                                          "GPU has fallen off the bus", "Uncontained error")
    assert xid.meanings((FIXTURES / "595.45.04" / xid.HEADER_FILE).read_text()) == {}


def test_the_shipped_catalogue_is_what_the_tool_writes():
    path = ROOT / "matrices" / "catalogues" / "xid.yaml"
    data = load_yaml(path.read_text())
    assert xid.render(data) == path.read_text()
    assert all(m["line"] > 0 and m["releases"] for m in data["messages"])
    assert [r["release"].split(".")[0] for r in data["releases"]] == list(xid.BRANCHES)


def test_the_command_writes_then_finds_it_current(tmp_path, cli):
    args = ("matrix", "catalogue", "--xid-source", FIXTURES, "--matrix-dir", tmp_path)
    first = cli(*args, "--write")
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "catalogues" / "xid.yaml").read_text().startswith("# NVIDIA's Xid numbers")
    again = cli(*args)
    assert (again.returncode, again.stdout) == (0, "") and "current" in again.stderr


def test_sources_without_a_driver_tag_are_a_one_paragraph_error(tmp_path, cli):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tags.txt").write_text("1.0 " + "0" * 40 + "\n")
    result = cli("matrix", "catalogue", "--xid-source", tmp_path / "src", "--matrix-dir", tmp_path / "m")
    assert result.returncode == 2 and "open-gpu-kernel-modules" in result.stderr and "Traceback" not in result.stderr
