"""CUDA extensions (extensions.yaml, --ext): the data, the rules, the plan, the build steps'
arch filter and SASS audit, and the smoke test's check. The real build is in
tests/docker/test_docker_e2e.py (causal-conv1d for sm_90 on the CI stack) and the opt-in
tests/builds/test_flash_attn_build.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, build_step, run_here
from envbuild.base.errors import EnvbuildError
from envbuild.resolve.extend import split_cuda_extensions
from envbuild.image import checks
from envbuild.knowledge import validate
from envbuild.knowledge.matrix import load_matrix
from envbuild.plan import stack_plan
from envbuild.resolve.resolver import Request, explain_rows, resolve

STEPS = ROOT / "templates" / "files" / "steps"
BUILD_PYTHON = ROOT / "envbuild" / "buildsteps"
sys.path.insert(0, str(BUILD_PYTHON))
import sass_audit  # noqa: E402  (a build step script: stdlib only, run in the builder as a top-level module)

FIXTURES = ROOT / "tests" / "fixtures" / "extensions"


# ---------------------------------------------------------------- the data


def test_every_extension_fact_names_a_public_source(production_matrix):
    for ext in production_matrix.extensions.values():
        for file in [*([ext.sdist] if ext.sdist else []), *ext.wheels]:
            assert file.url.startswith("https://files.pythonhosted.org/packages/")
            assert file.url.endswith("/" + file.filename)
        if ext.sdist and not ext.subdirectory:
            assert ext.sdist.filename == f"{ext.name.replace('-', '_')}-{ext.version}.tar.gz"
        for wheel in ext.wheels:
            assert wheel.filename.startswith(f"{ext.name.replace('-', '_')}-{ext.version}-")
        for fact in ("setup.py", "min_cc", "torch", "cuda", "python", "sdist"):
            source = ext.sources[fact]
            assert re.search(r"https://\S+|\.tar\.gz |wheel|cuobjdump|core", source), (ext.name, fact, source)
        assert ext.modules or ext.packages
        assert ext.memory_per_job_gib or not ext.compiled or ext.unbuildable
    tags = [e.tag for e in production_matrix.extensions.values()]
    assert len(tags) == len(set(tags))


def test_the_fixture_matrix_ships_the_same_extensions():
    """Behaviour tests resolve against the fixture matrix: its extensions are the shipped ones."""
    assert (ROOT / "tests/fixtures/matrix/extensions.yaml").read_text() == (ROOT / "matrices/extensions.yaml").read_text()


# ---------------------------------------------------------------- rules


def test_a_gpu_below_the_extensions_floor_is_refused_naming_the_gpus_that_fit(matrix):
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="t4", extensions=("flash-attn",)))
    msg = str(e.value)
    assert "t4 is sm_75" in msg and "rule ext-gpu" in msg and "a100" in msg and "t4" not in msg.split("fits:")[1].split(";")[0]
    resolve(matrix, Request(gpu="t4", extensions=("causal-conv1d",)))  # sm_75 is causal-conv1d's floor


def test_every_gpu_named_as_a_fit_is_one_a_render_accepts(matrix):
    """The fit list of rule ext-gpu passes rule ext-arch too: no Grace (aarch64-only) GPU is
    offered for an extension built for x86_64 only, and every Grace GPU for flash-attn, which
    builds on aarch64."""
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="v100", extensions=("flash-attn",)))
    fits = str(e.value).split("GPUs it fits: ")[1].split(";")[0].split(", ")
    assert {"h100", "gh200", "gb200", "gb300", "gb10"} <= set(fits), fits
    for gpu in fits:
        resolve(matrix, Request(gpu=gpu, extensions=("flash-attn",)))
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="v100", extensions=("xformers",)))
    assert "gh200" not in str(e.value).split("GPUs it fits: ")[1]
    with pytest.raises(EnvbuildError, match=r"xformers has been built for x86_64 only, the image is aarch64"):
        resolve(matrix, Request(gpu="gh200", extensions=("xformers",)))
    assert resolve(matrix, Request(gpu="gh200", extensions=("causal-conv1d",))).arch == "aarch64"  # its setup.py: any CPU


@pytest.mark.parametrize("given", ["flash-attn==9.9", "Flash_Attn==2.8.3.post2", "flash-attn[x]", "flash-attn>=2"])
def test_a_version_or_extra_in_ext_is_refused_naming_the_version_it_builds(matrix, given):
    with pytest.raises(EnvbuildError) as e:
        validate.parse_extensions(matrix, given)
    assert str(e.value) == (f"--ext '{given}': --ext takes names, not versions or extras; envbuild builds flash-attn "
                            f"2.8.3.post2 only (extensions.yaml). Nearest valid choice: --ext flash-attn.")


# ---------------------------------------------------------------- what envbuild does not pre-build

NOT_PREBUILT = ROOT / "tests" / "fixtures" / "extensions" / "not-prebuilt"


def test_every_refusal_reason_is_in_the_build_script_it_cites(production_matrix):
    """Each not_prebuilt entry cites a file of its named release: every 'WORD (line N)' it cites
    is on that line of the verbatim file kept here, and PyPI's JSON for that version is named."""
    entries = production_matrix.extensions_file.not_prebuilt
    assert {n.name for n in entries} >= {"natten"}
    for n in entries:
        sdist = f"{n.name.replace('-', '_')}-{n.version}.tar.gz"
        assert n.source.startswith(sdist + " ") and f"https://pypi.org/pypi/{n.name}/{n.version}/json" in n.source
        script = n.source.split()[1].rstrip(":")
        lines = (NOT_PREBUILT / f"{sdist.removesuffix('.tar.gz')}.{script.replace('/', '.')}.txt").read_text().splitlines()
        cited = re.findall(r"(\w[\w ']*?) \(line (\d+)\)", n.source)
        for word, number in cited:
            assert word.strip("'").split()[-1] in lines[int(number) - 1], (n.name, word, number)
        assert cited or "CppExtension" in "\n".join(lines), n.name
        assert n.name not in production_matrix.extensions


