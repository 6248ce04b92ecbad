"""Every compatibility rule, in one place.

Rules read the matrix data (torch.yaml, deepspeed.yaml, gpus.yaml, bases.yaml) and answer
with :class:`Rejection` objects, never booleans, so ``--explain`` and error messages can
say which rule rejected what and why. The rule names are stable strings users see:

- ``torch-cuda``      the torch release has a wheel for that CUDA
- ``torch-python``    the torch release has wheels for that Python
- ``deepspeed-torch`` the DeepSpeed release accepts that torch
- ``deepspeed-no-gpu`` the DeepSpeed release installs on a builder without a GPU
- ``os-python``       the base OS family ships that Python
- ``toolchain``       the builder's nvcc matches torch's CUDA (and torch's cuda-toolkit pin)
- ``gpu-host-arch``   PyPI has CUDA torch wheels for a CPU architecture the GPU's nodes have (Grace: aarch64)
- ``gpu-floor``       the GPU's own torch/CUDA floor (Blackwell: torch >= 2.7, CUDA >= 12.8)
- ``gpu-arch``        the torch build carries code for the GPU's compute capability
- ``gpu-jit-arch``    torch's cpp_extension accepts the GPU's arch (needed to pre-build ops)
- ``ds-op``           a DeepSpeed op can be pre-built for this stack, GPU and CPU architecture
- ``cpu-target``      the CPU target of the host-compiled ops fits the image's architecture and GCC
- ``fabric-os``       the base OS release has the packages the fabric needs (bases.yaml capabilities)
- ``fabric-arch``     the fabric exists for the image's CPU architecture
- ``fabric-nccl``     the fabric's NCCL plugin (or host NCCL) works with the NCCL torch bundles
- ``nccl``            a --nccl release may replace the NCCL torch pins: the same CUDA major as the stack's
                      NCCL wheel family, NCCL 2 (the libnccl.so.2 ABI torch links), not older than torch's
                      pin, a wheel on PyPI for the image's CPU, glibc and Python, and the fabric's NCCL range
- ``fabric-gpu``      a cloud's fabric profile is for its VM sizes' GPUs only (azure-ndv5: H100)
- ``ext-gpu``         a CUDA extension's kernels support the GPU's compute capability (flash-attn 2: sm_80+)
- ``ext-stack``       a CUDA extension's source builds against the stack's torch, CUDA and Python
- ``ext-arch``        a CUDA extension has been built for the image's CPU architecture
- ``ext-deps``        a CUDA extension's runtime requirements are in the stack's lock (nothing unlocked sneaks in)
- ``ext-audit``       the stack's toolchain has NVIDIA's cuobjdump, so the extension's SASS can be audited
- ``ext-source``    a CUDA extension has a source on PyPI that builds (FA3: the sdist lacks its kernels)
- ``ext-wheel``     a wheel-only extension has a PyPI wheel for the stack's CPU, CUDA major, torch and Python
- ``ext-needs``     an extension that needs another (mamba-ssm: causal-conv1d) is requested with it
- ``ext-not-prebuilt`` a package that compiles against torch and CUDA at pip install, and that envbuild does not pre-build, is refused by name
- ``request``         the stack matches the versions the user asked for

Rules that refuse the request itself, before or after a stack is chosen (an error naming the
rule, not a Rejection): ``torch-python`` and ``os-python`` for a --python no stack could have,
``cpu-target`` for a target the matrix does not know, ``nccl`` for a --nccl release the chosen
stack does not accept, ``base-os`` (a --base-image or
--builder-image must be the stack's distro release) and ``base-cuda`` (a named CUDA image must be
the stack's CUDA, and a devel one where the builder needs nvcc), ``base-pinned`` (a base image
names a release tag or a digest: no tag means the tag latest, which moves), ``qemu`` (--qemu only
for an arm64 image, where it does something).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.image.arch import arch_runs_on  # the gpu-arch rule, defined once with the in-image smoke test
from envbuild.oci.registry import split_reference

DEFAULT_CPU_TARGET = "x86-64-v3"  # x86_64 images; aarch64 ones default to their host CPU's (gpus.yaml)
PLATFORMS = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}  # OCI platform of each CPU architecture
PYTHONS = tuple(f"3.{n}" for n in range(8, 16))  # every CPython 3 a torch wheel could target
DEFAULT_OPS = "training"  # the op preset an image gets when nobody names one (--ds-ops, envbuild.yaml)


@dataclass(frozen=True)
class Rejection:
    rule: str
    message: str


# ---------------------------------------------------------------- helpers


def mm(version: str) -> str:
    """'13.0.2' -> '13.0'."""
    v = Version(version)
    return f"{v.major}.{v.minor}"


def _cc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def user_specifier(flag: str, text: str) -> SpecifierSet:
    """Parse a user's --torch/--cuda/--python/--deepspeed value.

    A bare version means that release line: ``2.5`` is ``==2.5.*``, ``2.5.1`` is
    ``==2.5.1``; anything else must be a PEP 440 specifier.
    """
    raw = text.strip().split("+", 1)[0]  # '2.11.0+cu130' (torch.__version__) means 2.11.0
    try:
        v = Version(raw)
    except InvalidVersion:
        v = None
    if v is not None and raw[:1].isdigit():
        plain = not (v.is_prerelease or v.is_postrelease or v.is_devrelease)
        return SpecifierSet(f"=={raw}.*" if plain and len(v.release) < 3 else f"=={raw}")
    try:
        spec = SpecifierSet(raw)
    except InvalidSpecifier:
        raise EnvbuildError(
            f"{flag} '{text}' is neither a version nor a PEP 440 specifier; examples: "
            f"{flag} 2.11, {flag} 2.11.0, {flag} '>=2.5,<2.8'.") from None
    if not str(spec):
        raise EnvbuildError(f"{flag} is empty; give a version like 2.11 or a specifier like '>=2.5'.")
    return spec


def contains(spec: str | SpecifierSet, version: str) -> bool:
    return SpecifierSet(str(spec)).contains(Version(version), prereleases=True)


def lowest_pinned_version(requirement: str) -> str:
    """The version a pin installs at least: '==3.3.1' -> '3.3.1', '~=3.8.0' -> '3.8.0'.

    >>> lowest_pinned_version("~=3.8.0")
    '3.8.0'
    """
    for spec in SpecifierSet(requirement):
        if spec.operator in ("==", "===", "~=", ">="):
            return spec.version.removesuffix(".*")
    raise ValueError(f"{requirement!r} pins no version")


def pin_overlaps(requirement: str, accepted: str) -> bool:
    """Can a version satisfying torch's `requirement` (a pin) also satisfy `accepted`?

    >>> pin_overlaps("~=3.8.0", ">=2.3,<3.3"), pin_overlaps("==3.1.0", ">=3.0,<3.2")
    (False, True)
    """
    return contains(accepted, lowest_pinned_version(requirement))


# ---------------------------------------------------------------- stack rules


def stack_rejections(m, s) -> list[Rejection]:
    """Rules a stack row must satisfy on its own (checked when the matrix loads)."""
    out: list[Rejection] = []
    rel = m.torch_release(s.torch)
    if s.cuda not in rel.variants:
        out.append(Rejection("torch-cuda", f"torch {s.torch} has no CUDA {s.cuda} wheel "
                                           f"(variants: {', '.join(rel.variants)})"))
    if not contains(rel.python, s.python):
        out.append(Rejection("torch-python", f"torch {s.torch} has no wheels for Python {s.python} "
                                             f"(it has {rel.python})"))
    ds = m.ds_release(s.deepspeed)
    if not contains(ds.torch, s.torch):
        out.append(Rejection("deepspeed-torch", f"DeepSpeed {s.deepspeed} needs torch {ds.torch}"))
    if not ds.gpu_free_install:
        affected = ", ".join(r.deepspeed for r in m.deepspeed_file.releases if not r.gpu_free_install)
        out.append(Rejection("deepspeed-no-gpu", f"DeepSpeed {s.deepspeed} cannot be installed on a builder without a "
                                                 f"GPU: with DS_ACCELERATOR=cuda its import (which setup.py runs) asks "
                                                 f"the GPU for its compute capability (releases on record that do: "
                                                 f"{affected}; deepspeed.yaml gpu_free_install)"))
    family = m.bases.families[s.os]
    if s.python not in family.python:
        out.append(Rejection("os-python", f"{s.os} ships Python {', '.join(family.python)}, not {s.python}"))
    tc = m.bases.toolchains[s.toolchain]
    if tc.install:
        if not s.cuda_toolkit:
            out.append(Rejection("toolchain", f"a {s.toolchain} toolchain stack must pin cuda_toolkit"))
        elif mm(s.cuda_toolkit) != s.cuda:
            out.append(Rejection("toolchain", f"cuda_toolkit {s.cuda_toolkit} does not match torch's CUDA {s.cuda}"))
        elif s.cuda == rel.default_cuda and rel.cuda_toolkit and s.cuda_toolkit != rel.cuda_toolkit:
            out.append(Rejection("toolchain", f"cuda_toolkit {s.cuda_toolkit} differs from the cuda-toolkit=="
                                              f"{rel.cuda_toolkit} torch {s.torch} itself depends on"))
        if tc.min_cuda and Version(s.cuda) < Version(tc.min_cuda):
            out.append(Rejection("toolchain", f"PyPI ships an nvcc binary only from CUDA {tc.min_cuda} "
                                              f"({tc.source})"))
    elif f":{s.cuda}." not in s.base_images.builder:
        out.append(Rejection("toolchain", f"builder image {s.base_images.builder} is not a CUDA {s.cuda} "
                                          f"devel image; DeepSpeed checks nvcc against torch's CUDA"))
    return out


def request_rejections(m, s, req) -> list[Rejection]:
    """Does the stack match what the user asked for (--python/--cuda/--torch/--deepspeed)?"""
    out = []
    for flag, attr in (("--python", "python"), ("--cuda", "cuda"), ("--torch", "torch"),
                       ("--deepspeed", "deepspeed")):
        want = getattr(req, attr)
        if want and not user_specifier(flag, want).contains(Version(getattr(s, attr)), prereleases=True):
            out.append(Rejection("request", f"{attr} {getattr(s, attr)} does not match {flag} '{want}'"))
    return out


def image_arch(m, s, gpu) -> Optional[str]:
    """The CPU architecture of the image for this stack and GPU: the first architecture of the
    GPU's nodes that PyPI has CUDA torch wheels for (None: there is none)."""
    arches = m.stack_arches(s)
    return next((a for a in gpu.host_arch if a in arches), None)


