"""CUDA extensions (extensions.yaml): the GPUs their kernels support, the stacks their source
builds against or a wheel fits, the architectures they have been built for, what they need
beside them, and the packages envbuild refuses because it does not pre-build them."""

from __future__ import annotations

import re
from typing import Optional

from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.rules.rejection import Rejection
from envbuild.knowledge.rules.versions import compute_capability, contains


def extension_gpu_rejection(ext, gpu) -> Optional[Rejection]:
    """Rule ext-gpu: the extension's kernels exist for the GPU's compute capability."""
    if compute_capability(gpu.cc) < compute_capability(ext.min_cc):
        return Rejection("ext-gpu", f"{ext.name} {ext.version} needs compute capability >= {ext.min_cc} and "
                                    f"{gpu.name} is {gpu.sm} ({ext.sources.get('min_cc', ext.sources.get('setup.py', ''))})")
    if ext.max_cc and compute_capability(gpu.cc) > compute_capability(ext.max_cc):
        return Rejection("ext-gpu", f"{ext.name} {ext.version} supports compute capability up to {ext.max_cc} and "
                                    f"{gpu.name} is {gpu.sm} ({ext.sources.get('max_cc', '')})")
    return None


def extension_requirements(ext, s) -> list[str]:
    """What the extension needs installed beside it on stack `s`: its Requires-Dist (the sdist's
    install_requires with their bounds where extensions.yaml gives them, less torch and the
    extensions it needs, which come by their own hash; else their names) and the requirements of
    the stack's CUDA major (FA4 on CUDA 13: nvidia-cutlass-dsl[cu13])."""
    major = s.cuda.split(".")[0]
    if ext.requires_dist is None:
        own = list(ext.requires)
    else:
        needs = {requirement_name(n.format(cuda_major=major)) for n in ext.needs}
        own = [r for r in (r.format(cuda_major=major) for r in ext.requires_dist.requirements)
               if requirement_name(r) not in {"torch", *needs}]
    return [*own, *ext.requires_by_cuda.get(major, [])]