def test_a_package_envbuild_does_not_prebuild_is_refused_by_ext_and_by_extend_before_uv(tmp_path):
    out = tmp_path / "out"
    r = run_here("render", "--gpu", "h100", "--ext", "NATTEN", "-o", str(out))
    assert r.returncode == 2 and "rule ext-not-prebuilt" in r.stderr and "NATTEN_CUDA_ARCH" in r.stderr, r.stderr
    assert "Pre-built: flash-attn, causal-conv1d" in r.stderr and "Traceback" not in r.stderr
    req = tmp_path / "r.txt"
    req.write_text("einops\nnatten>=0.17\n")
    r = run_here("extend", "-r", str(req), "--gpu", "h100", "-o", str(out), env={"UV_OFFLINE": "1"})
    assert r.returncode == 2 and f"{req}: 'natten>=0.17': natten compiles against torch" in r.stderr, r.stderr
    assert "WITHOUT libnatten" in r.stderr and f"Remove it from {req}" in r.stderr
    assert not out.exists()
    listed = run_here("extensions").stdout
    assert "not pre-built" in listed and "natten 0.21.7" in listed.split("not pre-built")[1]


def test_extend_refuses_a_package_that_pulls_in_one_envbuild_does_not_prebuild(matrix, monkeypatch):
    """uv's output is stood in for (the real uv resolves in test_extend.py): a requirement whose
    dependency is natten is refused naming what pulled it in."""
    from envbuild.resolve import extend
    uv_output = ("some-model-zoo==1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n    # via -r inputs\n"
                 "natten==0.21.7 \\\n    --hash=sha256:" + "b" * 64 + "\n    # via some-model-zoo\n")
    monkeypatch.setattr(extend, "_compile_layer", lambda *a: uv_output)
    resolution = resolve(matrix, Request(gpu="h100", stack="torch2.11-cu130-py3.12"))
    with pytest.raises(EnvbuildError) as e:
        extend.resolve_layer(matrix, resolution, ["some-model-zoo"], "r.txt")
    assert str(e.value).startswith("r.txt: the requirements pull in natten==0.21.7 (via some-model-zoo): "
                                   "natten compiles against torch"), str(e.value)


@pytest.mark.parametrize("field, what", [("torch", "torch"), ("cuda", "CUDA"), ("python", "Python")])
def test_a_floor_moves_the_choice_to_a_stack_that_fits_or_says_why(matrix_copy, field, what):
    path = matrix_copy / "extensions.yaml"
    data = yaml.safe_load(path.read_text())
    data["extensions"][0][field] = ">=2.99" if field == "torch" else ">=99"
    path.write_text(yaml.safe_dump(data))
    m = load_matrix(matrix_copy)
    with pytest.raises(EnvbuildError) as e:
        resolve(m, Request(gpu="h100", extensions=("flash-attn",)))
    assert f"flash-attn 2.8.3.post2 builds with {what} {data['extensions'][0][field]}" in str(e.value)
    assert "drop --ext" in str(e.value)
    rows = {sid: why for sid, _, why in explain_rows(m, Request(gpu="h100", extensions=("flash-attn",)))}
    assert all("[ext-stack]" in why for why in rows.values())


def test_requirements_missing_from_the_lock_are_refused_on_locked_stacks(matrix_copy):
    path = matrix_copy / "extensions.yaml"
    data = yaml.safe_load(path.read_text())
    data["extensions"][1]["requires"] = ["packaging", "transformers"]
    path.write_text(yaml.safe_dump(data))
    m = load_matrix(matrix_copy)
    with pytest.raises(EnvbuildError) as e:
        resolve(m, Request(gpu="h100", stack="torch2.11-cu130-py3.12", extensions=("causal-conv1d",)))
    assert "[" not in str(e.value).split(":")[0] and "needs packaging, transformers" not in str(e.value)
    assert "needs transformers, which stack torch2.11-cu130-py3.12's lock does not hold" in str(e.value)


