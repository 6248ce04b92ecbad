"""Installing a locked stack: the way envbuild's build does it (the matrix's uv: uv pip install
--require-hashes --no-deps -r, one part of the lock at a time; pip until issue 41) vs a plain
`pip install -r` of the same lock (pip's resolver on; hash checking is on in all, because the
file carries hashes) and pip as the build used it, each into a fresh venv from the same warm
wheel cache, in the same run. Downloads are not measured: a first pass fills each tool's cache.

    python bench/lock_install.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import CA, ROOT, STACK, machine, table

from envbuild.knowledge.lock import load_lock  # noqa: E402  (common put this checkout first)
from envbuild.resolve.locking import uv_binary  # noqa: E402


def run(*args, env=None):
    # The host's own pip configuration (global constraints, extra local indexes, find-links)
    # would change what pip resolves: every installer sees PyPI only.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    r = subprocess.run(list(args), capture_output=True, text=True,
                       env={**clean, "PIP_CONFIG_FILE": os.devnull, "UV_NO_CONFIG": "1", **(env or {})})
    if r.returncode != 0:
        sys.exit(f"{' '.join(args[:6])} ... failed:\n{r.stderr[-3000:]}")


def fresh_venv(where: Path) -> Path:
    shutil.rmtree(where, ignore_errors=True)
    run(sys.executable, "-m", "venv", str(where))
    return where / "bin" / "python"


def main():
    lock = load_lock(ROOT / "matrices", STACK, "x86_64")
    work = Path(tempfile.mkdtemp(prefix="envbuild-bench-lock-"))
    part = work / "venv.txt"  # what the torch step installs: the venv but DeepSpeed (an sdist built later)
    part.write_text(lock.requirements("venv", exclude=("deepspeed",)))
    env = {"PIP_CACHE_DIR": str(work / "pip-cache"), "UV_CACHE_DIR": str(work / "uv-cache"), "PIP_CERT": CA,
           "SSL_CERT_FILE": CA, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    methods = {
        "pip --require-hashes --no-deps -r (the build before issue 41)": lambda py: run(
            str(py), "-m", "pip", "install", "-q", "--require-hashes", "--no-deps", "-r", str(part), env=env),
        "plain pip install -r (baseline)": lambda py: run(str(py), "-m", "pip", "install", "-q", "-r", str(part), env=env),
        # what the torch step runs (templates/files/steps/torch.sh, lib.sh uv_pip): the matrix's uv
        "envbuild: uv pip install --require-hashes --no-deps -r": lambda py: run(
            uv_binary(), "pip", "install", "-q", "--no-config", "--link-mode", "copy", "--require-hashes", "--no-deps",
            "--python", str(py), "--compile-bytecode", "-r", str(part), env=env),
    }
    for install in (methods["plain pip install -r (baseline)"], methods["envbuild: uv pip install --require-hashes --no-deps -r"]):
        install(fresh_venv(work / "warm"))  # fills pip's and uv's caches: downloads are not measured
    seconds = {}
    for name, install in methods.items():
        py = fresh_venv(work / "venv")
        start = time.monotonic()
        install(py)
        seconds[name] = time.monotonic() - start
    base = seconds["plain pip install -r (baseline)"]
    table(f"Installing the locked venv of {STACK} ({len(lock.sections['venv']) - 1} packages, warm caches) — "
          f"{machine()}", ["installer", "wall time (s)", "ratio to baseline"],
          [[name, f"{s:.0f}", f"{s / base:.2f}"] for name, s in seconds.items()])
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