def check_emulation(m, req, gpu, arch: Optional[str]) -> None:
    """Rule qemu: --qemu changes an arm64 build only; on an x86_64 image it would do nothing,
    which the user should hear rather than find out."""
    if req.qemu and arch == "x86_64":
        arm = sorted(g.name for g in m.gpus if "aarch64" in g.host_arch)
        raise EnvbuildError(f"--qemu builds an arm64 image under qemu-user emulation, but {gpu.name}'s image is "
                            f"x86_64, where it would do nothing (rule qemu). Drop --qemu, or pick a GPU whose nodes "
                            f"are arm64: {', '.join(arm)}.")


def _no_cuda_wheels(m, s, arch: str) -> str:
    """Why PyPI has no CUDA torch wheel of this stack for `arch`."""
    rel = m.torch_release(s.torch)
    if arch in rel.cuda_platforms:
        return (f"PyPI's {arch} torch {s.torch} wheels are its default CUDA {rel.default_cuda} build, not CUDA "
                f"{s.cuda} (torch.yaml cuda_platforms)")
    first = next((r.torch for r in m.torch_file.releases if arch in r.cuda_platforms), None)
    since = f"PyPI has {arch} CUDA wheels from torch {first}" if first else f"no torch in the matrix has {arch} CUDA wheels"
    return f"torch {s.torch}'s {arch} wheels on PyPI are CPU-only builds ({since}; torch.yaml cuda_platforms)"


