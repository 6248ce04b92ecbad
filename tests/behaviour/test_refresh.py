"""`envbuild matrix refresh` on saved real upstream data (tests/fixtures/upstream, each
artifact with its SOURCE.txt), offline. The opt-in run against PyPI itself (ENVBUILD_LIVE=1) is
tests/behaviour/test_refresh_live.py."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import random
import re
import shutil
import threading
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from conftest import ROOT

from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.matrix import load_matrix
from envbuild.refresh import deepspeed_facts, ds_history, layout, torch_facts, writer
from envbuild.refresh.cli import refresh
from envbuild.refresh.metadata import PythonTags, linux_wheels, python_range, specifier_text
from envbuild.refresh.fixtures import FixtureIndex
from envbuild.refresh.pypi import PyPI

UPSTREAM = ROOT / "tests" / "fixtures" / "upstream"
FIXTURE_TORCH = ["2.5.1", "2.7.1", "2.14.1", "2.15.0"]
FIXTURE_DS = ["0.16.3", "0.16.9", "0.17.4", "0.17.5", "0.19.8"]
TRACKED_DS = ["0.15.4", "0.16.3", "0.16.9", "0.17.4", "0.17.6", "0.18.9", "0.19.8"]


@pytest.fixture(scope="module")
def index():
    return FixtureIndex(UPSTREAM)


@pytest.fixture(scope="module")
def torch_rows(index):
    return {str(v): torch_facts.derive_release(index, v).fields for v in torch_facts.tracked_releases(index)}


@pytest.fixture(scope="module")
def ds_sdists(index):
    return {v: index.sdist_files(next(f for f in index.files("deepspeed") if str(f.version) == v)) for v in FIXTURE_DS}


@pytest.fixture
def upstream_copy(tmp_path):
    """A writable copy of the fixtures, for tests that change a source's shape on purpose."""
    d = tmp_path / "upstream"
    shutil.copytree(UPSTREAM, d)
    return d


SMALL_MATRIX = ROOT / "tests" / "fixtures" / "refresh" / "matrix"


@pytest.fixture
def small_matrix(tmp_path):
    """The matrix cut down to the fixture releases (tests/fixtures/refresh: 2.14.1 set back to
    2.14.0 with its stacks, a patch the refresh must find and the stacks must follow; 2.15
    removed, a minor to find; 0.17.5 added), copied so a test may write it."""
    d = tmp_path / "matrices"
    shutil.copytree(SMALL_MATRIX, d)
    return d


# ---------------------------------------------------------------- torch


def test_every_fixture_names_its_artifact():
    for d in [p for p in UPSTREAM.iterdir() if p.is_dir()]:
        text = (d / "SOURCE.txt").read_text()
        assert "url: https://" in text, d
        if d.name.endswith((".whl", ".tar.gz")):
            assert "sha256: " in text and d.name in text, d


def test_tracked_releases_are_the_newest_patch_of_each_minor(index):
    assert [str(v) for v in torch_facts.tracked_releases(index)] == FIXTURE_TORCH


def test_torch_2_5_1(torch_rows):
    row = torch_rows["2.5.1"]
    # torch has cp313 wheels, but torchvision 0.20.1 has none (and triton's pin skips 3.13)
    assert row["python"] == ">=3.9,<3.13"
    assert row["torchvision"] == "0.20.1"
    assert row["triton"] == "==3.1.0"  # written `triton (==3.1.0) ; ...` in METADATA 2.1
    assert row["nccl"] == "2.21.5"
    assert row["manylinux"] == "manylinux1"
    assert row["default_cuda"] == "12.4"
    assert "cuda_toolkit" not in row and "aarch64_arches" not in row
    assert row["default_arches"] == "5.0;6.0;7.0;7.5;8.0;8.6;9.0"
    assert row["cuda_platforms"] == ["x86_64"]  # the aarch64 wheel's version.py says cuda = None
    assert row["cpp_extension_arches"].endswith(";9.0;9.0a") and "10.0" not in row["cpp_extension_arches"]
    assert row["extension_lock"] == "filebaton"


def test_torch_2_7_1(torch_rows):
    row = torch_rows["2.7.1"]
    assert (row["python"], row["torchvision"], row["triton"], row["nccl"]) == (">=3.9,<3.14", "0.22.1", "==3.3.1", "2.26.2")
    assert (row["manylinux"], row["default_cuda"]) == ("manylinux_2_28", "12.6")
    assert "12.0" in row["cpp_extension_arches"].split(";")


