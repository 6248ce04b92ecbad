"""ARM64 (Grace, GB10) images: which stacks serve aarch64 GPUs, the CPU target of the ops,
the ops that build there, and the platform in every rendered format. Fast: no Docker.

The real build under qemu emulation is tests/builds/test_arm64_build.py (opt-in, ENVBUILD_ARM64=1)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from conftest import ROOT, cpu_target_env
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.matrix import load_matrix
from envbuild.plan import stack_plan
from envbuild.render.builddir import render_files
from envbuild.resolve.resolver import Request, explain_rows, resolve

WHEELS = ROOT / "tests" / "fixtures" / "wheels"
PYPI_STACK = "torch2.11-cu130-py3.11-pypi"  # the fixture matrix's Debian 12 PyPI-toolchain stack


def _missing(why: str):
    """A cross tool is not installed: skipped on a developer's machine, a failure where
    scripts/test.sh installed them (ENVBUILD_CROSS_TOOLS=1: CI), so these tests cannot
    silently stop running there."""
    if os.environ.get("ENVBUILD_CROSS_TOOLS") == "1":
        pytest.fail(why)
    pytest.skip(why)


def _requires(path: Path, machine: str) -> list[str]:
    """The Requires-Dist names of a real wheel METADATA that apply on Linux `machine`, Python 3.11."""
    env = {"platform_system": "Linux", "platform_machine": machine, "python_version": "3.11",
           "sys_platform": "linux", "extra": ""}
    names = []
    for line in path.read_text().splitlines():
        if line.startswith("Requires-Dist: "):
            req = Requirement(line.removeprefix("Requires-Dist: "))
            if req.marker is None or req.marker.evaluate(env):
                names.append(req.name)
    return names


@pytest.mark.parametrize("torch,cuda_on_aarch64", [("2.10.0", False), ("2.15.0", True)])
def test_cuda_platforms_agree_with_the_real_aarch64_wheels(production_matrix, torch, cuda_on_aarch64):
    """torch.yaml's cuda_platforms against the aarch64 wheels' own METADATA and version.py
    (saved from PyPI, URLs in the fixtures): 2.10.0's nvidia deps are marked
    platform_machine == "x86_64" and it is a +cpu build; 2.15.0's are unmarked (+cu132)."""
    fixture = WHEELS / f"torch-{torch}-cp311-manylinux_2_28_aarch64.METADATA"
    deps = _requires(fixture, "aarch64")
    has_cuda_deps = any(d.startswith(("nvidia-", "cuda-toolkit")) for d in deps)
    version = re.search(r"__version__ = '([^']+)'", fixture.read_text()).group(1)
    assert has_cuda_deps == cuda_on_aarch64 and version.endswith("+cpu") != cuda_on_aarch64
    assert any(d.startswith("nvidia-") for d in _requires(fixture, "x86_64"))  # the marker is the difference
    rel = production_matrix.torch_release(torch)
    assert ("aarch64" in rel.cuda_platforms) == cuda_on_aarch64


def test_stack_arches_come_from_torch_yaml(matrix):
    arches = {s.id: matrix.stack_arches(s) for s in matrix.stacks}
    assert arches["torch2.10-cu128-py3.12"] == ["x86_64"]  # aarch64 wheels CPU-only before 2.11
    assert arches["torch2.11-cu126-py3.12"] == ["x86_64"]  # PyPI's aarch64 wheel is the default cu130 build
    assert arches["torch2.11-cu130-py3.12"] == ["x86_64", "aarch64"]


def test_x86_gpus_keep_x86_images(matrix):
    r = resolve(matrix, Request(gpu="h100"))
    assert (r.arch, r.platform, r.cpu_target) == ("x86_64", "linux/amd64", "x86-64-v3")
    assert "--platform" not in render_files(r)["Dockerfile"].decode()


