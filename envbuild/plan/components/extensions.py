"""The CUDA extensions (--ext: flash-attn, causal-conv1d): compiled from their hash-checked
sdists for the GPU's arches only, after DeepSpeed (an image without extensions shares every
layer before), cached by what determines each wheel (envbuild/buildsteps/extensions.py), and recorded in the
image (/opt/envbuild/built), which the final image copies from the builder."""

from __future__ import annotations

import hashlib
import json
from typing import Optional

from ... import rules
from ...image import paths
from ...resolve import Resolution
from ..blocks import FileCopy, Step, step_files
from . import compilecache
from .base import Context, Part
from .python import PIP_SECRETS

EXTENSION_SPEC = "extensions.json"  # under envbuild/ in the build directory: what extensions.py builds
EXTENSION_CACHE_ID = "envbuild-ext"  # the BuildKit cache mount shared by every build of this machine
# Bumped when extensions.py changes how a wheel is made: every cached wheel is then rebuilt.
EXTENSION_BUILD_RECIPE = 2


def spec(resolution: Resolution, cuda_home: Optional[str]) -> dict:
    """What extensions.py builds, and the cache key of each wheel: everything that determines the
    compiled file (the sdist by hash, torch's exact build, nvcc, Python, CPU architecture, the
    arch list, the build variables, the recipe), so a second GPU with the same arch list, a
    rebuild or another stack with the same torch build reuses it, and any change rebuilds it."""
    stack, lock = resolution.stack, resolution.lock
    torch_build = (hashlib.sha256(next(p.block for p in lock.sections["venv"] if p.key == "torch").encode()).hexdigest()
                   if lock else f"torch=={stack.torch}+cu{stack.cuda} from {resolution.torch_index or 'PyPI'}")
    arches = [a for a in resolution.arch_list.split(";") if a]
    out = []
    for ext in resolution.extensions:
        arch_value = ";".join(a.replace(".", "").replace("+PTX", "") for a in arches) if ext.arch_env else ""
        build_env = {**ext.build_env, **({ext.arch_env: arch_value} if ext.arch_env else {})}
        patches = [{"file": p.file, "old": p.old, "new": p.new, "source": p.source}
                   for p in rules.extension_patches(ext, stack)]
        determines = {"recipe": EXTENSION_BUILD_RECIPE, "name": ext.name, "version": ext.version,
                      "sdist_sha256": ext.sdist.sha256, "torch": torch_build, "cuda": stack.cuda,
                      "nvcc": stack.cuda_toolkit or resolution.base_images["builder"], "python": stack.python, "cpu_arch": resolution.arch,
                      "arch_list": resolution.arch_list, "build_env": build_env,
                      **({"patches": patches} if patches else {})}
        key = hashlib.sha256(json.dumps(determines, sort_keys=True).encode()).hexdigest()[:16]
        out.append({"name": ext.name, "version": ext.version, "sdist": ext.sdist.model_dump(),
                    "packages": ext.packages, "modules": ext.modules, "requires": ext.requires,
                    "build_only": ext.build_only, "build_requires": ext.build_requires, "build_env": build_env,
                    "memory_per_job_gib": ext.memory_per_job_gib, "nvcc_threads": ext.nvcc_threads,
                    "patches": patches, "cache_key": key, "determines": determines})
    return {"arch_list": resolution.arch_list, "cuda_home": cuda_home or "", "cache": paths.EXTENSION_CACHE,
            "record": paths.EXTENSIONS_RECORD, "lock": paths.EXTENSIONS_LOCK, "locked": lock is not None,
            "extensions": out}


def part(ctx: Context) -> Part:
    resolution = ctx.resolution
    if not resolution.extensions:
        return Part()
    target = f"{paths.SETUP_DIR}/{EXTENSION_SPEC}"
    step = Step("extensions", (target,),
                files=step_files("extensions.sh", "nvcc-arch.sh", "extensions.py", "sass_audit.py")
                + (FileCopy(f"envbuild/{EXTENSION_SPEC}", target),),
                secrets=(*PIP_SECRETS, compilecache.SECRET), caches=((EXTENSION_CACHE_ID, paths.EXTENSION_CACHE),),
                env=compilecache.env(ctx),
                comment=f"CUDA extensions {', '.join(e.name for e in resolution.extensions)} compiled "
                        f"from their sdists for {resolution.arch_list} only, cached by what determines "
                        f"the wheel; the build fails unless each imports and carries SASS for it")
    text = json.dumps(spec(resolution, ctx.toolchain_home), indent=2, sort_keys=True) + "\n"
    return Part(builder_steps=(step,), from_builder=(paths.BUILT,), generated=((f"envbuild/{EXTENSION_SPEC}", text),))