# ---------------------------------------------------------------- the plan


@pytest.fixture(scope="module")
def ext_plan(matrix):
    return stack_plan(resolve(matrix, Request(gpu="h100", stack="torch2.11-cu130-py3.12", ds_ops="cpu_adam,fused_adam",
                                              extensions=("causal-conv1d", "flash-attn"))))


def test_the_extensions_step_comes_after_deepspeed_and_before_the_guard(ext_plan):
    names = [s.name for s in ext_plan.builder.steps]
    assert names.index("deepspeed") < names.index("extensions") < names.index("finish")
    finish = next(s for s in ext_plan.builder.steps if s.name == "finish")
    guard = dict(finish.env)["ENVBUILD_GUARD_PACKAGES"]
    for frozen in ("flash_attn==2.8.3.post2", "causal-conv1d==1.7.0", "torch==2.11.0"):
        assert re.match(rf"^({guard})==", frozen, re.I), frozen
    assert not re.match(rf"^({guard})==", "flash-attention==1.0", re.I)
    step = next(s for s in ext_plan.builder.steps if s.name == "extensions")
    assert step.caches == (("envbuild-ext", "/var/cache/envbuild-ext"),)
    assert "--mount=type=cache,id=envbuild-ext,target=/var/cache/envbuild-ext,sharing=locked" in step.render("docker")
    assert ext_plan.runtime.from_builder[-1] == "/opt/envbuild/built"


def test_the_tag_label_and_manifest_name_the_extensions(ext_plan):
    assert "-h100-ccv1.7.0-fa2.8.3.post2-" in ext_plan.tag
    labels = dict(ext_plan.labels.pairs)
    assert labels["io.envbuild.extensions"] == "causal-conv1d==1.7.0,flash-attn==2.8.3.post2"
    names = [(e["name"], e["version"], e["arch_list"]) for e in ext_plan.manifest["extensions"]]
    assert names == [("causal-conv1d", "1.7.0", "9.0"), ("flash-attn", "2.8.3.post2", "9.0")]


def _spec(matrix, gpu, stack="torch2.11-cu130-py3.12", ext="flash-attn"):
    plan = stack_plan(resolve(matrix, Request(gpu=gpu, stack=stack, extensions=(ext,))))
    return json.loads(plan.generated_files["envbuild/extensions.json"])["extensions"][0]


def test_the_cache_key_follows_what_determines_the_wheel(matrix):
    """Same arch list, same stack: one key (a second GPU variant reuses the wheel); another arch,
    another stack (torch build, Python): another key."""
    h20, h100, h200 = (_spec(matrix, g)["cache_key"] for g in ("h20", "h100", "h200"))
    assert h20 == h100 == h200
    assert _spec(matrix, "a100")["cache_key"] != h100
    assert _spec(matrix, "h100", stack="torch2.5-cu124-py3.10")["cache_key"] != h100
    spec = _spec(matrix, "a100")
    assert spec["build_env"] == {"FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTN_CUDA_ARCHS": "80"}


# ---------------------------------------------------------------- source patches


UPSTREAM = ROOT / "tests" / "fixtures" / "upstream"


def test_each_source_patch_matches_its_real_upstream_file_exactly_once(production_matrix):
    """A patch is checked against the real file of the sdist it names (saved verbatim, with its
    URL and sha256): the build would otherwise fail on it, or compile the source unpatched."""
    patched = [ext for ext in production_matrix.extensions.values() if ext.patches]
    assert [ext.name for ext in patched] == ["flash-attn", "mamba-ssm"]
    for ext in patched:
        saved = UPSTREAM / ext.sdist.filename
        assert ext.sdist.sha256 in (saved / "SOURCE.txt").read_text()
        for patch in ext.patches:
            text = (saved / patch.file).read_text()
            assert text.count(patch.old) == 1 and patch.new not in text, patch
            assert patch.source.startswith("https://github.com/Dao-AILab/flash-attention/pull/2899 ")


def test_mamba_ssm_on_torch_2_13_compiles_its_two_cxx17_flags_as_cxx20_and_leaves_rocms_alone(production_matrix, tmp_path):
    """mamba-ssm 2.3.2.post1 passes -std=c++17 to g++ and nvcc (setup.py lines 226, 230) and to
    its ROCm branch (213, 216): the patch changes the CUDA two, in the real file."""
    step = build_step("extensions.py")
    setup = (UPSTREAM / "mamba_ssm-2.3.2.post1.tar.gz" / "setup.py").read_text()
    lines = setup.splitlines()
    assert [i + 1 for i, ln in enumerate(lines) if "c++17" in ln] == [213, 216, 226, 230]
    tree = step.unpack(_sdist(tmp_path, setup), tmp_path / "src")
    ext = production_matrix.extension("mamba-ssm")
    step.apply_patches(tree, [p.model_dump() for p in ext.patches], ext.name)
    patched = (tree / "setup.py").read_text().splitlines()
    assert [i + 1 for i, ln in enumerate(patched) if "c++20" in ln] == [226, 230]
    assert [i + 1 for i, ln in enumerate(patched) if "c++17" in ln] == [213, 216]


