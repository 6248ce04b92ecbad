"""The matrix data: complete, sourced, and a malformed file fails with file + field path."""

import re
import shutil

import pytest

from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.matrix import load_matrix

from conftest import FIXTURE_MATRIX

# Every GPU envbuild targets has a profile, with its compute capability as NVIDIA lists it
# (https://developer.nvidia.com/cuda-gpus and https://developer.nvidia.com/cuda-legacy-gpus).
EXPECTED_GPUS = {"p100": "6.0", "v100": "7.0", "t4": "7.5", "a10": "8.6", "a100": "8.0", "a800": "8.0", "l4": "8.9",
                     "l40": "8.9", "l40s": "8.9", "l20": "8.9", "rtx3090": "8.6", "rtx4090": "8.9",
                     "h100": "9.0", "h200": "9.0", "gh200": "9.0", "h800": "9.0", "h20": "9.0",
                     "b200": "10.0", "gb200": "10.0", "b300": "10.3", "gb300": "10.3", "rtx5090": "12.0",
                     "gb10": "12.1", "a30": "8.0", "a40": "8.6", "rtx-a6000": "8.6", "rtx6000-ada": "8.9",
                     "rtx-pro-6000": "12.0", "rtx-pro-5000": "12.0", "rtx-pro-4500": "12.0", "rtx5000-ada": "8.9",
                     "rtx-a5000": "8.6", "rtx-a4000": "8.6", "dgx-station": "10.3"}
# Memory per variant (GB), as NVIDIA's datasheets and product pages state it.
EXPECTED_MEMORY = {"a30": [24], "a40": [48], "rtx-a6000": [48], "rtx6000-ada": [48], "rtx-pro-6000": [96],
                   "h100": [80, 94], "h20": [96, 141], "b200": [180], "rtx5090": [32], "gb10": [128],
                   "rtx-pro-5000": [48, 72], "rtx-pro-4500": [32], "rtx5000-ada": [32], "rtx-a5000": [24], "rtx-a4000": [16]}


def test_every_target_gpu_has_its_compute_capability(production_matrix):
    assert {p.name: p.cc for p in production_matrix.gpus} == EXPECTED_GPUS


def test_every_profile_records_its_memory(production_matrix):
    memory = {p.name: p.memory_gb for p in production_matrix.gpus}
    assert all(memory.values()) and all(gb > 0 for sizes in memory.values() for gb in sizes)
    assert {name: memory[name] for name in EXPECTED_MEMORY} == EXPECTED_MEMORY


@pytest.mark.parametrize("printed", ["NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA RTX 6000 Ada Generation",
                                     "NVIDIA RTX A6000", "NVIDIA A40", "NVIDIA A30"])
def test_the_new_profiles_are_found_by_the_name_nvidia_smi_prints(production_matrix, printed):
    assert production_matrix.gpu(printed).name in {"rtx-pro-6000", "rtx6000-ada", "rtx-a6000", "a40", "a30"}


@pytest.mark.parametrize("printed, name", [
    ("NVIDIA RTX PRO 5000 Blackwell", "rtx-pro-5000"), ("NVIDIA RTX PRO 4500 Blackwell", "rtx-pro-4500"),
    ("NVIDIA RTX 5000 Ada Generation", "rtx5000-ada"), ("NVIDIA RTX A5000", "rtx-a5000"), ("NVIDIA RTX A4000", "rtx-a4000"),
    ("NVIDIA GeForce RTX 4090 D", "rtx4090"), ("NVIDIA GeForce RTX 5090 D", "rtx5090"), ("4090d", "rtx4090"),
    ("5090-d", "rtx5090"), ("gb300-dgx-station", "dgx-station")])
def test_round_three_profiles_and_aliases_are_found_by_what_nvidia_smi_prints(production_matrix, printed, name):
    assert production_matrix.gpu(printed).name == name