@pytest.mark.parametrize("gpu,stack,target", [
    ("gh200", PYPI_STACK, "armv9-a"),  # Debian 12's GCC 12.2 does not know neoverse-v2
    ("gh200", "torch2.11-cu130-py3.12", "neoverse-v2"),  # Ubuntu 24.04's GCC 13 does
    ("gb300", "torch2.11-cu130-py3.12", "neoverse-v2"),
    ("gb10", "torch2.11-cu130-py3.12", "armv9-a"),  # GB10's Cortex-X925/A725 are not Neoverse V2
])
def test_default_cpu_target_follows_the_host_cpu_and_the_os_compiler(matrix, gpu, stack, target):
    r = resolve(matrix, Request(gpu=gpu, stack=stack))
    assert (r.arch, r.platform, r.cpu_target) == ("aarch64", "linux/arm64", target)
    assert not r.tag.endswith(target)  # the default adds no tag suffix
    plan = stack_plan(r)
    deepspeed = next(step for step in plan.builder.steps if step.name == "deepspeed")
    assert ("ENVBUILD_CPU_TARGET", target) in deepspeed.env
    cpu = matrix.gpus_file.cpu_targets[target]  # the wrapper's flag and SIMD macro come from the plan
    assert {("ENVBUILD_CPU_FLAG", cpu.flag), ("ENVBUILD_CPU_SIMD", "-D__NEON__")} <= set(deepspeed.env)
    assert plan.manifest["cpu_target"] == target and plan.manifest["arch"] == "aarch64"


def test_cpu_target_override_is_checked_against_arch_and_gcc(matrix):
    r = resolve(matrix, Request(gpu="gh200", stack=PYPI_STACK, cpu_target="armv8-a"))
    assert r.cpu_target == "armv8-a" and r.tag.endswith("-armv8-a")
    with pytest.raises(EnvbuildError, match=r"x86_64 target and the image is aarch64"):
        resolve(matrix, Request(gpu="gh200", cpu_target="x86-64-v3"))
    with pytest.raises(EnvbuildError, match=r"aarch64 target and the image is x86_64"):
        resolve(matrix, Request(gpu="h100", cpu_target="neoverse-v2"))
    with pytest.raises(EnvbuildError, match=r"needs GCC >= 13 and debian12 ships GCC 12.2"):
        resolve(matrix, Request(gpu="gh200", stack=PYPI_STACK, cpu_target="neoverse-v2"))
    # Without --stack, the stack whose compiler knows the target is chosen, and --explain says why.
    assert resolve(matrix, Request(gpu="gh200", cpu_target="neoverse-v2")).stack.os == "ubuntu24.04"
    rows = {sid: why for sid, _, why in explain_rows(matrix, Request(gpu="gh200", cpu_target="neoverse-v2"))}
    assert "[cpu-target]" in rows[PYPI_STACK] and "GCC" in rows[PYPI_STACK]
    with pytest.raises(EnvbuildError, match=r"did you mean .*neoverse-v2"):
        resolve(matrix, Request(gpu="gh200", cpu_target="neoverse-v3"))


def test_ops_that_cannot_build_on_aarch64_are_refused_with_the_reason(matrix):
    r = resolve(matrix, Request(gpu="gh200", ds_ops="all"))
    dropped = dict(r.dropped_ops)
    assert "x86_64 only" in dropped["cutlass_ops"] and "aarch64" in dropped["cutlass_ops"]
    assert "cpu_adam" in r.ops and "fused_adam" in r.ops
    with pytest.raises(EnvbuildError, match=r"ragged_device_ops cannot be built for aarch64"):
        resolve(matrix, Request(gpu="gb200", ds_ops="ragged_device_ops"))
    # The same op on x86 is refused for its other reason only.
    x86 = dict(resolve(matrix, Request(gpu="h100", ds_ops="all")).dropped_ops)
    assert "aarch64" not in x86["cutlass_ops"]


