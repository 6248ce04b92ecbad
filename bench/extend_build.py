"""`envbuild extend` vs a full stack build: a lab's packages (accelerate, safetensors, einops)
as one layer on the stack image, against building the stack image itself with no cache
(what adding packages to the stack's own build would cost), in time and bytes shared, in the
same run.

    python bench/extend_build.py
"""

from __future__ import annotations

import json
import os
import time

from common import BASE, CA, OUT, REPO, STACK, build, envbuild, inspect, machine, table


def main():
    ops = ("--ds-ops", "cpu_adam,fused_adam")
    os.environ["ENVBUILD_DOCKER_BUILD_ARGS"] = "--no-cache"
    stack_image, stack_seconds = build("h20", "extend-stack", *ops)
    requirements = OUT / "extend-requirements.txt"
    requirements.write_text("accelerate\nsafetensors\neinops\n")
    out = OUT / "extend-lab"
    start = time.monotonic()
    envbuild("extend", "-r", str(requirements), "--gpu", "h20", "--stack", STACK, *ops, "--base-image", BASE,
             "--ca-cert", CA, "--image-repo", REPO, "--name", "lab", "--build", "-o", str(out))
    extend_seconds = time.monotonic() - start
    del os.environ["ENVBUILD_DOCKER_BUILD_ARGS"]
    extended = f"{REPO}:{json.loads((out / 'manifest.json').read_text())['tag']}"
    stack_info, ext_info = inspect(stack_image), inspect(extended)
    shared = sum(1 for a, b in zip(stack_info["RootFS"]["Layers"], ext_info["RootFS"]["Layers"]) if a == b)
    added_mb = (ext_info["Size"] - stack_info["Size"]) / 1e6
    table(f"envbuild extend vs a full stack build — {machine()}",
          ["build", "wall time (s)", "layers shared", "size (GB)"], [
              ["stack image, no cache (baseline)", f"{stack_seconds:.0f}", "", f"{stack_info['Size'] / 1e9:.2f}"],
              ["extend: accelerate, safetensors, einops, no cache", f"{extend_seconds:.0f}",
               f"{shared}/{len(stack_info['RootFS']['Layers'])} of the stack's", f"{ext_info['Size'] / 1e9:.2f}"],
              ["ratio extend / stack", f"{extend_seconds / stack_seconds:.3f}",
               f"{stack_info['Size'] / 1e9:.2f} GB shared", f"+{added_mb:.0f} MB added"],
          ])


if __name__ == "__main__":
    main()
