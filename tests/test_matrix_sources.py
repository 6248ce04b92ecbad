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


@pytest.mark.parametrize("torch", ["2.12.1", "2.13.0", "2.14.1"])
def test_the_cuda_13_2_variants_of_pytorch_s_release_matrix_are_recorded(torch):
    """PyTorch's release matrix (pytorch PRs #182849, #187075, #194367) and each wheel's
    PYTORCH_RELEASES_CODE_CC list a CUDA 13.2 build of these releases; the note names the source."""
    release = load_matrix(ROOT / "matrices").torch_release(torch)
    assert release.variants.get("13.2") == "cu13"
    assert all(pr in release.note for pr in ("#182849", "#187075", "#194367"))


def test_torch_2_13_with_cuda_13_2_renders_unlocked_from_pytorch_s_index(tmp_path: Path):
    ran = run_here("render", "--torch", "2.13", "--cuda", "13.2", "--gpu", "h100", "-o", str(tmp_path / "out"),
                   production=True)
    assert ran.returncode == 0, ran.stderr
    assert "torch2.13-cu132-py3.12" in ran.stdout and "download.pytorch.org" in ran.stdout
    assert "https://download.pytorch.org/whl/cu132 torch==2.13.0" in (tmp_path / "out" / "Dockerfile").read_text()


@pytest.mark.parametrize("gpu", ["p100", "Tesla P100-PCIE-16GB"])
def test_the_p100_renders_a_cu126_stack_that_carries_sm_60(tmp_path: Path, gpu):
    """PyTorch's CUDA 12.6 builds keep sm_60 (PYTORCH_RELEASES_CODE_CC["12.6"] of the torch
    2.11-2.15 wheels): the P100 is served from them, with torch.compile named as unavailable."""
    ran = run_here("render", "--gpu", gpu, "-o", str(tmp_path / "out"), production=True)
    assert ran.returncode == 0, ran.stderr
    assert re.search(r"^stack +torch2\.14-cu126-py3\.12$", ran.stdout, re.M)
    assert 'TORCH_CUDA_ARCH_LIST="6.0"' in (tmp_path / "out" / "Dockerfile").read_text()
    p100 = load_matrix(ROOT / "matrices").gpu(gpu)
    assert any("no torch.compile" in n and "7.0" in n for n in p100.notes)


def test_the_p100_refuses_a_build_without_sm_60_naming_the_cu126_stacks(tmp_path: Path):
    ran = run_here("render", "--gpu", "p100", "--cuda", "13.0", "-o", str(tmp_path / "out"), production=True)
    message = " ".join(ran.stderr.split())
    assert ran.returncode == 2 and "no code for p100 (sm_60)" in message
    assert "--cuda 12.6 --python 3.12 (stack torch2.14-cu126-py3.12)" in message


def test_fp_quantizer_is_refused_on_every_cuda_13_stack():
    """nvcc 13.0.88, 13.1.115 and 13.2 all reject fp_quantize_impl.cu of DeepSpeed >= 0.19.0
    (the redeclared template parameter of DeepSpeed PR #7976): no CUDA 13 stack offers the op."""
    from packaging.version import Version

    from envbuild import rules

    m = load_matrix(ROOT / "matrices")
    cuda13 = [s for s in m.stacks if s.cuda.startswith("13.")]
    assert cuda13 and all(Version(s.deepspeed) >= Version("0.19.0") for s in cuda13)
    for s in cuda13:
        why = rules.op_rejection(m, s, "fp_quantizer", "9.0")
        assert why and "13.0.88 and 13.1.115" in why.message and "pull/7976" in why.message, s.id