def test_torch_2_14_1(torch_rows):
    row = torch_rows["2.14.1"]
    assert row["torchvision"] == "0.29.2"  # newer than 0.29.1 and also `torch>=2.14.0`
    assert row["triton"] == "~=3.8.0"
    assert (row["default_cuda"], row["cuda_toolkit"], row["nccl"]) == ("13.0", "13.0.3", "2.30.7")
    assert row["default_arches"] == "7.5;8.0;8.6;9.0;10.0;12.0"  # no sm_70
    assert row["cuda_platforms"] == ["x86_64", "aarch64"]
    assert row["aarch64_arches"] == "8.0;9.0;10.0;11.0;12.0"
    assert row["extension_lock"] == "flock"
    assert {"10.7", "10.7a"} <= set(row["cpp_extension_arches"].split(";"))


def test_torch_2_15_0(torch_rows):
    row = torch_rows["2.15.0"]
    # cp311..cp315 wheels; triton 3.9.0 ships cp311 and cp312-abi3 wheels; torchvision is py3-none
    assert row["python"] == ">=3.11,<3.16"
    assert (row["torchvision"], row["triton"], row["default_cuda"], row["cuda_toolkit"]) == (
        "0.29.2", "~=3.9.0", "13.2", "13.2.2")


def test_arch_string_without_a_leading_nul():
    """In 2.8.0 the arch string follows another array's bytes directly ('ipc_hsm_70 ...')."""
    window = (UPSTREAM / "torch-2.8.0-cp39-cp39-manylinux_2_28_x86_64.whl" / torch_facts.ARCH_MEMBER).read_bytes()
    raw = re.search(torch_facts.ARCH_PATTERN, window).group(1)
    assert torch_facts.parse_arch_string(raw, "2.8.0") == "7.0;7.5;8.0;8.6;9.0;10.0;12.0"


def test_arch_string_parsing():
    assert torch_facts.parse_arch_string(b"sm_90 sm_75 compute_90 sm_100a", "x") == "7.5;9.0+PTX;10.0a"
    with pytest.raises(EnvbuildError, match="parses to no architecture"):
        torch_facts.parse_arch_string(b"sm_x gfx90a", "torch 9.9")


def test_rebuilt_wheels_replace_older_builds(index):
    """torch 2.10.0 was re-uploaded as 2.10.0-3 for x86_64: pip installs the build-3 wheels."""
    files = index.files("torch-rebuilds")  # torch 2.10.0's entries of PyPI's torch page
    wheels = linux_wheels(files, Version("2.10.0"), "x86_64")
    assert wheels and all(w.build == (3, "") for w in wheels)
    assert wheels[0].filename == "torch-2.10.0-3-cp310-cp310-manylinux_2_28_x86_64.whl"
    assert [w.filename for w in linux_wheels(files, Version("2.10.0"), "aarch64")][0] == \
        "torch-2.10.0-cp310-cp310-manylinux_2_28_aarch64.whl"


def test_python_tags_and_ranges(index):
    triton = [f for f in index.files("triton") if str(f.version) == "3.9.0"]
    tags = PythonTags(triton)
    assert tags.admits(11) and tags.admits(15) and not tags.admits(10)  # cp311 + cp312-abi3
    assert python_range([10, 11, 12]) == ">=3.10,<3.13"
    assert python_range([9, 10, 12]) == ">=3.9,<3.13,!=3.11.*"
    assert specifier_text('triton (==3.1.0) ; platform_system == "Linux"') == "==3.1.0"
    assert specifier_text("cuda-toolkit[cublas,cudart]==13.2.2; platform_system == \"Linux\"") == "==13.2.2"


# ---------------------------------------------------------------- sanity floors


def _wheel_dir(root: Path, version: str) -> Path:
    return next(root.glob(f"torch-{version}-*x86_64.whl"))


def test_floor_no_triton_pin(upstream_copy):
    meta = next(_wheel_dir(upstream_copy, "2.7.1").glob("*.dist-info/METADATA"))
    meta.write_text("\n".join(ln for ln in meta.read_text().splitlines() if not ln.startswith("Requires-Dist: triton")))
    with pytest.raises(EnvbuildError, match=r"torch 2\.7\.1 .*no triton requirement"):
        torch_facts.derive_release(FixtureIndex(upstream_copy), Version("2.7.1"))


