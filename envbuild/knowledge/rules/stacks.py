"""A stack row on its own (checked when the matrix loads), against the versions the user asked
for, and the request as a whole before any stack is looked at: a --python no stack could have
(rules torch-python, os-python), a --cpu-target the matrix does not know (rule cpu-target)."""

from __future__ import annotations

from packaging.version import Version

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.knowledge.rules.cpu_targets import DEFAULT_CPU_TARGET, PLATFORMS
from envbuild.knowledge.rules.rejection import Rejection
from envbuild.knowledge.rules.versions import contains, mm, user_specifier

PYTHONS = tuple(f"3.{n}" for n in range(8, 16))  # every CPython 3 a torch wheel could target


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