def requirement_name(requirement: str) -> str:
    """The canonical name of `name[extra]>=1,<2` (extensions.yaml's grammar)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def _stack_nvcc(s) -> str:
    """The nvcc a stack compiles with: its PyPI cuda-toolkit's version, or on NVIDIA's devel
    images the stack's CUDA (the builder image's own, rule bases checks they agree)."""
    return s.cuda_toolkit or s.cuda


def glibc_rejection(m, s, ext, cpu_arch: Optional[str]) -> Optional[Rejection]:
    """Rule ext-glibc: the extension's closure has wheels for `cpu_arch` only from a newer glibc
    than the stack's base image has (mamba-ssm's tilelang on aarch64: manylinux_2_34); anything
    else would compile an sdist in the image or fail to load."""
    floor = ext.min_glibc.get(cpu_arch) if cpu_arch else None
    have = m.bases.families[s.os].glibc
    if floor and Version(have) < Version(floor):
        return Rejection("ext-glibc", f"{ext.name} {ext.version} on {cpu_arch} needs glibc >= {floor} and stack "
                                      f"{s.id}'s base ({s.os}) has glibc {have} ({ext.sources.get('glibc', '')})")
    return None


def _nvcc_rejection(ext, s, gpu) -> Optional[Rejection]:
    """Rule ext-nvcc: a source build for a GPU its setup.py emits code for only from a newer nvcc
    (flash-attn and mamba-ssm: sm_100/sm_120 from nvcc 12.8, no PTX) would build no kernel the GPU
    runs; the SASS audit would find that hours later."""
    for floor in ext.nvcc_for_cc:
        if compute_capability(gpu.cc) >= compute_capability(floor.min_cc) and not contains(floor.nvcc, _stack_nvcc(s)):
            return Rejection("ext-nvcc", f"{ext.name} {ext.version} compiled for {gpu.name} ({gpu.sm}) needs nvcc "
                                         f"{floor.nvcc} and stack {s.id} compiles with nvcc {_stack_nvcc(s)}, which emits "
                                         f"no code for compute capability >= {floor.min_cc} ({floor.source})")
    return None


def extension_rejections(m, s, ext, cpu_arch: Optional[str], locked: Optional[set[str]], gpu=None) -> list[Rejection]:
    """Rules ext-stack, ext-arch, ext-source, ext-wheel, ext-nvcc, ext-glibc, ext-audit and ext-deps for one stack; `locked` holds the canonical
    names of the stack's lock (None: the stack is not hash-locked, and the build installs them)."""
    out = []
    for what, spec, have in (("torch", ext.torch, s.torch), ("CUDA", ext.cuda, s.cuda), ("Python", ext.python, s.python)):
        if not contains(spec, have):
            out.append(Rejection("ext-stack", f"{ext.name} {ext.version} builds with {what} {spec}, the stack has "
                                              f"{have} ({ext.sources.get(what.lower(), ext.sources.get('setup.py', ''))})"))
    if cpu_arch is not None and cpu_arch not in ext.cpu_arch:
        out.append(Rejection("ext-arch", f"{ext.name} has been built for {', '.join(ext.cpu_arch)} only, the image is "
                                         f"{cpu_arch}"))
    if ext.unbuildable:
        out.append(Rejection("ext-source", f"{ext.name} {ext.version} cannot be built: {ext.unbuildable}"))
    elif ext.unpinned:
        out.append(Rejection("ext-source", f"{ext.name} {ext.version} cannot be built: no sha256 of the tar stream of "
                                           f"its {', '.join(ext.unpinned)} archive is recorded, and a source is fetched "
                                           f"only by a checked hash (`scripts/fabric-sources.sh make DIR "
                                           f"{' '.join(ext.unpinned)}` prints it from a git mirror holding every object "
                                           f"of the commit)"))
    elif cpu_arch is not None:
        wheel, why = extension_wheel(ext, s, cpu_arch)
        if wheel is None and not ext.compiled:
            out.append(Rejection("ext-wheel", f"no {ext.name} {ext.version} wheel on PyPI fits and it has no sdist to "
                                              f"compile: {'; '.join(why)}"))
        nvcc = wheel is None and gpu is not None and _nvcc_rejection(ext, s, gpu)
        out += [nvcc] if nvcc else []
    glibc = glibc_rejection(m, s, ext, cpu_arch)
    out += [glibc] if glibc else []
    # ext-audit: only device code is audited (cuobjdump); a pure-Python wheel (FA4) or a host-only
    # library (TE's torch binding) has none, and its link check needs no cuobjdump
    no_audit = ext.device_code and m.bases.toolchains[s.toolchain].audit_missing(s.cuda_toolkit)
    if no_audit:
        out.append(Rejection("ext-audit", f"{ext.name} must pass the SASS audit and {no_audit}"))
    if locked is not None:
        missing = [n for n in (*extension_requirements(ext, s), *ext.build_requires) if requirement_name(n) not in locked]
        if missing:
            out.append(Rejection("ext-deps", f"{ext.name} needs {', '.join(missing)}, which stack {s.id}'s lock does "
                                             f"not hold (the image installs nothing unlocked)"))
    return out


def extension_wheel(ext, s, cpu_arch: str):
    """(the first of `ext`'s PyPI wheels that fits stack `s` on `cpu_arch`, why each other does
    not): its CPU architecture, the CUDA major its libraries link (a libcudart.so.12 in a CUDA 13
    image is a load error), the torch it loads into, its Python tag. None: compile the sdist."""
    why = []
    for wheel in ext.wheels:
        problems = [problem for problem in (
            wheel.cpu_arch not in ("any", cpu_arch) and f"it is for {wheel.cpu_arch}, the image is {cpu_arch}",
            wheel.cuda_major and wheel.cuda_major != s.cuda.split(".")[0]
            and f"it links CUDA {wheel.cuda_major} libraries (libcudart.so.{wheel.cuda_major}), the stack's torch CUDA {s.cuda}",
            wheel.torch and not contains(wheel.torch, s.torch) and f"it loads into torch {wheel.torch}, the stack has {s.torch}",
            wheel.python and not contains(wheel.python, s.python) and f"its tag admits Python {wheel.python}",
        ) if problem]
        if not problems:
            return wheel, why
        why.append(f"{wheel.filename}: {', '.join(problems)}")
    return None, why


