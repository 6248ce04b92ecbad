"""Fabrics (fabrics.yaml): the interconnect stack an image carries fits the GPU's cloud profile,
the OS release's packages, the CPU architecture and the NCCL torch bundles."""

from __future__ import annotations

from typing import Optional

from envbuild.knowledge.rules.rejection import Rejection
from envbuild.knowledge.rules.versions import contains


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