def test_gpu_arch_rule_reads_the_aarch64_wheels_arch_list(matrix_copy):
    """An aarch64-hosted GPU whose arch the aarch64 wheels lack (they start at sm_80) is
    rejected by gpu-arch, naming the aarch64 wheel's list."""
    path = matrix_copy / "gpus.yaml"
    data = yaml.safe_load(path.read_text())
    data["profiles"].append({"name": "t4g", "cc": "7.5", "memory_gb": [16], "generation": "Turing", "host_arch": ["aarch64"],
                             "interconnect": "PCIe only"})
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    m = load_matrix(matrix_copy)
    rows = explain_rows(m, Request(gpu="t4g"))
    cuda_aarch64 = [why for sid, _, why in rows if sid == "torch2.11-cu130-py3.12"]
    assert "[gpu-arch]" in cuda_aarch64[0] and "(aarch64 wheel) is built for 8.0;9.0" in cuda_aarch64[0]
    with pytest.raises(EnvbuildError, match="no stack fits"):
        resolve(m, Request(gpu="t4g"))


def test_platform_in_every_rendered_format(matrix):
    files = render_files(resolve(matrix, Request(gpu="gh200", stack=PYPI_STACK)))
    dockerfile = files["Dockerfile"].decode()
    froms = [line for line in dockerfile.splitlines() if line.startswith("FROM ")]
    assert froms and all(line.startswith("FROM --platform=linux/arm64 ") for line in froms)
    assert "hadolint global ignore=DL3059,DL3029" in dockerfile
    standalone = files["Singularity.standalone.def"].decode()
    assert "apptainer build --arch arm64" in standalone
    assert standalone.count('[ "$(uname -m)" = aarch64 ] ||') == 2  # both stages refuse another machine
    assert "apptainer build --arch arm64" in files["Singularity.def"].decode()


@pytest.mark.parametrize("gpu", ["gh200", "gb200", "gb300", "gb10"])
def test_render_cli_for_grace_gpus(cli, gpu, tmp_path):
    r = cli("render", "--gpu", gpu, "-o", str(tmp_path / gpu))
    assert r.returncode == 0, r.stderr
    assert "FROM --platform=linux/arm64 " in (tmp_path / gpu / "Dockerfile").read_text()
    manifest = json.loads((tmp_path / gpu / "manifest.json").read_text())
    # The summary says what the image runs on before anyone builds it.
    assert f"platform     linux/arm64 (aarch64), CPU code built for {manifest['cpu_target']}\n" in r.stdout


def test_render_cli_refuses_an_x86_target_for_grace(cli):
    r = cli("render", "--gpu", "gh200", "--cpu-target", "x86-64-v3", "--print-tag")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "x86_64 target and the image is aarch64" in r.stderr


def test_every_cpu_target_flag_is_what_cc_wrapper_passes(production_matrix, tmp_path):
    """gpus.yaml's flag for each target is exactly what cc-wrapper.sh substitutes for
    DeepSpeed's -march=native (the wrapper is run, the compiler replaced by `echo`)."""
    link = tmp_path / "g++"
    link.symlink_to(ROOT / "templates" / "files" / "steps" / "cc-wrapper.sh")
    for name, target in production_matrix.gpus_file.cpu_targets.items():
        out = subprocess.run([str(link), "-O3", "-march=native", "-D__AVX512__", "-c", "x.cpp"], check=True,
                             env={"PATH": "/usr/bin:/bin", **cpu_target_env(name), "ENVBUILD_CC": "echo"},
                             capture_output=True, text=True).stdout.split()
        assert target.flag in out and "-march=native" not in out, (name, out)
        if target.arch == "aarch64":
            assert "-D__NEON__" in out and "-D__AVX512__" not in out, (name, out)


# The shape of DeepSpeed 0.19.8's csrc/includes/simd.h on ARM: NEON when -D__NEON__, else scalar.
NEON_SIMD = r"""
#if defined(__NEON__)
#include <arm_neon.h>
#endif
extern "C" void step(float* p, const float* g, float lr, int n) {
    int i = 0;
#if defined(__NEON__)
    float32x4_t vlr = vdupq_n_f32(lr);
    for (; i + 4 <= n; i += 4) vst1q_f32(p + i, vfmsq_f32(vld1q_f32(p + i), vld1q_f32(g + i), vlr));
#endif
    for (; i < n; ++i) p[i] -= lr * g[i];
}
"""


