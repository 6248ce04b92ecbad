"""What a republish costs with the caches of issue "cost at matrix scale", measured in one run on
this machine: the CI stack's h20 image (DeepSpeed's cpu_adam and fused_adam compiled for sm_90)
built on an **empty engine** each time (a dockerd of its own, its own data root and containerd:
what a fresh CI runner has, BuildKit's cache mounts empty too), against a registry and a Redis of
the bench's own:

1. **baseline**: cold, no cache (what every publish run did before);
2. **cold**: the first run of a job: exports the layer cache (the builder stage and the image with
   its inline cache) and fills the compile cache (sccache on Redis, `--compile-cache`);
3. **warm**: a republish of the unchanged job: imports both layer references and builds nothing;
4. **one more op**: the same job with fused_lamb added: the layers up to DeepSpeed's step are
   pulled, DeepSpeed's wheel has a new key, and the compile cache serves every unit but
   fused_lamb's.

For each: wall time, the BuildKit `RUN` steps that ran, the compiling steps among them
(DeepSpeed's op build, the CUDA extensions), and the units the compilers compiled: the compile
cache's misses by category (`c++ [gcc]`, `cuda [nvcc]`, `ptx [cicc]`, `cubin [ptxas]`) from each
step's `envbuild: compiles` line, and its hits. The ratio is each run's wall time / baseline's.

    python bench/layer_cache.py          # about an hour on 2 cores, 30 GB of disk; redis-server

The engines start with only the debootstrap base loaded (`docker save | docker load`): no registry
serves local/debian, and the same image ID keeps the cache keys equal across engines.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BASE, CA, DOCKER, ROOT, STACK, envbuild, machine, table
from publish_steps import own_registry

COMPILING = ("deepspeed.sh", "extensions.sh")  # the steps (templates/files/steps) that run nvcc and g++


@contextlib.contextmanager
def empty_engine(work: Path, name: str):
    """A dockerd of its own, empty but for the base image; DOCKER_HOST points at it inside."""
    exec_root = Path(f"/run/envbuild-bench-{name}")
    host = f"unix://{exec_root}.sock"
    log = open(work / f"{name}-dockerd.log", "w")
    proc = subprocess.Popen(["/usr/sbin/dockerd", "--data-root", str(work / name), "--exec-root", str(exec_root),
                             "-H", host, "--pidfile", str(work / f"{name}.pid"), "--iptables=false",
                             "--bridge=none", "--storage-driver=overlay2"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    env = {**os.environ, "DOCKER_HOST": host}
    before = os.environ.get("DOCKER_HOST")
    try:
        while subprocess.run([DOCKER, "info"], env=env, capture_output=True).returncode != 0:
            if proc.poll() is not None:
                sys.exit(f"dockerd {name} did not start: {(work / f'{name}-dockerd.log').read_text()[-2000:]}")
            time.sleep(0.5)
        save = subprocess.Popen([DOCKER, "save", BASE], stdout=subprocess.PIPE)
        subprocess.run([DOCKER, "load", "-q"], stdin=save.stdout, env=env, check=True, capture_output=True)
        save.wait()
        os.environ["DOCKER_HOST"] = host
        yield host
    finally:
        os.environ.pop("DOCKER_HOST") if before is None else os.environ.update(DOCKER_HOST=before)
        proc.terminate()
        proc.wait(timeout=300)
        log.close()
        shutil.rmtree(work / name, ignore_errors=True)
        Path(f"{exec_root}.sock").unlink(missing_ok=True)
        shutil.rmtree(exec_root, ignore_errors=True)


def build(build_dir: Path, cache, compile_cache: str | None) -> dict:
    """One build of `build_dir` on the current engine; wall time, steps that ran, compiles."""
    from envbuild.builds.build import build_image
    from envbuild.engine import BuildSecrets
    from envbuild.engine.docker import DockerEngine
    from envbuild.knowledge.validate import compile_cache_secret

    secrets = BuildSecrets(ca_cert=Path(CA), compile_cache=compile_cache_secret(compile_cache, {}) if compile_cache else None)
    start = time.monotonic()
    result = build_image(build_dir, "bench", "envbuild-bench-cache", secrets,
                         engine=DockerEngine(), cache=cache, say=lambda t: print(f"  {t}", flush=True))
    seconds = time.monotonic() - start
    # both builds of a run with the layer cache: the builder stage alone (builder-stage.log), then the image
    logs = [p.read_text(errors="replace") for p in (result.log.with_name("builder-stage.log"), result.log) if p.is_file()]
    if cache is not None:
        result.log.with_name("builder-stage.log").unlink(missing_ok=True)  # the next run's must not be this one's
    ran = [step for text in logs for step in ran_steps(text)]
    compiling = [step for step in ran if any(name in step for name in COMPILING)]
    units = {"hits": collections.Counter(), "misses": collections.Counter(), "runs": collections.Counter()}
    for text in logs:
        for line in re.findall(r"envbuild: compiles (\{.*\})$", text, re.M):
            for what, counts in json.loads(line).items():
                if isinstance(counts, dict):  # not "step": the step's name
                    units.setdefault(what, collections.Counter()).update(counts)
    layers = subprocess.run([DOCKER, "image", "inspect", "--format", "{{json .RootFS.Layers}}", result.image_id],
                            capture_output=True, text=True, check=True).stdout.strip()
    return {"seconds": seconds, "ran": len(ran), "compiles": len(compiling), "image": result.image_id,
            "layers": json.loads(layers), "units": {k: dict(v) for k, v in units.items()}}


def ran_steps(log: str) -> list[str]:
    """The RUN steps of a BuildKit plain log that ran (not `CACHED`)."""
    runs = dict(re.findall(r"^#(\d+) \[(?:builder|runtime)[^\]]*\] (RUN .*)$", log, re.M))
    cached = set(re.findall(r"^#(\d+) CACHED$", log, re.M))
    return [step for number, step in runs.items() if number not in cached]


@contextlib.contextmanager
def own_redis(work: Path):
    """Debian's redis-server on a free port of 127.0.0.1: the compile cache's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                             "no", "--dir", str(work)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(1)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