def gpu_rejections(m, s, gpu) -> list[Rejection]:
    """Can this stack serve this GPU?"""
    out = []
    arch = image_arch(m, s, gpu)
    if arch is None:
        why = "; ".join(_no_cuda_wheels(m, s, a) for a in gpu.host_arch)
        out.append(Rejection("gpu-host-arch", f"{gpu.name} nodes have {' or '.join(gpu.host_arch)} CPUs and {why}"))
    req = gpu.requires
    if req:
        if req.torch and not contains(req.torch, s.torch):
            out.append(Rejection("gpu-floor", f"{gpu.name} needs torch {req.torch} ({req.source})"))
        if req.cuda and not contains(req.cuda, s.cuda):
            out.append(Rejection("gpu-floor", f"{gpu.name} needs CUDA {req.cuda} ({req.source})"))
    rel = m.torch_release(s.torch)
    if s.cuda in rel.variants and arch is not None:
        arches = m.arch_list(rel, s.cuda, arch)
        if not arch_runs_on(gpu.cc, arches):
            wheel = "" if arch == "x86_64" else f" ({arch} wheel)"
            out.append(Rejection("gpu-arch", f"torch {s.torch}+cu{s.cuda.replace('.', '')}{wheel} is built for "
                                             f"{arches}, which has no code for {gpu.name} ({gpu.sm})"))
    if not rel.accepts_arch(gpu.cc):
        first = next((r.torch for r in m.torch_file.releases if r.accepts_arch(gpu.cc)), None)
        since = f"accepted from torch {first}" if first else "no torch in the matrix accepts it"
        out.append(Rejection("gpu-jit-arch", f"torch {s.torch}'s cpp_extension rejects arch {gpu.cc} "
                                             f"({since}), so ops cannot be pre-built"))
    return out


# ---------------------------------------------------------------- DeepSpeed ops


def capabilities(m, s, sections: frozenset[str] = frozenset()) -> set[str]:
    """What the stack's build can provide to ops that need something (`needs:`): the OS
    family's packages, the toolchain's CUDA libraries, and those an extra of the toolchain adds
    where the stack's lock holds that extra's section (`sections`: the lock's section names)."""
    toolchain = m.bases.toolchains[s.toolchain]
    return (set(m.bases.families[s.os].capabilities) | set(toolchain.provides)
            | {need for need in toolchain.adds if need in sections})


def _unlocked_add(m, s, need: str) -> str:
    """Why a need the toolchain adds is missing: the stack's lock has no section for it."""
    toolchain = m.bases.toolchains[s.toolchain]
    return (f"the {s.toolchain} toolchain adds {need} from {toolchain.install.package}[{toolchain.adds[need].extra}], "
            f"hash-locked in the stack's lock, and the lock of {s.id} has no [{need}] section: "
            f"`envbuild lock --stack {s.id}` writes it")


