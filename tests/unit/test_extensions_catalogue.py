"""The extensions of issue 42 (FA3, FA4, Transformer Engine, mamba-ssm, xformers, flash-attn on
Grace): render-time refusals with the rule and the combination that works, the one audit a PyPI
wheel and a compiled one pass (SASS, NEEDED CUDA libraries, torch symbols) made from a real
mismatched wheel, and the stable-ABI cache key."""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, build_step, run_here
from envbuild.base.errors import EnvbuildError
from envbuild.plan.components import extensions as ext_plan
from envbuild.resolve.resolver import Request, resolve

sys.path.insert(0, str(ROOT / "envbuild" / "buildsteps"))
import sass_audit  # noqa: E402  (a build step script: stdlib only)

XFORMERS = ROOT / "tests" / "fixtures" / "extensions" / "wheels" / "xformers-0.0.35"


# ---------------------------------------------------------------- refusals at render


def test_fa3_on_an_ampere_gpu_is_refused_naming_compute_capability_and_the_gpus_it_fits(matrix):
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="a100", extensions=("fa3",)))
    msg = str(e.value)
    assert "needs compute capability >= 9.0 and a100 is sm_80" in msg and "rule ext-gpu" in msg, msg
    assert msg.split("GPUs it fits: ")[1].split(";")[0] == "h100, h200, h800, h20"


def test_fa4_on_a_v100_is_refused_naming_compute_capability(matrix):
    with pytest.raises(EnvbuildError, match=r"flash-attn-4 4\.0\.0b36 needs compute capability >= 9\.0 and v100 "
                                            r"is sm_70 .*rule ext-gpu"):
        resolve(matrix, Request(gpu="v100", extensions=("fa4",)))


def test_flash_attn_on_gh200_renders_an_arm64_image(tmp_path):
    out = tmp_path / "out"
    r = run_here("render", "--gpu", "gh200", "--ext", "flash-attn", "-o", str(out))
    assert r.returncode == 0, r.stderr
    spec = json.loads((out / "envbuild" / "extensions.json").read_text())
    assert [e["name"] for e in spec["extensions"]] == ["flash-attn"] and spec["arch_list"] == "9.0"
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["arch"], manifest["platform"]) == ("aarch64", "linux/arm64")
    assert re.search(r"^FROM --platform=linux/arm64 \S+ AS builder$", (out / "Dockerfile").read_text(), re.M)
    assert spec["extensions"][0]["determines"]["cpu_arch"] == "aarch64"  # its own wheel-cache key


@pytest.mark.parametrize("asked, fix", [(("mamba-ssm",), "--ext causal-conv1d,mamba-ssm"),
                                        (("te",), "--ext transformer-engine-cu13,transformer-engine-torch")])
def test_an_extension_without_the_one_it_needs_is_refused_naming_the_ext_that_works(matrix, asked, fix):
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="h100", extensions=asked))
    assert "rule ext-needs" in str(e.value) and f"Nearest valid choice: {fix} " in str(e.value), str(e.value)


def test_the_core_wheel_of_another_cuda_major_is_refused_for_the_stack(production_matrix):
    with pytest.raises(EnvbuildError) as e:
        resolve(production_matrix, Request(gpu="h100", extensions=("transformer-engine-cu12", "te"),
                                stack="torch2.15-cu132-py3.12"))
    assert "transformer-engine-cu12 2.20.2 builds with CUDA >=12.0,<13, the stack has 13.2" in str(e.value)


# ---------------------------------------------------------------- the wheel chosen, or the sdist


def test_xformers_installs_pypis_wheel_where_it_fits_and_compiles_where_it_does_not(production_matrix):
    """CUDA 12.8 with torch 2.10: PyPI's cu12 stable-ABI wheel; CUDA 13: its sdist, compiled."""
    fits = ext_plan.spec(resolve(production_matrix, Request(gpu="h100", extensions=("xformers",),
                                                 stack="torch2.10-cu128-py3.12")), None)["extensions"][0]
    assert fits["wheel"]["filename"] == "xformers-0.0.35-py39-none-manylinux_2_28_x86_64.whl" and fits["sdist"] is None
    cu13 = ext_plan.spec(resolve(production_matrix, Request(gpu="h100", extensions=("xformers",),
                                                 stack="torch2.13-cu130-py3.12")), None)["extensions"][0]
    assert cu13["wheel"] is None and cu13["sdist"]["filename"] == "xformers-0.0.35.tar.gz"