def _by_category(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "0"


def main() -> None:
    from envbuild.builds.build import LayerCache

    work = Path(tempfile.mkdtemp(prefix="envbuild-bench-cache-", dir="/var/tmp"))
    registry, host = own_registry(work)
    try:
        with own_redis(work) as redis:
            dirs = {}
            for name, ops in (("h20", "cpu_adam,fused_adam"), ("h20-lamb", "cpu_adam,fused_adam,fused_lamb")):
                dirs[name] = work / name
                envbuild("render", "--gpu", "h20", "--stack", STACK, "--ds-ops", ops, "--base-image", BASE,
                         "-o", str(dirs[name]))
            cache = LayerCache(builder=f"{host}/envbuild-cache:h20-amd64-builder", final=f"{host}/envbuild:h20-amd64")
            runs = {}
            for name, directory, with_cache, compile_cache in (
                    ("baseline", dirs["h20"], None, None), ("cold", dirs["h20"], cache, redis),
                    ("warm", dirs["h20"], cache, redis), ("one more op", dirs["h20-lamb"], cache, redis)):
                print(f"{name}: building on an empty engine", flush=True)
                with empty_engine(work, name.replace(" ", "-")):
                    runs[name] = build(directory, with_cache, compile_cache)
                    if name == "cold":  # what publish pushes: the image, with its inline cache
                        subprocess.run([DOCKER, "tag", runs[name]["image"], cache.final], check=True)
                        subprocess.run([DOCKER, "push", "-q", cache.final], check=True, capture_output=True)
        base = runs["baseline"]["seconds"]
        table(f"Republishing with the layer and compile caches, each build on an empty engine ({machine()}; "
              f"{time.strftime('%Y-%m-%d')})",
              ["build", "wall s", "RUN steps that ran", "compiling steps that ran", "units compiled (cache misses)",
               "units served (cache hits)", "vs baseline"],
              [[name, f"{r['seconds']:.0f}", r["ran"], r["compiles"], _by_category(r["units"]["misses"]),
                _by_category(r["units"]["hits"]), f"{r['seconds'] / base:.2f}x"] for name, r in runs.items()])
        # the content, not the image ID: Docker 20.10 stamps each build's config with its own time
        same = runs["cold"]["layers"] == runs["warm"]["layers"]
        print(f"warm image's layers {'equal' if same else 'DIFFER FROM'} the cold one's ({len(runs['warm']['layers'])} layers)")
        (work / "result.json").write_text(json.dumps(runs, indent=2))
        shutil.rmtree(work, ignore_errors=True)  # kept when a build failed: its logs are there
    finally:
        registry.terminate()
        registry.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