def test_the_build_finds_each_header_in_pips_nvidia_wheels_or_fails_naming_it(tmp_path, capsys):
    """Transformer Engine's binding includes cudnn.h and nccl.h, which NVIDIA's devel images do
    not have: the build step puts the directory of pip's nvidia-* wheel that holds each on CPATH."""
    step = build_step("extensions.py")
    site, cuda = tmp_path / "site", tmp_path / "cuda"
    for d, h in (("nvidia/cudnn/include", "cudnn.h"), ("nvidia/nccl/include", "nccl.h"), ("nvidia/cu13/include", "x.h")):
        (site / d).mkdir(parents=True)
        (site / d / h).write_text("")
    (cuda / "include").mkdir(parents=True)
    (cuda / "include" / "cuda.h").write_text("")
    assert step.header_dirs(["cudnn.h", "nccl.h", "cuda.h"], str(cuda), [str(site)]) == [
        str(site / "nvidia/cudnn/include"), str(site / "nvidia/nccl/include"), str(cuda / "include")]
    with pytest.raises(SystemExit):
        step.header_dirs(["cudnn.h", "nvshmem.h"], str(cuda), [str(site)])
    assert "includes <nvshmem.h> and neither the CUDA toolkit" in capsys.readouterr().err


def test_flash_attn_on_torch_2_15_is_built_with_upstreams_cxx20_fix_and_not_on_2_12(production_matrix):
    """torch >= 2.13 needs C++20 (flash-attention#2863): the CI stack's spec carries the two
    patches and its cache key covers them; torch 2.12 builds the sdist as released."""
    new = _spec(production_matrix, "h100", stack="torch2.15-cu132-py3.11-pypi")
    old = _spec(production_matrix, "h100", stack="torch2.12-cu130-py3.12")
    assert [p["new"].strip() for p in new["patches"]] == ['"-O3",\n    "-std=c++20",', 'compiler_c17_flag=["-O3", "-std=c++20"]']
    assert new["determines"]["patches"] == new["patches"] and old["patches"] == [] and "patches" not in old["determines"]


def _sdist(tmp_path, setup_text: str, extra=None):
    import io
    import tarfile

    archive = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in {"pkg-1.0/setup.py": setup_text, **(extra or {})}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_the_build_step_unpacks_the_sdist_and_applies_each_patch(production_matrix, tmp_path):
    step = build_step("extensions.py")
    setup = (UPSTREAM / "flash_attn-2.8.3.post2.tar.gz" / "setup.py").read_text()
    tree = step.unpack(_sdist(tmp_path, setup), tmp_path / "src")
    step.apply_patches(tree, _spec(production_matrix, "h100", stack="torch2.15-cu132-py3.11-pypi")["patches"],
                       "flash-attn")
    text = (tree / "setup.py").read_text()
    assert text.count("c++20") == 2 and text.count('"-std=c++17"') == setup.count('"-std=c++17"') - 2


def test_a_patch_that_does_not_match_fails_the_build_naming_it(tmp_path, capsys):
    step = build_step("extensions.py")
    tree = step.unpack(_sdist(tmp_path, "flags = ['-std=c++17']\n"), tmp_path / "src")
    with pytest.raises(SystemExit) as exit_:
        step.apply_patches(tree, [{"file": "setup.py", "old": '"-std=c++17"', "new": '"-std=c++20"',
                                   "source": "https://example.org/pr/1"}], "pkg")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "the patch for setup.py (https://example.org/pr/1)" in err and "found it 0 times" in err


def test_an_sdist_member_outside_its_directory_is_refused(tmp_path):
    step = build_step("extensions.py")
    with pytest.raises(SystemExit):
        step.unpack(_sdist(tmp_path, "x = 1\n", {"../evil.py": "boom\n"}), tmp_path / "src")
    assert not (tmp_path / "evil.py").exists()


# ---------------------------------------------------------------- resuming an interrupted compile


def _entry(archive):
    return {"name": "pkg", "version": "1.0", "cache_key": "k1", "patches": [],
            "sdist": {"filename": archive.name, "sha256": "ab" * 32}}


@pytest.fixture
def offline_step(tmp_path, monkeypatch):
    """The build step with `pip download` answered from a local sdist (no index here); the
    calls are counted."""
    step = build_step("extensions.py")
    archive = _sdist(tmp_path, "x = 1\n")
    calls = []

    def pip(*args, env=None):
        calls.append(args[0])
        if args[0] == "download":
            dest = Path(args[args.index("-d") + 1])
            dest.mkdir(parents=True, exist_ok=True)
            (dest / archive.name).write_bytes(archive.read_bytes())
    monkeypatch.setattr(step, "pip", pip)
    return step, archive, calls


