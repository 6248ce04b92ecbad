"""Run an image's GPU build steps and its smoke test on a GPU machine that has no Docker.

    python3 bench/gpu/device_check.py RENDER_DIR --sources DIR --out DIR [--dry-run]

RENDER_DIR is what `envbuild render` wrote for the stack that matches the machine's own torch
(its Python, torch and CUDA). The Dockerfile's own instructions are replayed on the machine:
its COPY lines lay the step scripts out where the image has them (/opt/envbuild-setup,
/opt/envbuild), the builder's RUN lines of the DeepSpeed and CUDA-extension steps run with
exactly their variables, then (after bench/gpu/cold_start.py, which needs ninja) the finish
step, and the runtime stage's ENV lines are set for the smoke test, run through the image's
entrypoint in GPU mode. The machine's torch stands in for the lock's (the venv step is not
replayed; /opt/venv is that torch's environment); nothing is fetched: pip reads only the
sdists and wheels in --sources (PIP_NO_INDEX), each still checked against the lock's hash.
Each phase has its own deadline and its output goes to --out; a phase that fails is reported
and the next one still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

# causal-conv1d's backward kernel alone compiled for 381 s on an H100 machine's 16 cores (one
# object, so more cores do not help): the build phase needs about 420 s with it.
PHASE_SECONDS = {"deps": 60, "build": 450, "cold_start": 150, "finish": 40, "smoke": 200}
STARTED = time.monotonic()
DEADLINE = float(os.environ.get("DEVICE_CHECK_SECONDS", "580"))  # the whole run, inside the device call's limit


def budget(name: str) -> float:
    """A phase's deadline: its own, cut to what is left of the whole run's."""
    return max(5.0, min(PHASE_SECONDS[name], DEADLINE - (time.monotonic() - STARTED)))


def instructions(dockerfile: str) -> list[tuple[str, str, str]]:
    """(stage, keyword, arguments) of each instruction, continuation lines joined, comments dropped."""
    out, stage, buffer = [], "", ""
    for raw in open(dockerfile, encoding="utf-8").read().splitlines():
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        text, buffer = buffer + line, ""
        keyword, _, rest = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage = rest.split()[-1]
        out.append((stage, keyword, rest.strip()))
    return out


def env_pairs(arguments: str, environ: dict) -> dict:
    """ENV a="b" c="d": the pairs, with ${VAR} expanded from `environ` as Docker does."""
    pairs = {}
    for word in shlex.split(arguments):
        name, _, value = word.partition("=")
        pairs[name] = re.sub(r"\$\{(\w+)\}", lambda m: environ.get(m.group(1), ""), value)
    return pairs


def run_command(arguments: str) -> str:
    """A RUN's shell command without its BuildKit --mount flags (secrets, caches: none here)."""
    words = arguments.split(" ")
    while words and words[0].startswith("--"):
        words.pop(0)
    return " ".join(words).strip()


def copy(render: str, arguments: str, log) -> None:
    """COPY SRC... DEST from the render folder (COPY --from=builder: already in place here)."""
    if arguments.startswith("--"):
        return
    *sources, dest = arguments.split()
    for source in sources:
        path = os.path.join(render, source)
        target = dest if not dest.endswith("/") else os.path.join(dest, os.path.basename(source.rstrip("/")))
        os.makedirs(os.path.dirname(target.rstrip("/")) or "/", exist_ok=True)
        if os.path.isdir(path):
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)
        log(f"COPY {source} -> {target}")


def phase(name: str, argv: list[str], env: dict, out: str, log) -> dict:
    """Run one phase under its deadline; its output to OUT/NAME.log; (rc, seconds) to the summary."""
    start = time.monotonic()
    with open(os.path.join(out, f"{name}.log"), "ab") as handle:
        try:
            rc = subprocess.run(argv, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                timeout=budget(name.split(".")[0])).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except OSError as error:
            rc = f"not run: {error}"
    seconds = round(time.monotonic() - start, 1)
    log(f"phase {name}: rc={rc} in {seconds}s")
    return {"rc": rc, "seconds": seconds}


