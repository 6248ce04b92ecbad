"""How fast `envbuild doctor` reads logs, against `grep -E` with the same patterns and against
doctor as it was before the block scan (a baseline commit), all measured in one run; and what it
does with hostile input (a 1 GiB log, random bytes, an endless stream, a gzip bomb).

The patterns grep gets are the `pattern` expressions of matrices/known_issues.yaml translated to
POSIX ERE: groups unnamed, \\d \\s \\w as character classes, lazy quantifiers made greedy and
lookarounds and back-references dropped, so grep matches a superset of what doctor matches and
has no context, ranks, joins or waits to keep. It runs with LC_ALL=C (its fastest). The inputs
are built from the project's own fixtures and written under bench/out/doctor (git-ignored).

    python3 bench/doctor.py [--baseline REV] [--big-gib N] [--skip-baseline]
"""

from __future__ import annotations

import argparse
import gzip
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "doctor"
LOGS = ROOT / "tests" / "fixtures" / "logs"
TRAINING = ["qwen-672-training-clean.log", "transformers-14531-deepspeed-training-clean.log",
            "megatron-deepspeed-356-clean.log", "transformers-9415-srun-training-clean.log"]
NCCL = ["nccl-1357-ib-sharp-clean.log", "nccl-360-eth-socket-clean.log", "detectron2-4730-eth-socket-clean.log",
        "nccl-226-aws-socket-clean.log"]
MIB = 1 << 20
SHORT_LINES = 10_000_000