def test_the_source_tree_is_kept_under_the_cache_key_and_reused_by_the_next_build(offline_step, tmp_path):
    """The compile's tree lies at a path set by the cache key alone (ninja's build.ninja holds
    absolute paths): a second build finds it, objects and all, and downloads nothing."""
    step, archive, calls = offline_step
    cache = tmp_path / "cache"
    tree = step.source_tree(_entry(archive), cache, {})
    assert tree == cache / "pkg" / "k1" / step.PARTIAL / "src" / "pkg-1.0" and (tree / "setup.py").is_file()
    (tree / "build").mkdir()
    (tree / "build" / "flash_fwd.o").write_text("object")
    assert step.source_tree(_entry(archive), cache, {}) == tree and (tree / "build" / "flash_fwd.o").is_file()
    assert calls == ["download"]


def test_an_unpack_that_was_cut_off_is_made_again(offline_step, tmp_path):
    step, archive, calls = offline_step
    cache = tmp_path / "cache"
    tree = step.source_tree(_entry(archive), cache, {})
    (tree.parent.parent / ".envbuild-unpacked").unlink()  # killed between the unpack and its stamp
    (tree / "half-written").write_text("")
    tree = step.source_tree(_entry(archive), cache, {})
    assert not (tree / "half-written").exists() and calls == ["download", "download"]


def test_each_attempt_leaves_its_time_and_the_one_that_finishes_counts_them_all(tmp_path):
    step = build_step("extensions.py")
    tree = tmp_path / "partial" / "src" / "pkg-1.0"
    tree.mkdir(parents=True)
    (tmp_path / "partial" / "attempts.json").write_text(
        json.dumps([{"objects_reused": 0, "seconds": 3600, "peak_memory_mib": 11000}]))
    with step.Attempts(tree, found=30) as attempts:
        pass
    assert json.loads((tmp_path / "partial" / "attempts.json").read_text())[1]["objects_found"] == 30
    attempts.now["objects_reused"] = 29
    facts = attempts.facts()
    assert facts["attempts"] == 2 and facts["objects_reused"] == 29 and facts["seconds_all_attempts"] >= 3600
    assert facts["peak_memory_mib"] >= 11000
    assert len(json.loads((tmp_path / "partial" / "attempts.json").read_text())) == 2


def test_a_compile_never_resumed_is_removed_after_its_days_and_nothing_else(tmp_path):
    step = build_step("extensions.py")
    old, fresh = (tmp_path / "pkg" / key / step.PARTIAL for key in ("old", "fresh"))
    for partial in (old, fresh):
        partial.mkdir(parents=True)
        (partial / "attempts.json").write_text("[]")
    (tmp_path / "pkg" / "old" / "pkg-1.0-cp311-linux_x86_64.whl").write_text("wheel")
    long_ago = time.time() - (step.STALE_DAYS + 1) * 86400
    for path in (old, old / "attempts.json"):
        os.utime(path, (long_ago, long_ago))
    step.remove_stale_trees(tmp_path)
    assert not old.exists() and fresh.exists() and (tmp_path / "pkg" / "old" / "pkg-1.0-cp311-linux_x86_64.whl").exists()


# ---------------------------------------------------------------- nvcc-arch.sh