@pytest.mark.parametrize("name, why", [
    ("NVIDIA Jetson AGX Thor", r"Jetson Thor .* out of scope: .*L4T"), ("jetson-t5000", r"Jetson Thor"), ("thor", r"sm_110")])
def test_jetson_thor_is_refused_by_name_with_the_reason(production_matrix, name, why):
    with pytest.raises(EnvbuildError, match=why) as e:
        production_matrix.gpu(name)
    assert "unknown GPU" not in e.value.message and "did you mean" not in e.value.message
    assert "(source: https://" in e.value.message


@pytest.mark.parametrize("gpu, cuda, floor", [
    ("b200", "12.8", "570.133.20"), ("gb200", "12.8", "570.133.20"), ("rtx-pro-6000", "12.8", "575.51.03"),
    ("rtx-pro-5000", "12.8", "575.57.08"), ("rtx-pro-4500", "12.8", "575.64"), ("b300", "12.9", "580.82.07"),
    ("b300", "13.0", "580.82.07"), ("dgx-station", "13.0", "595.58.03"),
    # GPUs NVIDIA gives no floor of their own: the generation's, or the stack's where larger
    ("rtx5090", "12.8", "570.26"), ("gb300", "12.9", "570.26"), ("b200", "13.0", "580.65.06"), ("h100", "12.8", "525.60.13")])
def test_blackwell_driver_floors_are_per_gpu(production_matrix, gpu, cuda, floor):
    """NVIDIA's MIG user guide (Deployment Considerations) lists the oldest driver per Blackwell GPU."""
    got = production_matrix.driver_floor(cuda, production_matrix.gpu(gpu))
    assert got.min_driver == floor
    assert "mig-user-guide" in got.source or floor in ("570.26", "580.65.06", "525.60.13")


def test_a_per_gpu_driver_floor_for_no_profile_is_an_inconsistent_matrix(tmp_path):
    import shutil

    from conftest import ROOT

    d = tmp_path / "m"
    shutil.copytree(ROOT / "matrices", d)
    path = d / "cuda.yaml"
    path.write_text(path.read_text().replace("  b300: {min_driver", "  b3000: {min_driver"))
    with pytest.raises(EnvbuildError, match="gpu_driver_floors names 'b3000', which is not a gpus.yaml profile"):
        load_matrix(d)


def test_round_three_facts_at_their_source(production_matrix):
    """The corrections of issue 34's audit, each where the fact lives."""
    m = production_matrix
    assert m.bases.families["ubuntu24.04"].gcc == "13.3" and "noble-updates" in m.bases.families["ubuntu24.04"].source
    ndv5 = m.fabric("azure-ndv5")
    assert "NCCL_IB_PCI_RELAXED_ORDERING" not in {e.name for e in ndv5.env}  # 1 is NCCL's default 2
    assert any("NCCL_IB_PCI_RELAXED_ORDERING" in n and "net_ib/init.cc" in n for n in ndv5.notes)
    [h20_p2p] = [e for e in m.gpu("h20").env if e.name == "NCCL_P2P_DISABLE"]
    assert h20_p2p.value == "1" and "overturn" in h20_p2p.reason and "envbuild smoke IMAGE --gpus all" in h20_p2p.reason
    pro = " ".join(m.gpu("rtx-pro-6000").notes)
    assert "NVIDIA/nccl#1999" in pro and "envbuild smoke IMAGE --gpus all" in pro


@pytest.mark.parametrize("name", ["mi300x", "MI250X", "AMD Instinct MI300X", "instinct-mi355x", "Radeon RX 7900 XTX"])
def test_amd_gpus_are_out_of_scope_not_a_typo(production_matrix, name):
    with pytest.raises(EnvbuildError, match="AMD GPUs are out of scope: .*ROCm") as e:
        production_matrix.gpu(name)
    assert "did you mean" not in e.value.message


