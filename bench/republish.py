"""What a publish run costs cold and warm: `envbuild publish --job` of the CI stack's h20 variant
(the job's whole work: build, smoke test, SBOM, audit, .sqsh, push, attach, sign), each run on an
**empty engine** (a dockerd of its own, BuildKit's cache mounts empty: what a fresh CI runner
has), against registries and a Redis of the bench's own, measured in one run:

1. **baseline**: the job as every run did it before the caches: no layer cache, no compile cache;
2. **cold**: the first run of the job with the caches: it exports the layer cache (the builder
   stage, the image with its cache inline) and fills the compile cache (sccache on Redis);
3. **warm**: the scheduled run of the unchanged job: the registry serves the variant from the
   same rendered files with provenance this key signed, so its pins are audited again and its
   digest handed on (envbuild/supply/published.py): nothing is built;
4. **warm, --republish**: the same, forced to build again: the layers come from the registry's
   layer cache, every unit from the compile cache; smoke test, .sqsh and push run again;
5. **one more op**: the job with fused_lamb added to its ops: a new image (the rendered files
   changed), its layers up to DeepSpeed's step pulled, DeepSpeed's wheel under a new key, and the
   compile cache serving every unit but fused_lamb's (misses and hits by category).

The ratio is each run's wall time / the cold run's. For each: the job's own per-step seconds
(OUT/report.json) and what the compilers ran (report.json `compiles`: compiler runs and the
compile cache's misses and hits by category).

    python bench/republish.py       # about 50 minutes on 2 cores, 30 GB of disk; redis-server

Vulnerability data: the local OSV endpoint of tests/tools/osv_server.py. Signing: a throw-away
ed25519 key (DSSE). Base: the debootstrap image, loaded into each empty engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BASE, CA, ROOT, STACK, machine, table
from layer_cache import empty_engine, own_redis
from publish_steps import own_registry

sys.path.insert(0, str(ROOT / "tests" / "tools"))
from osv_server import OsvServer  # noqa: E402

REPO = "envbuild-bench-republish"
OPS = "  training: [cpu_adam, cpu_adagrad, cpu_lion, utils, fused_adam, fused_lamb, fused_lion]\n"


def matrix_for(work: Path, frozen: Path, host: str, ops: str = "cpu_adam, fused_adam") -> Path:
    """The production matrix publishing the CI stack's h20 variant, its training preset `ops`
    (by default the two the layer-cache bench builds: cpu_adam on g++, fused_adam on nvcc), from
    `frozen`: the checkout's matrix as the bench started (an edit meanwhile must not change it)."""
    d = work / "matrices"
    shutil.copytree(frozen, d)
    (d / "publish.yaml").write_text(f'registry: "{host}"\nimage_repo: {REPO}\ngpus: [h20]\n')
    text = (d / "deepspeed.yaml").read_text()
    if OPS not in text:
        sys.exit("deepspeed.yaml's training preset changed: update bench/republish.py's copy")
    (d / "deepspeed.yaml").write_text(text.replace(OPS, f"  training: [{ops}]\n"))
    return d


def publish(host: str, matrix: Path, out: Path, key: Path, env: dict, *extra: str) -> dict:
    """One `envbuild publish --job` on the current engine: wall time and the variant's outcome."""
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "envbuild", "publish", "--job", f"{STACK}-amd64", "--registry", host,
                        "--signing-key", str(key), "--matrix-dir", str(matrix), "--out", str(out), "--base-image",
                        BASE, "--ca-cert", CA, *extra], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, **env})
    seconds = time.monotonic() - start
    if r.returncode != 0:
        sys.exit(f"publish {' '.join(extra)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    (outcome,) = json.loads((out / "report.json").read_text())["outcomes"]
    return {"seconds": seconds, "outcome": outcome}


def _runs(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "0"


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="envbuild-bench-republish-", dir="/var/tmp"))
    for name in ("plain", "cached"):
        (work / name).mkdir()
    plain, plain_host = own_registry(work / "plain")
    cached, host = own_registry(work / "cached")
    frozen = work / "frozen-matrices"
    shutil.copytree(ROOT / "matrices", frozen)
    key = work / "bench.key"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True, capture_output=True)
    try:
        with own_redis(work) as redis, OsvServer() as osv:
            env = {"ENVBUILD_STATE_DIR": str(work / "state"), "ENVBUILD_VULNERABILITY_SERVICE": osv.url}
            runs = {}
            two, three = "cpu_adam, fused_adam", "cpu_adam, fused_adam, fused_lamb"
            for name, registry, ops, extra in (
                    ("baseline: no caches", plain_host, two, ("--layer-cache", "off")),
                    ("cold: exports the layer cache, fills the compile cache", host, two, ("--compile-cache", redis)),
                    ("warm: the unchanged job again", host, two, ("--compile-cache", redis)),
                    ("warm, --republish: built again from the caches", host, two, ("--compile-cache", redis,
                                                                                   "--republish")),
                    ("one more op (fused_lamb): the caches serve the rest", host, three, ("--compile-cache", redis))):
                print(f"{name}: on an empty engine", flush=True)
                with empty_engine(work, f"engine{len(runs)}"):
                    runs[name] = publish(registry, matrix_for(work / f"m{len(runs)}", frozen, registry, ops),
                                         work / f"out{len(runs)}", key, env, *extra)
                if registry == plain_host:  # the baseline's registry is not read again: its gigabytes go
                    plain.terminate()
                    plain.wait(timeout=60)
                    shutil.rmtree(work / "plain", ignore_errors=True)
                print(f"  {runs[name]['seconds']:.0f} s", flush=True)
        cold = runs["cold: exports the layer cache, fills the compile cache"]["seconds"]
        rows = []
        for name, r in runs.items():
            o = r["outcome"]
            steps = o["seconds"]
            rest = sum(v for k, v in steps.items() if k not in ("build", "published before") and ":" not in k)
            rows.append([name, f"{r['seconds']:.0f}", f"{steps.get('build', 0):.0f}", f"{rest:.0f}",
                         _runs(o["compiles"].get("runs", {})), _runs(o["compiles"].get("misses", {})),
                         _runs(o["compiles"].get("hits", {})),
                         "handed on" if o["published_before"] else "built", f"{r['seconds'] / cold:.2f}x"])
        table(f"publish --job of the CI stack's h20 variant, each run on an empty engine ({machine()}; "
              f"{time.strftime('%Y-%m-%d')})",
              ["run", "wall s", "build s", "other steps s", "compiler runs", "compile cache misses",
               "compile cache hits", "image", "vs cold"], rows)
        digests = {n: r["outcome"]["digest"] for n, r in runs.items()}
        print(f"digests: {json.dumps(digests, indent=2)}")
        (work / "result.json").write_text(json.dumps(runs, indent=2))
        shutil.rmtree(work, ignore_errors=True)  # kept when a run failed: its logs are there
    finally:
        for proc in (plain, cached):
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
