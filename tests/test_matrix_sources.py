"""Matrix facts derived again from their primary source, kept in tests/fixtures as verbatim
excerpts with the URL and commit they were copied from: the next audit of these facts finds
nothing a test would not have found first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envbuild.matrix import load_matrix

from conftest import FIXTURE_MATRIX, ROOT, run_here
from property_settings import EXAMPLES

LEVELS = ROOT / "tests" / "fixtures" / "nccl-source" / "levels.txt"
LEVEL_VARIABLES = ("NCCL_P2P_LEVEL", "NCCL_NET_GDR_LEVEL")
# The names NCCL's env.html documents for each variable; the pattern must accept exactly these,
# in the spelling every NCCL release the matrix ships parses.
DOCUMENTED = {"NCCL_P2P_LEVEL": {"LOC", "NVL", "PIX", "PXB", "PHB", "SYS"},
              "NCCL_NET_GDR_LEVEL": {"LOC", "PIX", "PXB", "PHB", "SYS"}}


def nccl_level_parsers() -> dict[str, dict]:
    """Per NCCL release tag in the fixture: the level names ncclGetLevel accepts (the table's
    entries 0..PATH_SYS), whether it compares them case-sensitively, and the old numeric levels."""
    releases: dict[str, dict] = {}
    for block in LEVELS.read_text().split("\n== ")[1:]:
        tag, lines = block.split()[0], block.splitlines()
        headers, copied = lines[1::2], lines[2::2]
        assert all(h.startswith("-- https://github.com/NVIDIA/nccl/blob/") for h in headers), tag
        source = {h.split("/")[-1].split("#")[0]: line for h, line in zip(headers, copied)}
        table = re.findall(r'"([A-Z0-9]+)"', source["topo.cc"])
        path_sys = int(source.get("topo.h", source.get("graph.h", "")).split()[-1])
        parser = "\n".join(line for h, line in zip(headers, copied) if "/paths.cc#" in h)
        old = re.search(r"levelsOldToNew\[\] = \{([^}]*)\}", parser).group(1).count("PATH_")
        releases[tag] = {"names": set(table[:path_sys + 1]) if re.search(r"i ?<= ?PATH_SYS", parser) else set(),
                         "case_sensitive": "strcmp(str, topoPathTypeStr[i]) == 0" in parser,
                         "numbers": {str(n) for n in range(old)} if "str[0] >= '0' && str[0] <= '9'" in parser else set(),
                         "sys_index": table.index("SYS") == path_sys}
    return releases


def test_the_nccl_fixture_covers_every_release_torch_pins_up_to_the_newest_tag():
    """The fixture's tags are the NCCL versions the matrix's torch releases pin (2.31 and later
    have no tag in NVIDIA/nccl to read yet)."""
    pins = {r.nccl for r in load_matrix(ROOT / "matrices").torch_file.releases}
    tags = {t.removeprefix("v").removesuffix("-1") for t in nccl_level_parsers()}
    assert {p for p in pins if tuple(map(int, p.split("."))) <= (2, 30, 7)} <= tags
    assert all(r["sys_index"] and r["case_sensitive"] for r in nccl_level_parsers().values())


@pytest.mark.parametrize("directory", [ROOT / "matrices", FIXTURE_MATRIX])
@pytest.mark.parametrize("name", LEVEL_VARIABLES)
def test_level_patterns_are_the_names_nccl_parses(directory, name):
    """gpus.yaml's pattern accepts the documented names exactly as every release's ncclGetLevel
    accepts them (strcmp: capitals only) and its numeric levels; no other spelling of a name."""
    grammar = load_matrix(directory).gpus_file.variables[name]
    parsers = nccl_level_parsers().values()
    every_release = set.intersection(*(p["names"] | p["numbers"] for p in parsers))
    accepted = {v for v in every_release | {n.lower() for n in every_release} | {n.title() for n in every_release}
                if re.fullmatch(grammar.pattern, v)}
    assert accepted == DOCUMENTED[name] | set.intersection(*(p["numbers"] for p in parsers))
    assert accepted <= every_release


@given(st.sampled_from(sorted(DOCUMENTED["NCCL_P2P_LEVEL"])), st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_a_level_in_another_case_is_refused(level, data):
    """Any spelling NCCL's strcmp would not match (ignored silently there) is refused here."""
    other = "".join(c.lower() if data.draw(st.booleans()) else c for c in level)
    grammar = load_matrix(FIXTURE_MATRIX).gpus_file.variables["NCCL_P2P_LEVEL"]
    assert (grammar.problem("NCCL_P2P_LEVEL", other) is None) == (other == level)


def test_env_with_a_lower_case_level_is_exit_2_naming_the_spellings(tmp_path: Path):
    ran = run_here("render", "--gpu", "h100", "--env", "NCCL_P2P_LEVEL=nvl", "-o", str(tmp_path / "out"))
    message = " ".join(ran.stderr.split())
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert "NCCL_P2P_LEVEL takes LOC, NVL, PIX, PXB, PHB or SYS in capitals" in message
    assert not (tmp_path / "out").exists()
