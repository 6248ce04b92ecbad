"""`envbuild doctor --manifest`: a log whose NCCL is not the image's (signature nccl-not-the-images).

The logs are real: tests/fixtures/nccl-version (INDEX.yaml has each thread) and two of the
doctor's own fixtures in tests/fixtures/logs, whose NCCL version lines are the ones NCCL prints
at init (`NCCL version 2.19.3+cuda12.3`, one behind a timestamp column) and the one torch ends its NCCL errors with
(`unhandled system error, NCCL version 2.10.3`).
"""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from conftest import ROOT
from envbuild.cli import main
from envbuild.doctor import diagnose_text, examine, find_image, load_catalogue, read_image
from envbuild.doctor.signatures import bind_image
from envbuild.base.errors import EnvbuildError

ISSUES, FAMILIES = load_catalogue(ROOT / "matrices")
HERE = ROOT / "tests" / "fixtures" / "nccl-version"
LOGS = ROOT / "tests" / "fixtures" / "logs"
INDEX = yaml.safe_load((HERE / "INDEX.yaml").read_text())["logs"]
ID = "nccl-not-the-images"


def manifest(tmp_path, nccl="2.21.5", **more):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"tag": "torch2.5.1-cu124-py3.11-ds0.16.3-h100", "torch": "2.5.1", "nccl": nccl, **more}))
    return str(path)


def findings(log, image):
    return [f for f in examine([str(log)], ISSUES, FAMILIES, image=image).findings if f.issue.id == ID]


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_a_log_of_another_nccl_is_named_with_both_versions(entry, tmp_path):
    image = read_image(manifest(tmp_path, entry["image_nccl"]))
    found = findings(HERE / entry["file"], image)
    assert len(found) == 1, found
    assert found[0].title == f"NCCL {entry['ran']} ran, not the image's NCCL {entry['image_nccl']}"
    assert found[0].detail == f"NCCL {entry['ran']} in the log; the image's manifest pins {entry['image_nccl']}"


@pytest.mark.parametrize(("log", "version"), [("trtllm-1498-docker-socket-clean.log", "2.19.3"),
                                              ("aws-ofi-nccl-889-efa-empty.log", "2.21.5"),
                                              ("nccl-875-system-error.log", "2.10.3")])
def test_a_log_of_the_image_s_own_nccl_is_quiet_and_another_image_s_is_not(log, version, tmp_path):
    assert findings(LOGS / log, read_image(manifest(tmp_path, version))) == []
    other = findings(LOGS / log, read_image(manifest(tmp_path, "2.28.9")))
    assert [f.parts["nccl"] for f in other] == [[version]]


def test_every_image_signature_is_measured_here():
    assert {i.id for i in ISSUES if i.image} == {ID}
    assert all(e["source"].startswith("https://github.com/") and (HERE / e["file"]).is_file() for e in INDEX)


def test_without_an_image_the_signature_does_not_apply(tmp_path):
    log = HERE / INDEX[0]["file"]
    assert findings(log, None) == []
    assert ID not in {f.issue.id for f in diagnose_text(log.read_text(), ISSUES)}  # unbound: left out
    assert ID not in {i.id for i in bind_image(ISSUES, {"nccl": None})}


@pytest.mark.parametrize("line", ["NCCL version 2.21.5+cuda12.4", "NCCL version 2.21.5", "NCCL version 2.21.5.",
                                  "[rank0]: unhandled system error, NCCL version 2.21.5"])
def test_the_same_version_in_any_spelling_is_not_a_finding(line):
    assert ID not in {f.issue.id for f in diagnose_text(line + "\n", bind_image(ISSUES, {"nccl": "2.21.5"}))}


@pytest.mark.parametrize("line", ["NCCL version 2.21.51+cuda12.4", "NCCL version 2.2.15", "NCCL version 12.21.5"])
def test_a_version_that_only_starts_or_ends_alike_is_a_finding(line):
    assert ID in {f.issue.id for f in diagnose_text(line + "\n", bind_image(ISSUES, {"nccl": "2.21.5"}))}


def test_cli_names_the_log_and_the_image(tmp_path):
    log = HERE / INDEX[0]["file"]
    result = CliRunner().invoke(main, ["doctor", str(log), "--manifest", manifest(tmp_path, "2.19.3")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 3, result.output
    assert "NCCL 2.14.3 ran, not the image's NCCL 2.19.3 (nccl-not-the-images), line 5" in result.output
    assert f"Image: torch2.5.1-cu124-py3.11-ds0.16.3-h100 ({tmp_path / 'manifest.json'}): NCCL 2.19.3" in result.output
    result = CliRunner().invoke(main, ["doctor", "--json", str(log), "--manifest", manifest(tmp_path, None)])
    report = json.loads(result.output)
    assert result.exit_code == 0 and report["findings"] == [] and report["image"]["nccl"] is None


def test_a_bad_manifest_is_refused_naming_it(tmp_path):
    """Exit 2 (run() prints the paragraph): not JSON, not an envbuild manifest."""
    path = tmp_path / "m.json"
    for content, message in (("{not json", "is not JSON"), ('["torch"]', "is not an envbuild manifest")):
        path.write_text(content)
        result = CliRunner().invoke(main, ["doctor", str(HERE / INDEX[0]["file"]), "--manifest", str(path)])
        assert isinstance(result.exception, EnvbuildError) and result.exception.exit_code == 2
        assert message in result.exception.message and str(path) in result.exception.message


def test_a_manifest_that_is_not_a_regular_file_is_refused(tmp_path):
    with pytest.raises(EnvbuildError, match="not a regular file"):
        read_image(str(tmp_path))
    with pytest.raises(EnvbuildError, match="is a character device, not a regular file; give the file itself") as e:
        read_image("/dev/zero")
    assert "doctor -" not in e.value.message  # standard input is for logs, not the manifest


def test_inside_an_image_its_own_manifest_is_read(tmp_path):
    assert find_image(None, {"ENVBUILD_MANIFEST": manifest(tmp_path, "2.21.5")}).facts == {"nccl": "2.21.5"}
    assert find_image(None, {"ENVBUILD_MANIFEST": str(tmp_path / "absent.json")}) is None


def test_a_signature_with_image_needs_the_placeholder(tmp_path):
    broken = (ROOT / "matrices" / "known_issues.yaml").read_text().replace(
        "pattern: '\\bNCCL version (?!{image}", "pattern: '\\bNCCL version (?!x", 1)
    (tmp_path / "known_issues.yaml").write_text(broken)
    with pytest.raises(EnvbuildError, match="compares through {image}"):
        load_catalogue(tmp_path)
