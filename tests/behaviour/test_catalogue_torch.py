"""The torch.distributed catalogue: what torch/distributed's Python raises or logs, per shipped release.

tests/fixtures/catalogue/torch holds two whole, unchanged files of torch/distributed from the
torch 2.9.1 and 2.10.0 wheels (SOURCE.txt: wheel, member and sha256), saved as .py.txt; the tests
pack them into wheels of their own, at the real members' paths, to run the extraction and the
command offline. 2.10.0 reworded tail_log.py's error ("%s: %s" became "%s").
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, load_yaml
from envbuild.refresh import torch_catalogue as torch

FIXTURE = ROOT / "tests" / "fixtures" / "catalogue" / "torch"
RELEASES = ["2.9.1", "2.10.0"]
TAIL = "torch/distributed/elastic/multiprocessing/tail_log.py"
STORE = "torch/distributed/elastic/utils/store.py"


def wheel(directory: Path, release: str) -> str:
    """A wheel holding the fixture's files at their real members' paths; its file name."""
    name = f"torch-{release}-cp311-none-macosx_11_0_arm64.whl"
    with zipfile.ZipFile(directory / name, "w") as archive:
        for member in (TAIL, STORE):
            archive.writestr(member, (FIXTURE / release / f"{member}.txt").read_text())
        archive.writestr("torch/_C/not_distributed.py", "raise RuntimeError('not under torch/distributed')\n")
    return name


def test_the_fixtures_are_the_real_files_they_name():
    for line in (FIXTURE / "SOURCE.txt").read_text().splitlines():
        if " file sha256 " in line:
            name = line.split(":", 1)[0]
            assert hashlib.sha256((FIXTURE / f"{name}.txt").read_bytes()).hexdigest() == line.rsplit(" ", 1)[1], name


def test_a_reworded_message_has_one_entry_per_wording_with_its_releases(tmp_path):
    names = [wheel(tmp_path, r) for r in RELEASES]
    data = torch.derive(tmp_path, RELEASES + ["2.11.0"])
    assert [(r["release"], r["file"]) for r in data["releases"]] == list(zip(RELEASES, names))
    assert data["not_catalogued"] == [{"release": "2.11.0", "why": "no wheel of it in the directory"}]
    tailor = {m["text"]: (m["releases"], m["file"], m["line"]) for m in data["messages"] if "log tailor" in m["text"]}
    assert tailor == {"error in log tailor for %s%s. %s: %s": ("2.9.1", TAIL, 144),
                      "error in log tailor for %s%s. %s": ("2.10.0", TAIL, 155)}
    (barrier,) = [m for m in data["messages"] if m["text"].startswith("Timed out waiting on barrier")]
    assert (barrier["level"], barrier["error"], barrier["releases"], barrier["file"]) == \
        ("RAISE", "DistStoreError", "2.9.1..2.10.0", STORE)
    assert barrier["text"] == "Timed out waiting on barrier on rank %s, for key prefix: %s (world_size=%s, " \
                              "missing_ranks=%s, timeout=%s)"  # an f-string: each {...} a %s
    assert all(m["file"].startswith("torch/distributed/") for m in data["messages"])
    assert torch.render(data) == torch.render(torch.derive(tmp_path, RELEASES + ["2.11.0"]))


@pytest.mark.parametrize("source, expected", [
    ('raise ValueError(f"rank {r} of {n}: 100% done")', ("RAISE", "ValueError", "rank %s of %s: 100%% done")),
    ('logger.error("failed (pid: %s)", pid)', ("ERROR", "", "failed (pid: %s)")),
    ('log.warning("a 50% share")', ("WARNING", "", "a 50%% share")),
    ('raise errors.StoreError("key {} gone for {}s".format(k, t))', ("RAISE", "StoreError", "key %s gone for %ss")),
    ('msg = f"node {n} left"\n    raise RendezvousError(msg)', ("RAISE", "RendezvousError", "node %s left")),
    ('warnings.warn("deprecated: " + name)', ("WARNING", "", "deprecated: %s")),
])
def test_each_way_torch_builds_a_message_becomes_a_printf_format(source, expected):
    (message,) = torch.extract(f"def f():\n    {source}\n", "torch/distributed/x.py")
    assert (message["level"], message["error"], message["text"]) == expected


def test_messages_not_built_from_a_literal_and_other_calls_are_not_catalogued():
    source = ("def f(e):\n    raise RuntimeError(e)\n    print('Timed out waiting for everything')\n"
              "    self.error('not a logger')\n    raise KeyError\n")
    assert torch.extract(source, "torch/distributed/x.py") == []
    assert torch.extract("def broken(:\n", "torch/distributed/x.py") == []


def test_the_command_writes_the_catalogue_then_finds_it_current(tmp_path, cli):
    for release in RELEASES:
        wheel(tmp_path, release)
    matrix = tmp_path / "m"
    matrix.mkdir()
    (matrix / "torch.yaml").write_text("releases:\n  - torch: '2.9.1'\n  - torch: '2.10.0'\n")
    first = cli("matrix", "catalogue", "--torch-wheels", tmp_path, "--matrix-dir", matrix, "--write")
    assert first.returncode == 0, first.stderr
    assert "torch catalogue: release 2.10.0 added: 1 new and 1 removed messages against 2.9.1" in first.stderr
    again = cli("matrix", "catalogue", "--torch-wheels", tmp_path, "--matrix-dir", matrix)
    assert (again.returncode, again.stdout) == (0, "")
    (matrix / "torch.yaml").write_text("releases:\n  - torch: '2.4.1'\n")
    none = cli("matrix", "catalogue", "--torch-wheels", tmp_path, "--matrix-dir", matrix)
    assert none.returncode == 2 and "no torch wheel of a release" in none.stderr


def test_a_file_named_like_a_wheel_that_is_not_one_is_a_one_paragraph_error(tmp_path, cli):
    (tmp_path / "torch-2.9.1-cp311-none-macosx_11_0_arm64.whl").write_bytes(b"not a zip")
    matrix = tmp_path / "m"
    matrix.mkdir()
    (matrix / "torch.yaml").write_text("releases:\n  - torch: '2.9.1'\n")
    result = cli("matrix", "catalogue", "--torch-wheels", tmp_path, "--matrix-dir", matrix)
    assert result.returncode == 2 and "cannot be read as a wheel" in result.stderr and "Traceback" not in result.stderr


def test_the_shipped_catalogue_covers_the_shipped_releases_it_could_read():
    """Every release of matrices/torch.yaml is catalogued or listed as not catalogued, with why."""
    data = load_yaml((ROOT / "matrices" / "catalogues" / "torch.yaml").read_text())
    shipped = torch.shipped_releases(load_yaml((ROOT / "matrices" / "torch.yaml").read_text()))
    assert [r["release"] for r in data["releases"]] + [r["release"] for r in data["not_catalogued"]] == shipped
    texts = {m["text"] for m in data["messages"]}
    assert "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s" in texts
    assert all(len(r["sha256"]) == 64 for r in data["releases"])
