"""Reproducibility, measured in one run on this machine:

1. **The OS lock's cost** (`--os-cost`): the CI stack's two OS steps (the builder's compiler and
   headers, the runtime's Python with the fabric's verbs libraries) as the rendered Dockerfile runs
   them, through the real steps/os.sh, locked (every .deb pinned and checked, from the archive as
   of the lock's moment) and unlocked (the base's sources, apt's newest), each with --no-cache,
   alternating, ROUNDS times; both from the same Debian mirror.
2. **Two clean builds** (`--clean`): the CI stack with an OS lock built twice with --no-cache (no
   layer of the first serves the second), then `envbuild diff` of the two: files, packages and
   environment entries compared and differing, the image IDs, and the time of each step.

    python bench/reproducible.py --os-cost --rounds=3
    python bench/reproducible.py --clean        # about 20 minutes on 2 cores, 20 GB of disk
    python bench/reproducible.py --clean --compile-cache   # both through sccache on a Redis of its own:
                                                           # the second build's units served from it

The OS lock is made at the start with `envbuild lock --os ... --apt-snapshot live` (the snapshot
services cannot be reached from here), so both variants install from deb.debian.org.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BASE, CA, DOCKER, OUT, ROOT, STACK, docker, envbuild, machine, table

ROUNDS = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--rounds=")), "3"))
LIVE = "http://deb.debian.org/{archive}"


def locked_matrix() -> Path:
    """A copy of the production matrix with an OS lock of the CI stack on the debootstrap base."""
    matrix = OUT / "reproducible-matrix"
    shutil.rmtree(matrix, ignore_errors=True)
    shutil.copytree(ROOT / "matrices", matrix)
    envbuild("lock", "--os", "--stack", STACK, "--base-image", BASE, "--apt-snapshot", "live", "--matrix-dir", str(matrix))
    return matrix


def render(matrix: Path, name: str) -> Path:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    envbuild("render", "--gpu", "h20", "--stack", STACK, "--ds-ops", "cpu_adam,fused_adam", "--base-image", BASE,
             "--matrix-dir", str(matrix), "-o", str(out))
    return out


def os_steps(build_dir: Path) -> dict[str, list[str]]:
    """The rendered Dockerfile's OS steps per stage, as RUN lines that read the step scripts from
    the context (the builder COPYs them and the runtime binds them; here every step binds them)."""
    text = (build_dir / "Dockerfile").read_text()
    builder, runtime = text.split(" AS runtime\n", 1)
    steps = {}
    for stage, part in (("builder", builder), ("runtime", runtime)):
        steps[stage] = [_bound(block[block.index("RUN "):]) for block in part.split("\n\n")
                        if "os.sh" in block and "RUN " in block]
    return steps


def _bound(run: str) -> str:
    """A RUN line that binds the step scripts (the builder's COPYs them; its first mount may be apt's cache)."""
    bind = "--mount=type=bind,source=envbuild/steps,target=/opt/envbuild-setup"
    return run if bind in run else run.replace("RUN ", f"RUN {bind} ", 1)


def build_os(build_dir: Path, secrets: dict[str, str]) -> float:
    """The OS steps alone, each stage FROM the base as in the image, --no-cache; wall seconds."""
    steps = os_steps(build_dir)
    shell = 'SHELL ["/bin/bash", "-o", "pipefail", "-c"]'
    dockerfile = build_dir / "Dockerfile.os"
    dockerfile.write_text("\n".join([f"FROM {BASE} AS builder", shell, *steps["builder"],
                                     f"FROM {BASE} AS runtime", shell, *steps["runtime"],
                                     "COPY --from=builder /etc/debian_version /tmp/builder-done", ""]))
    with tempfile.TemporaryDirectory() as tmp:
        args = []
        for name, value in secrets.items():
            Path(tmp, name).write_text(value + "\n")
            args += ["--secret", f"id={name},src={Path(tmp, name)}"]
        start = time.monotonic()
        subprocess.run([DOCKER, "build", "--network", "host", "--no-cache", "-q", "-f", str(dockerfile), *args,
                        str(build_dir)], check=True, capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
        return time.monotonic() - start


def os_cost(matrix: Path) -> None:
    locked, unlocked = render(matrix, "repro-locked"), render(ROOT / "matrices", "repro-unlocked")
    times: dict[str, list[float]] = {"unlocked": [], "locked": []}
    for _ in range(ROUNDS):
        times["unlocked"].append(build_os(unlocked, {}))
        times["locked"].append(build_os(locked, {"apt_snapshot": LIVE}))
    lock = json.loads((locked / "manifest.json").read_text())["os_lock"]
    rows = [[name, sum(map(len, os_steps(d).values())), " / ".join(f"{t:.1f}" for t in times[name]), f"{statistics.median(times[name]):.1f}"]
            for name, d in (("unlocked", unlocked), ("locked", locked))]
    table(f"the CI stack's OS steps, --no-cache, {ROUNDS} rounds alternating ({machine()}); the lock pins "
          f"{lock['packages']} packages", ["variant", "OS steps", "seconds per round", "median s"], rows)
    ratio = statistics.median(times["locked"]) / statistics.median(times["unlocked"])
    print(f"locked / unlocked (median): {ratio:.2f}\n")


def clean_builds(matrix: Path, compile_cache: str | None = None) -> None:
    """Two --no-cache builds and their diff; with `compile_cache` (a Redis URL) both compile
    through it: the first fills it, the second is served from it (its hits printed)."""
    refs, seconds = [], []
    for n in (1, 2, 3) if compile_cache else (1, 2):
        out = OUT / f"repro-clean{n}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.monotonic()
        # the third: one more op (fused_lamb), to see the compile cache serve all but its units
        ops = "cpu_adam,fused_adam" + (",fused_lamb" if n == 3 else "")
        r = subprocess.run([sys.executable, "-m", "envbuild", "build", "--gpu", "h20", "--stack", STACK, "--ds-ops",
                            ops, "--base-image", BASE, "--matrix-dir", str(matrix), "--image-repo",
                            "envbuild-bench-clean", "--apt-snapshot", LIVE, "--ca-cert", CA, "-o", str(out),
                            *(("--compile-cache", compile_cache) if compile_cache else ())],
                           cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "ENVBUILD_DOCKER_BUILD_ARGS": "--no-cache"})
        if r.returncode != 0:
            sys.exit(r.stderr[-3000:])
        seconds.append(time.monotonic() - start)
        for line in re.findall(r"envbuild: compiles (\{.*\})$", (out / "build.log").read_text(), re.M):
            said = json.loads(line)
            print(f"build {n}, {said.get('step')}: misses {said.get('misses', {})}, hits {said.get('hits', {})}")
        tag = json.loads((out / "manifest.json").read_text())["tag"]
        docker("tag", f"envbuild-bench-clean:{tag}", f"envbuild-bench-clean:build{n}")
        refs.append(f"envbuild-bench-clean:build{n}")
    refs = refs[:2]  # the two builds of the same files
    start = time.monotonic()
    diff = json.loads(envbuild("diff", *refs, "--json", check=False).stdout)
    took = time.monotonic() - start
    rows = [[what, diff["compared"].get(what, ""), diff["differing"].get(what, 0)]
            for what in ("files", "python", "os", "env", "layers")]
    rows += [["labels", "", diff["differing"]["labels"]], ["config", "", diff["differing"]["config"]]]
    table(f"two clean builds of {STACK} (--no-cache each; {machine()})", ["compared", "entries", "differing"], rows)
    print(f"build seconds: {seconds[0]:.0f}, {seconds[1]:.0f}; envbuild diff: {took:.0f} s")
    print(f"image IDs: {diff['a']['id'][:19]} {diff['b']['id'][:19]} ({'same' if diff['a']['id'] == diff['b']['id'] else 'differ'})")
    layers = [json.loads(docker("image", "inspect", ref).stdout)[0]["RootFS"]["Layers"] for ref in refs]
    same = sum(a == b for a, b in zip(*layers))
    print(f"layer diff IDs (sha256 of each uncompressed layer): {same} of {len(layers[0])} the same")
    for d in diff["differences"][:20]:
        print(f"  {d['section']}: {d['key']}: {d['a']} | {d['b']}")


def main() -> None:
    matrix = locked_matrix()
    if "--os-cost" in sys.argv:
        os_cost(matrix)
    if "--clean" in sys.argv and "--compile-cache" in sys.argv:
        from layer_cache import own_redis

        with tempfile.TemporaryDirectory(dir="/var/tmp") as work, own_redis(Path(work)) as redis:
            clean_builds(matrix, redis)
    elif "--clean" in sys.argv:
        clean_builds(matrix)


if __name__ == "__main__":
    main()
