"""The fabric between nodes: its user space as an OS layer of its own after the runtime's OS
step, or (aws-efa) built in the builder from pinned sources and copied into the final image,
then registered with the dynamic linker; its vendored files (a topology) into the image."""

from __future__ import annotations

from typing import Optional

from envbuild.image import paths
from envbuild.plan.blocks import FileCopy, Step, step_files
from envbuild.plan.components.base import Context, Part
from envbuild.plan.components.ospackages import apt_step, fabric_packages

FABRIC_SECRETS = ("ca_cert", "pip_index_url", "source_mirror")
FABRIC_HEADERS = "fabric/headers.txt"  # under envbuild/ in the build directory: the fabric's pip header lines


def build_words(build) -> tuple[str, ...]:
    """fabric.sh's arguments: KEY VALUE pairs (define, link, export and probe take two values),
    a `source NAME` opening each source's, in build order. Every value passed its grammar at
    load (fabrics_yaml.py); Step quotes each word for the shell."""
    words: list[str] = ["ld-conf", build.ld_conf]
    for src in build.sources:
        words += ["source", src.name, "version", src.version, "url", src.url, "sha256", src.tar_sha256,
                  "build", src.build, "prefix", src.prefix]
        words += [w for option in src.options for w in ("option", build.expanded(option, src))]
        words += ["version-file", src.version_file] if src.version_file else []
        words += ["config-header", src.config_header] if src.defines else []
        words += [w for d in src.defines for w in ("define", d.name, d.why)]
    words += [w for path in build.drop for w in ("drop", path)]
    words += [w for link in build.links for w in ("link", link.path, link.to)]
    words += [w for e in build.exports for symbol in e.symbols for w in ("export", e.file, symbol)]
    words += [w for probe in build.probes for w in ("probe", probe.run, probe.expect)]
    return tuple(words)


def _build_step(fabric, cuda_home: Optional[str]) -> Step:
    """The builder compiles a fabric from its pinned sources (fabric.sh, one loop over the
    declared sources): the real URLs (the source_mirror secret may replace their GitHub base)
    and the sha256 of each tar stream, checked either way."""
    build = fabric.build
    if cuda_home is None and build.uses_cuda:  # rules.nvcc_required gives a source-built fabric the toolchain
        raise AssertionError(f"fabric {fabric.name} is built against CUDA but the builder has no CUDA_HOME")
    env = [("CUDA_HOME", cuda_home)] if cuda_home else []
    files = step_files("fabric.sh", "fabric-install.sh")
    if build.headers:
        env.append(("ENVBUILD_FABRIC_HEADERS", f"{paths.SETUP_DIR}/fabric-headers.txt"))
        files += (FileCopy(f"envbuild/{FABRIC_HEADERS}", f"{paths.SETUP_DIR}/fabric-headers.txt"),)
    return Step("fabric", build_words(build), files=files, env=tuple(env), secrets=FABRIC_SECRETS,
                comment=f"fabric {fabric.name}: {', '.join(f'{s.name} {s.version}' for s in build.sources)} from "
                        f"pinned sources, each tar's sha256 checked ({build.time})")


def _install_step(fabric) -> Step:
    """After the runtime copied the fabric's prefixes: register their libraries with the dynamic
    linker (NCCL dlopens its plugin by name) and put the fabric's tools on PATH."""
    build = fabric.build
    return Step("fabric-install", (build.ld_conf, *build.prefixes),
                comment=f"fabric {fabric.name}: its libraries in the loader's cache, its tools on PATH")


def _user_space(ctx: Context) -> tuple[Step, ...]:
    """The fabric's user space as a layer of its own, after the OS: fabric variants of a stack
    share everything below it, and its size is one layer's (bench/image_size.py). The runtime
    stage binds the step scripts, so nothing is copied. (--keep-toolchain: the builder's OS step
    installs it.)"""
    packages = fabric_packages(ctx.resolution)
    if not packages or ctx.keep:
        return ()
    fabric = ctx.resolution.fabric
    return (apt_step(ctx.resolution, packages, f"fabric {fabric.name}: {fabric.description}", "runtime"),)


def part(ctx: Context) -> Part:
    fabric = ctx.resolution.fabric
    if fabric is None:
        return Part()
    build = fabric.build
    # Built from source: the runtime copies its prefixes and registers them. With --keep-toolchain
    # Docker's runtime is the builder itself (fabric.sh registered them there), but Apptainer's
    # starts again from the builder's base and must take them like any other product.
    copied = build is not None
    return Part(builder_steps=(_build_step(fabric, ctx.toolchain_home),) if build else (),
                runtime_steps=_user_space(ctx),
                after_copy=(_install_step(fabric),) if copied else (),
                from_builder=build.prefixes if copied else (),
                image_files=tuple(FileCopy(f"envbuild/{f.vendored}", f.path) for f in fabric.files),
                generated=((f"envbuild/{FABRIC_HEADERS}", "".join(f"{line}\n" for line in build.headers)),)
                if build and build.headers else ())