def op_rejection(m, s, op_name: str, arch_list: str, cpu_arch: str = "x86_64",
                 sections: frozenset[str] = frozenset()) -> Optional[Rejection]:
    """Why `op_name` cannot be pre-built for this stack, GPU arch list and CPU architecture
    (None: it can). `sections`: the section names of the stack's lock (what it adds)."""
    op = m.ops[op_name]
    if cpu_arch == "aarch64" and op_name in m.deepspeed_file.aarch64.not_buildable:
        return Rejection("ds-op", f"{op_name} cannot be built for aarch64: "
                                  f"{m.deepspeed_file.aarch64.not_buildable[op_name]}")
    ds = Version(s.deepspeed)
    if ds < Version(op.since):
        return Rejection("ds-op", f"{op_name} first appears in DeepSpeed {op.since}")
    if op.until and ds >= Version(op.until):
        return Rejection("ds-op", f"{op_name} was removed in DeepSpeed {op.until}")
    if op.torch and not contains(op.torch, s.torch):
        return Rejection("ds-op", f"{op_name}: {op.reason or f'needs torch {op.torch}'}")
    if op.cuda and not contains(op.cuda, s.cuda):  # the builder's nvcc is the stack's CUDA (rule toolchain)
        return Rejection("ds-op", f"{op_name} compiles with CUDA {op.cuda} only and the stack has CUDA {s.cuda}: "
                                  f"{op.cuda_reason}")
    missing = [n for n in op.needs if n not in capabilities(m, s, sections)]
    if missing:
        known = {n: _unlocked_add(m, s, n) for n in m.bases.toolchains[s.toolchain].adds}  # how it adds them
        why = [known[n] for n in missing if n in known]  # each missing need with its own reason
        if op.reason and any(n not in known for n in missing):
            why.insert(0, op.reason)  # the op's curated reason covers the needs no toolchain explains
        return Rejection("ds-op", f"{op_name}: needs {', '.join(missing)}, which envbuild's {s.os} base and its "
                                  f"{s.toolchain} toolchain do not provide" + (f": {'; '.join(why)}" if why else ""))
    if op.min_cc:
        lowest = min(_cc(a.removesuffix("+PTX")) for a in arch_list.split(";") if a)
        if lowest < _cc(op.min_cc):
            return Rejection("ds-op", f"{op_name} needs compute capability >= {op.min_cc}, "
                                      f"the arch list is {arch_list}")
    triton = m.torch_release(s.torch).triton
    for rule in op.triton:
        if contains(rule.deepspeed, s.deepspeed) and not any(pin_overlaps(triton, t) for t in rule.triton):
            return Rejection("ds-op", f"{op_name}: DeepSpeed {s.deepspeed} accepts triton "
                                      f"{' or '.join(rule.triton)}, torch {s.torch} pins triton {triton}")
    return None


def select_ops(m, s, arch_list: str, choice: str, cpu_arch: str = "x86_64",
               sections_of=lambda stack: frozenset()) -> tuple[list[str], list[tuple[str, str]]]:
    """Resolve ``--ds-ops`` into (ops to pre-build, [(op dropped from a preset, why)]).

    Presets (``training``, ``none``, the computed ``all``) quietly drop what the stack
    cannot build, and say so in ``--explain``; an op named explicitly that cannot be
    built is an error.
    """
    choice = (choice or DEFAULT_OPS).strip()
    presets = m.deepspeed_file.presets
    sections = sections_of(s)  # `sections_of(stack)`: its lock's section names (what the lock adds)
    if choice == "all" or choice in presets:
        names = list(m.ops) if choice == "all" else presets[choice]
        chosen, dropped = [], []
        for n in names:
            why = op_rejection(m, s, n, arch_list, cpu_arch, sections)
            (dropped.append((n, why.message)) if why else chosen.append(n))
        return sorted(chosen), dropped
    names = [n.strip() for n in choice.split(",") if n.strip()]  # known op names: validate.check_ds_ops
    chosen = []
    for n in names:
        why = op_rejection(m, s, n, arch_list, cpu_arch, sections)
        if why:
            ok = [o for o in m.ops if not op_rejection(m, s, o, arch_list, cpu_arch, sections)]
            builds = [t.id for t in reversed(m.stacks)  # newest last in the matrix: the nearest first
                      if t.id != s.id and not op_rejection(m, t, n, arch_list, cpu_arch, sections_of(t))][:3]
            raise EnvbuildError(
                f"--ds-ops: op '{n}' cannot be pre-built for stack {s.id} ({cpu_arch}): {why.message}. "
                f"Ops this stack can pre-build: {', '.join(ok)}."
                + (f" Stacks that can pre-build {n}: {', '.join(builds)} (--stack ID; `envbuild render --explain` "
                   f"says whether the GPU allows each)." if builds else ""))
        if n not in chosen:
            chosen.append(n)
    return sorted(chosen), []


# ---------------------------------------------------------------- CUDA extensions (extensions.yaml)


def extension_gpu_rejection(ext, gpu) -> Optional[Rejection]:
    """Rule ext-gpu: the extension's kernels exist for the GPU's compute capability."""
    if _cc(gpu.cc) < _cc(ext.min_cc):
        return Rejection("ext-gpu", f"{ext.name} {ext.version} needs compute capability >= {ext.min_cc} and "
                                    f"{gpu.name} is {gpu.sm} ({ext.sources.get('min_cc', ext.sources.get('setup.py', ''))})")
    if ext.max_cc and _cc(gpu.cc) > _cc(ext.max_cc):
        return Rejection("ext-gpu", f"{ext.name} {ext.version} supports compute capability up to {ext.max_cc} and "
                                    f"{gpu.name} is {gpu.sm} ({ext.sources.get('max_cc', '')})")
    return None


def extension_rejections(m, s, ext, cpu_arch: Optional[str], locked: Optional[set[str]]) -> list[Rejection]:
    """Rules ext-stack, ext-arch and ext-deps for one stack; `locked` holds the canonical names
    of the stack's lock (None: the stack is not hash-locked, and the build installs them)."""
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
    elif ext.sdist is None and cpu_arch is not None:
        wheel, why = extension_wheel(ext, s, cpu_arch)
        if wheel is None:
            out.append(Rejection("ext-wheel", f"no {ext.name} {ext.version} wheel on PyPI fits and it has no sdist to "
                                              f"compile: {'; '.join(why)}"))
    no_audit = m.bases.toolchains[s.toolchain].audit_missing(s.cuda_toolkit)
    if no_audit:
        out.append(Rejection("ext-audit", f"{ext.name} must pass the SASS audit and {no_audit}"))
    if locked is not None:
        missing = [n for n in (*ext.requires, *ext.build_requires) if re.sub(r"[-_.]+", "-", n).lower() not in locked]
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