def test_floor_arch_string_gone(upstream_copy):
    lib = _wheel_dir(upstream_copy, "2.15.0") / torch_facts.ARCH_MEMBER
    lib.write_bytes(lib.read_bytes().replace(b"sm_", b"xx_"))
    with pytest.raises(EnvbuildError, match=r"torch 2\.15\.0 .*no arch-flags string"):
        torch_facts.derive_release(FixtureIndex(upstream_copy), Version("2.15.0"))


def test_floor_no_cp_tags(upstream_copy):
    page = upstream_copy / "index" / "torch.json"
    data = json.loads(page.read_text())
    for f in data["files"]:
        f["filename"] = re.sub(r"-cp3\d+-cp3\d+t?-", "-py3-none-", f["filename"])
    page.write_text(json.dumps(data))
    with pytest.raises(EnvbuildError, match=r"torch 2\.5\.1: no cpXY tags"):
        torch_facts.derive_release(FixtureIndex(upstream_copy), Version("2.5.1"))


def test_floor_lock_unknown(upstream_copy):
    cpp = _wheel_dir(upstream_copy, "2.14.1") / "torch/utils/cpp_extension.py"
    cpp.write_text(cpp.read_text().replace("FileLock(", "SomeOtherLock("))
    with pytest.raises(EnvbuildError, match="neither FileBaton nor FileLock"):
        torch_facts.derive_release(FixtureIndex(upstream_copy), Version("2.14.1"))


def test_floor_release_list_lost_a_minor(index, tmp_path):
    """The committed matrix tracks 2.4-2.15; the fixture index has only four of those minors."""
    shutil.copy(ROOT / "matrices" / "torch.yaml", tmp_path / "torch.yaml")
    shutil.copy(ROOT / "matrices" / "deepspeed.yaml", tmp_path / "deepspeed.yaml")
    with pytest.raises(EnvbuildError, match=r"torch 2\.4\.1 is in the matrix but PyPI lists no 2\.4\.x"):
        refresh(index, tmp_path)


def test_floor_ops_table_shrank(upstream_copy):
    for builder in (upstream_copy / "deepspeed-0.19.8.tar.gz" / "op_builder").glob("[a-m]*.py"):
        if builder.name != "builder.py":
            builder.unlink()
    with pytest.raises(EnvbuildError, match=r"deepspeed 0\.19\.8: only \d+ ops found"):
        ds_history.derive(FixtureIndex(upstream_copy), FIXTURE_DS)


# ---------------------------------------------------------------- DeepSpeed


@pytest.mark.parametrize("version,expected", [("0.16.3", True), ("0.16.9", False), ("0.17.4", False),
                                              ("0.17.5", True), ("0.19.8", True)])
def test_gpu_free_install(ds_sdists, version, expected):
    free, why = deepspeed_facts.gpu_free_install(ds_sdists[version])
    assert free is expected
    if not expected:
        assert "ds_transformer.py calls get_accelerator().is_triton_supported() at import" in why


@pytest.mark.parametrize("version,expected", [("0.16.3", False), ("0.17.5", False), ("0.19.8", True)])
def test_nvcc_free_install(ds_sdists, version, expected):
    free, why = deepspeed_facts.nvcc_free_install(ds_sdists[version])
    assert free is expected
    assert expected or "installed_cuda_version()" in why


def test_torch_requirement(ds_sdists):
    assert deepspeed_facts.torch_requirement(ds_sdists["0.17.5"], "x") == ""
    assert deepspeed_facts.torch_requirement(ds_sdists["0.19.8"], "x") == ">=2.0.0"


def test_ops_of_one_sdist(ds_sdists):
    old = deepspeed_facts.ops(ds_sdists["0.17.5"], "0.17.5")
    new = deepspeed_facts.ops(ds_sdists["0.19.8"], "0.19.8")
    assert old["cpu_adam"].kind == "cpu" and old["cpu_adam"].cuda_extension  # TorchCPUOpBuilder(CUDAOpBuilder)
    assert new["cpu_adam"].path == "op_builder/cpu/cpu_adam.py" and not new["cpu_adam"].cuda_extension
    # libcuda: '-lcuda' in async_io's extra_ldflags(); gds extends it through super().extra_ldflags()
    assert new["async_io"].kind == "cuda" and new["async_io"].needs == ("libaio", "libcuda")
    assert new["gds"].needs == ("cufile", "libaio", "libcuda")  # its own cufile test plus async_io's
    assert not {"libcuda", "curand"} & set(new["cpu_adam"].needs + new["fused_adam"].needs)
    assert new["pin_memory"].kind == "cpu" and "sparse_attn" not in new and "sparse_attn" in old
    assert {o.env for o in new.values()} >= {"CPU_ADAM", "DEEP_COMPILE", "AIO", "RAGGED_OPS"}


