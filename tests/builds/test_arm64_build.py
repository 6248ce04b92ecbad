"""The arm64 (Grace) image built and smoke-tested for real, under qemu-user emulation on this
x86-64 machine. Opt-in, because emulation is slow (see bench/RESULTS.md for how slow):

    bash scripts/host-setup.sh && bash scripts/host-setup-arm64.sh
    ENVBUILD_ARM64=1 python3 -m pytest tests/builds/test_arm64_build.py -m arm64 -s

It builds the GH200 image of the PyPI-toolchain stack on Debian 12 with the CPU ops
(cpu_adam, cpu_adagrad, cpu_lion, utils) from the arm64 debootstrap base in the local
registry (with --qemu: the stub CPU sysfs torch needs under qemu-user, templates/files/qemu), runs
the image's own smoke test under emulation, shows that every op library is
AArch64 code compiled for the declared CPU target (its DWARF producer string records the
compiler flags), and publishes it as a manifest list to the local registry. Timings go to
bench/out/arm64-emulated.json. CI builds arm64 natively on ubuntu-24.04-arm runners instead.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import conftest
from conftest import ci_stack_id, ROOT, remove_images, run_build, run_cli, unique

pytestmark = [
    pytest.mark.arm64,
    pytest.mark.skipif(os.environ.get("ENVBUILD_ARM64") != "1",
                       reason="opt-in: emulated arm64 build (about 90 min); set ENVBUILD_ARM64=1"),
]

REGISTRY = "127.0.0.1:5000"
BASE = f"{REGISTRY}/local/debian:bookworm-arm64"
REPO = unique("envbuild-arm64")
# Every CPU op by default. ENVBUILD_ARM64_OPS=cpu_adam builds one op: about 35 min less of
# emulated compiling (bench/RESULTS.md), for a re-check of the rest of the path.
OPS = os.environ.get("ENVBUILD_ARM64_OPS", "cpu_adam,cpu_adagrad,cpu_lion,utils")
RESULTS = ROOT / "bench" / "out" / "arm64-emulated.json"


docker = functools.partial(conftest.docker, timeout=600)


@pytest.fixture(scope="module")
def timings():
    data: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "stack": ci_stack_id(), "ops": OPS}
    yield data
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


@pytest.fixture(scope="module")
def image(tmp_path_factory, timings):
    binfmt = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not binfmt.is_file() or "enabled" not in binfmt.read_text():
        pytest.fail("no qemu-aarch64 binfmt handler: run scripts/host-setup-arm64.sh")
    if subprocess.run(["curl", "-sf", "-o", "/dev/null", f"http://{REGISTRY}/v2/local/debian/manifests/bookworm-arm64"],
                      capture_output=True).returncode != 0:
        pytest.fail(f"{BASE} missing: run scripts/host-setup-arm64.sh")
    out = tmp_path_factory.mktemp("arm64") / "build"
    state = out.parent / "state"
    start = time.monotonic()
    r = run_build("--gpu", "gh200", "--stack", ci_stack_id(), "--ds-ops", OPS, "--image-repo", REPO, "--qemu",
                  "-o", str(out), base_image=BASE, env={"ENVBUILD_STATE_DIR": str(state)}, timeout=4 * 3600)
    timings["build_seconds"] = round(time.monotonic() - start)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    yield {"ref": manifest["image"], "out": out, "manifest": manifest, "env": {"ENVBUILD_STATE_DIR": str(state)}}
    remove_images(REPO)


def test_the_image_is_arm64_with_the_declared_target(image):
    manifest = image["manifest"]
    assert (manifest["arch"], manifest["platform"], manifest["gpu"]) == ("aarch64", "linux/arm64", "gh200")
    assert manifest["cpu_target"] == "armv9-a"  # Debian 12's GCC 12.2 does not know neoverse-v2
    assert docker("image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", image["ref"]).stdout.strip() \
        == "linux/arm64"


def test_smoke_test_passes_under_emulation(image, timings):
    start = time.monotonic()
    r = run_cli("smoke", image["ref"], "--json", "--qemu", "--timeout", "5400", env=image["env"], timeout=6000)
    timings["smoke_seconds"] = round(time.monotonic() - start)
    report = json.loads(r.stdout)
    timings["smoke_checks"] = {c["name"]: ("skip" if c.get("skipped") else "ok" if c["ok"] else "FAIL")
                               for c in report["checks"]}
    timings["smoke_details"] = {c["name"]: c.get("detail", "") for c in report["checks"]}
    assert r.returncode == 0, json.dumps(report["checks"], indent=1)[-4000:]
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["cpu_arch"]["ok"] and "aarch64" in by_name["cpu_arch"]["detail"]
    assert by_name["no_jit"]["ok"] and by_name["cpu_adam"]["ok"]
    # The emulated CPU has Grace's 128-bit SVE (emulation.QEMU_CPU), so Inductor takes Grace's NEON path.
    assert "Inductor asimd" in by_name["torch_compile"]["detail"], by_name["torch_compile"]


def test_op_libraries_are_aarch64_code_for_the_target(image, tmp_path, timings):
    """`file` and `readelf -h` say AArch64 for every op library; in those of the ops whose builder
    asks for -march=native (cpu_adam, cpu_adagrad, cpu_lion), the DWARF producer string GCC wrote
    (DeepSpeed compiles them with -g) carries -march=armv9-a instead; no library says native."""
    for tool in ("file", "readelf"):
        assert shutil.which(tool), f"{tool} missing: scripts/host-setup-arm64.sh installs it"
    container = docker("create", "--platform", "linux/arm64", image["ref"]).stdout.strip()
    try:
        venv_ops = "/opt/venv/lib/python3.11/site-packages/deepspeed/ops"
        docker("cp", f"{container}:{venv_ops}", str(tmp_path / "ops"))
    finally:
        docker("rm", container, check=False)
    libraries = {lib.name.split(".")[0]: lib for lib in sorted((tmp_path / "ops").rglob("*.so"))}
    assert {f"{op}_op" for op in OPS.split(",")} <= set(libraries), sorted(libraries)
    evidence = {}
    for name, lib in libraries.items():
        kind = subprocess.run(["file", "-b", str(lib)], capture_output=True, text=True, check=True).stdout
        header = subprocess.run(["readelf", "-h", str(lib)], capture_output=True, text=True, check=True).stdout
        assert "ARM aarch64" in kind and re.search(r"Machine:\s+AArch64", header), (name, kind)
        info = subprocess.run(["readelf", "--debug-dump=info", str(lib)], capture_output=True, text=True).stdout
        producers = sorted(set(p.strip() for p in re.findall(
            r"DW_AT_producer\s*:\s*(?:\(indirect string[^)]*\):\s*)?(.+)", info)))
        assert not any("native" in p or "x86-64" in p for p in producers), (name, producers)
        if name != "utils_op":
            assert any("-march=armv9-a" in p for p in producers), (name, producers)
        evidence[name] = {"file": kind.strip(), "producer": next((p for p in producers if "-march" in p),
                                                                 producers[0] if producers else "")}
    timings["op_libraries"] = evidence


def test_publish_as_a_manifest_list(image, timings):
    """Push by platform to the local registry, merge the tag's manifest list, verify it."""
    env = image["env"]
    r = run_cli("push", image["ref"], "--registry", REGISTRY, "--by-platform", env=env, timeout=3600)
    assert r.returncode == 0, r.stderr
    digest = next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("digest "))
    tag = image["manifest"]["tag"]
    merged = run_cli("push", f"{REPO}:{tag}", "--registry", REGISTRY, "--merge", digest, env=env)
    assert merged.returncode == 0, merged.stderr
    verify = run_cli("push", f"{REPO}:{tag}", "--registry", REGISTRY, "--verify", env=env)
    assert verify.returncode == 0 and "linux/arm64" in verify.stdout, verify.stderr
    timings["published"] = verify.stdout.strip().splitlines()
