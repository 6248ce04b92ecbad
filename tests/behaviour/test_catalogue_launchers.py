"""`envbuild matrix catalogue --slurm-source/--enroot-source/--pyxis-source`: what the launchers
print, derived from their sources, offline.

tests/fixtures/catalogue/{slurm,enroot,pyxis} hold real files of each project at two tags (SOURCE.txt:
URL and sha256 of each; tags.txt: the tags' commits), read by the same rule and written by the same
layout as NCCL's catalogue. The catalogues envbuild ships (matrices/catalogues/slurm.yaml,
enroot.yaml, pyxis.yaml) are checked to cover every release line the tool names.
"""

from __future__ import annotations

import hashlib

import pytest

from conftest import ROOT, load_yaml
from envbuild.refresh import launcher_catalogue as launchers
from envbuild.refresh import nccl_catalogue

FIXTURES = ROOT / "tests" / "fixtures" / "catalogue"
URLS = {"slurm": "https://github.com/SchedMD/slurm/blob/", "enroot": "https://github.com/NVIDIA/enroot/blob/",
        "pyxis": "https://github.com/NVIDIA/pyxis/blob/"}


def derived(name: str) -> dict:
    component = launchers.component(name)
    return launchers.derive(component, launchers.open_sources(component, FIXTURES / name))


def entry(data: dict, text: str, call: str = "") -> dict:
    (found,) = [m for m in data["messages"] if m["text"] == text and (not call or m["call"] == call)]
    return found


@pytest.mark.parametrize("name", sorted(URLS))
def test_the_fixture_files_are_the_real_ones_they_name(name):
    """A fixture edited by hand would test an extraction of text the launcher never printed."""
    lines = [line for line in (FIXTURES / name / "SOURCE.txt").read_text().splitlines() if " sha256 " in line]
    assert len(lines) >= 4
    for line in lines:
        path, url, _, digest = line.split()
        assert url == URLS[name] + path
        assert hashlib.sha256((FIXTURES / name / path).read_bytes()).hexdigest() == digest, path


def test_slurm_wordings_carry_their_release_range_call_file_and_line():
    """srun's `Exited with exit code` moved from the launch plugin (22.05) into srun (23.02): the
    same wording in both releases, at its line in the newest; pmix's PMIXP_ERROR_STD is its own call."""
    data = derived("slurm")
    exited = entry(data, "%s: %s %s: Exited with exit code %d")
    assert (exited["level"], exited["call"], exited["file"], exited["releases"]) == (
        "ERROR", "error", "src/srun/launch.c", "22.05.11..24.11.7")
    source = (FIXTURES / "slurm" / "slurm-24-11-7-1" / exited["file"]).read_text().splitlines()
    assert 'error("%s: %s %s: Exited with exit code %d",' in source[exited["line"] - 1]
    socket = entry(data, "Cannot create UNIX socket")
    assert (socket["call"], socket["releases"]) == ("PMIXP_ERROR_STD", "22.05.11..24.11.7")
    assert entry(data, "Unable to create step for job %u: %m")["releases"] == "24.11.7"
    assert [r["release"] for r in data["releases"]] == ["22.05.11", "24.11.7"]
    assert data["releases"][0] == {"release": "22.05.11", "tag": "slurm-22-05-11-1",
                                   "commit": "608e2f502ffe0decc5564cb51525ddfd4cc59efd"}
    assert [r["release"] for r in data["not_catalogued"]] == ["23.02", "23.11", "24.05"]


def test_enroot_and_pyxis_wordings_carry_their_release_ranges():
    enroot, pyxis = derived("enroot"), derived("pyxis")
    assert entry(enroot, "URL %s returned error code: %s %s")["releases"] == "3.4.1..4.1.2"
    assert entry(enroot, "failed to disable L1TF mitigation", "err")["releases"] == "4.1.2"
    assert entry(pyxis, "pyxis: printing enroot log file:")["releases"] == "0.19.0"
    assert entry(pyxis, "pyxis: printing %s log file:")["releases"] == "0.24.0"


def test_the_newest_patch_of_each_release_line_is_catalogued_and_release_candidates_are_not():
    slurm = launchers.component("slurm")
    found, missing = launchers.releases_of(slurm, ["slurm-24-11-0-0rc1", "slurm-24-11-6-1", "slurm-24-11-7-1",
                                                   "slurm-24-11-10-1", "slurm-25-05-0-1", "slurm-22-05-8-1"])
    assert found == [("22.05.8", "slurm-22-05-8-1"), ("24.11.10", "slurm-24-11-10-1")]
    assert [m["release"] for m in missing] == ["23.02", "23.11", "24.05"]


