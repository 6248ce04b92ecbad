"""Drift between known_issues.yaml and what the components print, caught by a test rather than an audit.

A signature that quotes a component (NCCL, Slurm, enroot, pyxis, torch.distributed, DeepSpeed,
Triton) lists the wordings it stands for (`quotes`: the format string as
matrices/catalogues/NAME.yaml has it, under the component's name, and a line it prints with it).
For every release that component's catalogue holds, some quoted wording must be printed by that
release and matched by the pattern; one rule, every catalogue. The three NCCL signatures an audit
found stale (commit 8bc6d8d fixed them) and the pyxis one this check found (pyxis 0.24.0 dropped
`couldn't start container`) are held here with their old patterns: the check must name the
releases they missed.
"""

from __future__ import annotations

import pytest

from conftest import ROOT, load_yaml
from envbuild.doctor import load_issues
from envbuild.doctor.said import Said, drift, to_regex
from envbuild.doctor.signatures import QUOTED, Quote

ISSUES = load_issues(ROOT / "matrices")
CATALOGUES = {name: load_yaml((ROOT / "matrices" / "catalogues" / f"{name}.yaml").read_text()) for name in QUOTED}
CATALOGUE = CATALOGUES["nccl"]
# The patterns of 8bc6d8d^ (git show 8bc6d8d^:matrices/known_issues.yaml), before the audit's fix.
OLD = {
    "nccl-net-not-found": r"NCCL WARN Error: network (?P<net>[\w ./-]+?) not found",
    "net-plugin-partial": r"NET/Plugin: Could not find: (?P<plugin>\S+?)\.? Using internal",
    "gpudirect-rdma-off": r"GPU Direct RDMA Disabled for (?:GPU \S+ / )?HCA (?:\d+ )?.?(?P<hca>[\w.]+).?"
                          r"(?: \((?P<why>[^)]+)\))?",
}


def by_id(issue_id):
    return next(i for i in ISSUES if i.id == issue_id)


def test_every_quoted_wording_holds_on_every_catalogued_release():
    """One rule for every catalogue a signature can quote: NCCL, Slurm, enroot, pyxis,
    torch.distributed, DeepSpeed and Triton, each against the releases its catalogue holds."""
    assert drift(ISSUES, CATALOGUES) == []


def test_the_signatures_that_cite_nccl_s_source_quote_it():
    """A signature citing a line of NCCL's source names the wordings, so the check above covers it.
    nccl-system-error (many messages, from torch's side too) is not quoted yet."""
    citing = {i.id for i in ISSUES if "https://github.com/NVIDIA/nccl" in i.source and " src/" in i.source}
    assert citing and citing <= {i.id for i in ISSUES if i.quotes}


@pytest.mark.parametrize("issue_id, missed", [
    ("nccl-net-not-found", "NCCL 2.27.3, 2.27.5, 2.27.6, 2.27.7, 2.28.3"),
    ("net-plugin-partial", "NCCL 2.20.5, 2.21.5, 2.28.3, 2.28.7"),
    ("gpudirect-rdma-off", "NCCL 2.29.2, 2.29.3, 2.29.7 print 'GPU Direct RDMA Disabled for %s'"),
])
def test_the_old_patterns_the_audit_found_stale_fail_the_check(issue_id, missed):
    """Run on the wording before the fix, the check names the releases that print only other wordings."""
    old = by_id(issue_id).model_copy(update={"pattern": OLD[issue_id]})
    problems = drift([old], CATALOGUE)
    assert any(missed in problem for problem in problems), problems


def test_pyxis_container_failed_s_old_pattern_misses_what_pyxis_0_24_prints():
    """pyxis 0.24.0 (commit dcdf11e) no longer prints `couldn't start container`: a failed start
    says only `container start failed with error code: %d` (pyxis_slurmstepd.c:1149), which the
    pattern before this check did not match."""
    old = by_id("pyxis-container-failed").model_copy(update={"pattern": (
        r"pyxis: failed to import docker image|pyxis: couldn.t start container|pyxis: failed to create container "
        r"filesystem|pyxis: could not remove squashfs")})
    problems = "\n".join(drift([old], CATALOGUES))
    assert "pyxis 0.19.0, 0.20.1, 0.21.0, 0.22.0, 0.23.0, 0.24.0 print 'pyxis: container start failed with error code: %d'" \
           in problems
    assert "pyxis 0.24.0 print none of its quoted wordings of 'start failed'" in problems


