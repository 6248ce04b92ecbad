"""`--nccl VERSION`: another NCCL release in place of the one torch pins, hash-locked.

Against the fixture matrix plus an nccl.yaml derived, as `envbuild matrix refresh` derives it,
from real PyPI index pages of nvidia-nccl-cu12 and -cu13 (tests/fixtures/upstream/index, with
their SOURCE.txt): which releases a stack accepts, the refusals (exit 2, one paragraph, nothing
written), the image's lock, tag, manifest and Dockerfile, and that nothing changes without
--nccl. The real build is tests/docker/test_docker_e2e.py's opt-in test_nccl_override_builds_and_loads.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import yaml
from packaging.version import Version

from conftest import FIXTURE_MATRIX, ROOT, tree
from test_hostile_input import envbuild, refused

from envbuild.base.errors import EnvbuildError
from envbuild.knowledge import rules
from envbuild.image import checks
from envbuild.knowledge.lock import parse_lock
from envbuild.knowledge.matrix import NcclRelease, NcclWheel, load_matrix
from envbuild.plan import stack_plan
from envbuild.refresh import nccl_facts, torch_facts
from envbuild.refresh.cli import refresh
from envbuild.refresh.fixtures import FixtureIndex
from envbuild.render.builddir import render_files
from envbuild.resolve.resolver import Request, resolve

UPSTREAM = ROOT / "tests" / "fixtures" / "upstream"
H20_STACK = "torch2.11-cu130-py3.12"  # the fixture matrix's default for h20: torch 2.11.0 pins nvidia-nccl-cu13 2.28.9


def fixture_nccl_yaml(matrix_dir) -> str:
    """nccl.yaml for a matrix's torch releases, derived from the saved PyPI pages (the family
    each torch pins is NVIDIA's name for its CUDA major, as the real wheels' Requires-Dist say)."""
    torch = yaml.safe_load((matrix_dir / "torch.yaml").read_text())["releases"]  # not load_matrix: it caches
    facts = [torch_facts.TorchFacts(fields={"torch": r["torch"], "nccl": r["nccl"]},
                                    nccl_package=f"nvidia-nccl-cu{r['default_cuda'].split('.')[0]}") for r in torch]
    return nccl_facts.render(nccl_facts.derive(FixtureIndex(UPSTREAM), facts))


@pytest.fixture(scope="module")
def nccl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nccl") / "matrices"
    shutil.copytree(FIXTURE_MATRIX, d)
    (d / "nccl.yaml").write_text(fixture_nccl_yaml(d))
    return d


@pytest.fixture(scope="module")
def m(nccl_dir):
    return load_matrix(nccl_dir)


def invoke(*args, matrix_dir):
    """`envbuild ARGS` in this process through the entry point (exit codes, one-paragraph errors)."""
    return envbuild(*args, "--matrix-dir", str(matrix_dir))


# ---------------------------------------------------------------- the data


def test_the_derived_file_lists_each_family_from_its_oldest_pin_with_real_hashes(m):
    families = {p.package: p for p in m.nccl_file.packages}
    assert set(families) == {"nvidia-nccl-cu12", "nvidia-nccl-cu13"}
    cu13 = families["nvidia-nccl-cu13"]
    assert "2.11.0" in cu13.torch and "2.5.1" in families["nvidia-nccl-cu12"].torch
    assert [r.version for r in cu13.releases] == ["2.28.9", "2.30.7", "2.31.2", "2.32.3"]  # 2.28.3 is older than every pin
    newest = cu13.releases[-1]
    assert newest.source == "https://pypi.org/project/nvidia-nccl-cu13/2.32.3/"
    page = json.loads((UPSTREAM / "index" / "nvidia-nccl-cu13.json").read_text())
    on_pypi = {f["filename"]: f["hashes"]["sha256"] for f in page["files"]}
    assert {w.file: w.sha256 for w in newest.wheels} == {f: h for f, h in on_pypi.items() if "-2.32.3-" in f}
    assert sorted(newest.wheels[0].platforms() + newest.wheels[1].platforms()) == [("aarch64", (2, 27)),
                                                                                  ("x86_64", (2, 27))]


def test_refresh_keeps_an_nccl_yaml_current_and_names_what_changed(tmp_path):
    d = tmp_path / "matrices"
    shutil.copytree(ROOT / "tests" / "fixtures" / "refresh" / "matrix", d)
    stale = fixture_nccl_yaml(d).replace('      - version: "2.31.2"', '      - version: "2.31.1"')
    (d / "nccl.yaml").write_text(stale)
    changes, facts, _ = refresh(FixtureIndex(UPSTREAM), d)
    change = next(c for c in changes if c.path.name == "nccl.yaml")
    assert change.changed and '+      - version: "2.31.2"' in change.diff("nccl.yaml")
    assert "nccl.yaml: nvidia-nccl-cu13 2.31.1 removed" in facts and "nccl.yaml: nvidia-nccl-cu13 2.31.2 added" in facts
    # the torch releases the refresh tracks decide the families: the pins torch's METADATA names
    data = nccl_facts.parse(change.new, "nccl.yaml")
    assert {p["package"]: p["torch"] for p in data["packages"]} == {
        "nvidia-nccl-cu12": ["2.5.1", "2.7.1"], "nvidia-nccl-cu13": ["2.14.1", "2.15.0"]}


def test_refresh_writes_no_nccl_yaml_where_the_matrix_has_none(tmp_path):
    d = tmp_path / "matrices"
    shutil.copytree(ROOT / "tests" / "fixtures" / "refresh" / "matrix", d)
    changes, _, _ = refresh(FixtureIndex(UPSTREAM), d)
    assert "nccl.yaml" not in {c.path.name for c in changes}


def test_the_shipped_nccl_yaml_covers_every_torch_release_of_the_matrix(production_matrix):
    pinned = {t for p in production_matrix.nccl_file.packages for t in p.torch}
    assert pinned == {r.torch for r in production_matrix.torch_file.releases}
    for p in production_matrix.nccl_file.packages:
        for t in p.torch:
            assert any(r.version == production_matrix.torch_release(t).nccl for r in p.releases), (p.package, t)


# ---------------------------------------------------------------- accepted and refused


def test_a_newer_release_replaces_torch_s_pin_in_lock_tag_manifest_and_dockerfile(m):
    r = resolve(m, Request(gpu="h20", nccl="2.31.2"))
    assert r.stack.id == H20_STACK and r.nccl == "2.31.2"
    assert r.tag.endswith("-h20-nccl2.31.2")
    o = r.nccl_override
    assert (o.package, o.version, o.replaced) == ("nvidia-nccl-cu13", "2.31.2", "2.28.9")
    assert [f for f, _ in o.wheels] == ["nvidia_nccl_cu13-2.31.2-py3-none-manylinux_2_18_x86_64.whl"]  # x86_64 only
    files = render_files(r)
    venv = files["envbuild/lock/venv.txt"].decode()
    assert "nvidia-nccl-cu13==2.31.2 \\\n    --hash=sha256:" + o.wheels[0][1] in venv
    assert "\nnvidia-nccl-cu13==2.28.9" not in "\n" + venv  # torch's pinned wheel is not installed beside it
    image_lock = parse_lock(files["envbuild/lock.txt"].decode())
    assert image_lock.pins("nccl") == {"nvidia-nccl-cu13": "2.31.2"}
    assert image_lock.pins()["nvidia-nccl-cu13"] == "2.28.9"  # the matrix's lock, unchanged, above it
    manifest = json.loads(files["manifest.json"])
    assert manifest["nccl"] == "2.31.2"  # what the smoke test's `nccl` check expects loaded
    assert manifest["nccl_override"]["replaced"] == "2.28.9" and manifest["request"]["nccl"] == "2.31.2"
    assert manifest["lock"]["sha256"] == image_lock.sha256
    dockerfile = files["Dockerfile"].decode()
    assert "RUN bash /opt/envbuild-setup/nccl.sh nvidia-nccl-cu13 2.28.9 2.31.2" in dockerfile
    assert dockerfile.index("torch.sh") < dockerfile.index("nccl.sh") < dockerfile.index("deepspeed.sh")
    assert 'io.envbuild.nccl-override="nvidia-nccl-cu13==2.31.2 (torch pins 2.28.9)"' in dockerfile


def test_the_image_s_lock_check_expects_the_override_and_not_torch_s_pin(m, tmp_path):
    r = resolve(m, Request(gpu="h20", nccl="2.31.2"))
    files = render_files(r)
    path = tmp_path / "lock.txt"
    path.write_bytes(files["envbuild/lock.txt"])
    manifest = json.loads(files["manifest.json"])  # the smoke test's `lock` check reads the sections it names
    assert manifest["lock"]["sections"] == ["venv", "nccl"] and manifest["lock"]["packages"] == len(r.lock.pins())
    manifest["lock"].update(path=str(path), dropped=[])
    pins = {**r.lock.pins(), "nvidia-nccl-cu13": "2.31.2"}
    assert checks.check_lock(manifest, installed=pins)[0] is True
    ok, detail = checks.check_lock(manifest, installed={**pins, "nvidia-nccl-cu13": "2.28.9"})
    assert not ok and "nvidia-nccl-cu13==2.28.9 (lock: 2.31.2)" in detail


def test_an_aarch64_image_gets_the_aarch64_wheel(m):
    r = resolve(m, Request(gpu="gh200", nccl="2.31.2"))
    assert r.arch == "aarch64"
    assert [f for f, _ in r.nccl_override.wheels] == ["nvidia_nccl_cu13-2.31.2-py3-none-manylinux_2_18_aarch64.whl"]


def test_torch_s_own_release_is_the_default_image(m):
    plain, same = resolve(m, Request(gpu="h20")), resolve(m, Request(gpu="h20", nccl="2.28.9"))
    assert same.nccl_override is None and same.tag == plain.tag
    assert render_files(dataclasses.replace(same, request=plain.request)) == render_files(plain)


def test_without_nccl_nothing_rendered_changes_when_the_matrix_has_an_nccl_yaml(m, matrix):
    with_file, without = resolve(m, Request(gpu="h20")), resolve(matrix, Request(gpu="h20"))
    a, b = render_files(with_file), render_files(without)
    ma, mb = json.loads(a.pop("manifest.json")), json.loads(b.pop("manifest.json"))
    assert a == b
    assert "nccl_override" not in ma and "nccl" not in ma["request"]
    assert {k: v for k, v in ma.items() if k not in ("matrix", "render")} == \
        {k: v for k, v in mb.items() if k not in ("matrix", "render")}  # only the matrix's digest differs


@pytest.mark.parametrize("version, why, nearest", [
    ("2.28.3", "older than the NCCL 2.28.9 torch 2.11.0 pins", "2.28.9, 2.30.7, 2.31.2"),
    ("3.0.1", "NCCL 3 is another ABI than the NCCL 2 torch 2.11.0 links (libnccl.so.2)", "2.30.7, 2.31.2, 2.32.3"),
    ("2.31.1", "PyPI has no nvidia-nccl-cu13 2.31.1", "2.30.7, 2.31.2, 2.32.3"),
])
def test_a_refused_release_names_why_and_the_nearest_accepted(m, nccl_dir, tmp_path, version, why, nearest):
    with pytest.raises(EnvbuildError) as e:
        resolve(m, Request(gpu="h20", nccl=version))
    assert why in e.value.message and f"Nearest releases it accepts: {nearest}" in e.value.message
    out = tmp_path / "out"
    refused(invoke("render", "--gpu", "h20", "--nccl", version, "-o", str(out), matrix_dir=nccl_dir), "--nccl", why)
    assert not out.exists()


def test_a_stack_whose_torch_comes_from_pytorch_s_index_is_refused(m):
    with pytest.raises(EnvbuildError, match="torch 2.11.0 \\(CUDA 12.6\\) pins is not known"):
        resolve(m, Request(gpu="h20", stack="torch2.11-cu126-py3.12", nccl="2.29.3"))


def test_a_stack_without_a_lock_is_refused(m):
    with pytest.raises(EnvbuildError, match="it has no lock"):
        resolve(m, Request(gpu="h100", stack="torch2.8-cu128-py3.12", nccl="2.29.3"))


def test_a_matrix_without_nccl_yaml_refuses_every_release(matrix):
    with pytest.raises(EnvbuildError, match="lists no NCCL wheel family for torch 2.11.0"):
        resolve(matrix, Request(gpu="h20", nccl="2.31.2"))


def test_a_release_without_a_wheel_for_the_image_s_cpu_glibc_or_python_is_refused(m):
    s = m.stack(H20_STACK)
    package = m.nccl_package(s.torch)
    wheel = NcclWheel(file="nvidia_nccl_cu13-2.40.1-py3-none-manylinux_2_40_x86_64.whl", sha256="0" * 64, url="u")
    too_new = NcclRelease(version="2.40.1", source="s", wheels=[wheel])
    why = rules.nccl_rejection(m, s, package, "2.28.9", too_new, "x86_64")
    assert why == ("PyPI has no nvidia-nccl-cu13 2.40.1 wheel for x86_64 with glibc <= 2.39 (ubuntu24.04) and "
                   "Python 3.12")
    py = NcclRelease(version="2.40.1", source="s", wheels=[wheel.model_copy(update={
        "file": "nvidia_nccl_cu13-2.40.1-py3-none-manylinux_2_18_x86_64.whl", "requires_python": ">=3.13"})])
    assert rules.nccl_rejection(m, s, package, "2.28.9", py, "x86_64").startswith("PyPI has no")
    assert rules.nccl_rejection(m, s, package, "2.28.9", py, "aarch64").startswith("PyPI has no")


def test_a_fabric_s_nccl_range_applies_to_the_override(m):
    s, fabric = m.stack(H20_STACK), m.fabric("ib")
    package = m.nccl_package(s.torch)
    release = next(r for r in package.releases if r.version == "2.31.2")
    narrow = fabric.model_copy(update={"requires": (fabric.requires or m.fabric("aws-efa").requires).model_copy(
        update={"nccl": "<2.30", "arch": ["x86_64", "aarch64"], "gpus": []})})
    assert "needs NCCL <2.30" in rules.nccl_rejection(m, s, package, "2.28.9", release, "x86_64", narrow)


def test_envbuild_nccl_lists_what_render_accepts_and_refuses(m, nccl_dir):
    """The listing and a render decide by the same rules: each stack's oldest and newest accepted
    release render, a release PyPI has below torch's pin is refused, and a stack listed as
    unusable is refused with the reason listed."""
    r = invoke("nccl", "--json", matrix_dir=nccl_dir)
    assert r.code == 0, r.err
    listed = [c for c in json.loads(r.out) if c["arch"] == "x86_64"]
    assert {c["stack"] for c in listed} == {s.id for s in m.stacks}
    assert any(c["unusable"] for c in listed) and any(len(c["accepted"]) > 1 for c in listed)
    for c in listed:
        render = ("render", "--gpu", "h100", "--stack", c["stack"], "--print-tag", "--nccl")
        if c["unusable"]:
            r = invoke(*render, "2.31.2", matrix_dir=nccl_dir)
            assert r.code == 2 and " ".join(c["unusable"].split()) in " ".join(r.err.split()), (c, r.err)
            continue
        assert c["accepted"][0] == c["pin"], c
        for version in (c["accepted"][0], c["accepted"][-1]):
            r = invoke(*render, version, matrix_dir=nccl_dir)
            assert r.code == 0, (c, version, r.err)
        older = [v.version for v in m.nccl_package(m.stack(c["stack"]).torch).releases
                 if Version(v.version) < Version(c["pin"])]
        if older:
            r = invoke(*render, older[-1], matrix_dir=nccl_dir)
            assert r.code == 2 and "older than the NCCL" in r.err, (c, r.err)
    r = invoke("nccl", "--stack", H20_STACK, matrix_dir=nccl_dir)
    assert r.code == 0 and H20_STACK in r.out and "accepted" in r.out and "2.31.2" in r.out, r.out


# ---------------------------------------------------------------- the CLI and the project file


def test_render_prints_the_override_and_writes_its_build_directory(nccl_dir, tmp_path):
    out = tmp_path / "out"
    result = invoke("render", "--gpu", "h20", "--nccl", "2.31.2", "-o", str(out), matrix_dir=nccl_dir)
    assert result.code == 0, result.err
    assert "nvidia-nccl-cu13 2.31.2 in place of torch's pin 2.28.9" in result.out
    assert "--nccl 2.31.2" in result.out  # the `next:` build line repeats the request
    files = tree(out)
    assert files["envbuild/steps/nccl.sh"] == (ROOT / "templates/files/steps/nccl.sh").read_bytes()
    assert json.loads(files["manifest.json"])["nccl"] == "2.31.2"


def test_render_json_names_the_override(nccl_dir):
    result = invoke("render", "--gpu", "h20", "--nccl", "2.31.2", "--json", matrix_dir=nccl_dir)
    data = json.loads(result.out)
    assert result.code == 0 and data["nccl"] == "2.31.2" and data["nccl_override"]["replaced"] == "2.28.9"
    plain = json.loads(invoke("render", "--gpu", "h20", "--json", matrix_dir=nccl_dir).out)
    assert plain["nccl"] == "2.28.9" and "nccl_override" not in plain


def test_an_empty_nccl_option_is_refused(nccl_dir):
    refused(invoke("render", "--gpu", "h20", "--nccl", "", matrix_dir=nccl_dir), "--nccl is empty")


def test_the_project_file_takes_nccl_like_the_option(nccl_dir, tmp_path):
    project = tmp_path / "envbuild.yaml"
    project.write_text("gpu: h20\nnccl: 2.28.3\nrequirements: [einops]\n")
    out = tmp_path / "out"
    refused(invoke("extend", "-f", str(project), "-o", str(out), matrix_dir=nccl_dir), "--nccl 2.28.3 is refused")
    assert not out.exists()  # refused before uv resolves anything


def test_rebuild_re_renders_the_recorded_request(m):
    from envbuild.builds.rebuild import Record, check_record

    manifest = json.loads(render_files(resolve(m, Request(gpu="h20", nccl="2.31.2")))["manifest.json"])
    request = check_record(Record(manifest, "manifest.json", None), m)
    assert request.nccl == "2.31.2" and resolve(m, request).tag == manifest["tag"]


def test_plan_installs_the_override_in_the_torch_step(m):
    plan = stack_plan(resolve(m, Request(gpu="h20", nccl="2.31.2")))
    names = [s.name for s in plan.builder.steps]
    assert names.index("nccl") == names.index("torch") + 1


def test_the_rendered_files_pass_their_linters(m, tmp_path):
    """hadolint on the Dockerfile, shellcheck on the Apptainer sections, with the nccl step in both."""
    import subprocess

    from test_lint import _shell_sections, _tool

    files = render_files(resolve(m, Request(gpu="h20", nccl="2.31.2")))
    (tmp_path / "Dockerfile").write_bytes(files["Dockerfile"])
    r = subprocess.run([_tool("hadolint"), "--no-color", "--failure-threshold", "style", str(tmp_path / "Dockerfile")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    standalone = files["Singularity.standalone.def"].decode()  # Singularity.def starts from the Docker image
    assert "nccl.sh nvidia-nccl-cu13 2.28.9 2.31.2" in standalone
    scripts = []
    sections = _shell_sections(standalone) + _shell_sections(files["Singularity.def"].decode())
    for i, (section, body) in enumerate(sections):
        scripts.append(tmp_path / f"{i}.sh")
        scripts[-1].write_text(f"#!/bin/sh\n# %{section}\n{body}")
    r = subprocess.run([_tool("shellcheck"), "--severity=style", *map(str, scripts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