# ---------------------------------------------------------------- the audit, on a real wheel


def test_the_real_cu12_xformers_library_is_refused_in_a_cuda_13_image_naming_libcudart():
    lib = XFORMERS / "_C.dynamic.so"
    assert sass_audit.link_problems(lib, "13") == [
        "_C.dynamic.so needs libcudart.so.12, a CUDA 12 library, and the image is CUDA 13 (built for another CUDA major)"]
    assert sass_audit.link_problems(lib, "12") == []


def test_a_torch_that_lacks_a_symbol_the_library_calls_is_named():
    """xformers calls only torch's stable C shim; a torch without one of those functions (older
    than the ABI it targets) is refused naming it."""
    needed, undefined, _ = sass_audit.elf_dynamic(XFORMERS / "_C.dynamic.so")
    assert "libcudart.so.12" in needed and "aoti_torch_abi_version" in undefined
    assert not [s for s in undefined if s.startswith(("_ZN3c10", "_ZN2at"))]  # the stable ABI: no C++ symbol of torch
    assert sass_audit.link_problems(XFORMERS / "_C.dynamic.so", "12", set(undefined)) == []
    older = set(undefined) - {"torch_call_dispatcher"}
    assert sass_audit.link_problems(XFORMERS / "_C.dynamic.so", "12", older) == [
        "_C.dynamic.so needs 1 torch symbol(s) this torch's libraries do not define, such as torch_call_dispatcher "
        "(built against another torch)"]


@pytest.fixture
def recorded_cuobjdump(tmp_path):
    """cuobjdump as it printed the real xformers _C.so (the listing recorded beside it)."""
    listing = (XFORMERS / "cuobjdump.txt").read_text()
    tool = tmp_path / "cuobjdump"
    tool.write_text("#!/usr/bin/env bash\n[[ $1 == --list-elf ]] && grep '^ELF' <<'EOF'\n" + listing + "EOF\n"
                    "[[ $1 == --list-ptx ]] && grep '^PTX' <<'EOF'\n" + listing + "EOF\nexit 0\n")
    tool.chmod(0o755)
    return str(tool)


def test_the_real_xformers_wheel_has_no_sass_for_blackwell_and_is_refused_there(recorded_cuobjdump):
    lib = XFORMERS / "_C.dynamic.so"
    assert sass_audit.audit([lib], "9.0", recorded_cuobjdump, require_device_code=True)["problems"] == []
    problems = sass_audit.audit([lib], "10.0", recorded_cuobjdump, require_device_code=True)["problems"]
    assert problems == ["_C.dynamic.so has no code that runs on 10.0 (it carries sm_75, sm_80, sm_90a): "
                        "it would fail with 'no kernel image is available'"]


@pytest.mark.skipif(os.environ.get("ENVBUILD_REAL_WHEELS") != "1", reason="opt-in: downloads 3.3 MB from PyPI")
def test_the_whole_pypi_wheel_gives_the_same_verdict(tmp_path):
    """The fixture is the wheel's library cut to its dynamic section: the whole file, fetched by
    its recorded sha256, gives the same answer."""
    url = ("https://files.pythonhosted.org/packages/a4/85/6d71f9b16f2ac647877e66ed4af723b3fbd477806ab8b8a89d39a362b85f/"
           "xformers-0.0.35-py39-none-manylinux_2_28_x86_64.whl")
    wheel = tmp_path / "x.whl"
    urllib.request.urlretrieve(url, wheel)
    import hashlib
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == "ccc73c7db9890224ab05f5fb60e2034f9e6c8672a10be0cf00e95cbbae3eda7c"
    with zipfile.ZipFile(wheel) as z:
        (tmp_path / "_C.so").write_bytes(z.read("xformers/_C.so"))
    assert sass_audit.elf_dynamic(tmp_path / "_C.so")[:2] == sass_audit.elf_dynamic(XFORMERS / "_C.dynamic.so")[:2]


def test_a_file_that_is_not_elf_is_named(tmp_path):
    (tmp_path / "x.so").write_bytes(b"not an ELF file")
    with pytest.raises(ValueError, match="is not a 64-bit little-endian ELF file"):
        sass_audit.elf_dynamic(tmp_path / "x.so")


# ---------------------------------------------------------------- the stable-ABI cache key


