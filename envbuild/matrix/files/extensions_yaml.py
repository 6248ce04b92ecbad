"""extensions.yaml: the CUDA extensions `--ext` compiles, and those it refuses to."""

from __future__ import annotations

import re
from typing import ClassVar, Literal, Optional

from pydantic import field_validator

from ..fields import _Strict, _cc, _env_pairs, _sha256_hex, _specifier, _version


class ExtensionSdist(_Strict):
    """The sdist the builder compiles: PyPI's file, checked by its sha256 before setup.py runs."""

    filename: str
    url: str
    sha256: str
    size: int

    _sha = field_validator("sha256")(lambda v: _sha256_hex(v))


class SourcePatch(_Strict):
    """One exact text replacement in an unpacked sdist, applied before setup.py runs, for the
    torch releases `torch` names: upstream's own fix, merged after the sdist was released (its
    `source`). The build fails unless `old` occurs exactly once in `file`, so a patch never
    silently does nothing."""

    _multiline: ClassVar[tuple[str, ...]] = ("old", "new")  # lines of source code

    file: str  # relative to the sdist's top directory
    torch: str  # the torch releases that need it
    old: str
    new: str
    source: str  # the upstream change it reproduces (a public URL)

    _s = field_validator("torch")(_specifier)

    @field_validator("file")
    @classmethod
    def _relative(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/"):
            raise ValueError(f"expected a path inside the sdist, got {v!r}")
        return v


class CudaExtension(_Strict):
    """A CUDA extension compiled from its sdist in the builder stage, against the image's torch,
    for the GPU profile's arches only (envbuild/buildsteps/extensions.py), then verified:
    it imports with no undefined symbol and every shared library carries SASS for the GPU."""

    name: str  # the PyPI distribution name, as users write it in requirements
    tag: str  # what the image tag says for it, with its version: fa2.8.3
    description: str
    version: str
    sdist: ExtensionSdist
    packages: list[str]  # the import names of its Python packages
    modules: list[str]  # its compiled modules (imported by the build check and the smoke test)
    requires: list[str] = []  # its Requires-Dist names: each must already be in the stack's venv
    build_only: list[str] = []  # Requires-Dist it needs only to compile (ninja): dropped like DeepSpeed's
    build_requires: list[str] = []  # what setup.py imports besides torch (in the venv: --no-build-isolation)
    min_cc: str  # the oldest compute capability its kernels support
    max_cc: Optional[str] = None  # the newest (None: no ceiling known)
    torch: str  # the torch releases its source builds against
    cuda: str  # the CUDA releases its setup.py accepts
    python: str  # its Requires-Python
    cpu_arch: list[Literal["x86_64", "aarch64"]] = ["x86_64"]  # architectures it has been built for
    arch_env: Optional[str] = None  # its own arch variable (None: it follows TORCH_CUDA_ARCH_LIST)
    build_env: dict[str, str] = {}  # what makes setup.py compile here instead of downloading a wheel
    patches: list[SourcePatch] = []  # upstream fixes newer than the sdist, for the torch that needs them
    memory_per_job_gib: float  # peak memory of one compile job: MAX_JOBS = memory // this
    nvcc_threads: Optional[int] = None  # NVCC_THREADS: nvcc's own threads per job (memory grows with it)
    gpu_check: Optional[Literal["attention", "causal-conv1d"]] = None  # the smoke test's GPU check
    build_time: str  # measured, with the machine
    sources: dict[str, str]  # fact -> public source (a URL, a file of a named release)

    _e = field_validator("build_env")(lambda v: _env_pairs(v))
    _v = field_validator("version")(lambda v: _version(v))
    _c = field_validator("min_cc", "max_cc")(lambda v: v if v is None else _cc(v))
    _s = field_validator("torch", "cuda", "python")(_specifier)

    @field_validator("name", "tag")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.match(r"^[a-z][a-z0-9-]*[a-z0-9]\Z", v):
            raise ValueError(f"expected lower-case letters, digits and '-', got {v!r}")
        return v


class NotPrebuilt(_Strict):
    """A package that compiles against torch when pip installs it (PyPI has only its sdist) and
    that envbuild does not pre-build: named so that `--ext` and `envbuild extend` refuse it with
    the reason, instead of pip trying in a layer without nvcc (or fetching an unchecked wheel)."""

    name: str  # the PyPI distribution name, canonical
    version: str  # the newest release checked
    why: str  # why envbuild does not pre-build it
    source: str  # the file of the named release that says so

    _v = field_validator("version")(lambda v: _version(v))


class ExtensionsFile(_Strict):
    extensions: list[CudaExtension] = []
    not_prebuilt: list[NotPrebuilt] = []
