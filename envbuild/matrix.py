"""Load and validate the compatibility matrix (``matrices/*.yaml``).

The matrix is data, not code: four YAML files validated by pydantic models, so a
malformed file fails with the file, the path of the bad field and what was expected.
Cross-file checks (a stack naming an unknown torch release, a stack that breaks a rule)
run once here, at load time, so the resolver can trust what it gets.

Examples
--------
>>> m = load_matrix()
>>> m.gpu("H20").cc
'9.0'
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path
from typing import ClassVar, Literal, Optional

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from . import grammar, rules
from .errors import EnvbuildError, nearest
from .files import read_yaml
from .registry import reference_problems
from .resources import matrices_dir
from .validate import gpu_spellings, unknown_gpu

BASE_DIGESTS = "base-digests.yaml"  # optional: written by `envbuild lock --bases` (digests.py)
FILES = ("torch.yaml", "deepspeed.yaml", "gpus.yaml", "bases.yaml", "cuda.yaml", "stacks.yaml", "fabrics.yaml")


# ---------------------------------------------------------------- field types


def _version(v: str) -> str:
    try:
        Version(str(v))
    except InvalidVersion:
        raise ValueError(f"expected a version like '2.11.0', got {v!r}") from None
    return str(v)


def _specifier(v: str) -> str:
    try:
        SpecifierSet(str(v))
    except InvalidSpecifier:
        raise ValueError(f"expected a PEP 440 specifier like '>=2.7', got {v!r}") from None
    return str(v)


_CC = re.compile(r"^\d+\.\d+\Z")
_DRIVER = re.compile(r"^\d{3}(\.\d+){1,2}\Z")


def _driver(v: str) -> str:
    if not _DRIVER.match(str(v)):
        raise ValueError(f"expected an NVIDIA driver version like '580.65.06', got {v!r}")
    return str(v)


def _cc(v: str) -> str:
    if not _CC.match(str(v)):
        raise ValueError(f"expected a compute capability like '9.0', got {v!r}")
    return str(v)


_APT_WORD = re.compile(r"^[a-z0-9][a-z0-9.+-]*\Z")


def _apt_words(v):
    """Archive, suite and component names: what apt's sources.list grammar takes as one word."""
    for word in ([v] if isinstance(v, str) else v):
        if not _APT_WORD.match(str(word)):
            raise ValueError(f"expected a lower-case apt name like 'bookworm-updates' or 'main', got {word!r}")
    return v


def _url_template(v: str, timestamp: bool) -> str:
    """An http(s) archive URL with {archive} (and, for a snapshot, {timestamp}) in it."""
    if not re.match(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~{}/-]*)?\Z", v):
        raise ValueError(f"expected an http(s) URL such as 'http://deb.debian.org/{{archive}}', got {v!r}")
    needed = ["{archive}"] + (["{timestamp}"] if timestamp else [])
    missing = [p for p in needed if p not in v]
    if missing:
        raise ValueError(f"{v!r} lacks {' and '.join(missing)}")
    return v