@pytest.mark.parametrize("spelling", ["h20", "H20", "nvidia-h20", "NVIDIA-H20", "h20-96gb", "nvidia_h20"])
def test_gpu_aliases(matrix, spelling):
    assert matrix.gpu(spelling).name == "h20"


def test_h20_disables_nccl_p2p_with_reason_source_and_cost(production_matrix):
    env = {e.name: e for e in production_matrix.gpu("h20").env}
    assert env["NCCL_P2P_DISABLE"].value == "1"
    assert "field report 5" in env["NCCL_P2P_DISABLE"].source
    assert "NVLink" in env["NCCL_P2P_DISABLE"].cost  # what it takes away is stated
    assert "NCCL_NVLS_ENABLE" not in env  # one bare comment is not evidence


def test_every_env_default_has_reason_source_and_cost(production_matrix):
    for e in [*production_matrix.gpus_file.common_env, *(e for p in production_matrix.gpus for e in p.env)]:
        assert len(e.reason) > 20 and e.source and len(e.cost) > 10, e.name


def test_what_is_not_baked_says_why(production_matrix):
    left_out = {(d.name, tuple(d.gpus)) for d in production_matrix.gpus_file.not_baked}
    assert ("TORCH_NCCL_ASYNC_ERROR_HANDLING", ("all",)) in left_out
    assert ("NCCL_NVLS_ENABLE", ("h20",)) in left_out and ("NCCL_P2P_DISABLE", ("l20",)) in left_out
    baked = {(e.name, p.name) for p in production_matrix.gpus for e in p.env}
    for d in production_matrix.gpus_file.not_baked:
        assert all((d.name, g) not in baked for g in d.gpus), d.name


def test_every_cuda_of_every_stack_has_a_driver_floor(production_matrix):
    for s in production_matrix.stacks:
        assert production_matrix.driver_floor(s.cuda).min_driver


def test_stacks_cover_the_required_ranges(production_matrix):
    stacks = production_matrix.stacks
    torches = {".".join(s.torch.split(".")[:2]) for s in stacks}
    assert {"2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15"} <= torches
    assert {"12.1", "12.4", "12.6", "12.8", "13.0", "13.2"} <= {s.cuda for s in stacks}
    assert {"3.10", "3.11", "3.12"} <= {s.python for s in stacks}
    ds = {".".join(s.deepspeed.split(".")[:2]) for s in stacks}
    assert {"0.15", "0.19"} <= ds and "0.19.8" in {s.deepspeed for s in stacks}


def test_every_torch_minor_on_record_has_a_stack(production_matrix):
    """A torch row without a stack is a release users cannot get (the stale-matrix defect)."""
    used = {s.torch for s in production_matrix.stacks}
    assert [r.torch for r in production_matrix.torch_file.releases if r.torch not in used] == []


def test_the_newest_pypi_toolchain_stack_uses_the_newest_torch(production_matrix):
    """CI builds the PyPI-toolchain stack for real: it must be the newest torch, on plain Debian."""
    newest = max(production_matrix.torch_file.releases, key=lambda r: tuple(map(int, r.torch.split("."))))
    from envbuild.supply.ci import real_build_stack
    ci = real_build_stack(production_matrix)
    assert ci.torch == newest.torch and ci.cuda_toolkit == newest.cuda_toolkit
    assert not ci.base_images.builder.startswith("nvidia/")


def test_every_stack_pins_base_images_by_full_tag(production_matrix):
    for s in production_matrix.stacks:
        for ref in (s.base_images.builder, s.base_images.runtime):
            assert re.match(r"^[\w./-]+:[\w.-]+$", ref), ref
            if ref.startswith("nvidia/cuda:"):
                assert re.match(r"^nvidia/cuda:\d+\.\d+\.\d+-(base|devel)-ubuntu\d\d\.04$", ref), ref


