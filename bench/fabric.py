"""The fabric's cost: image size with and without the verbs user space (--fabric ib, the
default, against --fabric none), and container start-up time with the start-up checks: a
node with nothing to say (env.sh starts no process) against a node whose RDMA devices the
container cannot open (env.sh runs the image's Python node check and prints its warning),
all measured in the same run.

    python bench/fabric.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import build, docker, inspect, machine, table


def fake_rdma_node(root: Path) -> None:
    """A node whose kernel lists a ConnectX device (sysfs) that the container was not given
    (no /dev/infiniband): what a `docker run` without --device looks like on an IB node."""
    dev = root / "sys/class/infiniband/mlx5_0"
    (dev / "ports/1").mkdir(parents=True)
    (dev / "ports/1/link_layer").write_text("InfiniBand\n")


def start_times(image: str, runs: int, *extra: str) -> list[float]:
    """Wall seconds of `docker run --rm IMAGE true` (the entrypoint sources env.sh first)."""
    times = []
    for _ in range(runs):
        t = time.monotonic()
        docker("run", "--rm", "--network", "none", *extra, image, "true")
        times.append(time.monotonic() - t)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    ops = ("--ds-ops", "cpu_adam,fused_adam")
    with_fabric, _ = build("h20", "fabric-ib", *ops)
    without, _ = build("h20", "fabric-none", *ops, "--fabric", "none")
    size = {name: inspect(image)["Size"] / 1e6 for name, image in (("ib", with_fabric), ("none", without))}
    table(f"Image size with and without the fabric layer — {machine()}", ["image", "size (MB)"], [
        ["--fabric ib (default: verbs user space)", f"{size['ib']:.1f}"],
        ["--fabric none (baseline)", f"{size['none']:.1f}"],
        ["the fabric layer (MB)", f"{size['ib'] - size['none']:.1f}"],
        ["ratio ib / none", f"{size['ib'] / size['none']:.4f}"],
    ])
    with tempfile.TemporaryDirectory() as tmp:
        fake_rdma_node(Path(tmp))
        quiet = start_times(with_fabric, args.runs)
        baseline = start_times(without, args.runs)
        warned = start_times(with_fabric, args.runs, "-v", f"{tmp}:/fake-node:ro",
                             "-e", "ENVBUILD_NODE_ROOT=/fake-node")
    med = {k: statistics.median(v) for k, v in (("quiet", quiet), ("baseline", baseline), ("warned", warned))}
    table(f"Container start (docker run --rm IMAGE true, median of {args.runs}) — {machine()}",
          ["case", "median (s)", "min (s)", "max (s)"], [
              ["--fabric none, nothing to check (baseline)", f"{med['baseline']:.3f}", f"{min(baseline):.3f}",
               f"{max(baseline):.3f}"],
              ["--fabric ib, node with nothing to say", f"{med['quiet']:.3f}", f"{min(quiet):.3f}",
               f"{max(quiet):.3f}"],
              ["--fabric ib, RDMA device not handed over (node check runs, warns)", f"{med['warned']:.3f}",
               f"{min(warned):.3f}", f"{max(warned):.3f}"],
              ["ratio quiet / baseline", f"{med['quiet'] / med['baseline']:.2f}", "", ""],
              ["ratio warned / baseline", f"{med['warned'] / med['baseline']:.2f}", "", ""],
          ])


if __name__ == "__main__":
    main()