@pytest.mark.parametrize("target", ["armv8-a", "armv9-a"])
def test_cc_wrapper_compiles_aarch64_neon_code(tmp_path, target):
    """Through the wrapper, with the flags DeepSpeed passes on an SVE machine (-march=native
    -D__SVE__), Debian 12's aarch64 cross GCC 12 builds the NEON path for the declared target.
    scripts/host-setup-arm64.sh installs the cross compiler."""
    cross = shutil.which("aarch64-linux-gnu-g++")
    if cross is None:
        _missing("aarch64-linux-gnu-g++ missing: run scripts/host-setup-arm64.sh (g++-aarch64-linux-gnu)")
    src = tmp_path / "simd.cpp"
    src.write_text(NEON_SIMD)
    link = tmp_path / "g++"
    link.symlink_to(ROOT / "templates" / "files" / "steps" / "cc-wrapper.sh")
    obj = tmp_path / "simd.o"
    subprocess.run([str(link), "-O2", "-march=native", "-D__SVE__", "-c", str(src), "-o", str(obj)], check=True,
                   env={"PATH": "/usr/bin:/bin", **cpu_target_env(target), "ENVBUILD_CC": cross})
    asm = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    assert re.search(r"\bfmls\s+v\d+\.4s", asm), asm  # the NEON loop, not the scalar fallback
    # A target the compiler does not know fails the build instead of silently going generic.
    bad = subprocess.run([str(link), "-march=native", "-c", str(src), "-o", str(obj)], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", **cpu_target_env("neoverse-v2"),
                                         "ENVBUILD_CC": cross})
    assert bad.returncode != 0 and "neoverse-v2" in bad.stderr


SVE_PROBE = r"""
#include <stdio.h>
#include <sys/auxv.h>
#include <sys/prctl.h>
int main(void) {  /* HWCAP_SVE is bit 22 of AT_HWCAP, HWCAP2_SVE2 bit 1 of AT_HWCAP2; PR_SVE_GET_VL is 51 */
    int vl = prctl(51, 0, 0, 0, 0);
    printf("sve=%d sve2=%d vl_bits=%d\n", !!(getauxval(AT_HWCAP) & (1UL << 22)),
           !!(getauxval(AT_HWCAP2) & (1UL << 1)), vl < 0 ? -1 : (vl & 0xffff) * 8);
    return 0;
}
"""