def _key(matrix, stack: str) -> str:
    res = resolve(matrix, Request(gpu="h100", extensions=("xformers",), stack=stack))
    return ext_plan.spec(res, None)["extensions"][0]["cache_key"]


def test_one_stable_abi_compile_serves_every_stack_of_its_cuda_major_and_never_another(production_matrix):
    matrix = production_matrix
    """xformers' sdist builds against torch's stable ABI (TORCH_STABLE_ONLY): torch 2.11, 2.12 and
    2.13 on CUDA 13.0 share one cached wheel; CUDA 13.2, another CUDA major's libraries or a
    torch below the ABI's floor never get it."""
    k11, k12, k13 = (_key(matrix, s) for s in ("torch2.11-cu130-py3.12", "torch2.12-cu130-py3.12",
                                                "torch2.13-cu130-py3.12"))
    assert k11 == k12 == k13
    assert _key(matrix, "torch2.15-cu132-py3.12") == k11  # CUDA 13.2 is the same major: the same ABI and runtime
    assert _key(matrix, "torch2.14-cu126-py3.12") != k11  # CUDA 12


def test_an_extension_on_torchs_full_abi_keeps_the_full_key(production_matrix):
    keys = {ext_plan.spec(resolve(production_matrix, Request(gpu="h100", extensions=("causal-conv1d",), stack=s)), None)
            ["extensions"][0]["cache_key"] for s in ("torch2.11-cu130-py3.12", "torch2.12-cu130-py3.12")}
    assert len(keys) == 2


def test_extensions_are_built_after_those_they_need(matrix):
    res = resolve(matrix, Request(gpu="h100", extensions=("mamba-ssm", "causal-conv1d"), stack="torch2.11-cu126-py3.12"))
    assert [e["name"] for e in ext_plan.spec(res, None)["extensions"]] == ["causal-conv1d", "mamba-ssm"]


def test_the_listing_names_every_new_extension_with_its_cpu_architectures(cli):
    r = cli("extensions", "--json")
    assert r.returncode == 0, r.stderr
    data = {e["name"]: e for e in json.loads(r.stdout)}
    assert {"flash-attn-3", "flash-attn-4", "transformer-engine-torch", "transformer-engine-cu12",
            "transformer-engine-cu13", "mamba-ssm", "xformers"} <= set(data)
    assert "gh200" in data["flash-attn"]["gpus"] and any("aarch64" in s for s in data["flash-attn"]["stacks"])
    assert data["flash-attn-3"]["stacks"] == [] and data["flash-attn-3"]["gpus"] == ["h100", "h200", "h800", "h20"]


def test_every_wheel_and_sdist_of_the_catalogue_is_a_distinct_pypi_file(production_matrix):
    files = [(f.url, f.sha256) for e in production_matrix.extensions.values()
             for f in [*([e.sdist] if e.sdist else []), *e.wheels]]
    by_url = dict(files)
    assert all(by_url[u] == h for u, h in files)  # one hash per file, wherever it is named
    assert all(Path(u).name.endswith((".whl", ".tar.gz")) for u, _ in files)


# ---------------------------------------------------------------- the build step's wheel path


def test_fa3_is_downloaded_as_the_flash_attn_sdist_it_is_built_from():
    step = build_step("extensions.py")
    assert step.sdist_project("flash_attn-2.8.3.post2.tar.gz") == ("flash_attn", "2.8.3.post2")
    assert step.sdist_project("transformer_engine_torch-2.20.2.tar.gz") == ("transformer_engine_torch", "2.20.2")


def _wheel_entry(data: bytes) -> dict:
    import hashlib
    return {"name": "xformers", "version": "0.0.35", "cuda_major": "13", "device_code": True,
            "wheel": {"filename": "xformers-0.0.35-py39-none-manylinux_2_28_x86_64.whl",
                      "sha256": hashlib.sha256(data).hexdigest()}}