def nvcc_required(m, s, ops: list[str], fabric=None, extensions=()) -> Optional[str]:
    """Why the builder needs the CUDA toolchain (None: it does not). DeepSpeed < 0.19.8 runs
    `nvcc -V` in setup.py under DS_ACCELERATOR=cuda even for CPU-only ops; a fabric built from
    source (aws-efa) compiles libfabric and its NCCL plugin against CUDA's headers."""
    cuda_ops = [o for o in ops if m.ops[o].kind == "cuda"]
    compiled = ([f"CUDA ops {', '.join(cuda_ops)}"] if cuda_ops else []) + \
        ([f"CUDA extensions {', '.join(extensions)}"] if extensions else [])
    if compiled:
        return f"{' and '.join(compiled)} are compiled with nvcc"
    if not m.ds_release(s.deepspeed).nvcc_free_install:
        return f"DeepSpeed {s.deepspeed} runs `nvcc -V` at install time with DS_ACCELERATOR=cuda"
    if fabric is not None and fabric.build is not None:
        return f"fabric {fabric.name} builds {', '.join(src.name for src in fabric.build.sources)} against CUDA's headers"
    return None


def cpu_target_rejection(m, s, target: str, cpu_arch: str) -> Optional[Rejection]:
    """Why `--cpu-target target` cannot build this stack's CPU ops for a `cpu_arch` image
    (None: it can): another architecture's target, or one the OS's GCC does not know."""
    known = m.gpus_file.cpu_targets.get(target)
    if known is None:
        return Rejection("cpu-target", f"'{target}' is not a CPU target in gpus.yaml cpu_targets")
    if known.arch != cpu_arch:
        return Rejection("cpu-target", f"'{target}' is an {known.arch} target and the image is {cpu_arch}")
    family = m.bases.families[s.os]
    if Version(family.gcc) < Version(known.min_gcc):
        return Rejection("cpu-target", f"'{target}' ({known.flag}) needs GCC >= {known.min_gcc} and {s.os} ships GCC "
                                       f"{family.gcc} ({known.source})")
    return None


def check_request(m, req) -> None:
    """Rules torch-python, os-python and cpu-target for the request as a whole: refused before
    any stack is looked at, with the nearest valid choices."""
    targets = m.gpus_file.cpu_targets
    if req.cpu_target is not None and req.cpu_target not in targets:
        hint = nearest(req.cpu_target, targets)
        did = f" did you mean {', '.join(hint)}?" if hint else ""
        by_arch = "; ".join(f"{arch}: {', '.join(n for n, t in targets.items() if t.arch == arch)}"
                            for arch in PLATFORMS)
        raise EnvbuildError(f"--cpu-target {grammar.shown(req.cpu_target)} is not a known CPU target;{did} Known targets by "
                            f"architecture: {by_arch} (default: {DEFAULT_CPU_TARGET} on x86_64, the GPU's host "
                            f"CPU on aarch64: neoverse-v2 for Grace).")
    pspec = user_specifier("--python", req.python) if req.python else None
    if pspec is not None and req.torch:
        tspec = user_specifier("--torch", req.torch)
        rels = [r for r in m.torch_file.releases if tspec.contains(Version(r.torch))]
        wanted = [p for p in PYTHONS if pspec.contains(Version(p))]
        if rels and wanted and not any(contains(r.python, p) for r in rels for p in wanted):
            pys = [p for p in _pythons(m) if any(contains(r.python, p) for r in rels)]
            raise EnvbuildError(
                f"--python {req.python}: torch {', '.join(r.torch for r in rels)} has no wheels for it "
                f"(rule torch-python: wheels exist for Python {', '.join(r.python for r in rels)}); "
                f"nearest valid choices: --python {', '.join(pys) or 'none in the matrix'}.")
    if pspec is not None and not any(pspec.contains(Version(p)) for p in _pythons(m)):
        raise EnvbuildError(
            f"--python {req.python}: no base OS in the matrix ships it (rule os-python: "
            + "; ".join(f"{name} ships {', '.join(f.python)}" for name, f in m.bases.families.items())
            + f"); nearest valid choices: --python {', '.join(_pythons(m))}.")


def _pythons(m) -> list[str]:
    """Pythons some base family ships: the ones a stack could use."""
    return sorted({p for f in m.bases.families.values() for p in f.python}, key=Version)


def default_cpu_target_rejection(m, s, gpu, cpu_arch: str) -> Optional[Rejection]:
    """Rule cpu-target without --cpu-target: the GPU's host CPU has a target the OS's GCC knows."""
    try:
        m.cpu_target_for(cpu_arch, gpu, m.bases.families[s.os])
    except KeyError as e:
        return Rejection("cpu-target", f"{e.args[0]} ({s.os} ships GCC {m.bases.families[s.os].gcc})")
    return None


# ---------------------------------------------------------------- base images (rules base-os, base-cuda)

UBUNTU_CODENAMES = {"bionic": "18.04", "focal": "20.04", "jammy": "22.04", "kinetic": "22.10", "lunar": "23.04",
                    "mantic": "23.10", "noble": "24.04", "oracular": "24.10", "plucky": "25.04",
                    "questing": "25.10"}
