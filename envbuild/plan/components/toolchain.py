"""The CUDA toolchain: the builder base image brings nvcc, or (the PyPI toolchain) a step
installs it outside the venv, only when something needs nvcc; --keep-toolchain keeps it."""

from __future__ import annotations

from envbuild.plan.blocks import PY_CACHE, Step, step_files
from envbuild.plan.components.base import Context, Part
from envbuild.plan.components.python import PIP_SECRETS, lock_part, uv_env


def part(ctx: Context) -> Part:
    if not ctx.installs_toolchain:
        return Part()
    resolution, lock = ctx.resolution, ctx.lock
    stack, toolchain = resolution.stack, resolution.facts.toolchain
    install = toolchain.install
    if lock and lock.sections.get("toolchain"):
        target, copy = lock_part("toolchain")
        toolchain_install, toolchain_files = ("--require-hashes", "--no-deps", "-r", target), (copy,)
    else:
        toolchain_install = (f"{install.package}[{','.join(install.extras_for(stack.cuda_toolkit))}]=={stack.cuda_toolkit}",)
        toolchain_files = ()
    # what an extra added to the venv for the chosen ops (cuRAND), linked into CUDA_HOME for -l<name>
    env = (("ENVBUILD_TOOLCHAIN_ADDS", " ".join(toolchain.adds[n].library for n in resolution.toolchain_adds)),)
    step = Step("cuda-toolkit", (install.prefix, toolchain.cuda_home, *toolchain_install),
                env=(*uv_env(ctx), *(env if resolution.toolchain_adds else ())), caches=(PY_CACHE,),
                files=step_files("cuda-toolkit.sh") + toolchain_files, secrets=PIP_SECRETS,
                comment=f"nvcc {stack.cuda_toolkit} from PyPI, outside the venv ({resolution.nvcc_reason})")
    return Part(builder_steps=(step,), from_builder=(install.prefix,) if ctx.keep else ())
