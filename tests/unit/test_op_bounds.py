"""deepspeed.yaml's CUDA bounds of ops, derived by compiling (envbuild/refresh/op_bounds.py).

Offline: the parsing and deciding on real nvcc logs (tests/fixtures/op_bounds: PyPI's nvcc
13.0.88, 13.1.115 and 13.2.86 compiling the deepspeed-0.19.8 sdist's fp_quantize_impl.cu,
and a compile whose set-up lacked a header). The bound derived again from PyPI's nvcc (opt-in:
ENVBUILD_LIVE=1) is tests/unit/test_op_bounds_live.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT
from envbuild.base.errors import EnvbuildError
from envbuild.refresh import op_bounds
from envbuild.refresh.fixtures import FixtureIndex
from envbuild.refresh.op_bounds import CompileError, ReleaseResult

FIXTURES = ROOT / "tests" / "fixtures" / "op_bounds"
REJECTING = {"13.0": "nvcc-13.0.88.log", "13.1": "nvcc-13.1.115.log", "13.2": "nvcc-13.2.86.log"}
SOURCE_ROOT = "/var/tmp/bounds-work/run/sdist/deepspeed-0.19.8"  # where the fixtures' compile ran
REDECLARED = 'template parameter "q_exponent_bits" may not be redeclared in this scope'


def log(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_the_redeclaration_is_read_from_each_real_nvcc_log_as_file_and_line():
    for name in REJECTING.values():
        errors = op_bounds.parse_nvcc_log(log(name), SOURCE_ROOT)
        assert errors == [CompileError("csrc/fp_quantizer/fp_quantize_impl.cu", 234, REDECLARED),
                          CompileError("csrc/fp_quantizer/fp_quantize_impl.cu", 413, REDECLARED)], name


def test_a_set_up_that_lacks_a_header_is_never_taken_for_a_rejection():
    """A missing header (the mixed 13.0/13.2 install of an earlier attempt failed like this)
    says nothing about the op: no bound may rest on it."""
    with pytest.raises(EnvbuildError, match="No such file.*set-up is broken"):
        op_bounds.classify(1, log("broken-missing-header.log"), SOURCE_ROOT, "fp_quantizer")
    with pytest.raises(EnvbuildError, match="without a source error"):
        op_bounds.classify(1, "Killed\n", SOURCE_ROOT, "fp_quantizer")
    assert op_bounds.classify(0, "", SOURCE_ROOT, "x") == ("accepts", [])


def results_from_fixtures() -> list[ReleaseResult]:
    out = [ReleaseResult("12.9.1", "12.9", "not-tried", reason="nvidia-cuda-nvcc-cu12 12.9.86 holds no bin/nvcc")]
    for cuda, name in REJECTING.items():
        outcome, errors = op_bounds.classify(1, log(name), SOURCE_ROOT, name)
        out.append(ReleaseResult(name, cuda, outcome, nvcc=name, errors=errors))
    return out


def test_the_data_s_fp_quantizer_bound_is_the_one_the_recorded_compiles_give():
    """Every CUDA 13 nvcc tried rejects the op, so the bound is <13.0 (was <13.2, which let
    --ds-ops all on the cu130 stacks include an op that cannot build)."""
    _, _, ops = op_bounds.pinned(ROOT / "matrices")
    assert op_bounds.decide_bound(results_from_fixtures(), "fp_quantizer") == ops["fp_quantizer"]["cuda"] == "<13.0"
    reason = ops["fp_quantizer"]["cuda_reason"]
    for text in ("13.0.88", "13.1.115", "13.2.86", "fp_quantize_impl.cu:234", "fp_quantize_impl.cu:413",
                 "scripts/derive_op_bounds.py", "12.x"):
        assert text in reason, text


def test_release_order_is_by_version_not_by_text():
    """13.10 is newer than 13.9: a text sort would put a 13.10 rejection before 13.9's acceptance."""
    results = [ReleaseResult("a", "13.10", "rejects"), ReleaseResult("b", "13.9", "accepts")]
    assert op_bounds.decide_bound(results, "op") == "<13.10"