@pytest.fixture
def fake_nvcc(tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text('#!/bin/sh\necho "$@"\n')
    (home / "bin" / "nvcc").chmod(0o755)

    def run(archs, *args):
        env = dict(os.environ, CUDA_HOME=str(home), ENVBUILD_CUDA_ARCHS=archs)
        return subprocess.run(["bash", str(STEPS / "nvcc-arch.sh"), *args], env=env, capture_output=True, text=True)
    return run


CAUSAL_CONV1D_GENCODES = [f"arch=compute_{a},code=sm_{a}" for a in (75, 80, 87, 90, 100, 120, 103, 110, 121)]


@pytest.mark.parametrize("archs, kept", [
    ("90", ["sm_90"]),
    ("80 90", ["sm_80", "sm_90"]),
    ("86", ["sm_80"]),  # an sm_80 cubin runs on 8.6; sm_87 does not
    ("120", ["sm_120"]),
    ("121", ["sm_120", "sm_121"]),
])
def test_nvcc_keeps_only_the_code_the_gpu_runs(fake_nvcc, archs, kept):
    args = [w for g in CAUSAL_CONV1D_GENCODES for w in ("-gencode", g)]
    r = fake_nvcc(archs, "-O3", *args, "-c", "x.cu")
    assert r.returncode == 0, r.stderr
    assert re.findall(r"code=(sm_\d+)", r.stdout) == kept and r.stdout.startswith("-O3 ") and "x.cu" in r.stdout


def test_flash_attn_on_an_arch_its_setup_py_does_not_name_gets_torchs_gencode_for_the_gpu(matrix, fake_nvcc):
    """flash-attn's setup.py adds -gencode only for 80, 90, 100 and 120 of FLASH_ATTN_CUDA_ARCHS:
    on an A10 (8.6) or a B300 (10.3) it adds none, and torch's BuildExtension adds the GPU's own
    from TORCH_CUDA_ARCH_LIST (extensions.py sets it to the arch list), which nvcc-arch.sh keeps."""
    setup_py = (ROOT / "tests/fixtures/upstream/flash_attn-2.8.3.post2.tar.gz/setup.py").read_text()
    assert set(re.findall(r'"(\d+)" in cuda_archs\(\)', setup_py)) == {"80", "90", "100", "120"}
    for gpu, arch in (("a10", "86"), ("b300", "103")):
        spec = _spec(matrix, gpu)
        assert spec["build_env"]["FLASH_ATTN_CUDA_ARCHS"] == arch and spec["determines"]["arch_list"] == f"{arch[:-1]}.{arch[-1]}"
        r = fake_nvcc(arch, "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-c", "x.cu")  # torch's flag
        assert r.returncode == 0 and re.findall(r"code=(sm_\d+)", r.stdout) == [f"sm_{arch}"], r.stderr


def test_nvcc_refuses_a_compile_with_no_code_for_the_gpu(fake_nvcc):
    r = fake_nvcc("70", "-gencode", "arch=compute_80,code=sm_80", "x.cu")
    assert r.returncode == 1 and "none of them for the GPU arches 70" in r.stderr


def test_nvcc_leaves_host_compiles_and_arch_specific_code_alone(fake_nvcc):
    assert fake_nvcc("90", "-c", "x.cpp").stdout.strip() == "-c x.cpp"
    r = fake_nvcc("90+PTX", "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90",
                  "-gencode=arch=compute_100,code=sm_100")
    assert r.stdout.split() == ["-gencode", "arch=compute_90a,code=sm_90a", "-gencode", "arch=compute_90,code=compute_90"]


# ---------------------------------------------------------------- the SASS audit


def test_cuobjdump_listings_are_read_as_cuobjdump_prints_them():
    """Real output of NVIDIA's cuobjdump 13.2 on the causal_conv1d_cuda library built here for
    sm_90 (tests/fixtures/extensions/README.md says how it was made)."""
    elf = (FIXTURES / "causal_conv1d_cuda.list-elf.txt").read_text()
    ptx = (FIXTURES / "causal_conv1d_cuda.list-ptx.txt").read_text()
    assert sass_audit.parse_listing(elf) == ["sm_90"]
    assert sass_audit.parse_listing(ptx) == []


@pytest.mark.parametrize("code, arch, runs", [
    ("sm_80", "8.0", True), ("sm_80", "8.9", True), ("sm_87", "8.6", False), ("sm_90", "10.0", False),
    ("sm_90a", "9.0", True), ("sm_90a", "9.0+PTX", True), ("sm_100", "10.3", True), ("sm_120", "12.0", True),
    ("compute_90", "9.0", False), ("compute_90", "10.0+PTX", True), ("compute_100", "9.0+PTX", False),
])
def test_which_code_runs_on_which_arch(code, arch, runs):
    assert sass_audit.runs_on(code, arch) is runs


@pytest.fixture
def fake_cuobjdump(tmp_path):
    """A stand-in for cuobjdump that prints the real listing recorded for a library's name."""
    tool = tmp_path / "cuobjdump"
    tool.write_text("#!/usr/bin/env bash\n"
                    f'dir={FIXTURES}\n'
                    'case $(basename "$2") in\n'
                    '  host*) echo "cuobjdump info    : File \'$2\' does not contain device code" >&2; exit 255;;\n'
                    '  *) [[ $1 == --list-elf ]] && cat "$dir/causal_conv1d_cuda.list-elf.txt"'
                    ' || cat "$dir/causal_conv1d_cuda.list-ptx.txt";;\n'
                    'esac\n')
    tool.chmod(0o755)
    return str(tool)


def test_the_audit_passes_sm_90_code_on_hopper_and_names_what_is_missing_elsewhere(fake_cuobjdump, tmp_path):
    lib, host = tmp_path / "ext.so", tmp_path / "host_only.so"
    lib.write_bytes(b""), host.write_bytes(b"")
    ok = sass_audit.audit([lib, host], "9.0", fake_cuobjdump, require_device_code=False)
    assert ok["problems"] == [] and ok["libraries"] == {"ext.so": ["sm_90"], "host_only.so": []}
    bad = sass_audit.audit([lib], "8.0;9.0", fake_cuobjdump, require_device_code=True)
    assert bad["problems"] == ["ext.so has no code that runs on 8.0 (it carries sm_90): it would fail with "
                               "'no kernel image is available'"]
    assert sass_audit.audit([host], "9.0", fake_cuobjdump, require_device_code=True)["problems"] == \
        ["host_only.so carries no device code at all"]


# ---------------------------------------------------------------- extend


def test_extend_builds_a_cuda_extension_in_the_stack_image_and_refuses_another_version(matrix):
    compiled, rest = split_cuda_extensions(matrix, ["Flash_Attn", "einops>=0.7", "causal-conv1d==1.7.0"], "req.txt")
    assert compiled == ["causal-conv1d", "flash-attn"] and rest == ["einops>=0.7"]
    with pytest.raises(EnvbuildError) as e:
        split_cuda_extensions(matrix, ["flash-attn<2.8"], "req.txt")
    assert "builds flash-attn 2.8.3.post2 only" in str(e.value) and "'flash-attn==2.8.3.post2'" in str(e.value)


def test_extend_with_only_an_extension_renders_the_stack_image_with_it(cli, tmp_path):
    req = tmp_path / "req.txt"
    req.write_text("flash-attn\n")
    out = tmp_path / "out"
    r = cli("extend", "-r", str(req), "--gpu", "h100", "--stack", "torch2.11-cu130-py3.12", "-o", str(out))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["name"] for e in manifest["extensions"]] == ["flash-attn"] and "extend" not in manifest
    assert "there is no layer to add" in " ".join(r.stdout.split())


