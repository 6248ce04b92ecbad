"""A stack image's plan: the components listed in build order, each giving its ``Part``, folded
into the builder stage, the runtime stage and the image's record. The one place the parts meet;
what each part holds is decided in its component."""

from __future__ import annotations

from envbuild.image import paths
from envbuild.plan.blocks import STEPS_SOURCE, Copy, FileCopy, Label, Stage
from envbuild.plan.components import (
    compilecache,
    deepspeed,
    extensions,
    fabric,
    finish,
    layers,
    ospackages,
    python,
    record,
    toolchain,
)
from envbuild.plan.components.base import Component, Context
from envbuild.plan.model import MANIFEST_NAME, BuildPlan, build_files
from envbuild.resolve.resolver import EnvVar, Resolution

# The builder's steps in this order: the slowest-changing first, so a DeepSpeed or extension
# change re-runs only the steps after it (each step is its own cache layer).
COMPONENTS: tuple[Component, ...] = (record, ospackages, python, toolchain, fabric, compilecache, deepspeed, extensions, finish, layers)
# What the runtime stage copies from the builder, in this order: the CUDA layers (shared by
# every stack with the same CUDA wheels) first, the image's own products last.
RUNTIME_ORDER: tuple[Component, ...] = (layers, python, finish, fabric, extensions, toolchain)
VENV_ENV = (EnvVar("VIRTUAL_ENV", paths.VENV, "", "", "base"), EnvVar("PATH", f"{paths.VENV}/bin:${{PATH}}", "", "", "base"))


def stack_plan(resolution: Resolution) -> BuildPlan:
    """Derive the whole build of a stack image from a resolution."""
    ctx = Context.of(resolution)
    parts = {component: component.part(ctx) for component in COMPONENTS}
    steps = tuple(step for p in parts.values() for step in p.builder_steps)
    builder = Stage("builder", resolution.base_images["builder"], steps, env=VENV_ENV, platform=ctx.platform)
    taken = tuple(path for c in RUNTIME_ORDER for path in parts[c].from_builder)
    runtime_steps = tuple(step for p in parts.values() for step in p.runtime_steps)
    after_copy = tuple(step for p in parts.values() for step in p.after_copy)
    if ctx.keep:  # the runtime *is* the builder (Docker: FROM builder); Apptainer copies what it took
        runtime = Stage("runtime", resolution.base_images["builder"], runtime_steps, from_builder=taken,
                        reuses_builder=True, platform=ctx.platform, after_copy=after_copy)
    else:
        runtime = Stage("runtime", resolution.base_images["runtime"], runtime_steps, from_builder=taken,
                        binds_context=(FileCopy(STEPS_SOURCE, paths.SETUP_DIR),), platform=ctx.platform,
                        after_copy=after_copy)
    image_env = record.image_env(resolution, ctx.kept_toolchain_home)
    image_files = Copy(tuple(f for p in parts.values() for f in p.image_files))
    generated = dict(item for p in parts.values() for item in p.generated)
    manifest = record.manifest(ctx, image_env)
    return BuildPlan(
        image=record.image_facts(resolution), builder=builder, runtime=runtime, toolchain_home=ctx.toolchain_home,
        kept_toolchain_home=ctx.kept_toolchain_home, image_env=image_env, image_files=image_files,
        # the in-image package (envbuild/image, stdlib only) as /opt/envbuild/lib/envbuild_image
        image_package=Copy((FileCopy(f"envbuild/lib/{paths.PACKAGE}", f"{paths.LIB}/{paths.PACKAGE}"),)),
        manifest_file=Copy((FileCopy(MANIFEST_NAME, paths.MANIFEST),)),
        labels=Label(tuple(record.labels(resolution, manifest))), manifest=manifest,
        build_files=build_files(steps, image_files, qemu=bool(ctx.emulation), generated=generated),
        generated_files=generated, dropped=ctx.ds_build_only, node_env=tuple(resolution.node_env),
        lock=ctx.lock)
