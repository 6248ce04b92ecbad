"""The CUDA extensions (--ext: flash-attn, causal-conv1d, xformers, ...): PyPI's wheel by hash
where one fits the stack, else compiled from their hash-checked sdists for the GPU's arches only,
after DeepSpeed (an image without extensions shares every layer before), cached by what
determines each wheel (envbuild/buildsteps/extensions.py), and recorded in the
image (/opt/envbuild/built), which the final image copies from the builder."""

from __future__ import annotations

import hashlib
import json
from typing import Optional

from envbuild.base.buildcache import EXTENSION_CACHE_ID, EXTENSION_SPEC
from envbuild.image import paths
from envbuild.plan.blocks import FileCopy, Step, step_files
from envbuild.plan.components import compilecache
from envbuild.plan.components.base import Context, Part
from envbuild.plan.components.python import PIP_SECRETS
from envbuild.resolve.resolver import ExtensionBuild, Resolution

# The fabrics' secret: a base URL (a local copy, scripts/fabric-sources.sh serve) that replaces
# https://github.com in each archive's URL; the tar streams' sha256 are checked all the same.
ARCHIVE_SECRETS = ("source_mirror",)
# Bumped when extensions.py changes how a wheel is made: every cached wheel is then rebuilt.
EXTENSION_BUILD_RECIPE = 2


def _torch_build(resolution: Resolution) -> str:
    """torch's exact build: the hash of its lock block, or its version, CUDA and index."""
    stack, lock = resolution.stack, resolution.lock
    return (hashlib.sha256(next(p.block for p in lock.sections["venv"] if p.key == "torch").encode()).hexdigest()
            if lock else f"torch=={stack.torch}+cu{stack.cuda} from {resolution.torch_index or 'PyPI'}")


def _determines(build: ExtensionBuild, resolution: Resolution, build_env: dict, patches: list) -> dict:
    """Everything that determines the compiled wheel (its cache key): with the stable ABI, the
    CUDA major and the arches (GPU and CPU) only, so one compile serves every stack it fits."""
    ext, stack = build.ext, resolution.stack
    source = ({"sdist_sha256": ext.sdist.sha256} if ext.sdist else
              {"archives": {a.path: {"commit": a.commit, "tar_sha256": a.tar_sha256} for a in ext.archives}})
    common = {"recipe": EXTENSION_BUILD_RECIPE, "name": ext.name, "version": ext.version,
              **source, "cpu_arch": resolution.arch, "arch_list": resolution.arch_list,
              "build_env": build_env, **({"patches": patches} if patches else {})}
    if build.stable_abi:
        return {**common, "torch": f"stable ABI {ext.stable_abi}", "cuda_major": stack.cuda.split(".")[0]}
    return {**common, "torch": _torch_build(resolution), "cuda": stack.cuda, "python": stack.python,
            "nvcc": stack.cuda_toolkit or resolution.base_images["builder"]}


def _entry(build: ExtensionBuild, resolution: Resolution, installed: tuple[str, ...] = ()) -> dict:
    """One extension of extensions.json: the PyPI wheel the resolver chose (installed by hash and
    audited like a compiled one), else its sdist to compile. `installed`: what an earlier
    extension's lock installs (TE's core before its binding): not installed twice."""
    ext, wheel = build.ext, build.wheel
    stack, arches = resolution.stack, [a for a in resolution.arch_list.split(";") if a]
    common = {"name": ext.name, "version": ext.version, "packages": ext.packages, "modules": ext.modules,
              "op_libraries": ext.op_libraries,
              "requires": list(build.requirements), "build_only": ext.build_only, "device_code": ext.device_code,
              "cuda_major": stack.cuda.split(".")[0],
              # what it needs beyond the stack's lock (matrices/locks/ext), installed by hash before it
              "requires_lock": build.lock.requirements("venv", exclude=installed) if build.lock else ""}
    if wheel is not None or not ext.compiled:
        determines = {"recipe": EXTENSION_BUILD_RECIPE, "name": ext.name, "version": ext.version,
                      "wheel_sha256": wheel.sha256 if wheel else None}
        return {**common, "wheel": wheel.model_dump() if wheel else None, "sdist": None, "build_requires": [],
                "build_env": {}, "patches": [], "stable_abi": False, "determines": determines,
                "cache_key": cache_key(determines)}
    arch_value = ";".join(a.replace(".", "").replace("+PTX", "") for a in arches) if ext.arch_env else ""
    build_env = {**ext.build_env, **({ext.arch_env: arch_value} if ext.arch_env else {})}
    patches = [{"file": p.file, "old": p.old, "new": p.new, "source": p.source} for p in build.patches]
    determines = _determines(build, resolution, build_env, patches)
    # PyPI's sdist (pip checks its sha256), or GitHub archives (each tar stream's sha256 checked)
    source = ({"sdist": ext.sdist.model_dump()} if ext.sdist else
              {"sdist": None, "archives": [a.model_dump(include={"name", "version", "commit", "url", "tar_sha256", "path"})
                                           for a in ext.archives]})
    return {**common, "wheel": None, **source, "subdirectory": ext.subdirectory,
            "build_requires": ext.build_requires, "build_env": build_env, "build_headers": ext.build_headers,
            "memory_per_job_gib": ext.memory_per_job_gib, "nvcc_threads": ext.nvcc_threads, "patches": patches,
            "stable_abi": build.stable_abi, "determines": determines,
            "cache_key": cache_key(determines)}