# ---------------------------------------------------------------- the smoke test's check


MANIFEST = {"extensions": [{"name": "flash-attn", "version": "2.8.3.post2", "arch_list": "9.0",
                            "gpu_check": "attention", "modules": ["flash_attn_2_cuda"], "packages": ["flash_attn"]}]}


def _record(tmp_path) -> str:
    path = tmp_path / "extensions.json"
    path.write_text(json.dumps([{"name": "flash-attn", "version": "2.8.3.post2", "sha256": "ab" * 32}]))
    return str(path)


def test_the_smoke_check_passes_an_imported_extension_and_its_gpu_numerics(tmp_path):
    res = {"extensions": {"flash-attn": {"ok": True, "detail": "", "gpu": {"ok": True, "max_abs_diff": 3e-3}}}}
    ok, detail = checks.check_extensions(MANIFEST, res, _record(tmp_path))
    assert ok and "flash-attn 2.8.3.post2 imports (wheel sha256 abababababab, SASS 9.0)" in detail
    res["extensions"]["flash-attn"]["gpu"]["max_abs_diff"] = 0.5
    assert not checks.check_extensions(MANIFEST, res, _record(tmp_path))[0]


def test_a_gpu_check_not_run_is_said_not_passed_over(tmp_path):
    res = {"extensions": {"flash-attn": {"ok": True, "detail": "", "gpu_skipped": "no GPU"}}}
    ok, detail = checks.check_extensions(MANIFEST, res, _record(tmp_path))
    assert ok and detail.endswith("SASS 9.0); GPU check not run (no GPU)"), detail


def test_an_undefined_symbol_is_reported_as_a_torch_swap(tmp_path):
    """The text of flash-attention#1691's traceback, as the child would record it."""
    detail = ("ImportError: /opt/venv/lib/python3.11/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: "
              "undefined symbol: _ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE")
    ok, msg = checks.check_extensions(MANIFEST, {"extensions": {"flash-attn": {"ok": False, "detail": detail}}},
                                      _record(tmp_path))
    assert not ok and "torch was replaced under it" in msg and "undefined symbol" in msg


def test_a_compiled_library_changed_after_install_is_named(tmp_path):
    """The installed .so against the sha256 pip wrote in RECORD (a wheel's own format)."""
    import base64
    import hashlib

    from envbuild.image.children import compiled_files_changed

    (tmp_path / "demo_cuda.so").write_bytes(b"\x7fELF built")
    info = tmp_path / "demo_ext-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-ext\nVersion: 1.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"\x7fELF built").digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"demo_cuda.so,sha256={digest},10\ndemo_ext-1.0.dist-info/RECORD,,\n")
    assert compiled_files_changed("demo-ext", [str(tmp_path)]) == ""
    (tmp_path / "demo_cuda.so").write_bytes(b"\x7fELF other")
    assert compiled_files_changed("demo_ext", [str(tmp_path)]).startswith("demo_cuda.so differs from the wheel's RECORD")
    (info / "RECORD").write_text("demo_ext-1.0.dist-info/RECORD,,\n")
    assert compiled_files_changed("demo-ext", [str(tmp_path)]) == "demo-ext: its RECORD lists no compiled library"


def test_no_build_record_fails_the_check(tmp_path):
    ok, msg = checks.check_extensions(MANIFEST, {"extensions": {"flash-attn": {"ok": True, "detail": ""}}},
                                      str(tmp_path / "none.json"))
    assert not ok and "no build record" in msg


def test_the_guard_check_wants_the_extension_pinned(tmp_path):
    path = tmp_path / "constraint.txt"
    path.write_text("deepspeed==0.19.8\nflash_attn==2.8.3.post2\ntorch==2.15.0\n")
    manifest = {**MANIFEST, "constraints": str(path), "torch": "2.15.0", "deepspeed": "0.19.8"}
    env = {"PIP_CONSTRAINT": str(path), "UV_CONSTRAINT": str(path)}
    assert checks.check_guard(manifest, env)[0]
    path.write_text("deepspeed==0.19.8\ntorch==2.15.0\n")
    ok, msg = checks.check_guard(manifest, env)
    assert not ok and "flash-attn==(missing) (want 2.8.3.post2)" in msg