def _break(matrix_copy, name, old, new):
    p = matrix_copy / name
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("name, old, new, expected", [
    ("stacks.yaml", 'torch: "2.5.1"', 'torch: "two.five"', r"stacks\[1\] \(torch2.5-cu124-py3.10\)\.torch: expected a version"),
    ("stacks.yaml", "    toolchain: pypi\n", "    toolchain: pypi\n    colour: blue\n", r"stacks\[9\].*colour: Extra inputs are not permitted"),
    ("gpus.yaml", 'cc: "9.0", memory_gb: [96, 141], cc_inferred: true, generation: Hopper, interconnect: "HGX', 'cc: "nine", memory_gb: [96, 141], cc_inferred: true, generation: Hopper, interconnect: "HGX', r"profiles\[19\] \(h20\)\.cc: expected a compute capability"),
    ("torch.yaml", 'python: ">=3.9,<3.13"', 'python: "~=>3.9"', r"releases\[1\]\.python: expected a PEP 440 specifier"),
    ("cuda.yaml", 'min_driver: "580.65.06"', 'min_driver: "r580"', r"driver_floors\[2\]\.min_driver: expected an NVIDIA driver version"),
    ("deepspeed.yaml", "kind: cpu, since", "kind: gpu, since", r"ops\.cpu_adam\.kind: Input should be 'cpu' or 'cuda'"),
    ("bases.yaml", "  debian12:\n", "  debian12:\n  - oops\n", r"bases.yaml is not valid YAML at line"),
])
def test_malformed_matrix_names_file_and_field(matrix_copy, name, old, new, expected):
    _break(matrix_copy, name, old, new)
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert name in e.value.message
    assert re.search(expected, e.value.message), e.value.message


def test_a_stack_that_breaks_a_rule_is_a_matrix_error(matrix_copy):
    # torch 2.4 has no wheels for Python 3.13: the rule, not the schema, catches it.
    _break(matrix_copy, "stacks.yaml", 'python: "3.10"\n    cuda: "12.1"', 'python: "3.13"\n    cuda: "12.1"')
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "torch-python" in e.value.message and "torch2.4-cu121-py3.10" in e.value.message


def test_a_deepspeed_that_needs_a_gpu_to_install_is_rejected(matrix_copy):
    """0.16.4-0.17.4 import torch.cuda.get_device_capability() in setup.py: CI has no GPU."""
    _break(matrix_copy, "stacks.yaml", 'deepspeed: "0.16.3"', 'deepspeed: "0.16.9"')
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "deepspeed-no-gpu" in e.value.message and "torch2.5-cu124-py3.10" in e.value.message


def test_unknown_reference_is_a_matrix_error(matrix_copy):
    _break(matrix_copy, "stacks.yaml", 'deepspeed: "0.15.4"', 'deepspeed: "0.15.9"')
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "0.15.9 is not a release in deepspeed.yaml" in e.value.message


# A source users can follow: a URL, an upstream repository's issue or pull request (owner/repo#N,
# repo#N, PR #N), a file of a named release (a wheel, an sdist, a repository file), or the
# project's own file (docs/, matrices/). "field report N" is defined in docs/matrix.md, so it
# must say so; no internal document of ours is ever named.
PUBLIC_SOURCE = re.compile(
    r"https?://|\b[\w.-]+\.(?:com|org|io|dev|net|ai)/|[\w.-]+/[\w.-]+#\d+|[\w.-]+#\d+|\bPR #\d+|\.whl\b|\.tar\.gz\b"
    r"|\bsdists?\b|\bwheels?\b|\bdocs/[\w./-]+|\bmatrices/[\w./-]+|\benvbuild\b|\bMETADATA\b|\bsetup\.py\b"
    r"|release notes|\b[\w.-]+/[\w*./-]*\.(?:py|sh|h|hpp|cc|cpp|cu|txt|md)\b|^\{driver_source\}$")


