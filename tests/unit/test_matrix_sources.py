"""Matrix facts derived again from their primary source, kept in tests/fixtures as verbatim
excerpts with the URL and commit they were copied from: the next audit of these facts finds
nothing a test would not have found first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from envbuild.knowledge.matrix import load_matrix

from conftest import FIXTURE_MATRIX, ROOT, run_here

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


NCCL_SOURCE = ROOT / "tests" / "fixtures" / "nccl-source"
C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale: what strtoll and NCCL's trim skip


def nccl_fixture(name: str) -> dict[str, list[str]]:
    """Per release tag of an nccl-source fixture: its verbatim lines, each checked to come from
    NVIDIA/nccl at the commit its block names."""
    releases: dict[str, list[str]] = {}
    for block in (NCCL_SOURCE / name).read_text().split("\n== ")[1:]:
        lines = block.splitlines()
        tag, commit = lines[0].split()
        assert all(h.startswith(f"-- https://github.com/NVIDIA/nccl/blob/{commit}/src/") for h in lines[1::2]), tag
        releases[tag] = lines[2::2]
    return releases


def test_the_nccl_fixtures_cover_the_same_releases_as_the_level_names():
    """Every NCCL tag the level test reads (the versions torch pins) is in each new fixture."""
    assert set(nccl_fixture("debug.txt")) == set(nccl_fixture("params.txt")) == set(nccl_level_parsers())


def nccl_debug_parsers() -> dict[str, dict]:
    """Per release: NCCL_DEBUG's level names, whether they compare in any (ASCII) case, and
    whether blanks around the value are trimmed first (v2.30's ncclParamOneOf) or not (strcasecmp)."""
    releases = {}
    for tag, lines in nccl_fixture("debug.txt").items():
        text = "\n".join(lines)
        old = re.findall(r'strcasecmp\(nccl_debug, "([A-Z]+)"\) == 0', text)
        new = re.findall(r'makeOption\("([A-Z]+)", NCCL_LOG_', text) if "ncclParamOneOf<ncclDebugLogLevel>" in text else []
        one_of = "utils::iequals(opt.name, token)" in text and "utils::trim(std::string(input))" in text
        assert bool(old) != bool(new) and (not new or one_of), tag
        releases[tag] = {"names": set(old or new), "trims": bool(new)}
    return releases


def nccl_debug_level(release: dict, value: str):
    """The level a release sets for `value` (None: no level, logging stays off)."""
    token = value.strip(C_SPACE) if release["trims"] else value
    if not token.isascii():
        return None  # strcasecmp and iequals fold ASCII letters only
    return token.upper() if token.upper() in release["names"] else None


DEBUG_SPELLINGS = ["INFO", "info", "Warn", "tRaCe", "version", "abort", " INFO", "INFO\n", "", "NONE", "DEBUG",
                   "INFO,WARN", "VERſION", "ınfo", "İNFO", "WARNING", "1", "0"]


def nccl_debug_pattern_agrees(value: str) -> None:
    grammar = load_matrix(ROOT / "matrices").gpus_file.variables["NCCL_DEBUG"]
    levels = {nccl_debug_level(r, value) for r in nccl_debug_parsers().values()}
    assert (re.fullmatch(grammar.pattern, value) is not None) == (None not in levels), value


@pytest.mark.parametrize("value", DEBUG_SPELLINGS)
def test_nccl_debug_pattern_is_what_every_release_reads_as_a_level(value):
    """gpus.yaml's NCCL_DEBUG pattern accepts a value exactly when every release torch pins reads
    it as a level (any ASCII case; blanks only v2.30 trims are refused, as are look-alike letters
    such as the long s or the dotless i, which Python's (?i) would fold and strcasecmp does not)."""
    nccl_debug_pattern_agrees(value)
    assert all(r["names"] == {"VERSION", "WARN", "INFO", "ABORT", "TRACE"} for r in nccl_debug_parsers().values())


def c_strtoll(text: str) -> tuple[int, bool]:
    """C's strtoll(text, NULL, 0) on glibc: (value, errno set). Leading blanks and a sign, then
    0x hex, 0 octal or decimal digits, as many as there are; no digits reads as 0, errno unset."""
    rest = text.lstrip(C_SPACE)
    sign = -1 if rest[:1] == "-" else 1
    rest = rest[1:] if rest[:1] in "+-" else rest
    base, digits = 10, "0123456789"
    if rest[:2].lower() == "0x" and rest[2:3].lower() in tuple("0123456789abcdef"):
        base, digits, rest = 16, "0123456789abcdefABCDEF", rest[2:]
    elif rest[:1] == "0":
        base, digits = 8, "01234567"
    run = len(rest) - len(rest.lstrip(digits))
    value = sign * int(rest[:run] or "0", base)
    return max(min(value, 2**63 - 1), -2**63), not -2**63 <= value < 2**63


def nccl_int_readers() -> dict[str, dict]:
    """Per release: what each of the four variables does with a value, as the fixture's lines read
    it (strtol/strtoll base 0, then the comparison that switches the transport)."""
    releases = {}
    for tag, lines in nccl_fixture("params.txt").items():
        text = "\n".join(lines)
        assert "int disable = strtol(str, NULL, 0);" in text and re.search(r"if \(disable == 1\) l = (0|PATH_LOC);", text), tag
        assert "value = strtoll(str, nullptr, 0);" in text and "if (errno) {" in text, tag
        for param, default in (("IbDisable", 0), ("ShmDisable", 0), ("NvlsEnable", 2)):
            assert f'NCCL_PARAM({param}, "{param_env(param)}", {default});' in text, (tag, param)
        assert "if (ncclParamIbDisable()) return" in text and "if (ncclParamShmDisable() == 1) return" in text, tag
        assert "if (!ncclParamNvlsEnable() ||" in text and "if (ncclParamNvlsEnable() == 2) {" in text, tag
        releases[tag] = {"NCCL_P2P_DISABLE": lambda v: "off" if c_int(c_strtoll(v)[0]) == 1 else "on",
                         "NCCL_SHM_DISABLE": lambda v: "off" if param_value(v, 0) == 1 else "on",
                         "NCCL_IB_DISABLE": lambda v: "off" if param_value(v, 0) else "on",
                         "NCCL_NVLS_ENABLE": lambda v: {0: "off", 2: "auto"}.get(param_value(v, 2), "on")}
    return releases


def param_env(param: str) -> str:
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", param).upper()


def c_int(value: int) -> int:
    """A long stored into an int (ncclGetLevel's `int disable`): its low 32 bits, signed."""
    return (value + 2**31) % 2**32 - 2**31


def param_value(text: str, default: int) -> int:
    """ncclLoadParam: the default for an empty value or one out of range, else strtoll's."""
    value, errno = c_strtoll(text)
    return default if not text or errno else value


@pytest.mark.parametrize(("value", "read"), [("true", "on"), ("yes", "on"), ("0x1", "off"), (" 1", "off"),
                                             ("1abc", "off"), ("2", "on"), ("4294967297", "off")])
def test_nccl_reads_text_as_0_and_any_leading_integer(value, read):
    """What the pattern refuses and NCCL would read: NCCL_P2P_DISABLE=true leaves P2P on, 0x1
    turns it off; 2 turns InfiniBand off but not shared memory (so no value beyond 0 and 1)."""
    for release in nccl_int_readers().values():
        assert release["NCCL_P2P_DISABLE"](value) == read
        assert release["NCCL_IB_DISABLE"]("2") == "off" and release["NCCL_SHM_DISABLE"]("2") == "on"
        assert release["NCCL_NVLS_ENABLE"]("2") == "auto" and release["NCCL_NVLS_ENABLE"]("3") == "on"


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

    from envbuild.knowledge import rules
    m = load_matrix(ROOT / "matrices")
    cuda13 = [s for s in m.stacks if s.cuda.startswith("13.")]
    assert cuda13 and all(Version(s.deepspeed) >= Version("0.19.0") for s in cuda13)
    for s in cuda13:
        why = rules.op_rejection(m, s, "fp_quantizer", "9.0")
        assert why and "13.0.88 and 13.1.115" in why.message and "pull/7976" in why.message, s.id


# ---------------------------------------------------------------- torch's getCvarBool and getCvarInt

def torch_cvar_parser() -> dict:
    """getCvarBool's words and getCvarInt's parser, read from torch 2.15.0's Utils.hpp (the wheel
    a lock pins; tests/fixtures/torch-source/getcvar.txt)."""
    text = (ROOT / "tests" / "fixtures" / "torch-source" / "getcvar.txt").read_text()
    body = text[text.index("inline bool getCvarBool"):]
    true_part, false_part = body.split("ret = true;")[0], body.split("ret = true;")[1].split("ret = false;")[0]
    assert "x = std::tolower(x);" in body and "ret = std::stoi(val.value());" in text
    return {"true": set(re.findall(r'val == "([^"]+)"', true_part)), "false": set(re.findall(r'val == "([^"]+)"', false_part))}


def torch_reads_bool(words: dict, value: str):
    """True/False as getCvarBool reads `value`, None where it stops ProcessGroupNCCL: std::tolower
    on each byte changes ASCII letters only, and nothing is trimmed."""
    lowered = "".join(c.lower() if c.isascii() else c for c in value)
    return True if lowered in words["true"] else False if lowered in words["false"] else None


BOOL_SPELLINGS = ["1", "0", "y", "Yes", "TRUE", "f", "No", "false", " 1", "1 ", "on", "off", "2", "", "yeſ", "İ",
                  "truE", "nO", "t", "T"]


@pytest.mark.parametrize("name", ["TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING"])
@pytest.mark.parametrize("value", BOOL_SPELLINGS)
def test_torch_bool_patterns_are_what_getcvarbool_reads(name, value):
    """The pattern accepts a value exactly when torch reads it as a yes or a no (any ASCII case;
    look-alike letters such as the long s, which Python's (?i) alone would fold, are refused)."""
    words = torch_cvar_parser()
    assert words == {"true": {"y", "yes", "1", "t", "true"}, "false": {"n", "no", "0", "f", "false"}}
    grammar = load_matrix(ROOT / "matrices").gpus_file.variables[name]
    assert (re.fullmatch(grammar.pattern, value) is not None) == (torch_reads_bool(words, value) is not None), value


@pytest.mark.parametrize("name", ["TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"])
def test_torch_int_patterns_accept_only_what_stoi_reads_as_that_number(name):
    """getCvarInt is std::stoi, which would also take blanks, a sign and trailing text: the
    patterns are narrower on purpose (plain digits that fit an int), and each value they accept
    is read by stoi as the number it reads as."""
    torch_cvar_parser()
    pattern = load_matrix(ROOT / "matrices").gpus_file.variables[name].pattern
    for value in ("0", "1", "3", "2000", "999999999", "-1", " 5", "5x", "0x10", "99999999999"):
        if re.fullmatch(pattern, value):
            assert value.isdigit() and int(value) <= 2 ** 31 - 1, value
