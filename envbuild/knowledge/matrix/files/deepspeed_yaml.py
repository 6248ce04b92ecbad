"""deepspeed.yaml: the DeepSpeed releases, their ops, presets and what aarch64 cannot build."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator

from envbuild.knowledge.matrix.fields import _cc, _op_switch, _specifier, _Strict, _version


class DsRelease(_Strict):
    """One DeepSpeed release, derived from its sdist by `envbuild matrix refresh`."""

    deepspeed: str
    torch: str  # requirements.txt's torch requirement ("" when unversioned)
    gpu_free_install: bool  # setup.py and import work with DS_ACCELERATOR=cuda and no GPU
    nvcc_free_install: bool  # setup.py needs no nvcc when only CPU ops are pre-built
    source: Optional[str] = None

    _v = field_validator("deepspeed")(_version)
    _s = field_validator("torch")(_specifier)


class TritonRule(_Strict):
    deepspeed: str
    triton: list[str]

    _s = field_validator("deepspeed")(_specifier)

    @field_validator("triton")
    @classmethod
    def _specs(cls, v: list[str]) -> list[str]:
        return [_specifier(s) for s in v]


class Op(_Strict):
    env: str
    kind: Literal["cpu", "cuda"]
    since: str
    until: Optional[str] = None
    cuda_extension_until: Optional[str] = None  # a CUDA extension (links cudart) before this release
    needs: list[str] = []
    min_cc: Optional[str] = None
    triton: list[TritonRule] = []
    torch: Optional[str] = None
    reason: Optional[str] = None
    cuda: Optional[str] = None  # the CUDA toolkits (nvcc) whose compiler takes the op's sources
    cuda_reason: Optional[str] = None  # why, with its source: what a refusal says
    note: Optional[str] = None

    _v = field_validator("since", "until", "cuda_extension_until")(lambda v: v if v is None else _version(v))
    _c = field_validator("min_cc")(lambda v: v if v is None else _cc(v))
    _e = field_validator("env")(lambda v: _op_switch(v))
    _s = field_validator("torch", "cuda")(lambda v: v if v is None else _specifier(v))


class Aarch64Facts(_Strict):
    """What DeepSpeed's sources say about building its ops on aarch64 (read from the sdists)."""

    neon_since: str  # first release whose csrc/includes/simd.h has a NEON path; before it, scalar
    not_buildable: dict[str, str] = {}  # op -> why it cannot be pre-built on aarch64
    source: str

    _v = field_validator("neon_since")(_version)


class DeepspeedFile(_Strict):
    sources: dict[str, str]
    releases: list[DsRelease]
    build_requires: list[str]  # what setup.py imports before pip resolves (--no-build-isolation)
    build_only: dict[str, str] = {}  # package -> why the final image drops it (DeepSpeed's JIT-only needs)
    ops: dict[str, Op]
    presets: dict[str, list[str]]
    aarch64: Aarch64Facts