def _presence():
    table = json.loads((UPSTREAM / "deepspeed-op-presence" / "presence.json").read_text())
    versions = sorted(table, key=Version)
    return table, versions


def test_bisect_finds_since_and_until_of_every_op():
    """Over every real release, bisecting from the tracked releases gives the exhaustive scan's
    answer and the known truths, reading only a few releases per op."""
    table, versions = _presence()
    scanned = sorted({versions.index(v) for v in TRACKED_DS} | {len(versions) - 1})
    found = {}
    for name in sorted({o for v in TRACKED_DS for o in table[v]["ops"]}):
        reads = set()

        def has(p, name=name, reads=reads):
            reads.add(p)
            return name in table[versions[p]]["ops"]
        since, until = ds_history.op_bounds(scanned, len(versions) - 1, has)
        found[name] = (versions[since], until and versions[until])
        assert len(reads - set(scanned)) <= 9, name  # a bisection, not a scan
        run_start = min(p for p in scanned if name in table[versions[p]]["ops"])
        while run_start > 0 and name in table[versions[run_start - 1]]["ops"]:
            run_start -= 1
        assert since == run_start, name  # the exhaustive scan's start of the run
    truths = {"fp_quantizer": "0.14.1", "gds": "0.15.0", "dc": "0.16.6", "utils": "0.17.1", "pin_memory": "0.19.5",
              "cpu_lion": "0.11.0", "fused_lion": "0.11.0", "evoformer_attn": "0.11.0"}
    assert {k: found[k][0] for k in truths} == truths
    assert found["sparse_attn"][1] == "0.19.7"
    assert all(until is None for name, (_, until) in found.items() if name != "sparse_attn")


def test_history_on_fixtures(index):
    history = ds_history.derive(index, FIXTURE_DS)
    assert history.ops["cpu_adam"].cuda_extension_until == "0.19.8"
    assert history.ops["async_io"].cuda_extension_until is None
    assert history.ops["sparse_attn"].until == "0.19.8"  # 0.19.7 is not in the fixture index
    assert [history.releases[v].gpu_free_install for v in FIXTURE_DS] == [True, False, False, True, True]


# ---------------------------------------------------------------- merge, layout, diff, command


def test_merge_keeps_curated_and_replaces_derived(index, small_matrix):
    before_ds = yaml.safe_load((small_matrix / "deepspeed.yaml").read_text())
    changes, facts, moves = refresh(index, small_matrix)
    torch_data = yaml.safe_load(changes[0].new)
    ds_data = yaml.safe_load(changes[1].new)
    rows = {r["torch"]: r for r in torch_data["releases"]}
    assert list(rows) == FIXTURE_TORCH  # 2.14.0 -> 2.14.1, 2.15.0 appended, ordered
    assert rows["2.5.1"]["python"] == ">=3.9,<3.13"
    assert rows["2.5.1"]["variants"] == {"12.4": "default", "11.8": "cu118_old"}
    assert "torchvision 0.20.1 has none" in rows["2.5.1"]["note"]
    assert rows["2.14.1"]["variants"] and "flock" in rows["2.14.1"]["note"]
    assert rows["2.15.0"]["note"] == writer.NEW_ROW_NOTE
    assert rows["2.15.0"]["variants"] == {"13.2": "default"}  # its wheel's own CUDA; the loader requires one
    assert rows["2.15.0"]["source"].startswith("torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl (METADATA")
    assert set(torch_data["sources"]) >= {"python", "default_arches", "variants", "arch_lists"}
    assert "derived" not in torch_data["sources"]
    ops = ds_data["ops"]
    assert ops["async_io"]["kind"] == "cuda" and ops["async_io"]["reason"] == before_ds["ops"]["async_io"]["reason"]
    assert ops["fp_quantizer"]["triton"] == before_ds["ops"]["fp_quantizer"]["triton"]
    assert ops["evoformer_attn"]["needs"] == ["curand", "cutlass"]  # the same set: the curated order stays
    assert ops["gds"]["needs"] == ["cufile", "libaio", "libcuda"] and ops["async_io"]["needs"] == ["libaio", "libcuda"]
    assert ds_data["build_requires"] == before_ds["build_requires"]
    assert [r["deepspeed"] for r in ds_data["releases"]] == FIXTURE_DS
    assert "torch 2.14.0 -> 2.14.1" in facts and "torch 2.15.0: new release" in facts
    assert "op async_io: kind cpu -> cuda" in facts