def test_a_quote_names_exactly_one_component():
    with pytest.raises(ValueError, match="exactly one component"):
        Quote(line="x", nccl="a", pyxis="b")
    with pytest.raises(ValueError, match="exactly one component"):
        Quote(line="x")
    assert drift([by_id("cpu-only-torch")], {"nccl": CATALOGUE}) == [
        "cpu-only-torch: quotes torch, which has no catalogue in matrices/catalogues/"]


def test_a_quote_no_release_prints_or_a_line_it_cannot_print_is_named():
    issue = by_id("nccl-net-not-found")
    typo = issue.model_copy(update={"quotes": [Quote(nccl="Error: network %s not found", line="NCCL WARN Error: network IB not found")]})
    assert "which no catalogued NCCL release prints" in drift([typo], CATALOGUE)[0]
    wrong_line = issue.model_copy(update={"quotes": [Quote(nccl="Error: network %s not found.", line="NCCL WARN Error: net IB")]})
    assert "is not a line" in drift([wrong_line], CATALOGUE)[0]


@pytest.mark.parametrize("text, line, parts", [
    ("GPU Direct RDMA Disabled for GPU %d / HCA %lx (distance %d > %d)",
     "GPU Direct RDMA Disabled for GPU 0 / HCA 1a (distance 5 > 4)", {"d1": "0", "x2": "1a", "d3": "5", "d4": "4"}),
    ("Cuda failure %d '%s'", "Cuda failure 2 'out of memory'", {"d1": "2", "s2": "out of memory"}),
    ("Call to %s failed : %zu%%", "Call to  ibv_open_device\n  failed : 12%", {"s1": "ibv_open_device", "u2": "12"}),
    ("ptr %p size %lu", "ptr 0x7f00aa size 4096", {"p1": "0x7f00aa", "u2": "4096"}),
])
def test_a_format_string_becomes_a_matcher_with_typed_captures(text, line, parts):
    import re
    match = re.search(to_regex(text), line)
    assert match and {k: v for k, v in match.groupdict().items()} == parts
    assert not re.fullmatch(to_regex("status=%d"), "status=abc")


def test_the_most_specific_catalogued_message_wins():
    """`%s` alone says nothing and is not matched; of two wordings a line fits, the longer fixed text is chosen."""
    said = Said.of({"component": "nccl", "source": "https://github.com/NVIDIA/nccl",
                 "releases": [{"release": "2.30.7", "tag": "v2.30.7-1", "commit": "0" * 40}],
                 "messages": [{"level": "WARN", "text": "%s", "file": "a.cc", "line": 1, "releases": "2.30.7"},
                              {"level": "WARN", "text": "Call to %s failed", "file": "b.cc", "line": 2, "releases": "2.30.7"},
                              {"level": "WARN", "text": "Call to %s failed with %d", "file": "c.cc", "line": 3, "releases": "2.30.7"}]})
    index, _ = said.match("\x1b[0mhost:1:2 [0] NCCL WARN Call to ibv_open failed with 5")
    assert said.matchers[index].detail.startswith("NCCL 2.30.7, c.cc:3;")
    assert said.match("host:1:2 [0] NCCL INFO Call to x failed with 5") is None


def test_a_reworded_message_fails_until_its_new_wording_is_quoted():
    """Each quoted message must be printed, in a quoted wording, by every release from its first to
    the newest, or to its `until`: dropping the 2.29 wording of paths.cc's line, or its `until`, fails."""
    issue = by_id("gpudirect-rdma-off")
    without_2_29 = issue.model_copy(update={"quotes": [q for q in issue.quotes if q.nccl != "GPU Direct RDMA Disabled for %s"]})
    (problem,) = drift([without_2_29], CATALOGUE)
    assert "NCCL 2.29.2, 2.29.3, 2.29.7, 2.30.3, 2.30.4, 2.30.7 print none of its quoted wordings of 'paths.cc" in problem
    no_until = issue.model_copy(update={"quotes": [q.model_copy(update={"until": None}) for q in issue.quotes]})
    (problem,) = drift([no_until], CATALOGUE)
    assert "NCCL 2.30.3, 2.30.4, 2.30.7 print none of its quoted wordings of 'paths.cc" in problem