DEBIAN_CODENAMES = {"buster": "10", "bullseye": "11", "bookworm": "12", "trixie": "13", "forky": "14"}
OTHER_DISTROS = ("rockylinux", "almalinux", "centos", "ubi", "rhel", "oraclelinux", "amazonlinux", "fedora",
                 "alpine", "opensuse", "archlinux")
_RELEASE_TOKEN = re.compile(rf"^(ubuntu|debian|{'|'.join(OTHER_DISTROS)})(\d[\d.]*)?$")


def image_release(ref: str) -> Optional[tuple[str, str]]:
    """(distro, version) named by an image reference, e.g. ('ubuntu', '22.04'), or None
    when the name and tag say nothing about it (no pull: private names are not guessed)."""
    name, tag, _ = split_reference(ref)
    last = name.rsplit("/", 1)[-1]
    tokens = re.split(r"[-_]", tag) if tag else []
    if last == "ubuntu" and tokens and re.fullmatch(r"\d\d\.\d\d", tokens[0]):
        return "ubuntu", tokens[0]
    if last == "debian" and tokens and re.fullmatch(r"\d+(\.\d+)*", tokens[0]):
        return "debian", tokens[0].split(".")[0]
    for token in tokens:
        if token in UBUNTU_CODENAMES:
            return "ubuntu", UBUNTU_CODENAMES[token]
        if token in DEBIAN_CODENAMES:
            return "debian", DEBIAN_CODENAMES[token]
        found = _RELEASE_TOKEN.match(token)
        if found and found.group(2):
            version = found.group(2)
            return found.group(1), (version.split(".")[0] if found.group(1) == "debian" else version)
    if last in OTHER_DISTROS:
        return last, tokens[0] if tokens else ""
    return None


def _family_release(family: str) -> Optional[tuple[str, str]]:
    """'ubuntu24.04' -> ('ubuntu', '24.04'); 'debian12' -> ('debian', '12')."""
    found = re.fullmatch(r"([a-z]+)(\d[\d.]*)", family)
    return (found.group(1), found.group(2)) if found else None


def _retag(ref: str, want: tuple[str, str]) -> Optional[str]:
    """The same image name with the release in its tag changed to `want` (same spelling)."""
    name, tag, _ = split_reference(ref)
    if not tag:
        return None
    distro, version = want
    codenames = {v: k for k, v in (UBUNTU_CODENAMES if distro == "ubuntu" else DEBIAN_CODENAMES).items()}
    out = []
    for token in re.split(r"([-_])", tag):
        if token in UBUNTU_CODENAMES or token in DEBIAN_CODENAMES:
            token = codenames.get(version, f"{distro}{version}")
        elif _RELEASE_TOKEN.match(token) and _RELEASE_TOKEN.match(token).group(2):
            token = f"{distro}{version}"
        out.append(token)
    if name.rsplit("/", 1)[-1] in ("ubuntu", "debian") and re.fullmatch(r"\d+(\.\d+)*", out[0]):
        if name.rsplit("/", 1)[-1] != distro:
            return None
        out[0] = version
    new = "".join(out)
    return f"{name}:{new}" if new != tag else None


def unpinned(ref: str) -> Optional[str]:
    """Why image `ref` may be another image tomorrow (rule base-pinned), or None: it names no tag
    (Docker reads `latest`) or the tag `latest`, and no digest. hadolint refuses both in a
    FROM line (DL3006, DL3007)."""
    _, tag, digest = split_reference(ref)
    if digest:
        return None
    if tag is None:
        return "names no tag, so a build takes whatever `latest` is that day"
    if tag == "latest":
        return "names the tag `latest`, which moves"
    return None


def check_base_images(m, stack, req) -> None:
    """A --base-image/--builder-image must be the stack's distro release (the venv is built
    with that release's Python and copied between the stages); a named CUDA builder must be
    a devel image of the stack's CUDA (DeepSpeed checks nvcc against torch's CUDA)."""
    want = _family_release(stack.os)
    images = [("--base-image", req.base_image, stack.base_images.runtime),
              ("--builder-image", req.builder_image, stack.base_images.builder)]
    for flag, ref, own in images:
        if not ref:
            continue
        why = unpinned(ref)
        if why:
            name = split_reference(ref)[0]
            raise EnvbuildError(f"{flag} {ref!r} {why} (rule base-pinned: the image built would not be the one "
                                f"rendered, and hadolint refuses such a FROM line). Nearest valid choices: {flag} "
                                f"{name}:<release tag> or {name}@sha256:<digest>, or leave it out for the stack's {own}.")
        have = image_release(ref)
        if want and have and have != want:
            same_release = sorted(s.id for s in m.stacks if _family_release(s.os) == have)
            retagged = _retag(ref, want) if have[0] == want[0] else None  # never 'debian:noble'
            choices = [c for c in (retagged, own) if c]
            other = (f", or a stack built on {have[0]}{have[1]}: --stack {', '.join(same_release)}"
                     if same_release else f"; no stack in the matrix is built on {have[0]}{have[1]}")
            raise EnvbuildError(
                f"{flag} '{ref}' is {have[0]} {have[1]}, but stack {stack.id} is built on {stack.os} (rule base-os: "
                f"its Python {stack.python} and the venv copied between the stages come from that release). Nearest "
                f"valid choices: {flag} {' or '.join(dict.fromkeys(choices))}{other}.")
        if flag == "--builder-image" and not m.bases.toolchains[stack.toolchain].install:
            _check_cuda_image(ref, stack, flag, own, need_nvcc=True)
        elif flag == "--base-image":
            _check_cuda_image(ref, stack, flag, own, need_nvcc=False)