def _sources(node, where=""):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("source", "sources") and isinstance(value, str):
                yield f"{where}.{key}", value
            elif key == "sources" and isinstance(value, dict):
                yield from ((f"{where}.sources.{k}", v) for k, v in value.items() if isinstance(v, str))
            else:
                yield from _sources(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _sources(value, f"{where}[{i}]")


@pytest.mark.parametrize("directory", ["matrices", "tests/fixtures/matrix"])
def test_every_source_is_public_or_the_projects_own(directory):
    import yaml

    from conftest import ROOT

    bad = [(f"{path.name}{where}", text[:100]) for path in sorted((ROOT / directory).glob("*.yaml"))
           for where, text in _sources(yaml.safe_load(path.read_text()))
           if not PUBLIC_SOURCE.search(text) or ("field report" in text and "docs/matrix.md" not in text)]
    assert bad == []


# Markdown files named outside a URL that are not this repository's: each an upstream file named
# with its repository or release beside it, or one the generated workflow writes itself.
UPSTREAM_MD = {"RELEASE.md",      # pytorch/pytorch's, in torch.yaml's arch_lists source
               "PERFORMANCE.md",  # NVIDIA/nccl-tests', in the image's multinode.py
               "spec.md",         # opencontainers/distribution-spec's, in registry.py
               "RELEASENOTES.md", # aws-ofi-nccl v1.21.1's, in fabrics.yaml
               "pr-body.md",      # written by the matrix-refresh workflow
               "doc/support-policy.md"}  # gitlab.com/nvidia/container-images/cuda's, in docs/reproducing.md


def test_every_document_named_is_one_users_have():
    """A Markdown file the matrix, a template, a message or a doc names is this repository's (or
    an upstream file named with its repository): never a document users do not have."""
    from conftest import ROOT

    ours = {p.name for p in ROOT.rglob("*.md") if ".git" not in p.parts} | {
        p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md") if ".git" not in p.parts}
    unknown = sorted({(str(p.relative_to(ROOT)), name)
                      for top in ("matrices", "templates", "envbuild", "docs") for p in (ROOT / top).rglob("*")
                      if p.is_file() and p.suffix in (".yaml", ".py", ".j2", ".sh", ".md", ".txt")
                      for name in re.findall(r"(?<![\w/.:-])[\w./-]+\.md\b",
                                             re.sub(r"(?:https?://|\b[\w.-]+\.(?:com|org|io)/)\S+", "",
                                                    p.read_text(errors="replace")))
                      if name not in ours and name.lstrip("./") not in ours and name not in UPSTREAM_MD})
    assert unknown == []


def test_the_source_rule_refuses_what_users_cannot_follow():
    assert not PUBLIC_SOURCE.search("field report 5; the upstream issue link is [U]")
    assert not PUBLIC_SOURCE.search("NCCL docs")
    assert PUBLIC_SOURCE.search("https://docs.nvidia.com/deploy/cuda-compatibility/") and PUBLIC_SOURCE.search("nccl#451")


def test_a_matrix_directory_written_again_under_the_same_name_is_read_again(tmp_path):
    """pytest gives a passing test's tmp_path name to the next test, and a lab edits its matrix
    between two calls of one process: a cache keyed by the path alone served the matrix the
    directory held before (two CI failures: another test's extensions floor, a hostile stacks.yaml
    that rendered)."""
    d = tmp_path / "matrices"
    shutil.copytree(FIXTURE_MATRIX, d)
    first = load_matrix(d)
    assert load_matrix(d) is first  # unchanged files: parsed once
    shutil.rmtree(d)
    shutil.copytree(FIXTURE_MATRIX, d)
    stacks = d / "stacks.yaml"
    stacks.write_text(stacks.read_text().replace("stacks:", "stacks: [", 1))
    with pytest.raises(EnvbuildError, match=str(stacks)):
        load_matrix(d)


def test_what_ci_publishes_changes_no_matrix_digest_an_image_records(tmp_path):
    """A lab choosing its variants (publish.yaml), accepting an advisory for a while
    (vulnerabilities.yaml) or doctor learning a signature changes no image, so `rebuild` of an image made before must still find
    the matrix it was made from; a stack's file does change it."""
    import shutil

    from conftest import ROOT
    from envbuild.knowledge.matrix import load_matrix

    d = tmp_path / "m"
    shutil.copytree(ROOT / "matrices", d)
    before = load_matrix(d).sha256
    (d / "publish.yaml").write_text((d / "publish.yaml").read_text() + "# a lab's edit\n")
    (d / "vulnerabilities.yaml").write_text("allow: []\n")
    assert load_matrix(d).sha256 == before
    # doctor's knowledge: a new signature or a refreshed catalogue re-renders no image
    (d / "known_issues.yaml").write_text((d / "known_issues.yaml").read_text() + "# a new signature\n")
    (d / "catalogues" / "nccl.yaml").write_text((d / "catalogues" / "nccl.yaml").read_text() + "# refreshed\n")
    (d / "catalogues" / "new.yaml").write_text("component: new\n")
    assert load_matrix(d).sha256 == before
    (d / "locks" / "new.txt").write_text("# a lock\n")  # a folder not on the list still counts
    assert load_matrix(d).sha256 != before
    (d / "locks" / "new.txt").unlink()
    (d / "stacks.yaml").write_text((d / "stacks.yaml").read_text() + "# an edit\n")
    assert load_matrix(d).sha256 != before


def test_the_stack_listing_says_what_is_pinned_and_counts_it(tmp_path):
    """No shipped stack has an OS lock, some have no Python lock: the listing says so in numbers
    rather than read as if everything were pinned; a lock removed or an OS lock added moves them."""
    import shutil

    from conftest import ROOT, run_here

    d = tmp_path / "m"
    shutil.copytree(ROOT / "matrices", d)
    said = " ".join(run_here("matrix", "--matrix-dir", str(d)).stdout.split())
    assert "OS packages: no stack has an OS lock yet" in said and "base images by digest: 0 of" in said
    before = int(said.split("Python packages by a hash lock for ")[1].split(" of ")[0])
    (d / "locks" / "torch2.10-cu128-py3.12.x86_64.txt").unlink()
    (d / "locks" / "os").mkdir()
    (d / "locks" / "os" / "torch2.11-cu130-py3.12.x86_64.txt").write_text("# envbuild OS lock\n")
    said = " ".join(run_here("matrix", "--matrix-dir", str(d)).stdout.split())
    assert f"Python packages by a hash lock for {before - 1} of" in said and "torch2.10-cu128-py3.12" in said
    assert "OS packages by an OS lock for 1 of" in said


def test_a_default_naming_an_undeclared_node_condition_is_refused_at_load(matrix_copy):
    """fabrics.yaml's node_conditions declares what a `node:` may name; a misspelt or missing
    name stops the load with one paragraph naming the file, the entry and the nearest name."""
    from conftest import run_here

    gpus = matrix_copy / "gpus.yaml"
    gpus.write_text(gpus.read_text().replace('driver_below: "550.40.07", infiniband: absent',
                                             'driver_below: "550.40.07", infinband: absent', 1))
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert (f"{matrix_copy / 'gpus.yaml'}: rtx4090.env[1] (NCCL_IB_DISABLE): node names 'infinband', a node "
            f"condition {matrix_copy / 'fabrics.yaml'} does not declare under node_conditions; nearest valid: "
            f"infiniband (declared: infiniband, efa, and the built-in driver_below)") in e.value.message
    r = run_here("render", "--gpu", "h20", "--matrix-dir", str(matrix_copy), "--print-tag")
    assert r.returncode == 2 and r.stdout == "" and "nearest valid: infiniband" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_matrix_older_than_node_conditions_is_told_where_the_table_comes_from(matrix_copy):
    fabrics = matrix_copy / "fabrics.yaml"
    text = fabrics.read_text()
    fabrics.write_text(text[:text.index("\nnode_conditions:\n")] + text[text.index("\nfabrics:\n"):])
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "node names 'infiniband'" in e.value.message
    assert "it declares none, as a matrix older than the table: copy node_conditions from" in e.value.message


@pytest.mark.parametrize("table, said", [
    ("  RoCE:\n    label: RoCE\n    devices: any\n    means: m\n    source: s\n",
     "at node_conditions: expected a node condition name of lower-case letters"),
    ("  driver_below:\n    label: D\n    devices: any\n    means: m\n    source: s\n",
     "'driver_below' is a built-in condition"),
    ("  roce:\n    label: RoCE\n    devices: all\n    means: m\n    source: s\n",
     "at node_conditions.roce.devices.any: Input should be 'any'"),
    ("  roce:\n    label: RoCE\n    devices: {}\n    means: m\n    source: s\n",
     "names neither drivers nor link_layers"),
    ("  roce:\n    label: RoCE\n    devices: {link_layers: [ethernet]}\n    means: m\n    source: s\n",
     "at node_conditions.roce.devices.match.link_layers[0]: Input should be 'InfiniBand', 'Ethernet' or 'Unknown'"),
    ("  roce:\n    label: RoCE\n    devices: {drivers: [bnxt_en]}\n    means: m\n",
     "at node_conditions.roce.source: Field required"),
])
def test_node_conditions_are_checked_by_their_grammar(matrix_copy, table, said):
    fabrics = matrix_copy / "fabrics.yaml"
    fabrics.write_text(fabrics.read_text().replace("\nnode_conditions:\n", "\nnode_conditions:\n" + table, 1))
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert said in e.value.message and "fabrics.yaml is malformed" in e.value.message


def test_every_node_condition_the_matrices_name_is_declared_with_its_source(production_matrix, matrix):
    for m in (production_matrix, matrix):
        assert set(m.fabrics_file.node_conditions) == {"infiniband", "efa"}
        named = {n for e in [*m.gpus_file.common_env, *(e for p in m.gpus for e in p.env),
                             *(e for f in m.fabrics for e in f.env)] if e.node for n in e.node.conditions}
        assert named == {"infiniband", "efa"}
        assert all(c.source and c.means for c in m.fabrics_file.node_conditions.values())


def test_the_digest_is_read_again_when_a_file_changes_under_the_same_matrix(tmp_path, monkeypatch):
    """Matrix.sha256 keeps a digest while no file's stat changes (a publish plan resolves every
    variant), and only for files older than files.RACY_NS; a lock rewritten in place to the same size,
    replaced, added or removed gives the digest of the files as they are now, as a fresh read does."""
    import shutil

    from conftest import FIXTURE_MATRIX
    from envbuild.base import files
    from envbuild.knowledge.matrix import core, load_matrix

    d = tmp_path / "m"
    shutil.copytree(FIXTURE_MATRIX, d)
    m = load_matrix(d)
    lock = next((d / "locks").glob("*.txt"))

    def fresh() -> str:
        core._DIGESTS.clear()
        return m.sha256

    def kept() -> bool:
        return any(key[0][0] == str(d.resolve()) for key in core._DIGESTS._kept)

    first = m.sha256
    assert not kept()  # just copied: too recent to keep
    monkeypatch.setattr(files, "RACY_NS", -10 ** 12)  # as if every file were old
    assert m.sha256 == first and kept()
    text = lock.read_text()
    lock.write_text(text.replace("==", "=~", 1))  # the same size, in place
    assert m.sha256 == fresh() != first
    replaced = lock.with_name("new.tmp")
    replaced.write_text(text)
    replaced.replace(lock)
    assert m.sha256 == fresh() == first
    (d / "locks" / "extra.txt").write_text("# a lock\n")
    assert m.sha256 == fresh() != first
    (d / "locks" / "extra.txt").unlink()
    assert m.sha256 == first
