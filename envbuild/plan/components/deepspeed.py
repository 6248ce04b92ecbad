"""DeepSpeed with its ops pre-built for the GPU's arches (steps/deepspeed.sh): the sdist by the
lock's hash, each op built by its DS_BUILD_* variable, the host compilers wrapped for the
declared CPU target, and the build failing unless DeepSpeed recorded every op for cuda."""

from __future__ import annotations

from ...image import paths
from ..blocks import PY_CACHE, Step, step_files
from .base import Context, Part
from .python import PIP_SECRETS, lock_part


def part(ctx: Context) -> Part:
    resolution, lock = ctx.resolution, ctx.lock
    facts, stack = resolution.facts, resolution.stack
    env = [("DS_ACCELERATOR", "cuda"), ("DS_BUILD_OPS", "0")]
    env += [(f"DS_BUILD_{facts.ops[o].env}", "1") for o in resolution.ops]
    env += [("TORCH_CUDA_ARCH_LIST", resolution.arch_list), ("ENVBUILD_CPU_TARGET", resolution.cpu_target),
            ("ENVBUILD_CPU_FLAG", facts.cpu_target.flag), ("ENVBUILD_CPU_SIMD", facts.cpu_target.simd)]
    if ctx.toolchain_home:
        env.append(("CUDA_HOME", ctx.toolchain_home))
        no_audit = facts.toolchain.audit_missing(stack.cuda_toolkit)
        if no_audit:  # said in the build log and the manifest, not skipped in silence
            env.append(("ENVBUILD_SASS_AUDIT", f"skipped: {no_audit}"))
    if resolution.toolchain_adds:  # the library an extra put in the venv: found at run time by the ops' RUNPATH
        env.append(("LDFLAGS", f"-Wl,-rpath,{paths.venv_cuda_lib(stack.python, ctx.toolchain_home)}"))
    if not lock:  # with a lock they are in the venv already, at the locked versions
        env.append(("ENVBUILD_DS_BUILD_REQUIRES", " ".join(facts.ds_build_requires)))
    target, copy = lock_part("deepspeed")
    step = Step("deepspeed", (target if lock else f"deepspeed=={stack.deepspeed}", *resolution.ops),
                env=tuple(env),
                files=step_files("deepspeed.sh", "cc-wrapper.sh", "verify_ops.py", "sass_audit.py")
                + ((copy,) if lock else ()),
                secrets=PIP_SECRETS, caches=(PY_CACHE,),  # pip's download of the sdist
                comment="DeepSpeed with its ops pre-built for the target arches; the build "
                        "fails unless DeepSpeed recorded every op for cuda",
                # --qemu: only the step that imports torch (setup.py); the others keep their cache
                emulation_binds=ctx.emulation)
    return Part(builder_steps=(step,))
