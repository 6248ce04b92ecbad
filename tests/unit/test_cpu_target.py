"""Portable CPU ops: cc-wrapper.sh turns DeepSpeed's -march=native/-D__AVX512__ into the
declared x86-64 level. Compiled and disassembled for real; the x86-64-v4 case is the
positive control that shows the check can fail."""

import os
import platform
import shutil
import subprocess

import pytest

from conftest import ROOT, cpu_target_env

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only exist on x86_64")

# The shape of DeepSpeed's csrc/includes/simd.h: the vector width follows the -D flag.
SIMD = r"""
#include <immintrin.h>
#if defined(__AVX512__)
#define SIMD_WIDTH 16
typedef __m512 vec;
#define LOAD _mm512_loadu_ps
#define FMA _mm512_fmadd_ps
#define STORE _mm512_storeu_ps
#elif defined(__AVX256__)
#define SIMD_WIDTH 8
typedef __m256 vec;
#define LOAD _mm256_loadu_ps
#define FMA _mm256_fmadd_ps
#define STORE _mm256_storeu_ps
#endif
extern "C" void step(float* p, const float* g, float lr, int n) {
    int i = 0;
#if defined(SIMD_WIDTH)
    for (; i + SIMD_WIDTH <= n; i += SIMD_WIDTH) {
        vec a = LOAD(p + i), b = LOAD(g + i);
        STORE(p + i, FMA(b, b, a));
    }
#endif
    for (; i < n; ++i) p[i] -= lr * g[i];
}
"""


def _compile(tmp_path, target):
    src = tmp_path / "simd.cpp"
    src.write_text(SIMD)
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    link = bindir / "g++"
    if not link.exists():
        link.symlink_to(ROOT / "templates" / "files" / "steps" / "cc-wrapper.sh")
    out = tmp_path / f"simd-{target}.o"
    env = {**os.environ, **cpu_target_env(target)}
    # Exactly the flags DeepSpeed's cpu_adam builder passes on an AVX-512 build machine.
    r = subprocess.run([str(link), "-O3", "-march=native", "-D__AVX512__", "-c", str(src), "-o", str(out)],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(out)], capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture(autouse=True)
def _needs_toolchain():
    for tool in ("objdump", "/usr/bin/g++"):
        assert shutil.which(tool), f"{tool} missing: apt-get install binutils g++"


def test_default_target_has_no_avx512(tmp_path):
    asm = _compile(tmp_path, "x86-64-v3")
    assert "%zmm" not in asm
    assert "%ymm" in asm and "vfmadd" in asm  # AVX2/FMA kept: v3 is not the scalar fallback


def test_v4_target_keeps_avx512(tmp_path):
    assert "%zmm" in _compile(tmp_path, "x86-64-v4")


def test_v2_target_is_scalar_sse(tmp_path):
    asm = _compile(tmp_path, "x86-64-v2")
    assert "%zmm" not in asm and "%ymm" not in asm
