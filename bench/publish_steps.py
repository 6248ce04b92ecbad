"""What each supply-chain step adds to a publish: one run of `envbuild publish --job` for the CI
stack's h20 variant against the local registry, step by step from the job's own report
(OUT/report.json), against the job without them (build, smoke test, push: what the workflow did
before); then the .sqsh beside the image against exporting it on the cluster, measured in the
same run: `envbuild stage REF` (download the published .sqsh by digest) against `envbuild
export --enroot` of the image (what a site without the published file does after `docker pull`;
the pull is not timed here: the layers are already on this machine, and on loopback a download
measures the disk, so the bytes each way are printed instead).

    python bench/publish_steps.py            # about 15 minutes with the build cache warm

Vulnerability data: the local OSV endpoint of tests/tools/osv_server.py (PyPI's per-release
JSON answers 404 from this machine's network). Signing: a throw-away ed25519 key (DSSE).
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

from common import BASE, CA, OUT, ROOT, STACK, docker, machine, table

sys.path.insert(0, str(ROOT / "tests" / "tools"))
from osv_server import OsvServer  # noqa: E402

REPO = "envbuild-bench-publish"


def own_registry(work: Path) -> tuple[subprocess.Popen, str]:
    """A docker-registry of the bench's own (plain HTTP on loopback), its storage under `work`:
    the gigabytes this run pushes go away with it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (work / "registry.yml").write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                                       f"    rootdirectory: {work / 'registry'}\nhttp:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(work / "registry.yml")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        if subprocess.run(["curl", "-sf", "-o", "/dev/null", f"http://127.0.0.1:{port}/v2/"]).returncode == 0:
            break
        time.sleep(0.2)
    return proc, f"127.0.0.1:{port}"


def run(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "envbuild", *args], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    seconds = time.monotonic() - start
    if r.returncode != 0:
        sys.exit(f"envbuild {' '.join(args[:3])} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r, seconds


def ref_local(out: Path) -> str:
    """The job's image on this machine (kept by --keep-images), by its readable tag."""
    manifest = json.loads(next((out / "build").glob("*/manifest.json")).read_text())
    return manifest["image"]


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="envbuild-bench-publish-"))
    registry, host = own_registry(work)
    try:
        matrix = work / "matrices"
        shutil.copytree(ROOT / "matrices", matrix)
        (matrix / "publish.yaml").write_text(f'registry: "{host}"\nimage_repo: {REPO}\ngpus: [h20]\n')
        key = work / "bench.key"
        subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True,
                       capture_output=True)
        subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(work / "bench.pub")], check=True,
                       capture_output=True)
        with OsvServer() as osv:
            env = {"ENVBUILD_STATE_DIR": str(work / "state"), "ENVBUILD_VULNERABILITY_SERVICE": osv.url}
            out = work / "out"
            _, total = run("publish", "--job", f"{STACK}-amd64", "--registry", host, "--signing-key", str(key),
                           "--matrix-dir", str(matrix), "--out", str(out), "--base-image", BASE, "--ca-cert", CA,
                           "--keep-images", env=env)
        outcome = json.loads((out / "report.json").read_text())["outcomes"][0]
        s, b = outcome["seconds"], outcome["bytes"]
        digest = outcome["digest"]
        ref = f"{host}/{REPO}@{digest}"
        manifest = json.loads(subprocess.run(["curl", "-sf", "-H", "Accept: application/vnd.docker.distribution"
                                              ".manifest.v2+json", f"http://{host}/v2/{REPO}/manifests/{digest}"],
                                             capture_output=True, text=True, check=True).stdout)
        image_bytes = sum(layer["size"] for layer in manifest["layers"])
        baseline = s["build"] + s["smoke"] + s["push"]
        rows = [["build (cached layers)", f"{s['build']:.1f}", ""], ["smoke test", f"{s['smoke']:.1f}", ""],
                ["push by platform + pull-back", f"{s['push']:.1f}", mib(image_bytes)],
                ["**job without the steps below**", f"**{baseline:.1f}**", f"**{mib(image_bytes)}**"],
                ["sbom (inventory in the image + CycloneDX)", f"{s['sbom']:.1f}", mib(b["sbom"])],
                ["audit (pip-audit of the image)", f"{s['audit']:.1f}", ""],
                ["sqsh export (mksquashfs, zstd)", f"{s['sqsh']:.1f}", ""],
                ["attach SBOM", f"{s['attach:sbom']:.1f}", mib(b["sbom"])],
                ["attach smoke record", f"{s['attach:smoke']:.1f}", mib(b["smoke"])],
                ["attach .sqsh (upload)", f"{s['attach:sqsh']:.1f}", mib(b["sqsh"])],
                ["provenance (statement)", f"{s['provenance']:.1f}", ""],
                ["sign + attach provenance (DSSE, ed25519)", f"{s['sign']:.1f}", mib(b["provenance"])]]
        added = sum(s[k] for k in ("sbom", "audit", "sqsh", "attach", "provenance", "sign"))
        added_bytes = b["sbom"] + b["smoke"] + b["sqsh"] + b["provenance"]
        rows.append(["**added by the supply-chain steps**", f"**{added:.1f}**", f"**{mib(added_bytes)}**"])
        rows.append(["ratio: whole job / job without them", f"{(baseline + added) / baseline:.2f}",
                     f"{(image_bytes + added_bytes) / image_bytes:.2f}"])
        print(f"machine: {machine()}; envbuild publish --job took {total:.0f} s in all (lock audit included)\n")
        table("What each step adds to one variant's publish (seconds, MiB in the registry)",
              ["step", "seconds", "MiB pushed"], rows)
        verified, verify_s = run("verify", ref, "--key", str(work / "bench.pub"), env=env)
        print(f"envbuild verify {ref} --key bench.pub: {verify_s:.1f} s (pulls nothing: the image is local)\n")
        print(verified.stdout)

        # The .sqsh on the cluster: published beside the image, or exported where it runs.
        staged = work / "staged"
        staged.mkdir()
        _, fetch = run("stage", f"{host}/{REPO}@{digest}", "--to", str(staged), env=env)
        _, export = run("export", ref_local(out), "--enroot", "-o", str(work / "exported.sqsh"))
        table("The .sqsh on the cluster: fetched from the registry against exported there (seconds)",
              ["way", "seconds", "MiB over the network"],
              [["envbuild stage REF (download the published .sqsh by digest, sha256 checked)", f"{fetch:.1f}",
                mib(b["sqsh"])],
               ["docker pull + envbuild export --enroot (the export alone timed: the layers are here)",
                f"{export:.1f}", mib(image_bytes)],
               ["ratio: stage / export; bytes: .sqsh / image layers", f"{fetch / export:.2f}",
                f"{b['sqsh'] / image_bytes:.2f}"]])
    finally:
        registry.terminate()
        registry.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        for ref_tag in docker("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split():
            if ref_tag.rsplit(":", 1)[0].endswith(REPO):
                docker("rmi", ref_tag, check=False)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    main()
