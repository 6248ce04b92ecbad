"""Image size: envbuild's multi-stage final image vs a single-stage image of the same
stack that keeps the build toolchain (what a hand-written Dockerfile usually ships),
built in the same run with `--keep-toolchain`.

    python bench/image_size.py
"""

from common import build, inspect, machine, table


def main():
    final, _ = build("h20", "size-final", "--ds-ops", "cpu_adam,fused_adam")
    single, _ = build("h20", "size-single", "--ds-ops", "cpu_adam,fused_adam", "--keep-toolchain")
    a, b = inspect(final)["Size"], inspect(single)["Size"]
    table(f"Image size — {machine()}", ["image", "size (GB)", "layers"], [
        ["envbuild final stage", f"{a / 1e9:.2f}", len(inspect(final)["RootFS"]["Layers"])],
        ["single stage, toolchain kept (baseline)", f"{b / 1e9:.2f}", len(inspect(single)["RootFS"]["Layers"])],
        ["ratio envbuild / baseline", f"{a / b:.2f}", ""],
    ])


if __name__ == "__main__":
    main()