def test_a_pypi_wheel_is_fetched_with_its_hash_required_and_refused_when_it_differs(tmp_path, monkeypatch):
    step, calls = build_step("extensions.py"), []

    def pip(*args, env=None):
        calls.append(args)
        out = Path(args[args.index("-d") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "xformers-0.0.35-py39-none-manylinux_2_28_x86_64.whl").write_bytes(b"what the index served")
    monkeypatch.setattr(step, "pip", pip)
    entry = _wheel_entry(b"what the index served")
    assert step.fetch_wheel(entry, tmp_path).read_bytes() == b"what the index served"
    assert "--require-hashes" in calls[0] and "--only-binary" in calls[0]
    assert (tmp_path / "wheel.txt").read_text() == f"xformers==0.0.35 --hash=sha256:{entry['wheel']['sha256']}\n"
    with pytest.raises(SystemExit):
        step.fetch_wheel(_wheel_entry(b"the file the matrix recorded"), tmp_path)


def test_the_build_refuses_pypis_cu12_xformers_library_in_a_cuda_13_image(tmp_path, monkeypatch, capsys,
                                                                        recorded_cuobjdump):
    """The same audit a compiled wheel passes: the real library's SASS fits sm_90, and its
    libcudart.so.12 does not fit CUDA 13: the build fails naming it."""
    step = build_step("extensions.py")
    monkeypatch.setattr(step, "shared_libraries", lambda name: [XFORMERS / "_C.dynamic.so"])
    monkeypatch.setattr(step.importlib.util, "find_spec", lambda name: None)  # no torch here: CUDA only
    with pytest.raises(SystemExit):
        step.audit_libraries(_wheel_entry(b""), "9.0", recorded_cuobjdump)
    assert "xformers: _C.dynamic.so needs libcudart.so.12, a CUDA 12 library, and the image is CUDA 13" in capsys.readouterr().err
    entry = {**_wheel_entry(b""), "cuda_major": "12"}
    assert step.audit_libraries(entry, "9.0", recorded_cuobjdump)["problems"] == []


# ---------------------------------------------------------------- the smoke test's report


def test_the_smoke_check_says_where_fa4_compiles_its_kernels(tmp_path, monkeypatch, production_matrix):
    """The report proves which way FA4's run-time compile goes in this container: the per-job
    directory env.sh set, or memory only where its cache is off."""
    from envbuild.image import checks
    fa4 = production_matrix.extension("fa4")
    manifest = {"extensions": [{"name": fa4.name, "version": fa4.version, "arch_list": "9.0", "gpu_check": None,
                                "modules": [], "packages": fa4.packages,
                                "run_time_compile": {"enable_env": fa4.run_time_compile.enable_env,
                                                     "cache_env": fa4.run_time_compile.cache_env}}]}
    record = tmp_path / "extensions.json"
    record.write_text(json.dumps([{"name": fa4.name, "version": fa4.version, "sha256": "cd" * 32}]))
    res = {"extensions": {fa4.name: {"ok": True, "detail": ""}}}
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/tmp/flash_attention_cute_dsl-42")
    ok, detail = checks.check_extensions(manifest, res, str(record))
    assert ok and detail.endswith("; kernels compile at first call into /tmp/flash_attention_cute_dsl-42 "
                                  "(FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, per job and node)"), detail
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    assert "kept in memory only" in checks.check_extensions(manifest, res, str(record))[1]


def test_env_sh_turns_fa4s_cache_on_in_the_per_job_directory_and_keeps_a_users_value(tmp_path):
    import subprocess
    env_sh = ROOT / "templates" / "files" / "env.sh"
    show = '. "$1"; echo "$FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED $FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"'
    base = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "ENVBUILD_LOCAL_DIR": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run(["sh", "-c", show, "sh", str(env_sh)], env=base, capture_output=True, text=True).stdout
    assert out.split("\n")[-2] == f"1 {tmp_path}/flash_attention_cute_dsl-77", out
    mine = {**base, "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/mine"}
    out = subprocess.run(["sh", "-c", show, "sh", str(env_sh)], env=mine, capture_output=True, text=True).stdout
    assert out.split("\n")[-2] == "0 /mine", out


@pytest.mark.parametrize("filename", ["../../etc/x.whl", "other-1.0.tar.gz", ".hidden.whl"])
def test_a_file_name_that_is_not_its_urls_last_part_is_refused_naming_the_field(tmp_path, filename):
    import shutil
    import yaml
    from envbuild.knowledge.matrix import load_matrix
    d = tmp_path / "m"
    shutil.copytree(ROOT / "matrices", d)
    data = yaml.safe_load((d / "extensions.yaml").read_text())
    data["extensions"][0]["sdist"]["filename"] = filename
    (d / "extensions.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(EnvbuildError, match=r"extensions\[0\] \(flash-attn\)\.sdist: .*is not the last part of its url"):
        load_matrix(d)