def test_smoke_under_qemu_emulates_grace_s_128_bit_sve(tmp_path):
    """qemu's default CPU has 512-bit SVE, where torch reports SVE256 and Inductor's CPU code
    takes a path Grace never does (and GCC 12.2 rejects). QEMU_CPU, as `smoke --qemu` sets it,
    gives SVE2 with Grace's 128-bit vectors: a real aarch64 program asks the emulated kernel."""
    from envbuild.base.emulation import QEMU_CPU

    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if cross is None or qemu is None:
        _missing("aarch64-linux-gnu-gcc or qemu-aarch64-static missing: run scripts/host-setup-arm64.sh")
    (tmp_path / "probe.c").write_text(SVE_PROBE)
    subprocess.run([cross, "-static", "-O2", str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")], check=True)

    def probe(env):
        return subprocess.run([qemu, str(tmp_path / "probe")], env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    assert probe({"QEMU_CPU": QEMU_CPU}) == "sve=1 sve2=1 vl_bits=128"
    assert probe({}) != "sve=1 sve2=1 vl_bits=128"  # why the setting is needed


def test_smoke_cpu_arch_check_reads_the_op_libraries(tmp_path):
    """The in-image check: the machine and every op .so must be the manifest's architecture.
    Real ELF files: this host's x86-64 libc, and Debian's arm64 cross libc (libc6-arm64-cross)."""
    from envbuild.image.checks import check_cpu_arch, elf_arch

    arm_libc = Path("/usr/aarch64-linux-gnu/lib/libc.so.6")
    if not arm_libc.is_file():
        _missing("libc6-arm64-cross missing: run scripts/host-setup-arm64.sh")
    x86_libc = next(p for p in (Path("/lib/x86_64-linux-gnu/libc.so.6"), Path("/usr/lib/x86_64-linux-gnu/libc.so.6"))
                    if p.is_file())
    assert (elf_arch(str(x86_libc)), elf_arch(str(arm_libc))) == ("x86_64", "aarch64")
    ops = tmp_path / "ops" / "adam"
    ops.mkdir(parents=True)
    (ops / "cpu_adam_op.so").write_bytes(arm_libc.read_bytes())
    assert check_cpu_arch({"arch": "aarch64"}, machine="aarch64", ops_dir=str(tmp_path / "ops"))[0]
    ok, detail = check_cpu_arch({"arch": "aarch64"}, machine="x86_64", ops_dir=str(tmp_path / "ops"))
    assert not ok and "this machine is x86_64" in detail
    (ops / "cpu_lion_op.so").write_bytes(x86_libc.read_bytes())
    ok, detail = check_cpu_arch({"arch": "aarch64"}, machine="aarch64", ops_dir=str(tmp_path / "ops"))
    assert not ok and "cpu_lion_op.so=x86_64" in detail


def test_matrix_refuses_a_cpu_target_of_another_architecture(matrix_copy):
    path = matrix_copy / "gpus.yaml"
    path.write_text(path.read_text().replace("cpu_targets: [neoverse-v2, armv9-a]", "cpu_targets: [x86-64-v3]", 1))
    with pytest.raises(EnvbuildError, match=r"gh200.cpu_targets names 'x86-64-v3', which is not a cpu_targets entry "
                                            r"for its host_arch aarch64"):
        load_matrix(matrix_copy)


def test_an_os_whose_gcc_knows_no_target_is_a_rejection_not_a_crash(matrix_copy):
    path = matrix_copy / "bases.yaml"
    path.write_text(path.read_text().replace('gcc: "12.2"', 'gcc: "10.2"'))
    m = load_matrix(matrix_copy)
    rows = {sid: why for sid, _, why in explain_rows(m, Request(gpu="gh200"))}
    assert "[cpu-target] no CPU target for aarch64 that GCC 10.2 knows" in rows[PYPI_STACK]
    with pytest.raises(EnvbuildError, match="GCC 10.2"):
        resolve(m, Request(gpu="gh200", stack=PYPI_STACK))


def test_qemu_binds_the_stub_cpu_sysfs_into_the_deepspeed_step_only(matrix):
    """--qemu (an arm64 image built under qemu-user on x86-64): the step whose setup.py imports
    torch gets the stub /sys/devices/system/cpu, nothing else changes (the other steps keep their
    cache), Apptainer files are untouched, and an x86 image refuses it (it would do nothing)."""
    plain = render_files(resolve(matrix, Request(gpu="gh200", stack=PYPI_STACK)))
    emulated = render_files(resolve(matrix, Request(gpu="gh200", stack=PYPI_STACK, qemu=True)))
    bind = "--mount=type=bind,source=envbuild/qemu/cpu,target=/sys/devices/system/cpu "
    dockerfile = emulated["Dockerfile"].decode()
    assert dockerfile.count(bind) == 1
    deepspeed_run = next(block for block in dockerfile.split("\n\n") if "deepspeed.sh " in block and "RUN " in block)
    assert bind in deepspeed_run
    assert dockerfile.replace(bind, "") == plain["Dockerfile"].decode()
    for name in ("Singularity.def", "Singularity.standalone.def"):
        assert emulated[name] == plain[name]
    # the manifest records the request (qemu) and the rendered files' digest (the Dockerfile), nothing else
    recorded = [{k: v for k, v in json.loads(files["manifest.json"]).items() if k not in ("request", "render")}
                for files in (emulated, plain)]
    assert recorded[0] == recorded[1]
    assert emulated["envbuild/qemu/cpu/cpu0/regs/identification/midr_el1"].strip() == b"0x00000000410fd4f0"
    from envbuild.base.errors import EnvbuildError

    with pytest.raises(EnvbuildError, match=r"--qemu builds an arm64 image .* h100's image is x86_64.*rule qemu"):
        resolve(matrix, Request(gpu="h100", qemu=True))
