"""Variant rebuild: a stack's first image built from scratch (`--no-cache`, base image
present) vs its second GPU variant (h100 after h20), in time and shared layers.

    python bench/variant_rebuild.py
"""

import common
from common import build, inspect, machine, table


def main():
    ops = ("--ds-ops", "cpu_adam,fused_adam")
    # --no-cache reaches docker build through an env var the bench sets for one call.
    import os
    os.environ["ENVBUILD_DOCKER_BUILD_ARGS"] = "--no-cache"
    first, t1 = build("h20", "variant-h20", *ops)
    del os.environ["ENVBUILD_DOCKER_BUILD_ARGS"]
    second, t2 = build("h100", "variant-h100", *ops)
    la, lb = inspect(first)["RootFS"]["Layers"], inspect(second)["RootFS"]["Layers"]
    shared = sum(1 for x, y in zip(la, lb) if x == y)
    table(f"Second GPU variant of a stack — {machine()}", ["build", "wall time (s)", "layers shared with h20"], [
        ["h20, from scratch (baseline)", f"{t1:.0f}", f"{len(la)}/{len(la)}"],
        ["h100 after h20", f"{t2:.0f}", f"{shared}/{len(lb)}"],
        ["ratio h100 / h20", f"{t2 / t1:.3f}", f"{shared / len(lb):.2f} shared"],
    ])


if __name__ == "__main__":
    _ = common
    main()
