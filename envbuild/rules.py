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
- ``request``         the stack matches the versions the user asked for
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import EnvbuildError, nearest
from .image.arch import arch_runs_on  # the gpu-arch rule, defined once with the in-image smoke test


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


def pinned_version(requirement: str) -> str:
    """The version a pin installs at least: '==3.3.1' -> '3.3.1', '~=3.8.0' -> '3.8.0'.

    >>> pinned_version("~=3.8.0")
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
    return contains(accepted, pinned_version(requirement))


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


def capabilities(m, s) -> set[str]:
    """What the stack's build can provide to ops that need something (`needs:`)."""
    return set(m.bases.families[s.os].capabilities)


def op_rejection(m, s, op_name: str, arch_list: str, cpu_arch: str = "x86_64") -> Optional[Rejection]:
    """Why `op_name` cannot be pre-built for this stack, GPU arch list and CPU architecture
    (None: it can)."""
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
    missing = [n for n in op.needs if n not in capabilities(m, s)]
    if missing:
        return Rejection("ds-op", f"{op_name}: {op.reason or 'needs ' + ', '.join(missing)} "
                                  f"(not provided by envbuild's {s.os} base)")
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


def select_ops(m, s, arch_list: str, choice: str,
               cpu_arch: str = "x86_64") -> tuple[list[str], list[tuple[str, str]]]:
    """Resolve ``--ds-ops`` into (ops to pre-build, [(op dropped from a preset, why)]).

    Presets (``training``, ``none``, the computed ``all``) quietly drop what the stack
    cannot build, and say so in ``--explain``; an op named explicitly that cannot be
    built is an error.
    """
    choice = (choice or DEFAULT_OPS).strip()
    presets = m.deepspeed_file.presets
    if choice == "all" or choice in presets:
        names = list(m.ops) if choice == "all" else presets[choice]
        chosen, dropped = [], []
        for n in names:
            why = op_rejection(m, s, n, arch_list, cpu_arch)
            (dropped.append((n, why.message)) if why else chosen.append(n))
        return sorted(chosen), dropped
    names = [n.strip() for n in choice.split(",") if n.strip()]
    if not names:
        raise EnvbuildError("--ds-ops is empty; give a preset (training, all, none) or op names.")
    chosen = []
    for n in names:
        if n not in m.ops:
            hint = nearest(n, m.ops)
            did = f" did you mean {', '.join(hint)}?" if hint else ""
            raise EnvbuildError(
                f"--ds-ops names unknown DeepSpeed op '{n}';{did} Presets: "
                f"{', '.join(['all', *presets])}; ops: {', '.join(m.ops)}.")
        why = op_rejection(m, s, n, arch_list, cpu_arch)
        if why:
            ok = [o for o in m.ops if not op_rejection(m, s, o, arch_list, cpu_arch)]
            raise EnvbuildError(
                f"--ds-ops: op '{n}' cannot be pre-built for stack {s.id} ({cpu_arch}): {why.message}. "
                f"Ops this stack can pre-build: {', '.join(ok)}.")
        if n not in chosen:
            chosen.append(n)
    return sorted(chosen), []


def nvcc_required(m, s, ops: list[str], fabric=None) -> Optional[str]:
    """Why the builder needs the CUDA toolchain (None: it does not). DeepSpeed < 0.19.8 runs
    `nvcc -V` in setup.py under DS_ACCELERATOR=cuda even for CPU-only ops; a fabric built from
    source (aws-efa) compiles libfabric and its NCCL plugin against CUDA's headers."""
    cuda_ops = [o for o in ops if m.ops[o].kind == "cuda"]
    if cuda_ops:
        return f"CUDA ops {', '.join(cuda_ops)} are compiled with nvcc"
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