def test_the_op_s_translation_units_and_includes_come_from_its_builder():
    index = FixtureIndex(ROOT / "tests" / "fixtures" / "upstream")
    dist = next(d for d in index.files("deepspeed") if d.filename == "deepspeed-0.19.8.tar.gz")
    sources, includes = op_bounds.op_sources(index.sdist_files(dist), "fp_quantizer")
    assert (sources, includes) == (["csrc/fp_quantizer/fp_quantize_impl.cu"],
                                   ["csrc/fp_quantizer/includes", "csrc/includes"])
    with pytest.raises(EnvbuildError, match="no op 'fp_quantiser'.*fp_quantizer"):
        op_bounds.op_sources(index.sdist_files(dist), "fp_quantiser")
    with pytest.raises(EnvbuildError, match="no .cu file, so nvcc compiles nothing of op utils"):
        op_bounds.op_sources(index.sdist_files(dist), "utils")  # a cpu op: a compile shows no CUDA bound
    with pytest.raises(EnvbuildError, match="stochastic_transformer.py does not define sources"):
        op_bounds.op_sources(index.sdist_files(dist), "stochastic_transformer")  # TransformerBuilder's
    # random_ltd's include_paths() returns a name it assigned a list literal
    assert op_bounds.op_sources(index.sdist_files(dist), "random_ltd")[1] == ["csrc/includes"]


def test_a_builder_whose_sources_are_computed_is_not_derived_but_named():
    """A computed list (sources() + more) would need DeepSpeed run: the op is named, not guessed."""
    tree = ast.parse("class XBuilder(CUDAOpBuilder):\n    def sources(self):\n        return self.base() + ['a.cu']\n")
    with pytest.raises(EnvbuildError, match=r"op_builder/x.py: sources\(\) does not return a literal list"):
        op_bounds._literal_return(tree, "sources", "op_builder/x.py")


def test_the_nvcc_line_is_deepspeed_s_for_the_release():
    """-std as DeepSpeed's nvcc_args() picks it (c++20 from CUDA 12.5), one arch, the op's includes."""
    line = op_bounds.nvcc_command(Path("/n/nvcc"), Path("/cuda"), Path("/t"), Path("/ds"), "a.cu", ["inc"], "13.1",
                                  Path("/o"))
    assert "-std=c++20" in line and "-gencode=arch=compute_90,code=sm_90" in line and "-I/ds/inc" in line
    assert "-I/cuda/include" in line and "-I/t/torch/csrc/api/include" in line
    assert "-std=c++17" in op_bounds.nvcc_command(Path("n"), Path("c"), Path("t"), Path("d"), "a.cu", [], "12.4",
                                                  Path("o"))


def test_sparse_attn_torch_bound_is_what_its_builder_checks():
    """deepspeed.yaml's `sparse_attn.torch: "<2.0"` is derived from the op builder's own check
    (DeepSpeed 0.19.6, the last release with the op: `torch_compatible = (TORCH_MAJOR == 1 and
    TORCH_MINOR >= 5)`), evaluated for every torch the matrix ships and for torch 1.x: the
    bound refuses exactly the releases the builder refuses above 1.5."""
    from packaging.specifiers import SpecifierSet

    from envbuild.knowledge.matrix import load_matrix

    lines = (FIXTURES / "sparse_attn-0.19.6.txt").read_text().splitlines()
    check = next(line.strip() for line in lines if line.strip().startswith("torch_compatible ="))
    expression = ast.parse(check).body[0].value
    m = load_matrix(ROOT / "matrices")
    bound = SpecifierSet(m.ops["sparse_attn"].torch)
    shipped = sorted({s.torch for s in m.stacks})
    assert shipped and all(v.startswith("2.") for v in shipped)
    for version in [*shipped, "1.5.0", "1.13.1", "1.4.0"]:
        major, minor = (int(x) for x in version.split(".")[:2])
        compatible = eval(compile(ast.Expression(expression), "sparse_attn.py", "eval"),  # noqa: S307  (a comparison of two ints)
                          {"__builtins__": {}}, {"TORCH_MAJOR": major, "TORCH_MINOR": minor})
        if major >= 1 and minor >= 5 or major >= 2:  # the builder's floor (1.5) is below every stack the matrix could ship
            assert compatible == (version in bound), version
