"""The CUDA wheels' libraries out of the venv into layers of their own (steps/layers.sh): a pull
downloads them in parallel, and stacks with the same CUDA wheels share them."""

from __future__ import annotations

from envbuild.image import paths
from envbuild.plan.blocks import Step, step_files
from envbuild.plan.components.base import Context, Part

LAYERS_DIR = "/opt/envbuild-layers"
# Which layer each package directory of site-packages/nvidia goes in: shell globs, the first
# match wins, `other` takes the rest (nvidia-*-cu13 wheels' directory names, read from the wheels).
CUDA_LAYER_PACKAGES = (
    ("cuda", ("cu1[0-9]", "cublas", "cuda_*", "cufft", "cufile", "curand", "cusolver", "cusparse", "nvjitlink",
              "nvtx")),
    ("cudnn", ("cudnn",)),
    ("nccl", ("nccl", "nvshmem")),
    ("other", ("*",)),
)
CUDA_LAYERS = tuple(layer for layer, _ in CUDA_LAYER_PACKAGES)


def cuda_layer_args() -> tuple[str, ...]:
    """layers.sh's LAYER=GLOB,GLOB arguments.

    >>> cuda_layer_args()[1:]
    ('cudnn=cudnn', 'nccl=nccl,nvshmem', 'other=*')
    """
    return tuple(f"{layer}={','.join(globs)}" for layer, globs in CUDA_LAYER_PACKAGES)


def part(ctx: Context) -> Part:
    step = Step("layers", (paths.VENV, LAYERS_DIR, *cuda_layer_args()), files=step_files("layers.sh"),
                comment="the CUDA wheels' libraries out of the venv into layers of their own "
                        "(parallel pulls; shared by stacks with the same CUDA wheels)")
    # Each layer its own COPY (its own layer of the final image); --keep-toolchain keeps the folder.
    layers = (LAYERS_DIR,) if ctx.keep else tuple(f"{LAYERS_DIR}/{layer}" for layer in CUDA_LAYERS)
    return Part(builder_steps=(step,), from_builder=layers)
