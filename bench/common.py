"""Shared helpers for the benchmarks: build through envbuild itself, run containers, print
a table. Benchmarks measure; they assert nothing (tests do)."""

from __future__ import annotations

import contextlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from envbuild.supply.ci import real_build_stack  # noqa: E402  (this checkout's, not an installed one)
from envbuild.knowledge.matrix import load_matrix  # noqa: E402

OUT = ROOT / "bench" / "out"
DOCKER = "/usr/bin/docker"
BASE = "local/debian:bookworm"
# The production matrix's PyPI-toolchain stack on plain Debian (what CI builds for real).
STACK = real_build_stack(load_matrix()).id
REPO = "envbuild-bench"
CA = "/etc/ssl/certs/ca-certificates.crt"


def envbuild(*args, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "envbuild", *args], capture_output=True, text=True, cwd=ROOT)
    if check and r.returncode != 0:
        sys.exit(f"envbuild {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return r


def build_args(gpu: str, name: str, *extra: str) -> list[str]:
    """`envbuild build` of the CI stack on the debootstrap base into OUT/name."""
    return ["build", "--gpu", gpu, "--stack", STACK, "--base-image", BASE, "--ca-cert", CA,
            "--image-repo", REPO, "-o", str(OUT / name), *extra]


def build(gpu: str, name: str, *extra: str) -> tuple[str, float]:
    """Build through `envbuild build`; return (image ref, wall seconds)."""
    out = OUT / name
    t = time.monotonic()
    envbuild(*build_args(gpu, name, *extra))
    seconds = time.monotonic() - t
    tag = json.loads((out / "manifest.json").read_text())["tag"]
    return f"{REPO}:{tag}", seconds


def docker(*args, timeout=None, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        sys.exit(f"docker {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r


def inspect(image: str) -> dict:
    return json.loads(docker("image", "inspect", image).stdout)[0]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, no GPU"


def table(title: str, headers: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    text = "\n".join([f"### {title}", "", line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(line, rows)])
    print(text + "\n", flush=True)
    return text


@contextlib.contextmanager
def checkout(rev: str, where: Path):
    """Commit `rev` of this repository checked out at `where` (a detached git worktree), the
    baseline a benchmark runs beside this checkout; removed afterwards."""
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True, capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, capture_output=True)
