"""How long the commands a user types first take, against a baseline checkout measured in the
same run: `envbuild --help`, `envbuild render --gpu h20` and `envbuild gpus --json`.

The baseline is another commit of this repository (default: the first parent of the commit
that split the CLI into a package, 28d6e3d), checked out with `git worktree` into a temporary
directory; both run from source with the same Python, interleaved, so load on the machine
hits both alike. Prints medians and the ratio this checkout / baseline.

    python3 bench/cli_latency.py [--baseline REV] [--runs N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import checkout

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {"--help": ["--help"], "render --gpu h20": ["render", "--gpu", "h20", "-o", "{out}"],
            "gpus --json": ["gpus", "--json"]}


def _time(checkout: Path, args: list[str], out: Path) -> float:
    argv = [sys.executable, "-m", "envbuild", *(a.replace("{out}", str(out)) for a in args)]
    start = time.perf_counter()
    subprocess.run(argv, cwd=out.parent, env={**os.environ, "PYTHONPATH": str(checkout)}, check=True,
                   capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="28d6e3d")
    parser.add_argument("--runs", type=int, default=15)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="envbuild-bench-") as tmp:
        with checkout(opts.baseline, Path(tmp) / "baseline") as base:
            times: dict[tuple[str, str], list[float]] = {}
            for i in range(opts.runs):
                for name, args in COMMANDS.items():
                    for label, tree in (("baseline", base), ("this", ROOT)):
                        out = Path(tmp) / f"{label}-{i}"
                        out.mkdir(exist_ok=True)
                        times.setdefault((name, label), []).append(_time(tree, args, out / "build"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{opts.runs} runs each, interleaved; baseline {opts.baseline}")
    print(f"{'command':<20} {'baseline s':>11} {'this s':>8} {'ratio':>6}")
    for name in COMMANDS:
        b, t = (statistics.median(times[(name, label)]) for label in ("baseline", "this"))
        print(f"{name:<20} {b:>11.3f} {t:>8.3f} {t / b:>6.2f}")


if __name__ == "__main__":
    main()