def test_layout_quotes_what_would_not_read_back():
    assert layout.scalar("2.10") == '"2.10"' and layout.scalar("true") == '"true"' and layout.scalar("") == '""'
    assert layout.scalar("manylinux_2_28") == "manylinux_2_28" and layout.scalar(">=3.9") == '">=3.9"'
    text = layout.dump({"a": {"b": "1.0"}, "releases": [{"x": "2.10", "l": ["x86_64"], "d": {"12.4": "y"}}]}, "# h", {})
    assert text == '# h\n\na:\n  b: "1.0"\n\nreleases:\n  - x: "2.10"\n    l: [x86_64]\n    d: {"12.4": y}\n'


def test_diff_lists_only_changed_lines():
    old = "".join(f"  - same: \"{i % 3}\"\n" for i in range(300))
    new = old.replace('same: "1"\n', 'same: "9"\n', 1)
    diff = writer.unified_diff(old, new, "m/x.yaml")
    assert diff.count("\n-") == 1 and diff.count("\n+") == 2  # +++ header and the one line


def test_command_offline_diff_write_and_current(cli, small_matrix, tmp_path):
    args = ["matrix", "refresh", "--offline", str(UPSTREAM), "--matrix-dir", str(small_matrix),
            "--cache-dir", str(tmp_path / "cache")]
    before = (small_matrix / "torch.yaml").read_text()
    first = cli(*args)
    assert first.returncode == 1, first.stderr
    assert first.stdout.startswith("--- a/matrices/torch.yaml\n+++ b/matrices/torch.yaml\n")
    assert '+    python: ">=3.9,<3.13"' in first.stdout
    assert "derived facts differ" in first.stderr.splitlines()[-1]
    assert (small_matrix / "torch.yaml").read_text() == before  # nothing written without --write
    written = cli(*args, "--write")
    assert written.returncode == 0 and "wrote" in written.stderr
    assert written.stdout == first.stdout  # deterministic: the same diff, then written
    current = cli(*args)
    assert current.returncode == 0 and current.stdout == "" and "current" in current.stderr
    assert load_matrix(small_matrix).torch_release("2.15.0").variants == {"13.2": "default"}