def _text(value, field: str):
    """Every string of a matrix field (in lists and mappings too) is one line of text: a matrix
    value reaches comments, labels and shell lines of the rendered files, where a newline or
    another control character would end the line and start an instruction of its own."""
    if isinstance(value, str):
        grammar.one_line(value, "a matrix value")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _text(item, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            _text(key, field)
            _text(item, field)
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    _multiline: ClassVar[tuple[str, ...]] = ()  # fields whose text may span lines (a patch's old and new source)

    @field_validator("*")
    @classmethod
    def _one_line(cls, v, info):
        return v if info.field_name in cls._multiline else _text(v, info.field_name)


# ---------------------------------------------------------------- torch.yaml


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


# ---------------------------------------------------------------- deepspeed.yaml


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
    note: Optional[str] = None

    _v = field_validator("since", "until", "cuda_extension_until")(lambda v: v if v is None else _version(v))
    _c = field_validator("min_cc")(lambda v: v if v is None else _cc(v))
    _e = field_validator("env")(lambda v: _op_switch(v))
    _s = field_validator("torch")(lambda v: v if v is None else _specifier(v))


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


# ---------------------------------------------------------------- gpus.yaml


class NodeCondition(_Strict):
    """A condition only the node can answer (its driver, its network), checked at start-up
    by the image's entrypoint / Apptainer environment instead of being baked blindly."""

    driver_below: Optional[str] = None
    infiniband: Optional[Literal["absent", "present"]] = None  # any RDMA device in /sys/class/infiniband
    efa: Optional[Literal["absent", "present"]] = None  # an RDMA device whose kernel driver is AWS's efa

    _v = field_validator("driver_below")(lambda v: v if v is None else _driver(v))


def _matching(pattern: str, like: str, prepare=lambda v: v):
    """A field validator: the value, if `prepare(value)` is all of `pattern`; else why not."""
    def check(v: str) -> str:
        if not re.fullmatch(pattern, prepare(v)):
            raise ValueError(f"expected {like}, got {v!r}")
        return v
    return check


_env_name = _matching(r"[A-Z_][A-Z0-9_]*", "an environment variable name like NCCL_DEBUG")
# An op's build switch, DS_BUILD_<env>: a build argument and an environment name.
_op_switch = _matching(r"[A-Z0-9_]+", "the part after DS_BUILD_ of a DeepSpeed build switch, like FUSED_ADAM")
# A Debian package name (Debian Policy 5.6.1), `{python}` standing for the family's Python
# package: a word of an apt-get line in a RUN instruction and %post.
_package = _matching(r"[a-z0-9][a-z0-9+.-]+", "a Debian package name like 'libaio-dev' or '{python}-dev'",
                     lambda v: v.replace("{python}", "python3"))
_host = _matching(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*",
                  "a host name like 'deb.debian.org'")


def _env_value(v: str) -> str:
    """A value written into a Dockerfile ENV line and Apptainer's %environment: the grammar of
    --env values (grammar.env_value)."""
    return grammar.env_value(v)


def _env_pairs(v: dict[str, str]) -> dict[str, str]:
    for name, value in v.items():
        _env_name(name)
        grammar.env_value(value, name)
    return v


class EnvDefault(_Strict):
    """A default the image sets: what it is for (reason, source) and what it costs."""

    name: str
    value: str
    reason: str
    source: str
    cost: str
    when: Optional[dict[Literal["torch"], str]] = None
    node: Optional[NodeCondition] = None

    _n = field_validator("name")(lambda v: _env_name(v))
    _v = field_validator("value")(lambda v: _env_value(v))

    @field_validator("when")
    @classmethod
    def _when(cls, v):
        return v if v is None else {k: _specifier(s) for k, s in v.items()}


IMAGE_ENV_FIELDS = ("venv", "constraints", "system_path", "cuda_home", "min_driver", "driver_source", "cuda",
                    "arch_list", "gpu", "sm")  # what an image_env value, reason or source may name in braces


class ImageEnv(_Strict):
    """A variable every image bakes (gpus.yaml image_env), its value filled in per image."""

    name: str
    value: str
    layer: Literal["base", "gpu"]  # the stack-wide part of the image, or the late per-GPU layer
    reason: str
    source: str
    cost: str
    toolchain: Optional[Literal["kept", "lean"]] = None  # only with / without --keep-toolchain

    _n = field_validator("name")(lambda v: _env_name(v))

    @field_validator("value", "reason", "source")
    @classmethod
    def _fields(cls, v: str, info) -> str:
        if info.field_name == "value":  # the value once its {field} names are filled in
            grammar.env_value(re.sub(r"\{\w+\}", "x", v))
        unknown = sorted(set(re.findall(r"\{(\w+)\}", v)) - set(IMAGE_ENV_FIELDS))
        if unknown:
            raise ValueError(f"names {', '.join('{' + u + '}' for u in unknown)}; an image_env text may name "
                             f"{', '.join('{' + f + '}' for f in IMAGE_ENV_FIELDS)}")
        return v

    def filled(self, facts: dict[str, str]) -> tuple[str, str, str]:
        """(value, reason, source) with the image's facts in place of their names."""
        return tuple(re.sub(r"\{(\w+)\}", lambda m: facts[m.group(1)], text)  # type: ignore[return-value]
                     for text in (self.value, self.reason, self.source))


class NotBaked(_Strict):
    """A default that was considered and left out, with why: so nobody adds it back blindly."""

    name: str
    value: str
    gpus: list[str]
    why: str
    source: str


class GpuRequires(_Strict):
    torch: Optional[str] = None
    cuda: Optional[str] = None
    source: str

    _s = field_validator("torch", "cuda")(lambda v: v if v is None else _specifier(v))


class GpuProfile(_Strict):
    name: str
    aliases: list[str] = []
    cc: str
    memory_gb: list[int]  # per variant (H100: 80 SXM/PCIe, 94 NVL)
    cc_inferred: bool = False
    generation: str  # the chip generation: Volta, Ampere, Hopper, Blackwell ...
    host_arch: list[Literal["x86_64", "aarch64"]] = ["x86_64"]  # the CPUs of the nodes it comes in
    host_cpu: Optional[str] = None  # the host CPU, when the GPU fixes it (Grace: Neoverse V2)
    cpu_targets: list[str] = []  # CPU targets for its host, best first (empty: the arch's defaults)
    interconnect: str
    env: list[EnvDefault] = []
    requires: Optional[GpuRequires] = None
    notes: list[str] = []

    _c = field_validator("cc")(_cc)

    @property
    def sm(self) -> str:
        return "sm_" + self.cc.replace(".", "")


class CpuTarget(_Strict):
    """A CPU target the host-compiled (CPU) ops can be built for: the compiler flag that
    replaces DeepSpeed's -march=native, the CPUs it runs on, and the oldest GCC that knows it."""

    arch: Literal["x86_64", "aarch64"]
    flag: str  # what cc-wrapper.sh passes instead of -march=native
    simd: Literal["", "-D__AVX256__", "-D__AVX512__", "-D__NEON__"]  # what it passes for DeepSpeed's SIMD macro
    runs_on: str
    min_gcc: str
    source: str

    _v = field_validator("min_gcc")(_version)

    @field_validator("flag")
    @classmethod
    def _flag(cls, v: str) -> str:
        if not re.match(r"^-m(arch|cpu)=[a-z0-9.+-]+\Z", v):
            raise ValueError(f"expected -march=NAME or -mcpu=NAME, got {v!r}")
        return v


class OutOfScope(_Strict):
    """GPUs envbuild does not build for, named so that `--gpu mi300x` says so instead of
    suggesting a similar-looking NVIDIA name."""

    vendor: str
    what: str = ""  # what is refused, when not all of the vendor's GPUs ("the P100 (Pascal, sm_60)")
    names: list[str]  # spellings as gpu_spellings() reads them: mi300x, instinct-mi300x ...
    prefixes: list[str] = []
    why: str
    source: str = ""


class VariableGrammar(_Strict):
    """The values a variable of the image's environment can take, as the code that reads it
    parses them (`source`): a value outside them is refused, in --env and in the matrix's own
    defaults alike (NCCL reads text as 0, torch stops at start-up, PYTHONHOME stops Python)."""

    pattern: Optional[str] = None  # a regular expression the whole value must match
    means: Optional[str] = None  # the same in words, for the message: "0 or 1"
    refused: Optional[str] = None  # set: no value is accepted; why, and what to do instead
    source: str

    @field_validator("pattern")
    @classmethod
    def _regex(cls, v):
        try:
            re.compile(v or "")
        except re.error as e:
            raise ValueError(f"{v!r} is not a regular expression ({e})") from None
        return v

    def problem(self, name: str, value: str) -> Optional[str]:
        """Why `value` cannot work for `name` (None: it can)."""
        if self.refused:
            return f"{name} cannot be baked into an image: {self.refused} ({self.source})"
        if self.pattern and not re.fullmatch(self.pattern, value):
            return f"{name} takes {self.means or self.pattern}, not {grammar.shown(value)} ({self.source})"
        return None


class GpusFile(_Strict):
    sources: dict[str, str]
    image_env: list[ImageEnv]
    common_env: list[EnvDefault]
    cpu_targets: dict[str, CpuTarget]
    default_cpu_targets: dict[Literal["x86_64", "aarch64"], list[str]]  # preference, first the OS's GCC knows
    profiles: list[GpuProfile]
    not_baked: list[NotBaked] = []
    variables: dict[str, VariableGrammar] = {}  # what each known variable's value may be
    out_of_scope: list[OutOfScope] = []


# ---------------------------------------------------------------- cuda.yaml


class DriverFloor(_Strict):
    """The oldest Linux driver a CUDA major's runtime runs on (minor-version compatibility)."""

    cuda: str  # a CUDA major: "12", "13"
    min_driver: str
    branch: str
    source: str

    _v = field_validator("min_driver")(lambda v: _driver(v))


class GenerationDriverFloor(_Strict):
    """The oldest driver branch that knows a GPU generation: whatever the stack's CUDA, a GPU of
    it needs at least this driver (Blackwell on a CUDA 12.x stack: R570, not 12.x's R525)."""

    min_driver: str
    branch: str
    source: str

    _v = field_validator("min_driver")(lambda v: _driver(v))


class CudaFile(_Strict):
    sources: dict[str, str]
    driver_floors: list[DriverFloor]
    generation_driver_floors: dict[str, GenerationDriverFloor] = {}
    gpu_driver_floors: dict[str, GenerationDriverFloor] = {}  # by gpus.yaml profile name, where NVIDIA names one
    forward_compat: str


# ---------------------------------------------------------------- bases.yaml


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
    # NVIDIA's cuobjdump for the SASS audit (steps/sass_audit.py): the extra that installs it, and the
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


class Toolchain(_Strict):
    description: str
    cuda_home: str
    provides: list[str] = []  # CUDA libraries an op may link (curand): headers and libraries in the builder
    lacks: dict[str, str] = {}  # capability it does not provide -> why (said when an op is refused for it)
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


class BasesFile(_Strict):
    families: dict[str, Family]
    toolchains: dict[str, Toolchain]


# ---------------------------------------------------------------- fabrics.yaml


def _sha256_hex(v: str) -> str:
    if not re.match(r"^[0-9a-f]{64}\Z", v):
        raise ValueError(f"expected 64 lower-case hex digits, got {v!r}")
    return v


class FabricSource(_Strict):
    """A source a fabric builds from: the real URL (what the publishing CI fetches) and the
    sha256 of its uncompressed tar stream, which a local mirror of the same commit reproduces
    (GitHub's /archive/ gzip bytes are not promised stable; the tar inside is `git archive`)."""

    name: str
    version: str
    commit: str
    url: str
    tar_sha256: str
    license: str
    source: str

    _sha = field_validator("tar_sha256")(lambda v: _sha256_hex(v))

    @field_validator("commit")
    @classmethod
    def _commit(cls, v: str) -> str:
        if not re.match(r"^[0-9a-f]{40}\Z", v):
            raise ValueError(f"expected a 40-hex-digit git commit, got {v!r}")
        return v


class FabricBuild(_Strict):
    """What the builder stage compiles for a fabric (templates/files/steps/fabric.sh), and what
    the runtime stage takes from it: the prefixes, registered with the dynamic linker in the
    file `ld_conf` (NCCL dlopens its net plugin by name: no LD_LIBRARY_PATH to lose)."""

    sources: list[FabricSource]
    prefix: str  # libfabric and rdma-core (AWS's layout: /opt/amazon/efa)
    plugin_prefix: str  # the NCCL net plugin (/opt/amazon/ofi-nccl)
    ld_conf: str  # /etc/ld.so.conf.d file naming both lib directories
    # pip requirement lines (hash-pinned, no dependencies) for headers the build needs that the
    # stack's CUDA wheels lack: libfabric's CUDA support includes nvml.h.
    headers: list[str] = []
    time: str  # measured build time, with the machine
    source: str

    _p = field_validator("prefix", "plugin_prefix", "ld_conf")(lambda v: grammar.path_word(v))


class FabricRequires(_Strict):
    nccl: Optional[str] = None  # the NCCL versions the fabric's plugin or host library works with
    arch: list[Literal["x86_64", "aarch64"]] = ["x86_64", "aarch64"]
    gpus: list[str] = []  # GPU profiles the fabric is for (empty: any), e.g. a VM size's topology file
    source: str

    _s = field_validator("nccl")(lambda v: v if v is None else _specifier(v))


class FabricFile(_Strict):
    """A small file a fabric bakes (a VM size's NCCL topology), kept in templates/files as
    `vendored`, a copy of `url` (a pinned commit) whose sha256 a test checks."""

    path: str  # where it goes in the image
    vendored: str  # its name in templates/files
    url: str
    sha256: str
    license: str
    source: str

    _sha = field_validator("sha256")(lambda v: _sha256_hex(v))
    _p = field_validator("path")(lambda v: grammar.path_word(v))


class Fabric(_Strict):
    """How NCCL reaches other nodes: the user space the image carries (or the host injects),
    the transport NCCL must then choose, and the environment that pins or tunes it."""

    name: str
    aliases: list[str] = []
    tag: str  # the image tag's suffix when this is not the default fabric ("" for the default)
    description: str
    provided_by: Literal["image", "host"]
    transport: str  # the net NCCL reports choosing ("Using network IB") on a node with the devices
    net_env: dict[str, str] = {}  # what pins that transport (the smoke test's transport check sets it)
    needs: list[str] = []  # bases.yaml capabilities: OS packages per OS release (runtime and builder)
    libraries: list[str] = []  # sonames the fabric promises (what NCCL or its plugin dlopens): the smoke test loads each
    providers: list[str] = []  # rdma-core verbs providers that must be registered and load
    net_plugins: list[str] = []  # NCCL net plugins in the image: must exist and resolve every library
    tools: list[str] = []  # diagnostic commands users reach for: must be on PATH
    device_drivers: list[str] = []  # kernel drivers of the RDMA devices this fabric serves
    host_paths: list[str] = []  # what the host must mount (provided_by: host)
    verbs_prefix: Optional[str] = None  # rdma-core built into this prefix instead of the OS's (its providers, config)
    files: list[FabricFile] = []
    env: list[EnvDefault] = []  # baked (no `node:`) or decided on the node at start-up
    requires: Optional[FabricRequires] = None
    build: Optional[FabricBuild] = None
    size: str  # what it adds to the image, measured
    source: str
    notes: list[str] = []

    _e = field_validator("net_env")(lambda v: _env_pairs(v))

    @field_validator("name", "tag")
    @classmethod
    def _name(cls, v: str) -> str:
        if v and not re.match(r"^[a-z0-9][a-z0-9-]*\Z", v):
            raise ValueError(f"expected lower-case letters, digits and '-', got {v!r}")
        return v


class FabricsFile(_Strict):
    default: str
    sources: dict[str, str]
    fabrics: list[Fabric]


# ---------------------------------------------------------------- extensions.yaml


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
    for the GPU profile's arches only (templates/files/steps/extensions.py), then verified:
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


# ---------------------------------------------------------------- stacks.yaml


class BaseImages(_Strict):
    builder: str
    runtime: str

    @field_validator("builder", "runtime")
    @classmethod
    def _reference(cls, v: str) -> str:
        problems = reference_problems(v)
        if problems:
            raise ValueError(f"{grammar.shown(v)} is not an image reference: {'; '.join(problems)}")
        why = rules.unpinned(v)
        if why:
            raise ValueError(f"{grammar.shown(v)} {why}; name a release tag or a digest")
        return v


class Stack(_Strict):
    id: str
    python: str
    cuda: str
    torch: str
    deepspeed: str
    os: str
    toolchain: str
    cuda_toolkit: Optional[str] = None
    base_images: BaseImages
    note: Optional[str] = None

    _v = field_validator("torch", "deepspeed", "cuda", "python")(_version)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not re.match(r"^[a-z0-9][a-z0-9._-]*\Z", v):
            raise ValueError(f"expected lower-case letters, digits, '.', '_' or '-', got {v!r}")
        return v


class StacksFile(_Strict):
    stacks: list[Stack]


EXTENSIONS = "extensions.yaml"  # optional: the CUDA extensions `--ext` can pre-build
PUBLISH = "publish.yaml"  # optional: what `envbuild ci` publishes, and the repository name it uses


class PublishFile(_Strict):
    """publish.yaml: the images CI builds and where they go (`envbuild ci`, `--registry`)."""

    registry: Optional[str] = None  # HOST[/NAMESPACE]; $OWNER is filled in by CI
    image_repo: str = "envbuild"  # the repository name under the registry
    runners: dict[Literal["x86_64", "aarch64"], str] = {}
    gpus: list[str] = []
    multiarch: dict[str, str] = {}  # x86 GPU -> its Grace sibling, merged into one tag
    fabrics: dict[str, list[str]] = {}  # fabric -> the GPUs it is published for
    extensions: dict[str, list[str]] = {}  # CUDA extension -> the GPUs it is published for (compiled in)
    extension_runners: dict[str, str] = {}  # CUDA extension -> the x86_64 runner of its jobs (a larger one)


_MODELS = {
    "torch.yaml": TorchFile,
    "deepspeed.yaml": DeepspeedFile,
    "gpus.yaml": GpusFile,
    "bases.yaml": BasesFile,
    "cuda.yaml": CudaFile,
    "stacks.yaml": StacksFile,
    PUBLISH: PublishFile,
    "fabrics.yaml": FabricsFile,
    EXTENSIONS: ExtensionsFile,
}


# ---------------------------------------------------------------- the matrix


class Matrix:
    """All matrix files, cross-checked, with lookups by name and alias."""

    def __init__(self, directory: Path, torch: TorchFile, deepspeed: DeepspeedFile,
                 gpus: GpusFile, bases: BasesFile, cuda: CudaFile, stacks: StacksFile, fabrics: FabricsFile,
                 extensions: Optional[ExtensionsFile] = None):
        self.directory = directory
        self.cuda_file = cuda
        self.torch_file = torch
        self.deepspeed_file = deepspeed
        self.gpus_file = gpus
        self.bases = bases
        self.stacks = stacks.stacks
        self.fabrics_file = fabrics
        self._torch = {r.torch: r for r in torch.releases}
        self._ds = {r.deepspeed: r for r in deepspeed.releases}
        self._gpu_names: dict[str, GpuProfile] = {}
        self.extensions_file = extensions or ExtensionsFile()
        self.base_digests = _base_digests(directory)  # ref -> the digest the publishing CI recorded

    @functools.cached_property
    def sha256(self) -> str:
        """One digest of every file of the matrix directory (YAML files, locks, OS locks): what an
        image records, so `envbuild rebuild` knows whether this matrix is the one it was made from."""
        digest = hashlib.sha256()
        root = Path(self.directory)
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not any(
                part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)):
            digest.update(f"{path.relative_to(root).as_posix()}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n"
                          .encode())
        return digest.hexdigest()

    # lookups ----------------------------------------------------------
    def torch_release(self, version: str) -> TorchRelease:
        return self._torch[version]

    def ds_release(self, version: str) -> DsRelease:
        return self._ds[version]

    @property
    def ops(self) -> dict[str, Op]:
        return self.deepspeed_file.ops

    @property
    def gpus(self) -> list[GpuProfile]:
        return self.gpus_file.profiles

    def gpu_names(self) -> dict[str, GpuProfile]:
        """Every accepted spelling (lower-case) -> profile."""
        if not self._gpu_names:
            for p in self.gpus:
                for n in [p.name, *p.aliases]:
                    for spelling in (n, f"nvidia-{n}"):
                        self._gpu_names[spelling.lower()] = p
        return self._gpu_names

    def gpu(self, name: str) -> GpuProfile:
        """A profile by name, alias or the name nvidia-smi prints ('NVIDIA H100 80GB HBM3')."""
        names = self.gpu_names()
        spellings = gpu_spellings(name)
        for key in spellings:
            if key in names:
                return names[key]
        for scope in self.gpus_file.out_of_scope:
            if any(s in scope.names or any(s.startswith(p) for p in scope.prefixes) for s in spellings):
                source = f" (source: {scope.source})" if scope.source else ""
                what = f"{scope.what} is" if scope.what else f"{scope.vendor} GPUs are"
                raise EnvbuildError(f"--gpu {name}: {what} out of scope: {scope.why.rstrip('.')}{source}.")
        raise unknown_gpu(name, spellings, [p.name for p in self.gpus], str(self.directory / "gpus.yaml"))

    @property
    def fabrics(self) -> list[Fabric]:
        return self.fabrics_file.fabrics

    def fabric(self, name: Optional[str]) -> Fabric:
        """A fabric by name or alias; None is the default (fabrics.yaml `default`)."""
        wanted = (name or self.fabrics_file.default).strip().lower()
        for f in self.fabrics:
            if wanted in (f.name, *f.aliases):
                return f
        names = [f.name for f in self.fabrics]
        hint = nearest(wanted, [n for f in self.fabrics for n in (f.name, *f.aliases)])
        did = f" did you mean {', '.join(hint)}?" if hint else ""
        raise EnvbuildError(
            f"--fabric '{name}' is not a known fabric;{did} Known fabrics: {', '.join(names)} (default: "
            f"{self.fabrics_file.default}; `envbuild fabrics` shows what each puts in the image).")

    @property
    def extensions(self) -> dict[str, CudaExtension]:
        return {e.name: e for e in self.extensions_file.extensions}

    def extension(self, name: str) -> CudaExtension:
        """An extension by its PyPI name, in any spelling pip accepts (flash_attn, Flash-Attn)."""
        wanted = re.sub(r"[-_.]+", "-", name.strip()).lower()
        if wanted in self.extensions:
            return self.extensions[wanted]
        why = rules.extension_not_prebuilt(self, wanted)
        if why:
            raise EnvbuildError(f"--ext '{name}': {why.message} (rule {why.rule}). Pre-built: "
                                f"{', '.join(self.extensions)} (`envbuild extensions`).")
        try:  # a requirement (flash-attn==2.8, flash-attn[x]) rather than a name
            req = Requirement(name)
        except InvalidRequirement:
            req = None
        if req and (req.specifier or req.extras or req.url or req.marker) and canonicalize_name(req.name) in self.extensions:
            ext = self.extensions[canonicalize_name(req.name)]
            raise EnvbuildError(f"--ext '{name}': --ext takes names, not versions or extras; envbuild builds "
                                f"{ext.name} {ext.version} only (extensions.yaml). Nearest valid choice: "
                                f"--ext {ext.name}.")
        hint = nearest(wanted, self.extensions)
        did = f" did you mean {', '.join(hint)}?" if hint else ""
        known = ", ".join(self.extensions) or "none (this matrix has no extensions.yaml)"
        raise EnvbuildError(f"--ext '{name}' is not a CUDA extension envbuild can pre-build;{did} Known: {known} "
                            f"(`envbuild extensions` shows which GPUs and stacks each fits).")

    def stack(self, stack_id: str) -> Stack:
        for s in self.stacks:
            if s.id == stack_id:
                return s
        hint = nearest(stack_id, [s.id for s in self.stacks])
        did = f" did you mean {', '.join(hint)}?" if hint else ""
        raise EnvbuildError(
            f"unknown stack '{stack_id}' for --stack;{did} `envbuild matrix` lists all "
            f"{len(self.stacks)} stacks.")

    def arch_list(self, release: TorchRelease, cuda: str, arch: str = "x86_64") -> str:
        """The GPU arches torch's `cuda` build for CPU architecture `arch` carries code for."""
        if arch == "aarch64":
            return release.aarch64_arches or ""
        name = release.variants[cuda]
        return release.default_arches if name == "default" else self.torch_file.arch_lists[name]

    def stack_arches(self, s: Stack) -> list[str]:
        """The CPU architectures PyPI has CUDA torch wheels for, for this stack's torch and CUDA.

        The aarch64 wheels on PyPI are the release's default CUDA build, and CUDA builds only
        from torch 2.11.0 (torch.yaml cuda_platforms); PyTorch's own index for other CUDA
        variants is not read here, so no aarch64 variant is claimed from it.
        """
        rel = self.torch_release(s.torch)
        arches = ["x86_64"] if s.cuda in rel.variants else []
        if "aarch64" in rel.cuda_platforms and s.cuda == rel.default_cuda:
            arches.append("aarch64")
        return arches

    def cpu_target_for(self, arch: str, gpu: GpuProfile, family: Family) -> str:
        """The default CPU target: the GPU host's best target the OS's GCC knows, else the
        architecture's portable one."""
        gcc = Version(family.gcc)
        targets = self.gpus_file.cpu_targets
        wanted = [*gpu.cpu_targets, *self.gpus_file.default_cpu_targets[arch]]
        for name in wanted:
            if targets[name].arch == arch and gcc >= Version(targets[name].min_gcc):
                return name
        raise KeyError(f"no CPU target for {arch} that GCC {family.gcc} knows")

    def driver_floor(self, cuda: str, gpu: Optional[GpuProfile] = None) -> DriverFloor:
        """The oldest driver that runs CUDA `cuda` ('13.0' -> the CUDA 13 floor), and, with `gpu`,
        knows that GPU: the largest of the stack's floor, the GPU generation's and the GPU's own."""
        major = cuda.split(".")[0]
        floor = next((f for f in self.cuda_file.driver_floors if f.cuda == major), None)
        if floor is None:
            raise KeyError(cuda)
        if gpu is None:
            return floor
        for what, own in ((f"{gpu.generation} GPUs ({gpu.name})", self.cuda_file.generation_driver_floors.get(gpu.generation)),
                          (gpu.name, self.cuda_file.gpu_driver_floors.get(gpu.name))):
            if own and Version(own.min_driver) > Version(floor.min_driver):
                floor = DriverFloor(cuda=major, min_driver=own.min_driver, branch=own.branch,
                                    source=f"{what}: {own.source}")
        return floor

    def torch_index(self, release: TorchRelease, cuda: str) -> Optional[str]:
        """PyTorch's own index for a non-default CUDA variant; None means plain PyPI."""
        if cuda == release.default_cuda:
            return None
        return self.torch_file.variant_index.format(cuda_nodot=cuda.replace(".", ""))


