"""How long the commands that fold the whole matrix take, against a baseline checkout measured in
the same run: `envbuild ci` (resolves every variant the publish job builds: each resolve asks the
matrix digest and its stack's lock), `envbuild matrix --json` (every stack, its lock and what is
pinned) and `envbuild doctor` on a real log (loads every message catalogue, hundreds of KB of YAML).

The baseline is another commit of this repository (default 905d474: before the matrix digest and
the parsed locks were kept while their files are unchanged and YAML within the bounds was read with
libyaml), checked out with `git worktree` into a temporary directory; both run from source with the
same Python, interleaved, so load on the machine hits both alike. Prints medians and the ratio this
checkout / baseline.

    python3 bench/plan_speed.py [--baseline REV] [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import checkout, machine, table

ROOT = Path(__file__).resolve().parent.parent
LOG = "tests/fixtures/logs/areal-639-socket-bond.log"  # a public issue's log (its URL: tests/fixtures/logs/INDEX.yaml)
COMMANDS = {"ci": ["ci", "-o", "{out}/publish.yml"], "matrix --json": ["matrix", "--json"],
            "doctor LOG": ["doctor", str(ROOT / LOG)]}


def _time(checkout: Path, args: list[str], out: Path) -> float:
    argv = [sys.executable, "-m", "envbuild", *(a.replace("{out}", str(out)) for a in args)]
    start = time.perf_counter()
    r = subprocess.run(argv, cwd=out, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(checkout)}, capture_output=True)
    if r.returncode not in (0, 3):  # doctor: 3 when it recognised something
        raise SystemExit(f"{' '.join(args)} in {checkout} failed: {r.stderr.decode()[-600:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="905d474")
    parser.add_argument("--runs", type=int, default=7)
    opts = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="envbuild-bench-") as tmp:
        with checkout(opts.baseline, Path(tmp) / "baseline") as base:
            for i in range(opts.runs):
                for name, args in COMMANDS.items():
                    for label, tree in (("baseline", base), ("this", ROOT)):
                        out = Path(tmp) / f"{label}-{i}"
                        out.mkdir(exist_ok=True)
                        times.setdefault((name, label), []).append(_time(tree, args, out))
    print(f"{machine()}; {opts.runs} runs each, interleaved; baseline {opts.baseline}")
    rows = []
    for name in COMMANDS:
        b, t = (statistics.median(times[(name, label)]) for label in ("baseline", "this"))
        rows.append([name, f"{b:.2f}", f"{t:.2f}", f"{t / b:.2f}"])
    table("commands that fold the whole matrix", ["command", "baseline s", "this s", "ratio"], rows)


if __name__ == "__main__":
    main()
