"""The finish: the guard (PIP_CONSTRAINT pins what the ops and extensions were compiled
against), the build-only packages dropped (ninja: nothing can JIT at run time), pip check."""

from __future__ import annotations

from envbuild.image import paths
from envbuild.plan.blocks import Step, step_files
from envbuild.plan.components.base import Context, Part

# The guard (PIP_CONSTRAINT): the distributions pinned as built, an extended regular expression
# over `pip freeze` lines (finish.sh): what the pre-built ops were compiled against.
GUARD_PACKAGES = "torch|torchvision|triton|deepspeed|nvidia-[a-z0-9._-]+|cuda-[a-z0-9._-]+"


def guard_packages(extensions=()) -> str:
    """The guard's pattern, with the CUDA extensions pinned like torch (any spelling pip freeze uses).

    >>> guard_packages() == GUARD_PACKAGES
    True
    >>> class Ext: name = "flash-attn"
    >>> guard_packages([Ext()]).endswith("|flash[-_.]attn")
    True
    """
    return GUARD_PACKAGES + "".join("|" + "[-_.]".join(e.name.split("-")) for e in extensions)


def part(ctx: Context) -> Part:
    env = [("ENVBUILD_CONSTRAINTS", paths.CONSTRAINTS),
           ("ENVBUILD_GUARD_PACKAGES", guard_packages(ctx.resolution.extensions))]
    if ctx.ds_build_only:
        env.append(("ENVBUILD_DS_BUILD_ONLY", " ".join(ctx.ds_build_only)))
    step = Step("finish", (), env=tuple(env), files=step_files("finish.sh", "pip_check.py", "requires.py"),
                comment="the guard pins what was compiled against; the build-only packages leave; pip check")
    return Part(builder_steps=(step,), from_builder=(paths.CONSTRAINTS,))