@pytest.mark.parametrize("source, text", [
    ('common::err "Not enough space left in $(dirname "${dest}") (${total_size} KB needed)"',
     "Not enough space left in %s (%s KB needed)"),
    ('cd "$1" 2> /dev/null || common::err "Could not change directory: $1"', "Could not change directory: %s"),
    ('common::err "URL ${@: -1} returned error code: ${code} ${status}"', "URL %s returned error code: %s %s"),
    ("common::err '100% literal: $x'", "100%% literal: $x"),
    ('common::log WARN "a \\"quoted\\" `cmd` $? done"', 'a "quoted" %s %s done'),
])
def test_shell_messages_are_read_as_bash_expands_them(source, text):
    (message,) = launchers.shell_extract(source, "src/x.sh")
    assert (message["text"], message["line"]) == (text, 1)


@pytest.mark.parametrize("source", ['# common::err "commented out"', 'common::log WARN - <&3', 'common::log',
                                    'common::err "never closed'])
def test_what_is_not_a_shell_message_is_left_out(source):
    assert launchers.shell_extract(source, "src/x.sh") == []


def test_c_calls_are_read_by_the_nccl_rule_with_their_own_names():
    """One rule for C format strings: err()'s exit status and PMIXP_ERROR_NO's errno are skipped."""
    slurm, enroot = launchers.component("slurm"), launchers.component("enroot")
    found = slurm.extract('PMIXP_ERROR_NO(rc, "send to %s failed", host);\nslurm_error("not slurm");\n'
                          'fatal("%s: job env is NULL", __func__);\n', "src/srun/x.c")
    assert [(m["call"], m["level"], m["text"], m["line"]) for m in found] == [
        ("PMIXP_ERROR_NO", "ERROR", "send to %s failed", 1), ("fatal", "FATAL", "%s: job env is NULL", 3)]
    (message,) = enroot.extract('err(EXIT_FAILURE, "failed to open: %s", fstab);', "bin/enroot-mount.c")
    assert (message["call"], message["text"]) == ("err", "failed to open: %s")


@pytest.mark.parametrize("name", sorted(URLS))
def test_the_same_sources_give_the_same_bytes(name):
    component = launchers.component(name)
    first, second = launchers.render(component, derived(name)), launchers.render(component, derived(name))
    assert first == second
    assert launchers.render(component, load_yaml(first)) == first


@pytest.mark.parametrize("name, releases", [
    ("slurm", ["22.05.11", "23.02.8", "23.11.11", "24.05.8", "24.11.7"]),
    ("enroot", ["3.4.1", "3.5.0", "4.0.1", "4.1.2"]),
    ("pyxis", ["0.19.0", "0.20.1", "0.21.0", "0.22.0", "0.23.0", "0.24.0"]),
])
def test_the_shipped_catalogues_cover_every_release_line(name, releases):
    path = ROOT / "matrices" / "catalogues" / f"{name}.yaml"
    data = load_yaml(path.read_text())
    assert [r["release"] for r in data["releases"]] == releases and data["not_catalogued"] == []
    assert len(data["releases"]) == len(launchers.component(name).lines)
    assert launchers.render(launchers.component(name), data) == path.read_text()
    assert all(m["file"] and m["line"] > 0 and m["releases"] for m in data["messages"])


def test_the_command_writes_then_finds_it_current(tmp_path, cli):
    """No nccl.yaml needed for a launcher; a second run with the same sources is an empty diff."""
    args = ("matrix", "catalogue", "--pyxis-source", FIXTURES / "pyxis", "--enroot-source", FIXTURES / "enroot",
            "--matrix-dir", tmp_path)
    first = cli(*args, "--write")
    assert first.returncode == 0, first.stderr
    assert "pyxis catalogue: release 0.24.0 added: 3 new and 1 removed messages against 0.19.0" in first.stderr
    assert (tmp_path / "catalogues" / "enroot.yaml").read_text().startswith("# What enroot can print")
    again = cli(*args)
    assert (again.returncode, again.stdout) == (0, "") and "current" in again.stderr


def test_a_source_without_a_tag_of_any_release_line_is_exit_2(tmp_path, cli):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tags.txt").write_text("v0.1.0 " + "0" * 40 + "\n")
    result = cli("matrix", "catalogue", "--pyxis-source", tmp_path / "src", "--matrix-dir", tmp_path / "m")
    assert result.returncode == 2 and "no release tag" in result.stderr and "Traceback" not in result.stderr


def test_a_saved_tag_list_is_checked_against_the_component_tags(tmp_path):
    """Slurm's tags are slurm-22-05-11-1: a `v2.27.3-1` (NCCL's) in its tags.txt is refused."""
    from envbuild.base.errors import EnvbuildError
    (tmp_path / "tags.txt").write_text("v2.27.3-1 " + "0" * 40 + "\n")
    with pytest.raises(EnvbuildError, match="tags.txt line 1"):
        launchers.open_sources(launchers.component("slurm"), tmp_path)
    assert isinstance(launchers.open_sources(launchers.component("slurm"), FIXTURES / "slurm"),
                      nccl_catalogue.DirSources)
