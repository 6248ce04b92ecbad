"""Image size: envbuild's multi-stage final image (with the C compiler torch.compile needs)
vs the same image built with --no-compiler (the compiler's cost) and vs a single-stage image
of the same stack that keeps the whole build toolchain (what a hand-written Dockerfile
usually ships), all built in the same run.

    python bench/image_size.py
"""

from common import build, inspect, machine, table


def main():
    ops = ("--ds-ops", "cpu_adam,fused_adam")
    final, _ = build("h20", "size-final", *ops)
    bare, _ = build("h20", "size-nocc", *ops, "--no-compiler")
    single, _ = build("h20", "size-single", *ops, "--keep-toolchain")
    sizes = {name: inspect(image) for name, image in (("final", final), ("bare", bare), ("single", single))}
    gb = {name: info["Size"] / 1e9 for name, info in sizes.items()}
    layers = {name: len(info["RootFS"]["Layers"]) for name, info in sizes.items()}
    table(f"Image size — {machine()}", ["image", "size (GB)", "layers"], [
        ["envbuild final stage (C compiler for torch.compile)", f"{gb['final']:.2f}", layers["final"]],
        ["envbuild final stage, --no-compiler", f"{gb['bare']:.2f}", layers["bare"]],
        ["single stage, toolchain kept (baseline)", f"{gb['single']:.2f}", layers["single"]],
        ["cost of the compiler (MB)", f"{(gb['final'] - gb['bare']) * 1000:.0f}", ""],
        ["ratio envbuild / baseline", f"{gb['final'] / gb['single']:.2f}", ""],
    ])


if __name__ == "__main__":
    main()