def _locate(loc: tuple, data) -> str:
    """Turn a pydantic error location into `stacks[3].base_images.builder`, naming
    the stack id or GPU name when the list element has one."""
    out = ""
    node = data
    for part in loc:
        if isinstance(part, int):
            label = ""
            if isinstance(node, list) and part < len(node) and isinstance(node[part], dict):
                key = node[part].get("id") or node[part].get("name")
                label = f" ({grammar.shown(str(key))[1:-1]})" if key else ""
            out += f"[{part}]{label}"
        else:
            out += f".{part}" if out else str(part)
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
    return out


def _load_yaml(path: Path):
    return read_yaml(path, "matrix file")


def _load_file(path: Path):
    model = _MODELS[path.name]
    data = _load_yaml(path)
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as e:
        errs = e.errors()
        parts = []
        for err in errs[:3]:
            where = _locate(err["loc"], data) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if isinstance((err.get("ctx") or {}).get("error"), grammar.GrammarError) and isinstance(err["input"], str):
                msg = f"{grammar.shown(err['input'])}: {msg}"  # a grammar's reason names no value: name it here
            parts.append(f"at {where}: {msg}")
        more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
        raise EnvbuildError(f"matrix file {path} is malformed {'; '.join(parts)}{more}.") from None


def _check_references(m: Matrix) -> None:
    """Cross-file integrity, then every stack against the rules."""
    d = m.directory
    problems: list[str] = []
    for name, rel in m._torch.items():
        for cuda, arch in rel.variants.items():
            if arch != "default" and arch not in m.torch_file.arch_lists:
                problems.append(f"{d/'torch.yaml'}: torch {name} variant {cuda} names unknown arch list "
                                f"'{arch}' (known: {', '.join(m.torch_file.arch_lists)})")
        if rel.variants.get(rel.default_cuda) != "default":
            problems.append(f"{d/'torch.yaml'}: torch {name}: variants[{rel.default_cuda}] (its default_cuda) must be "
                            f"'default' (the PyPI wheel's own arch list)")
    for op in m.deepspeed_file.aarch64.not_buildable:
        if op not in m.ops:
            problems.append(f"{d/'deepspeed.yaml'}: aarch64.not_buildable names unknown op '{op}'")
    for preset, ops in m.deepspeed_file.presets.items():
        for op in ops:
            if op not in m.ops:
                problems.append(f"{d/'deepspeed.yaml'}: presets.{preset} names unknown op '{op}'")
    seen: dict[str, tuple[int, str]] = {}
    for i, p in enumerate(m.gpus_file.profiles):
        for n in dict.fromkeys(x.lower() for x in [p.name, *p.aliases]):
            if n in seen:
                other = seen[n][1]
                problems.append(f"{d/'gpus.yaml'}: two profiles are named '{n}' (they would get one image tag)"
                                if other == p.name else
                                f"{d/'gpus.yaml'}: {'name' if n == p.name.lower() else 'alias'} '{n}' is used by "
                                f"both {other} and {p.name}")
            seen[n] = (i, p.name)
    known_targets = m.gpus_file.cpu_targets
    for arch, names in m.gpus_file.default_cpu_targets.items():
        for name in names:
            if name not in known_targets or known_targets[name].arch != arch:
                problems.append(f"{d/'gpus.yaml'}: default_cpu_targets.{arch} names '{name}', which is not an "
                                f"{arch} entry of cpu_targets (known: {', '.join(known_targets)})")
    for p in m.gpus:
        for name in p.cpu_targets:
            if name not in known_targets or known_targets[name].arch not in p.host_arch:
                problems.append(f"{d/'gpus.yaml'}: {p.name}.cpu_targets names '{name}', which is not a cpu_targets "
                                f"entry for its host_arch {', '.join(p.host_arch)}")
    fabric_names: dict[str, str] = {}
    for f in m.fabrics:
        for n in (f.name, *f.aliases):
            if n in fabric_names:
                problems.append(f"{d/'fabrics.yaml'}: name '{n}' is used by both {fabric_names[n]} and {f.name}")
            fabric_names[n] = f.name
        if (f.name == m.fabrics_file.default) != (f.tag == ""):
            problems.append(f"{d/'fabrics.yaml'}: {f.name}: only the default fabric has an empty tag suffix")
        for g in (f.requires.gpus if f.requires else ()):
            if g not in {p.name for p in m.gpus}:
                problems.append(f"{d/'fabrics.yaml'}: {f.name}.requires.gpus names '{g}', which is not a gpus.yaml "
                                f"profile")
        for need in f.needs:
            if not any(need in fam.capabilities for fam in m.bases.families.values()):
                problems.append(f"{d/'fabrics.yaml'}: {f.name}.needs names '{need}', a capability no bases.yaml "
                                f"family provides")
    if m.fabrics_file.default not in fabric_names:
        problems.append(f"{d/'fabrics.yaml'}: default '{m.fabrics_file.default}' is not a fabric "
                        f"(known: {', '.join(f.name for f in m.fabrics)})")
    defaults = [("gpus.yaml", "common_env", e) for e in m.gpus_file.common_env]
    defaults += [("gpus.yaml", f"{p.name}.env", e) for p in m.gpus for e in p.env]
    defaults += [("fabrics.yaml", f"{f.name}.env", e) for f in m.fabrics for e in f.env]
    for file, where, default in defaults:  # the matrix's own defaults in the grammar --env is held to
        known = m.gpus_file.variables.get(default.name)
        why = known.problem(default.name, default.value) if known else None
        if why:
            problems.append(f"{d / file}: {where}: {why}")
    majors = {f.cuda for f in m.cuda_file.driver_floors}
    generations = {p.generation for p in m.gpus}
    for gen in m.cuda_file.generation_driver_floors:
        if gen not in generations:
            problems.append(f"{d/'cuda.yaml'}: generation_driver_floors names '{gen}', a generation no gpus.yaml "
                            f"profile has (known: {', '.join(sorted(generations))})")
    for name in m.cuda_file.gpu_driver_floors:
        if name not in {p.name for p in m.gpus}:
            problems.append(f"{d/'cuda.yaml'}: gpu_driver_floors names '{name}', which is not a gpus.yaml profile")
    for rel in m.torch_file.releases:
        if "aarch64" in rel.cuda_platforms and not rel.aarch64_arches:
            problems.append(f"{d/'torch.yaml'}: torch {rel.torch} has aarch64 in cuda_platforms but no aarch64_arches")
        for cuda in rel.variants:
            if cuda.split(".")[0] not in majors:
                problems.append(f"{d/'cuda.yaml'}: no driver floor for CUDA {cuda} (torch {rel.torch}); "
                                f"known majors: {', '.join(sorted(majors))}")
    ids: set[str] = set()
    seen_versions: dict[tuple, str] = {}
    for i, s in enumerate(m.stacks):
        where = f"{d/'stacks.yaml'}: stacks[{i}] ({s.id})"
        if s.id in ids:
            problems.append(f"{where}: duplicate id")
        ids.add(s.id)
        versions = (s.torch, s.cuda, s.python, s.deepspeed)
        if versions in seen_versions:
            problems.append(f"{where}: same torch/CUDA/Python/DeepSpeed as {seen_versions[versions]}, "
                            f"so both would get the same image tag")
        seen_versions[versions] = s.id
        if s.torch not in m._torch:
            problems.append(f"{where}.torch: {s.torch} is not a release in torch.yaml "
                            f"(known: {', '.join(m._torch)})")
            continue
        if s.deepspeed not in m._ds:
            problems.append(f"{where}.deepspeed: {s.deepspeed} is not a release in deepspeed.yaml "
                            f"(known: {', '.join(m._ds)})")
            continue
        if s.os not in m.bases.families:
            problems.append(f"{where}.os: unknown family '{s.os}' (known: {', '.join(m.bases.families)})")
            continue
        if s.toolchain not in m.bases.toolchains:
            problems.append(f"{where}.toolchain: unknown '{s.toolchain}' (known: {', '.join(m.bases.toolchains)})")
            continue
        for rejection in rules.stack_rejections(m, s):
            problems.append(f"{where}: breaks rule {rejection.rule}: {rejection.message}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise EnvbuildError("the matrix is inconsistent: " + "; ".join(problems[:3]) + more + ".")


def _base_digests(directory: Path) -> dict[str, str]:
    """ref -> digest recorded by `envbuild lock --bases` (empty when none were reachable)."""
    path = Path(directory) / BASE_DIGESTS
    if not os.path.lexists(path):
        return {}
    data = _load_yaml(path) or {}
    try:
        return {str(ref): str(entry["digest"]) for ref, entry in (data.get("bases") or {}).items()}
    except (AttributeError, KeyError, TypeError):
        raise EnvbuildError(f"matrix file {path} is malformed: each entry under `bases` needs a `digest`; "
                            f"regenerate it with `envbuild lock --bases`.") from None


def load_publish(directory: Path) -> PublishFile:
    """The matrix directory's publish.yaml, read and checked in one place (defaults without one)."""
    path = Path(directory) / PUBLISH
    return _load_file(path) if os.path.lexists(path) else PublishFile()


@functools.lru_cache(maxsize=8)
def _load_cached(directory: str) -> Matrix:
    d = Path(directory)
    if not d.is_dir():
        raise EnvbuildError(f"matrix directory {d} {'is not a directory' if d.exists() else 'does not exist'}; give "
                            f"--matrix-dir a directory of matrix files such as a copy of the shipped matrices/.")
    missing = [f for f in FILES if not os.path.lexists(d / f)]
    if missing:
        raise EnvbuildError(f"matrix directory {d} lacks {', '.join(missing)}; it needs {', '.join(FILES)}.")
    loaded = {f: _load_file(d / f) for f in FILES}
    m = Matrix(d, loaded["torch.yaml"], loaded["deepspeed.yaml"], loaded["gpus.yaml"],
               loaded["bases.yaml"], loaded["cuda.yaml"], loaded["stacks.yaml"], loaded["fabrics.yaml"],
               _load_file(d / EXTENSIONS) if os.path.lexists(d / EXTENSIONS) else None)
    _check_references(m)
    return m


def load_matrix(directory: Optional[Path] = None) -> Matrix:
    """Load the built-in matrix, or the one in `directory` (``--matrix-dir``)."""
    d = Path(directory) if directory else matrices_dir()
    return _load_cached(str(d.resolve()))
