"""Can a stack serve a GPU: the CPU its nodes have (the image's architecture), the GPU's own
torch/CUDA floor, the arches torch is built and its cpp_extension accepts, and --qemu only
where the image is arm64."""

from __future__ import annotations

from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.image.arch import arch_runs_on  # the gpu-arch rule, defined once with the in-image smoke test
from envbuild.knowledge.rules.rejection import Rejection
from envbuild.knowledge.rules.versions import contains


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