def _check_cuda_image(ref: str, stack, flag: str, own: str, need_nvcc: bool) -> None:
    """An NVIDIA CUDA image by name must be the stack's CUDA (its NVIDIA_REQUIRE_CUDA lets
    an older driver start the container otherwise), and a devel one where nvcc is needed."""
    name, tag, _ = split_reference(ref)
    if name.rsplit("/", 1)[-1] != "cuda" or not tag:
        return  # not an NVIDIA CUDA image by name: nothing to check without a pull
    found = re.match(r"^(\d+)\.(\d+)(?:\.\d+)?-(.*)$", tag)
    if not found:
        return
    cuda, flavour = f"{found.group(1)}.{found.group(2)}", found.group(3)
    if cuda != stack.cuda:
        why = ("DeepSpeed checks nvcc against it (rule toolchain)" if need_nvcc else
               "the image's NVIDIA_REQUIRE_CUDA would let a driver too old for the stack start the container")
        raise EnvbuildError(f"{flag} '{ref}' is CUDA {cuda}, but stack {stack.id}'s torch is built for CUDA "
                            f"{stack.cuda} and {why} (rule base-cuda). Nearest valid choice: {flag} {own}.")
    if need_nvcc and "devel" not in flavour.split("-"):
        raise EnvbuildError(f"{flag} '{ref}' is a {flavour.split('-')[0]} image without nvcc; the builder "
                            f"compiles DeepSpeed's CUDA ops (rule base-cuda). Nearest valid choice: a devel image such as "
                            f"{flag} {own}.")


# ---------------------------------------------------------------- fabrics


def fabric_rejections(m, s, fabric, cpu_arch: Optional[str], gpu=None) -> list[Rejection]:
    """Why `fabric` cannot go into an image of stack `s` for CPU architecture `cpu_arch` (and
    GPU profile `gpu`: a cloud's fabric profile may be for its VM sizes' GPUs only)."""
    out = []
    req = fabric.requires
    if req and req.gpus and gpu is not None and gpu.name not in req.gpus:
        out.append(Rejection("fabric-gpu", f"fabric {fabric.name} is for {', '.join(req.gpus)} nodes and the "
                                           f"image is for {gpu.name} ({req.source})"))
    family = m.bases.families[s.os]
    missing = [n for n in fabric.needs if n not in family.capabilities]
    if missing:
        having = [f.name for f in m.fabrics if all(n in family.capabilities for n in f.needs)]
        out.append(Rejection("fabric-os", f"fabric {fabric.name} needs {', '.join(missing)} packages, which "
                                          f"bases.yaml does not list for {s.os} (fabrics for {s.os}: "
                                          f"{', '.join(having)})"))
    if req and cpu_arch and cpu_arch not in req.arch:
        out.append(Rejection("fabric-arch", f"fabric {fabric.name} is for {', '.join(req.arch)} hosts and the "
                                            f"image is {cpu_arch} ({req.source})"))
    nccl = m.torch_release(s.torch).nccl
    if req and req.nccl and not contains(req.nccl, nccl):
        out.append(Rejection("fabric-nccl", f"fabric {fabric.name} needs NCCL {req.nccl} and torch {s.torch} "
                                            f"bundles NCCL {nccl} ({req.source})"))
    return out


def check_apt_mirror(os_locked: tuple[str, ...], apt_mirror: Optional[str], apt_snapshot: Optional[str]) -> None:
    """--apt-mirror replaces the live archive's host; a stage the OS lock pins installs from the
    archive as of the lock's moment, which a live mirror no longer serves. --apt-snapshot without
    an OS lock has nothing to serve."""
    if os_locked and apt_mirror:
        raise EnvbuildError(f"--apt-mirror replaces the live archive's host, but this stack's OS lock pins the "
                            f"{' and '.join(os_locked)} stage's packages to the archive as of the lock's moment, "
                            f"which a live mirror no longer serves. Give a mirror of that moment as --apt-snapshot "
                            f"'URL/{{archive}}/{{timestamp}}' (or leave both out: the snapshot service has it).")
    if apt_snapshot and not os_locked:
        raise EnvbuildError("--apt-snapshot serves an OS lock's moment of the archive, and this build has no OS "
                            "lock (the summary's `os lock` line says why); leave it out, or use --apt-mirror for the "
                            "live archive.")


# ---------------------------------------------------------------- NCCL


def _glibc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def nccl_wheels(release, cpu_arch: str, glibc: str, python: str) -> list:
    """The wheels of an NCCL release that install on the image: its CPU, a manylinux glibc no
    newer than the OS's, a Requires-Python that admits the stack's Python."""
    return [w for w in release.wheels
            if any(arch == cpu_arch and need <= _glibc(glibc) for arch, need in w.platforms())
            and (w.requires_python is None or contains(w.requires_python, python + ".0"))]