def cache_key(determines: dict) -> str:
    """A wheel's key in the wheel cache: 16 hex digits of everything that decides its bytes (the
    extensions' wheels and DeepSpeed's alike; extcache.py reads NAME/KEY)."""
    return hashlib.sha256(json.dumps(determines, sort_keys=True).encode()).hexdigest()[:16]


def spec(resolution: Resolution, cuda_home: Optional[str]) -> dict:
    """What extensions.py builds, and the cache key of each wheel: everything that determines the
    compiled file (the sdist by hash, torch's exact build, nvcc, Python, CPU architecture, the
    arch list, the build variables, the recipe), so a second GPU with the same arch list, a
    rebuild or another stack with the same torch build reuses it, and any change rebuilds it; an
    extension on torch's stable ABI is keyed by CUDA major and arches only (_determines)."""
    return {"arch_list": resolution.arch_list, "cuda_home": cuda_home or "", "cache": paths.EXTENSION_CACHE,
            "record": paths.EXTENSIONS_RECORD, "lock": paths.EXTENSIONS_LOCK, "locked": resolution.lock is not None,
            "extensions": _entries(resolution)}


def _entries(resolution: Resolution) -> list[dict]:
    """Each extension's entry, in build order; a package two extension locks hold (at the same
    version: the later one was resolved with the earlier as constraints) is installed once."""
    installed: tuple[str, ...] = ()
    entries = []
    for b in resolution.extension_builds:
        entries.append(_entry(b, resolution, installed))
        installed += tuple(b.lock.pins()) if b.lock else ()
    return entries


def _archives(resolution: Resolution) -> bool:
    """Some extension of the image compiles from GitHub archives (which a source_mirror may serve)."""
    return any(b.wheel is None and b.ext.archives for b in resolution.extension_builds)


def part(ctx: Context) -> Part:
    resolution = ctx.resolution
    if not resolution.extensions:
        return Part()
    target = f"{paths.SETUP_DIR}/{EXTENSION_SPEC}"
    step = Step("extensions", (target,),
                files=step_files("extensions.sh", "nvcc-arch.sh", "extensions.py", "sass_audit.py")
                + (FileCopy(f"envbuild/{EXTENSION_SPEC}", target),),
                secrets=(*PIP_SECRETS, compilecache.SECRET, *(ARCHIVE_SECRETS if _archives(resolution) else ())),
                caches=((EXTENSION_CACHE_ID, paths.EXTENSION_CACHE),),
                env=compilecache.env(ctx),
                comment=f"CUDA extensions {', '.join(e.name for e in resolution.extensions)}: PyPI's wheel by "
                        f"hash where one fits, else compiled from the sdist"
                        f"{' or the GitHub archives pinned by their tar sha256' if _archives(resolution) else ''} "
                        f"for {resolution.arch_list} only, cached by "
                        f"what determines the wheel; the build fails unless each imports, carries SASS for it and "
                        f"links this CUDA major and torch")
    text = json.dumps(spec(resolution, ctx.toolchain_home), indent=2, sort_keys=True) + "\n"
    return Part(builder_steps=(step,), from_builder=(paths.BUILT,), generated=((f"envbuild/{EXTENSION_SPEC}", text),))
