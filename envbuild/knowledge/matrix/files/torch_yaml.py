"""torch.yaml: the torch releases, their CUDA variants and the arches each carries."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator

from envbuild.knowledge.matrix.fields import _specifier, _Strict, _version


class TorchRelease(_Strict):
    """One torch release. Every field but `variants` and `note` is derived from the PyPI
    artifacts by `envbuild matrix refresh`; `source` names what it was read from."""

    torch: str
    python: str
    torchvision: str
    triton: str  # the requirement exactly as the Linux x86_64 wheel states it: "==3.3.1", "~=3.8.0"
    nccl: str
    manylinux: str
    default_cuda: str
    cuda_toolkit: Optional[str] = None  # the cuda-toolkit pin of wheels that depend on it (>= 2.11)
    default_arches: str  # TORCH_CUDA_ARCH_LIST form of the default wheel's own arch string
    cuda_platforms: list[Literal["x86_64", "aarch64"]] = ["x86_64"]
    aarch64_arches: Optional[str] = None
    cpp_extension_arches: str  # what cpp_extension accepts in TORCH_CUDA_ARCH_LIST
    extension_lock: Literal["filebaton", "flock"]
    variants: dict[str, str]  # CUDA -> a named arch list, or "default" for the PyPI wheel's
    note: Optional[str] = None
    source: Optional[str] = None

    _v = field_validator("torch", "torchvision", "nccl", "default_cuda")(_version)
    _s = field_validator("python", "triton")(_specifier)
    _o = field_validator("cuda_toolkit")(lambda v: v if v is None else _version(v))

    def accepts_arch(self, cc: str) -> bool:
        """Does cpp_extension accept `cc` in TORCH_CUDA_ARCH_LIST (needed to pre-build ops)?"""
        return cc in self.cpp_extension_arches.split(";")


class TorchFile(_Strict):
    sources: dict[str, str]
    variant_index: str
    arch_lists: dict[str, str]
    releases: list[TorchRelease]