def test_command_moves_stack_pins_with_a_patch_release(cli, small_matrix, tmp_path):
    """PyPI's 2.14.1 replaces the matrix's 2.14.0: the stacks pinned to 2.14.0 must follow it
    (and the pypi-toolchain stack's cuda-toolkit pin 2.14.0 depended on), else no command can
    load the refreshed matrix. Only those scalars change in stacks.yaml."""
    shutil.copytree(small_matrix, tmp_path / "before")
    assert load_matrix(tmp_path / "before").torch_release("2.14.0")  # the fixture is a valid matrix
    stacks_before = (small_matrix / "stacks.yaml").read_text()
    args = ["matrix", "refresh", "--facts", "--offline", str(UPSTREAM), "--matrix-dir", str(small_matrix),
            "--cache-dir", str(tmp_path / "cache")]
    shown = cli(*args)
    assert shown.returncode == 1, shown.stderr
    assert "--- a/matrices/torch.yaml\n" in shown.stdout
    stacks_diff = shown.stdout[shown.stdout.index("--- a/matrices/stacks.yaml\n"):]
    assert [line for line in stacks_diff.splitlines() if line[:1] in "-+" and line[:3] not in ("---", "+++")] == [
        '-    torch: "2.14.0"  # the V100 row', '+    torch: "2.14.1"  # the V100 row',
        '-    torch: "2.14.0"', '+    torch: "2.14.1"',
        "-    torch: '2.14.0'", "+    torch: '2.14.1'",
        '-    cuda_toolkit: "13.0.2"  # 2.14.0\'s own cuda-toolkit pin in this fixture',
        '+    cuda_toolkit: "13.0.3"  # 2.14.0\'s own cuda-toolkit pin in this fixture']
    assert "  stack torch2.14-cu130-py3.11-pypi: cuda_toolkit 13.0.2 -> 13.0.3" in shown.stderr
    assert "4 stack pins in stacks.yaml follow torch 2.14.0 -> 2.14.1" in shown.stderr.splitlines()[-1]
    assert (small_matrix / "stacks.yaml").read_text() == stacks_before  # nothing written without --write

    written = cli(*args, "--write")
    assert written.returncode == 0, written.stderr
    assert str(small_matrix / "stacks.yaml") in written.stderr.splitlines()[-1]
    expected = (stacks_before.replace('torch: "2.14.0"', 'torch: "2.14.1"')
                .replace("torch: '2.14.0'", "torch: '2.14.1'")
                .replace('cuda_toolkit: "13.0.2"', 'cuda_toolkit: "13.0.3"'))
    assert expected != stacks_before
    assert (small_matrix / "stacks.yaml").read_text() == expected  # other rows and comments byte for byte
    matrix = load_matrix(small_matrix)
    assert {s.id: s.torch for s in matrix.stacks} == {
        "torch2.5-cu124-py3.10": "2.5.1", "torch2.14-cu126-py3.12": "2.14.1",
        "torch2.14-cu130-py3.12": "2.14.1", "torch2.14-cu130-py3.11-pypi": "2.14.1"}
    assert cli(*args).returncode == 0  # and then it is current


def test_stack_pins_move_only_with_a_replaced_release():
    old = {"releases": [{"torch": "2.3.1"}, {"torch": "2.7.1"},
                        {"torch": "2.14.0", "default_cuda": "13.0", "cuda_toolkit": "13.0.2"}]}
    new = {"releases": [{"torch": "2.3.1"}, {"torch": "2.7.1"},
                        {"torch": "2.14.1", "default_cuda": "13.0", "cuda_toolkit": "13.0.3"}]}
    text = """\
stacks:
  - {id: flow, torch: "2.14.0", cuda: "13.0", cuda_toolkit: "13.0.2"}
  - id: plain
    torch: 2.14.0
    cuda: "12.6"
    cuda_toolkit: "13.0.2"
  - id: own-toolkit
    cuda: "13.0"
    cuda_toolkit: "13.0.1"
    torch: "2.14.0"
  - id: typo
    torch: "2.14.7"  # not a release: left for the loader to report
  - id: current
    torch: "2.7.1"
  - id: untracked-minor
    torch: "2.3.1"
"""
    moved, moves = writer.move_stack_pins(text, old, new, Path("stacks.yaml"))
    assert moved == (text.replace('{id: flow, torch: "2.14.0", cuda: "13.0", cuda_toolkit: "13.0.2"}',
                                  '{id: flow, torch: "2.14.1", cuda: "13.0", cuda_toolkit: "13.0.3"}')
                     .replace("torch: 2.14.0\n", "torch: 2.14.1\n")
                     .replace('"13.0.1"\n    torch: "2.14.0"', '"13.0.1"\n    torch: "2.14.1"'))
    assert [str(m) for m in moves] == [
        "stack flow: torch 2.14.0 -> 2.14.1", "stack flow: cuda_toolkit 13.0.2 -> 13.0.3",
        "stack plain: torch 2.14.0 -> 2.14.1", "stack own-toolkit: torch 2.14.0 -> 2.14.1"]
    assert writer.move_stack_pins(text, old, old, Path("stacks.yaml")) == (text, [])
    with pytest.raises(EnvbuildError, match="has no `stacks` list"):
        writer.move_stack_pins("stack: []\n", old, new, Path("stacks.yaml"))


def test_command_failure_writes_nothing(cli, upstream_copy, small_matrix):
    lib = _wheel_dir(upstream_copy, "2.15.0") / torch_facts.ARCH_MEMBER
    lib.write_bytes(b"\0nothing here\0")
    before = {p.name: p.read_bytes() for p in small_matrix.iterdir()}
    r = cli("matrix", "refresh", "--write", "--offline", str(upstream_copy), "--matrix-dir", str(small_matrix))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "torch 2.15.0" in r.stderr and "arch-flags string" in r.stderr
    assert {p.name: p.read_bytes() for p in small_matrix.iterdir()} == before