def test_nccl_system_error_s_old_pattern_misses_what_nccl_2_20_to_2_30_print():
    """Before its quotes, the pattern knew 2.20-2.26's `Connect to` only and a `Socket creation
    failed` no shipped release prints alone."""
    old = by_id("nccl-system-error").model_copy(update={"pattern": (
        r"unhandled system error|ncclSystemError|NCCL WARN socket(?:Start|Poll)Connect: Connect to|WARN Socket "
        r"creation failed|WARN Net : Connection closed by remote peer|NCCL WARN socketProgress: Connection closed by remote peer")})
    problems = "\n".join(drift([old], CATALOGUE))
    assert "NCCL 2.27.3, 2.27.5" in problems and "'%s: connect to %s failed : %s'" in problems
    assert "NCCL 2.20.5, 2.21.5, 2.22.3, 2.23.4 print 'ncclSocketInit: Socket creation failed : %s'" in problems


def _renderings(component: str) -> dict[str, str]:
    """Each wording of a component's catalogue as a line it prints (sample values filled in, after
    what prints it), by the wording."""
    from envbuild.doctor.said import CONVERSION, LAUNCHERS, PYTHON, _torch_line, printed
    from test_doctor_said import LAUNCHER_LINE, SAMPLE, container_line
    lines = {}
    if component in ("container-toolkit", "libnvidia-container", "apptainer"):
        return {str(m["text"]): container_line(component, m) for m in CATALOGUES[component]["messages"]}
    for m in CATALOGUES[component]["messages"]:
        text = printed(m["text"]) if component in LAUNCHERS else m["text"]
        text = _torch_line(text) if component in LAUNCHERS or component in PYTHON else text
        sample = CONVERSION.sub(lambda c: SAMPLE.get(c.group("kind"), "0"), text)
        lines[str(m["text"])] = LAUNCHER_LINE.get(m.get("call"), "") + sample
    return lines


@pytest.mark.parametrize("component", [c for c in QUOTED if c != "nccl"])
def test_a_signature_whose_pattern_matches_a_catalogued_wording_quotes_it(component):
    """A signature that matches what a component prints stands for that wording, so it must quote
    it and the drift check above holds it on every release (NCCL: the rule above, by its source)."""
    import re
    unquoted = []
    for issue in ISSUES:
        pattern = re.compile(issue.pattern)
        quoted = {q.text for q in issue.quotes if q.component == component}
        unquoted += [f"{issue.id}: {text!r}" for text, line in _renderings(component).items()
                     if text not in quoted and pattern.search(line)]
    assert unquoted == []


def test_container_runtime_no_driver_s_old_pattern_misses_what_libnvidia_container_prints_today():
    """libnvidia-container renamed its driver service's error in 2021 (`driver error:` became `%s rpc error`,
    src/rpc.h): every release the toolkit 1.14 to 1.17 pins prints `driver rpc error: ...`, which the
    pattern before this check did not match."""
    old = by_id("container-runtime-no-driver").model_copy(update={"pattern": (
        r'nvidia-container-cli: initialization error: (?P<reason>nvml error: driver not loaded|driver error: '
        r'[^:\\"]+|load library failed: [^:\\"]+)')})
    problems = "\n".join(drift([old], CATALOGUES))
    assert "libnvidia-container 1.14.3, 1.15.0, 1.16.2, 1.17.2 print '%s rpc error'" in problems


def test_container_cuda_requirement_s_old_pattern_misses_the_toolkit_s_own_check():
    """The toolkit checks NVIDIA_REQUIRE_CUDA itself in CSV mode (Jetson): `requirements not met:
    unsatisfied condition: cuda>=X (cuda=Y)`, which only nvidia-container-cli's wording matched before."""
    old = by_id("container-cuda-requirement").model_copy(update={
        "pattern": r"nvidia-container-cli: requirement error: unsatisfied condition: cuda\s*>=\s*[\d.]+"})
    problems = "\n".join(drift([old], CATALOGUES))
    assert "'unsatisfied condition: %v (%v)'" in problems and "its pattern does not match it" in problems


def test_a_quote_of_the_container_stack_names_its_component_with_a_hyphen():
    quote = Quote.model_validate({"libnvidia-container": "nvml error", "line": "x"})
    assert (quote.component, quote.text) == ("libnvidia-container", "nvml error")
    with pytest.raises(ValueError, match="exactly one component"):
        Quote.model_validate({"libnvidia-container": "a", "container-toolkit": "b", "line": "x"})