def extension_needs(need: str) -> list[str]:
    """The extensions one `needs:` entry can be: itself, or with {cuda_major} the one of each CUDA
    major (11 to 19; the stack's own is the one whose CUDA range fits it)."""
    return [need.format(cuda_major=major) for major in range(11, 20)] if "{cuda_major}" in need else [need]


def _check_needs(m, ext, names: tuple[str, ...]) -> None:
    """Rule ext-needs: an extension that needs another (mamba-ssm: causal-conv1d; Transformer
    Engine's torch binding: the core wheel of the stack's CUDA major) is refused without it,
    naming the --ext that works."""
    wanted = {m.extension(n).name for n in names}
    for need in ext.needs:
        choices = [n for n in extension_needs(need) if n in m.extensions]
        if not wanted & set(choices):
            fix = ",".join(dict.fromkeys([*choices[-1:], *(m.extension(n).name for n in names)]))
            raise EnvbuildError(f"--ext {ext.name} needs {' or '.join(choices) or need} in the same image "
                                f"({ext.sources.get('needs', ext.sources.get('setup.py', ''))}) (rule ext-needs). "
                                f"Nearest valid choice: --ext {fix} (`envbuild extensions` shows the stacks each fits).")


def extension_patches(ext, s) -> list:
    """The source patches the stack's torch needs (an upstream fix newer than the sdist: e.g.
    C++20 for torch >= 2.13), in the order the matrix lists them."""
    return [p for p in ext.patches if contains(p.torch, s.torch)]


def extension_not_prebuilt(m, name: str) -> Optional[Rejection]:
    """Rule ext-not-prebuilt: a package that compiles against torch and CUDA when pip installs it,
    and that envbuild does not pre-build, is refused by name (`--ext`, `extend`): the final image
    has no nvcc, so pip would fail late, or build without its kernels, or fetch an unchecked
    wheel. `name` is canonical (lower case, '-')."""
    for n in m.extensions_file.not_prebuilt:
        if n.name == name:
            return Rejection("ext-not-prebuilt", f"{n.name} compiles against torch and the CUDA toolkit when pip "
                                                 f"installs it (PyPI has only its sdist; the image has no nvcc) and envbuild does not pre-build it: "
                                                 f"{n.why} ({n.source})")
    return None


def extension_gpus(m, ext) -> list[str]:
    """The GPUs `ext` can be built for: rule ext-gpu passes and one of the hosts the GPU comes in
    is a CPU the extension has been built for (rule ext-arch), so a GPU named as a fit is one
    that a render with it would accept."""
    return [g.name for g in m.gpus
            if not extension_gpu_rejection(ext, g) and set(g.host_arch) & set(ext.cpu_arch)]


def _check_conflicts(m, names: tuple[str, ...]) -> None:
    """Rule ext-conflict: two extensions that cannot share an image (disjoint ranges of one
    dependency, or the same files) are refused, naming each set without one of them."""
    exts = [m.extension(n) for n in names]
    for ext in exts:
        for c in ext.conflicts:
            other = next((e for e in exts if e.name == c.name), None)
            if other is None:
                continue
            without = [",".join(e.name for e in exts if e is not drop) for drop in (other, ext)]
            raise EnvbuildError(f"--ext {ext.name} and {other.name} cannot share an image: {c.why} ({c.source}) "
                                f"(rule ext-conflict). Nearest valid choices: --ext {without[0]}, or --ext "
                                f"{without[1]} (one image each).")


def check_extensions(m, gpu, names: tuple[str, ...]) -> None:
    """Rule ext-gpu for the request as a whole: an extension the GPU cannot run is refused before
    any stack is looked at, naming the GPUs that fit."""
    for name in names:
        ext = m.extension(name)
        why = extension_gpu_rejection(ext, gpu)
        if why:
            fits = extension_gpus(m, ext)
            raise EnvbuildError(f"--ext {ext.name}: {why.message} (rule {why.rule}). GPUs it fits: "
                                f"{', '.join(fits) or 'none'}; drop --ext {ext.name} for {gpu.name}.")
        _check_needs(m, ext, names)
    _check_conflicts(m, names)