def facts(out: str) -> dict:
    def text(argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            return f"unavailable: {error}"

    return {
        "gpu": text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"]),
        "nvcc": text(["nvcc", "--version"]).splitlines()[-1:],
        "torch": text([sys.executable, "-c", "import torch, json; print(json.dumps({'torch': torch.__version__, "
                       "'cuda': torch.version.cuda, 'nccl': '.'.join(map(str, torch.cuda.nccl.version())), "
                       "'capability': torch.cuda.get_device_capability()}))"]),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "kernel": os.uname().release,
    }


def built_record() -> dict:
    """The extensions' build record and the SASS each compiled library carries (cuobjdump)."""
    record = {}
    try:
        with open("/opt/envbuild/built/extensions.json", encoding="utf-8") as handle:
            record["extensions"] = json.load(handle)
    except (OSError, ValueError) as error:
        record["extensions"] = f"unreadable: {error}"
    site = subprocess.run(["/opt/venv/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    record["sass"] = {}
    for folder in ("deepspeed", "causal_conv1d_cuda", ""):
        root = os.path.join(site, folder)
        names = ([os.path.join(root, n) for n in os.listdir(site) if n.startswith("causal_conv1d") and n.endswith(".so")]
                 if not folder else [os.path.join(d, n) for d, _, files in os.walk(root) for n in files if n.endswith(".so")])
        for path in sorted(names):
            listing = subprocess.run(["cuobjdump", "--list-elf", path], capture_output=True, text=True)
            record["sass"][os.path.relpath(path, site)] = sorted(set(re.findall(r"sm_\w+", listing.stdout))) or \
                (listing.stderr.strip()[:200] or "no device code")
    return record


def cuda_home() -> str:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("render")
    parser.add_argument("--sources", required=True, help="the sdists and wheels pip may install (no index)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true", help="print the replayed steps, run nothing")
    args = parser.parse_args()
    render, out = os.path.abspath(args.render), os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    summary: dict = {"phases": {}}
    lines = []

    def log(msg):
        lines.append(f"{time.monotonic() - STARTED:6.1f}s {msg}")
        print(lines[-1], flush=True)
        with open(os.path.join(out, "summary.json"), "w") as handle:  # what is known so far, if killed
            json.dump(dict(summary, log=lines), handle, indent=2)

    steps = instructions(os.path.join(render, "Dockerfile"))
    builder = [(k, a) for s, k, a in steps if s == "builder"]
    runtime = [(k, a) for s, k, a in steps if s == "runtime"]
    # What the base image and the container runtime give a container: the driver's library path.
    base_env = {k: v for k, v in os.environ.items()
                if k in ("HOME", "PATH", "LANG", "TERM", "USER", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")}
    build_env = dict(base_env, PIP_NO_INDEX="1", PIP_FIND_LINKS=os.path.abspath(args.sources),
                     PYTHONUNBUFFERED="1")
    for keyword, arguments in builder:
        if keyword == "ENV":
            build_env.update(env_pairs(arguments, build_env))
    replay = [run_command(a) for k, a in builder if k == "RUN" and re.search(r"/(deepspeed|extensions)\.sh ", a)]
    finish = [run_command(a) for k, a in builder if k == "RUN" and "/finish.sh" in a]
    if args.dry_run:
        print(json.dumps({"build_env": build_env, "replay": replay, "finish": finish,
                          "copies": [a for k, a in builder + runtime if k == "COPY"]}, indent=2))
        return 0

    summary["facts"] = facts(out)
    log(f"facts: {json.dumps(summary['facts'])}")
    # The image's paths on this machine: /opt/venv is the machine's torch environment,
    # /usr/local/cuda its CUDA toolkit.
    home = cuda_home()
    if not os.path.exists("/usr/local/cuda") and home != "/usr/local/cuda":
        os.symlink(home, "/usr/local/cuda")
    prefix = sys.prefix  # the environment that holds the machine's torch
    if not os.path.exists("/opt/venv"):
        os.symlink(prefix, "/opt/venv")
    if not os.path.exists("/opt/venv/bin/pip"):  # the steps call the venv's pip by path
        with open("/opt/venv/bin/pip", "w") as handle:
            handle.write('#!/bin/sh\nexec /opt/venv/bin/python -m pip "$@"\n')
        os.chmod("/opt/venv/bin/pip", 0o755)
    log(f"CUDA_HOME /usr/local/cuda -> {os.path.realpath('/usr/local/cuda')}; /opt/venv -> {os.path.realpath('/opt/venv')}")
    wheels = sorted(os.path.join(args.sources, n) for n in os.listdir(args.sources) if n.endswith(".whl"))
    summary["phases"]["deps"] = phase("deps", ["/opt/venv/bin/pip", "install", "--no-index", "--no-deps", *wheels],
                                      build_env, out, log)
    for keyword, arguments in builder:
        if keyword == "COPY":
            copy(render, arguments, log)
    # The DeepSpeed ops and the CUDA extensions at once (independent steps; 16 cores).
    procs = []
    for index, command in enumerate(replay):
        name = "build." + ("deepspeed" if "deepspeed.sh" in command else "extensions")
        log(f"RUN {command}")
        handle = open(os.path.join(out, f"{name}.log"), "ab")
        procs.append((name, time.monotonic(), handle,
                      subprocess.Popen(["bash", "-o", "pipefail", "-c", command], env=build_env, stdout=handle,
                                       stderr=subprocess.STDOUT, start_new_session=True)))
    for name, start, handle, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, budget("build") - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:  # the whole step: pip and its compilers too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        handle.close()
        summary["phases"][name] = {"rc": rc, "seconds": round(time.monotonic() - start, 1)}
        log(f"phase {name}: {summary['phases'][name]}")
    here = os.path.dirname(os.path.abspath(__file__))
    summary["phases"]["cold_start"] = phase("cold_start", ["/opt/venv/bin/python", os.path.join(here, "cold_start.py"),
                                                           "--timeout", "120"], build_env, out, log)
    for command in finish:
        summary["phases"]["finish"] = phase("finish", ["bash", "-o", "pipefail", "-c", command], build_env, out, log)
    run_env = dict(base_env)
    for keyword, arguments in runtime:
        if keyword == "ENV":
            run_env.update(env_pairs(arguments, run_env))
        elif keyword == "COPY":
            copy(render, arguments, log)
    smoke = ["sh", "/opt/envbuild/entrypoint.sh", "/opt/venv/bin/python", "/opt/envbuild/smoke.py", "--json"]
    start = time.monotonic()
    with open(os.path.join(out, "smoke.json"), "wb") as stdout, open(os.path.join(out, "smoke.log"), "wb") as stderr:
        try:
            rc = subprocess.run(smoke, env=run_env, stdout=stdout, stderr=stderr, timeout=budget("smoke")).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    summary["phases"]["smoke"] = {"rc": rc, "seconds": round(time.monotonic() - start, 1)}
    log(f"phase smoke: {summary['phases']['smoke']}")
    summary["built"] = built_record()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
