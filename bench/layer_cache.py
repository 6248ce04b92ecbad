"""The publish job's layer cache (envbuild/build.py LayerCache), measured in one run on this
machine: the CI stack's h20 image (DeepSpeed's cpu_adam and fused_adam compiled for sm_90) built
on an **empty engine** three ways, each a Docker engine of its own started for it (its own data
root and containerd: what a fresh CI runner has), against a registry of the bench's own:

1. **cold, no cache** (the baseline: what every publish run did before);
2. **cold, exporting the cache** (the first run of a job: it also pushes the builder stage and the
   image with its inline cache);
3. **warm** (a republish of the unchanged job: imports both references and builds nothing).

For each: wall time, the BuildKit steps that ran (a `RUN` that ran is work; `CACHED` is not), and
of those the compiling ones (DeepSpeed's op build, the CUDA extensions: every nvcc and g++ of the
image runs inside them, so a build in which neither ran invoked no compiler). The ratio is warm /
baseline.

    python bench/layer_cache.py          # about 40 minutes on 2 cores, 25 GB of disk

The engines start with only the debootstrap base loaded (`docker save | docker load`): no registry
serves local/debian, and the same image ID keeps the cache keys equal across engines.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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


def build(build_dir: Path, cache) -> dict:
    """One build of `build_dir` on the current engine; wall time, steps that ran, compiles."""
    from envbuild.build import build_image
    from envbuild.engine import BuildSecrets
    from envbuild.engine.docker import DockerEngine

    start = time.monotonic()
    result = build_image(build_dir, "bench", "envbuild-bench-cache", BuildSecrets(ca_cert=Path(CA)),
                         engine=DockerEngine(), cache=cache, say=lambda t: print(f"  {t}", flush=True))
    seconds = time.monotonic() - start
    ran = [name for name, _ in result.steps if " RUN " in f" {name} "]
    compiling = [name for name in ran if any(step in name for step in COMPILING)]
    return {"seconds": seconds, "ran": len(ran), "compiles": len(compiling), "image": result.image_id}


def main() -> None:
    from envbuild.build import LayerCache

    work = Path(tempfile.mkdtemp(prefix="envbuild-bench-cache-", dir="/var/tmp"))
    registry, host = own_registry(work)
    try:
        out = work / "h20"
        envbuild("render", "--gpu", "h20", "--stack", STACK, "--ds-ops", "cpu_adam,fused_adam", "--base-image", BASE,
                 "-o", str(out))
        cache = LayerCache(builder=f"{host}/envbuild-cache:h20-amd64-builder", final=f"{host}/envbuild:h20-amd64")
        runs = {}
        for name, with_cache in (("baseline", None), ("cold", cache), ("warm", cache)):
            print(f"{name}: building on an empty engine", flush=True)
            with empty_engine(work, name):
                runs[name] = build(out, with_cache)
                if name == "cold":  # what publish pushes: the image, with its inline cache
                    subprocess.run([DOCKER, "tag", runs[name]["image"], cache.final], check=True)
                    subprocess.run([DOCKER, "push", "-q", cache.final], check=True, capture_output=True)
        base = runs["baseline"]["seconds"]
        table(f"The layer cache on an empty engine ({machine()}; {time.strftime('%Y-%m-%d')})",
              ["build", "wall s", "RUN steps that ran", "compiling steps that ran", "vs baseline"],
              [[name, f"{r['seconds']:.0f}", r["ran"], r["compiles"], f"{r['seconds'] / base:.2f}x"]
               for name, r in runs.items()])
        same = runs["cold"]["image"] == runs["warm"]["image"]
        print(f"warm image ID {'equals' if same else 'DIFFERS FROM'} the cold one ({runs['warm']['image'][:19]})")
        (work / "result.json").write_text(json.dumps(runs, indent=2))
        shutil.rmtree(work, ignore_errors=True)  # kept when a build failed: its logs are there
    finally:
        registry.terminate()
        registry.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