def test_the_lock_check_counts_the_compiled_extension(tmp_path):
    lock, built = tmp_path / "lock.txt", tmp_path / "extensions-lock.txt"
    lock.write_text("# [venv]\ntorch==2.15.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    built.write_text("# [extensions] built in the builder stage\ncausal-conv1d==1.7.0 --hash=sha256:" + "1" * 64 + "\n")
    manifest = {"lock": {"path": str(lock), "sha256": "f" * 64}, "extensions": [{"name": "causal-conv1d", "lock": str(built)}]}
    ok, msg = checks.check_lock(manifest, {"torch": "2.15.0", "causal-conv1d": "1.7.0"})
    assert ok and "the compiled causal-conv1d" in msg
    assert not checks.check_lock({**manifest, "extensions": []}, {"torch": "2.15.0", "causal-conv1d": "1.7.0"})[0]


def test_the_extensions_listing_shows_each_patch_with_its_source(cli):
    r = cli("extensions", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip().startswith("patch setup.py")]
    # flash-attn's two and mamba-ssm's one (its g++ and nvcc flags in one text)
    assert len(lines) == 3 and all("for torch >=2.13" in line and "-std=c++20" in line for line in lines), lines
    assert "flash-attention/pull/2899" in r.stdout


def test_the_build_installs_an_extensions_own_lock_by_hash_before_it_and_records_its_pins(tmp_path, monkeypatch):
    """FA4's closure (matrices/locks/ext) goes in with --require-hashes --no-deps; its blocks join
    the image's extension lock, so the smoke test's `lock` check expects those packages."""
    step = build_step("extensions.py")
    calls = []
    monkeypatch.setattr(step, "pip", lambda *args, env=None: calls.append((args, (tmp_path / "requires-lock.txt").read_text())))
    block = "quack-kernels==0.6.5 \\\n    --hash=sha256:" + "a" * 64 + "\n"
    assert step.install_requires_lock({"name": "flash-attn-4", "version": "4.0.0b36", "requires_lock": block}, tmp_path) == [block]
    assert calls == [(("install", "--require-hashes", "--no-deps", "-r", str(tmp_path / "requires-lock.txt")), block)]
    assert step.install_requires_lock({"name": "x", "version": "1", "requires_lock": ""}, tmp_path) == [] and len(calls) == 1
    (tmp_path / "lock.txt").write_text("# [extensions]\n" + block)
    assert checks.lock_pins(str(tmp_path / "lock.txt"), "extensions") == {"quack-kernels": "0.6.5"}


def test_every_extensions_gpu_check_has_a_numerics_function_and_a_tolerance(production_matrix):
    """FA3, FA4, Transformer Engine, mamba-ssm and xformers each get a forward+backward check against a
    torch reference on a GPU node (run only where a GPU is present)."""
    from envbuild.image import children

    named = {e.name: e.gpu_check for e in production_matrix.extensions.values() if e.gpu_check}
    assert named == {"flash-attn": "attention", "causal-conv1d": "causal-conv1d", "flash-attn-3": "flash-attn-3",
                     "flash-attn-4": "flash-attn-4",
                     "transformer-engine-torch": "transformer-engine", "mamba-ssm": "selective-scan",
                     "xformers": "xformers"}
    assert set(named.values()) <= set(children.GPU_CHECKS) == set(checks.EXTENSION_TOLERANCE)


def test_a_pure_python_extension_imports_as_present_and_fitting_without_a_compiled_library():
    """FA4 is a py3-none-any wheel: the smoke test's import check passes it on its version (it has
    no .so whose RECORD hash to compare), where a compiled extension without one would fail."""
    from importlib import metadata

    from envbuild.image import children

    ext = {"name": "packaging", "version": metadata.version("packaging"), "packages": ["packaging"], "modules": []}
    assert children._import_extension(ext)["ok"], children._import_extension(ext)
    compiled = children._import_extension({**ext, "modules": ["packaging.version"]})
    assert not compiled["ok"] and "RECORD lists no compiled library" in compiled["detail"]


def test_transformer_engines_core_is_locked_with_its_meta_package_of_the_same_release():
    """The core wheel's transformer_engine/common/__init__.py asserts at import that the
    `transformer-engine` meta package of its own version is installed from a wheel: a core locked
    without it fails the build's import check (the opt-in TE cell found it)."""
    from conftest import ROOT
    from envbuild.knowledge.matrix import load_matrix

    m = load_matrix(ROOT / "matrices")
    cores = [e for e in m.extensions.values() if e.name.startswith("transformer-engine-cu")]
    assert len(cores) == 2
    for core in cores:
        major = core.name.removeprefix("transformer-engine-cu")
        assert f"transformer-engine=={core.version}" in core.requires_by_cuda[major], core.name