def test_command_bad_fixture_dir(cli, tmp_path):
    r = cli("matrix", "refresh", "--offline", str(tmp_path), "--matrix-dir", str(ROOT / "matrices"))
    assert r.returncode == 2 and "not a fixture directory" in r.stderr


def test_refresh_workflow_is_current_and_opens_a_pull_request():
    from envbuild.supply.ci import REFRESH_WORKFLOW, render_refresh_workflow

    text = (ROOT / REFRESH_WORKFLOW).read_text()
    assert text == render_refresh_workflow(), "re-render .github/workflows/matrix-refresh.yml"
    workflow = yaml.safe_load(text)
    assert set(workflow[True]) == {"schedule", "workflow_dispatch"}  # YAML 1.1 reads `on` as True
    runs = [s.get("run", "") for s in workflow["jobs"]["refresh"]["steps"]]
    order = [next(i for i, r in enumerate(runs) if needle in r)
             for needle in ("envbuild matrix refresh --write", 'pytest -m "not docker"', "gh pr create")]
    assert order == sorted(order)


# ---------------------------------------------------------------- range requests


class _RangeServer(http.server.BaseHTTPRequestHandler):
    """A local stand-in for files.pythonhosted.org (the tests must run offline): serves
    `files` with HTTP Range support and counts the bytes it sent."""

    files: dict[str, bytes] = {}
    sent = 0
    honour_range = True

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start, end = 0, len(body) - 1
        header = self.headers.get("Range")
        if header and self.honour_range:
            start, end = (int(x) for x in header.removeprefix("bytes=").split("-"))
            self.send_response(206)
        else:
            self.send_response(200)
        chunk = body[start:end + 1]
        type(self).sent += len(chunk)
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        self.wfile.write(chunk)

    def log_message(self, *args):
        pass


@pytest.fixture
def range_server():
    rng = random.Random(0)
    blob = rng.randbytes(1 << 20) + b"sm_80 sm_90 compute_90\0" + rng.randbytes(7 << 20)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                                                  "Requires-Dist: triton==3.1.0; platform_system == \"Linux\"\n\nbody\n")
        z.writestr("torch/lib/libtorch_python.so", blob)
    wheel = buffer.getvalue()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeServer)
    base = f"http://127.0.0.1:{server.server_port}"
    name = "demo-1.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    page = {"meta": {"api-version": "1.1"}, "name": "demo",
            "files": [{"filename": name, "url": f"{base}/{name}", "hashes": {"sha256": hashlib.sha256(wheel).hexdigest()},
                       "requires-python": ">=3.9", "size": len(wheel), "yanked": False}]}
    _RangeServer.files = {f"/{name}": wheel, "/simple/demo/": json.dumps(page).encode()}
    _RangeServer.sent, _RangeServer.honour_range = 0, True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield base, len(wheel)
    server.shutdown()


def test_range_reads_stop_early_and_cache(range_server, tmp_path):
    base, size = range_server
    pypi = PyPI(tmp_path / "cache", simple_url=base + "/simple/{project}/")
    (dist,) = pypi.files("demo")
    assert dist.size == size
    assert "Requires-Dist: triton==3.1.0" in pypi.member(dist, "demo-1.0.dist-info/METADATA").decode()
    found = pypi.search_member(dist, torch_facts.ARCH_MEMBER, torch_facts.ARCH_PATTERN)
    assert found == b"sm_80 sm_90 compute_90"
    assert _RangeServer.sent < size * 0.3  # stopped inflating after the match
    sent = _RangeServer.sent
    again = PyPI(tmp_path / "cache", simple_url=base + "/simple/{project}/")
    (dist,) = again.files("demo")
    assert again.search_member(dist, torch_facts.ARCH_MEMBER, torch_facts.ARCH_PATTERN) == found
    assert again.member(dist, "demo-1.0.dist-info/METADATA")
    assert _RangeServer.sent - sent < 2000  # only the index page: the artifact reads came from the cache


def test_server_ignoring_ranges_is_refused(range_server, tmp_path):
    base, _ = range_server
    _RangeServer.honour_range = False
    pypi = PyPI(tmp_path / "cache", simple_url=base + "/simple/{project}/")
    (dist,) = pypi.files("demo")
    with pytest.raises(EnvbuildError, match="ignored a range request"):
        pypi.members(dist)
