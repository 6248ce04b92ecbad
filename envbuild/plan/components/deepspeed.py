"""DeepSpeed with its ops pre-built for the GPU's arches (steps/deepspeed.sh): the sdist by the
lock's hash, each op built by its DS_BUILD_* variable, the host compilers wrapped for the
declared CPU target, and the build failing unless DeepSpeed recorded every op for cuda. The
compiled wheel is kept in the extension cache under a key of what decides its bytes
(envbuild/deepspeed.json), so an unchanged key never compiles again, on this machine or one an
`ext-cache` file was loaded into; the compiles go through the compile cache when the build has one."""

from __future__ import annotations

import hashlib
import json

from envbuild.base.buildcache import DEEPSPEED_RECORD as RECORD
from envbuild.base.buildcache import EXTENSION_CACHE_ID
from envbuild.image import paths
from envbuild.plan.blocks import PY_CACHE, Step, step_files
from envbuild.plan.components import compilecache
from envbuild.plan.components.base import Context, Part
from envbuild.plan.components.extensions import cache_key
from envbuild.plan.components.python import PIP_SECRETS, lock_part

CACHE_NAME = "deepspeed"  # its folder in the extension cache, beside the extensions' names
# Bumped when deepspeed.sh changes how the wheel is made: every cached DeepSpeed wheel is then rebuilt.
BUILD_RECIPE = 1


def wheel_key(ctx: Context, env: list[tuple[str, str]]) -> dict:
    """The cache key of the DeepSpeed wheel and everything that decides its bytes: the sdist and
    torch by the lock's hashes, the compilers (nvcc's release, the builder base and its OS lock),
    Python, the CPU architecture, and the step's whole build environment (ops, arches, CPU target)."""
    r, lock = ctx.resolution, ctx.lock
    block = {p.key: p.block for p in lock.sections["venv"]}
    determines = {"recipe": BUILD_RECIPE, "deepspeed": hashlib.sha256(block["deepspeed"].encode()).hexdigest(),
                  "torch": hashlib.sha256(block["torch"].encode()).hexdigest(), "cuda": r.stack.cuda,
                  "nvcc": r.stack.cuda_toolkit or r.base_images["builder"], "builder": r.base_images["builder"],
                  "os_lock": r.os_lock.sha256 if r.os_lock else None, "python": r.stack.python, "cpu_arch": r.arch,
                  "build_env": dict(env)}
    return {"cache_key": f"{CACHE_NAME}/{cache_key(determines)}", "determines": determines}


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
    generated = ()
    if lock:  # the wheel's cache key (a stack without a lock has no hashes to key it by: compiled each time)
        record = wheel_key(ctx, env)
        env.append(("ENVBUILD_DS_CACHE_KEY", record["cache_key"]))
        generated = ((f"envbuild/{RECORD}", json.dumps(record, indent=2, sort_keys=True) + "\n"),)
    env += compilecache.env(ctx)
    step = Step("deepspeed", (target if lock else f"deepspeed=={stack.deepspeed}", *resolution.ops),
                env=tuple(env),
                files=step_files("deepspeed.sh", "cc-wrapper.sh", "nvcc-arch.sh", "verify_ops.py", "sass_audit.py")
                + ((copy,) if lock else ()),
                secrets=(*PIP_SECRETS, compilecache.SECRET),
                # pip's download of the sdist; the wheel cache (`ext-cache` carries it)
                caches=(PY_CACHE, (EXTENSION_CACHE_ID, paths.EXTENSION_CACHE)),
                comment="DeepSpeed with its ops pre-built for the target arches; the build "
                        "fails unless DeepSpeed recorded every op for cuda",
                # --qemu: only the step that imports torch (setup.py); the others keep their cache
                emulation_binds=ctx.emulation)
    return Part(builder_steps=(step,), generated=generated)