def nccl_rejection(m, s, package, pin: str, release, cpu_arch: str, fabric=None) -> Optional[str]:
    """Why NCCL `release` of wheel family `package` cannot replace torch's pin `pin` in an image of
    stack `s` (None: it can). NCCL keeps its ABI within a major (libnccl.so.2, `ncclGetVersion`)
    and adds to it with each minor, so a newer 2.x serves a torch built against an older one and
    an older one may lack a function torch calls."""
    why = _nccl_version_rejection(s, package, pin, release.version)
    if why:
        return why
    glibc = m.bases.families[s.os].glibc
    if not nccl_wheels(release, cpu_arch, glibc, s.python):
        return (f"PyPI has no {package.package} {release.version} wheel for {cpu_arch} with glibc <= {glibc} "
                f"({s.os}) and Python {s.python}")
    need = fabric.requires.nccl if fabric is not None and fabric.requires else None
    if need and not contains(need, release.version):
        return f"fabric {fabric.name} needs NCCL {need} ({fabric.requires.source})"
    return None


def _nccl_version_rejection(s, package, pin: str, version: str) -> Optional[str]:
    """What the version number alone rules out: another CUDA major, another ABI, older than the pin."""
    if package.cuda_major != s.cuda.split(".")[0]:
        return f"{package.package} is built for CUDA {package.cuda_major} and the stack's torch for CUDA {s.cuda}"
    if Version(version).major != Version(pin).major:
        return (f"NCCL {Version(version).major} is another ABI than the NCCL {Version(pin).major} torch {s.torch} "
                f"links (libnccl.so.{Version(pin).major})")
    if Version(version) < Version(pin):
        return (f"it is older than the NCCL {pin} torch {s.torch} pins, and torch may call what an older "
                f"release lacks")
    return None


def select_nccl(m, s, pin: Optional[str], locked: Optional[dict[str, str]], version: str, cpu_arch: str,
                fabric=None):
    """(wheel family, release) that `--nccl version` installs in stack `s`'s image in place of
    torch's pin; an EnvbuildError naming --nccl, why, and the nearest releases it accepts."""
    try:
        grammar.nccl_version(version)
    except grammar.GrammarError as e:
        raise grammar.refuse("--nccl", version, str(e), "give a release of matrices/nccl.yaml, such as 2.31.2, or "
                                                         "leave --nccl out for the NCCL torch pins.") from None
    package = m.nccl_package(s.torch)
    where = m.directory / "nccl.yaml"
    unusable = nccl_unusable(m, s, pin, locked)
    if unusable:
        raise EnvbuildError(f"--nccl {version} cannot be used with stack {s.id}: {unusable}")
    accepted = accepted_nccl(m, s, package, pin, cpu_arch, fabric)
    chosen = next((r for r in package.releases if Version(r.version) == Version(version)), None)
    why = (nccl_rejection(m, s, package, pin, chosen, cpu_arch, fabric) if chosen is not None else
           _nccl_version_rejection(s, package, pin, version)
           or f"PyPI has no {package.package} {version} (as of the matrix's {where.name})")
    if why is None:
        return package, chosen
    near = sorted(accepted, key=lambda r: (abs(_nccl_number(r.version) - _nccl_number(version)), Version(r.version)))
    choices = ", ".join(r.version for r in sorted(near[:3], key=lambda r: Version(r.version)))
    raise EnvbuildError(f"--nccl {version} is refused for stack {s.id} (torch {s.torch} pins {package.package} "
                        f"{pin}): {why}. Nearest releases it accepts: {choices or 'none'} (rule nccl; the releases "
                        f"are {where}); or leave --nccl out for torch's own.")


def nccl_unusable(m, s, pin: Optional[str], locked: Optional[dict[str, str]]) -> Optional[str]:
    """Why no --nccl can be used with stack `s` at all, and what to do instead (None: releases
    may replace torch's pin `pin`; `locked`: the stack lock's pins, None without a lock)."""
    package = m.nccl_package(s.torch)
    if pin is None or package is None:
        why = (f"the NCCL its torch {s.torch} (CUDA {s.cuda}) pins is not known: the matrix reads torch's pin "
               f"from its PyPI wheel, and this stack's torch comes from PyTorch's CUDA-variant index"
               if pin is None else f"{m.directory / 'nccl.yaml'} lists no NCCL wheel family for torch {s.torch} "
                                   f"(`envbuild matrix refresh --write` derives it where the matrix has an nccl.yaml)")
        return (f"{why}. Leave --nccl out for the NCCL torch pins, or pick a stack whose torch is the PyPI default "
                f"wheel (`envbuild nccl` lists the stacks and the releases each accepts).")
    if locked is None:
        return (f"it has no lock (matrices/locks), and --nccl replaces a pin of the stack's lock with another "
                f"hash-locked wheel. Leave --nccl out, or pick a locked stack (`envbuild lock --stack {s.id}` makes one).")
    if locked.get(package.package) != pin:
        return (f"its lock pins {package.package} {locked.get(package.package) or 'not at all'} and torch.yaml says "
                f"torch {s.torch} pins {pin}; refresh the lock (`envbuild lock --stack {s.id}`).")
    return None


def accepted_nccl(m, s, package, pin: str, cpu_arch: str, fabric=None) -> list:
    """The releases of wheel family `package` that may replace torch's pin in stack `s`'s image, oldest first."""
    return [r for r in package.releases if nccl_rejection(m, s, package, pin, r, cpu_arch, fabric) is None]


def _nccl_number(version: str) -> int:
    """A release as one number, for 'nearest' (2.31.2 -> 2031002)."""
    v = Version(version)
    return v.major * 1_000_000 + v.minor * 1_000 + v.micro