def write_repeated(path: Path, text: str, size: int):
    """`text` repeated to `size` bytes (a long run of one job's output)."""
    if path.exists() and path.stat().st_size >= size:
        return
    block = (text * (MIB // max(len(text), 1) + 1)).encode()
    with open(path, "wb") as f:
        written = 0
        while written < size:
            f.write(block)
            written += len(block)


def inputs(big_gib: float) -> dict[str, Path]:
    OUT.mkdir(parents=True, exist_ok=True)
    short = OUT / "short.log"  # the issue's case: many short lines
    if not short.exists() or lines_of(short) != SHORT_LINES:
        with open(short, "w") as f:
            f.writelines(f"step {i} loss {1 / (i + 1):.4f}\n" if i % 3 else f"[rank{i % 8}]:it {i}\n"
                         for i in range(SHORT_LINES))
    training = "".join((LOGS / name).read_text(errors="replace") for name in TRAINING)
    nccl = "".join((LOGS / name).read_text(errors="replace") for name in NCCL)
    write_repeated(OUT / "training.log", training, 200 * MIB)
    write_repeated(OUT / "nccl.log", nccl, 100 * MIB)
    write_repeated(OUT / "big.log", training, int(big_gib * 1024 * MIB))
    return {f"{SHORT_LINES:,} short lines": short, "training output": OUT / "training.log",
            "NCCL INFO lines": OUT / "nccl.log", f"one log of {big_gib:g} GiB": OUT / "big.log"}


def hostile() -> dict[str, tuple[Path, tuple[str, ...]]]:
    binary = OUT / "random.bin"
    if not binary.exists():
        binary.write_bytes(os.urandom(100 * MIB))
    bomb = OUT / "bomb.log.gz"
    if not bomb.exists():
        with gzip.open(bomb, "wb", compresslevel=9) as f:
            for _ in range(1024):
                f.write(b"\n" * MIB)
    return {"random bytes (100 MiB)": (binary, ()),
            f"gzip bomb ({bomb.stat().st_size // 1024} KiB -> 1 GiB of newlines), default budget": (bomb, ()),
            "the same gzip bomb, --max-bytes 256M": (bomb, ("--max-bytes", "256M"))}


def to_ere(pattern: str) -> str:
    """A Python `re` expression as POSIX ERE for grep -E: a superset where lookarounds are dropped."""
    out, i = [], 0
    classes = {"d": "[0-9]", "D": "[^0-9]", "s": "[[:space:]]", "S": "[^[:space:]]", "w": "[[:alnum:]_]",
               "W": "[^[:alnum:]_]"}
    inside = {"d": "0-9", "s": "[:space:]", "w": "[:alnum:]_"}
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            n = pattern[i + 1]
            out.append(classes.get(n, "\\" + n))
            i += 2
        elif c == "[":
            end = i + 1 + (pattern[i + 1] in "^]") + (pattern[i + 1:i + 3] == "^]")
            while pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            body = re.sub(r"\\([dsw])", lambda m: inside[m.group(1)], pattern[i + 1:end])
            body = body.replace("\\]", "]").replace("\\\\", "\\").replace("\\", "")
            out.append("[" + body + "]")
            i = end + 1
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!", "(?P="), i):
            depth, j = 0, i
            while True:  # skip the whole lookaround
                if pattern[j] == "\\":
                    j += 2
                    continue
                depth += pattern[j] == "("
                depth -= pattern[j] == ")"
                j += 1
                if depth == 0:
                    break
            i = j
        elif pattern.startswith("(?:", i):
            out.append("(")
            i += 3
        elif pattern.startswith("(?P<", i):
            out.append("(")
            i = pattern.index(">", i) + 1
        elif c in "+*?}" and i + 1 < len(pattern) and pattern[i + 1] == "?":
            out.append(c)
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def grep_patterns() -> tuple[Path, list[str]]:
    issues = yaml.safe_load((ROOT / "matrices" / "known_issues.yaml").read_text())["issues"]
    patterns, dropped = [], []
    for issue in issues:
        for alternative in issue["pattern"] if isinstance(issue["pattern"], list) else [issue["pattern"]]:
            ere = to_ere(alternative)
            ok = subprocess.run(["grep", "-E", "-e", ere, "/dev/null"], capture_output=True).returncode == 1
            (patterns if ok else dropped).append(ere if ok else issue["id"])
    path = OUT / "patterns.ere"
    path.write_text("\n".join(patterns) + "\n")
    return path, dropped


def timed(argv: list[str], env=None, stdin=None, cwd=ROOT) -> tuple[float, float, int, int, str]:
    """(CPU seconds, wall seconds, max RSS KiB, exit status, stdout) of a command, from
    /usr/bin/time. CPU time (user + system) is what the tables compare: the build machine is
    shared, and wall time there measures the neighbours as much as the command."""
    r = subprocess.run(["/usr/bin/time", "-f", "%U %S %e %M", *argv], capture_output=True, text=True, env=env,
                       stdin=stdin, cwd=cwd)
    user, system, wall, rss = r.stderr.strip().splitlines()[-1].split()
    return float(user) + float(system), float(wall), int(rss), r.returncode, r.stdout


def doctor(checkout: Path, log: Path, *extra: str, stdin=None) -> tuple[float, float, int, int, str]:
    # `python -m` puts the working directory first on sys.path: run in the checkout measured.
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return timed([sys.executable, "-m", "envbuild", "doctor", *extra, str(log)], env=env, stdin=stdin, cwd=checkout)


def machine() -> str:
    """The line RESULTS.md headings carry: architecture, cores, CPU model, memory."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    kib = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0)
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {kib / (1 << 20):.0f} GiB"


def lines_of(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(MIB), b""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="857aa91", help="the commit whose doctor is the baseline")
    parser.add_argument("--big-gib", type=float, default=1.0)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    logs = inputs(args.big_gib)
    patterns, dropped = grep_patterns()
    grep_env = {**os.environ, "LC_ALL": "C"}
    with tempfile.TemporaryDirectory() as tmp:
        baseline = Path(tmp) / "baseline"
        if not args.skip_baseline:
            subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=ROOT,
                           check=True, capture_output=True)
        try:
            print(f"{machine()}, Python {platform.python_version()}; "
                  f"grep: {subprocess.run(['grep', '--version'], capture_output=True, text=True).stdout.splitlines()[0]}; "
                  f"{len(patterns.read_text().splitlines())} ERE patterns ({len(dropped)} not translatable: {dropped})\n")
            print("| input | size | lines | doctor CPU | doctor wall | doctor lines/s | doctor max RSS | grep -E -c CPU "
                  f"| grep lines/s | doctor / grep | doctor at {args.baseline}, CPU | speed-up |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for name, log in logs.items():
                n = lines_of(log)
                cpu, wall, rss, _, _ = doctor(ROOT, log)
                grep_cpu = timed(["grep", "-E", "-c", "-f", str(patterns), str(log)], env=grep_env)[0]
                base = speedup = "-"
                if not args.skip_baseline and log.stat().st_size < 512 * MIB:
                    base_cpu = doctor(baseline, log)[0]
                    base, speedup = f"{base_cpu:.1f} s", f"{base_cpu / cpu:.1f}x"
                print(f"| {name} | {log.stat().st_size / MIB:.0f} MiB | {n:,} | {cpu:.1f} s | {wall:.1f} s | "
                      f"{n / cpu:,.0f} | {rss / 1024:.0f} MiB | {grep_cpu:.2f} s | {n / max(grep_cpu, 0.01):,.0f} | "
                      f"{cpu / max(grep_cpu, 0.01):.0f}x | {base} | {speedup} |")
        finally:
            if not args.skip_baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, capture_output=True)
    print("\n| hostile input | doctor's answer | exit | CPU | wall | max RSS |")
    print("|---|---|---|---|---|---|")
    for name, (path, extra) in hostile().items():
        cpu, wall, rss, code, out = doctor(ROOT, path, *extra)
        answer = "refused: not text" if code == 2 else next((line for line in out.splitlines()
                                                            if line.startswith("Not read")), "read to the end")
        print(f"| {name} | {answer} | {code} | {cpu:.1f} s | {wall:.1f} s | {rss / 1024:.0f} MiB |")
    endless = subprocess.Popen(["yes", "step 1 loss 0.5"], stdout=subprocess.PIPE)
    try:
        cpu, wall, rss, code, out = doctor(ROOT, Path("-"), "--max-seconds", "10", stdin=endless.stdout)
    finally:
        endless.kill()
        endless.wait()
    stopped = next((line for line in out.splitlines() if line.startswith("Not read")), "?")
    print(f"| endless stream on stdin (`yes`, --max-seconds 10) | {stopped} | {code} | {cpu:.1f} s | {wall:.1f} s | "
          f"{rss / 1024:.0f} MiB |")


if __name__ == "__main__":
    main()
