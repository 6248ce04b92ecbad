"""extensions.yaml: the CUDA extensions `--ext` compiles, and those it refuses to."""

from __future__ import annotations

import re
from typing import ClassVar, Literal, Optional

from pydantic import field_validator, model_validator

from envbuild.knowledge.matrix.fields import (_cc, _env_name, _env_pairs, _git_commit, _sha256_hex, _source_word, _specifier,
                                             _Strict, _version)

_OP_LIBRARY = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*/)*[A-Za-z0-9_][A-Za-z0-9_.-]*\.so")
_PYPI_FILE = re.compile(r"https://files\.pythonhosted\.org/packages/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{60}/[A-Za-z0-9_.+-]+")
# A source only on GitHub: the archive of one commit (what the source_mirror secret stands in for),
# or a server of this machine (a test's copy).
_GITHUB_ARCHIVE = re.compile(r"https://github\.com/[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*"
                             r"/archive/(?P<commit>[0-9a-f]{40})\.tar\.gz")
_LOCAL_ARCHIVE = re.compile(r"http://127\.0\.0\.1(:[0-9]{1,5})?/[A-Za-z0-9._~%+/-]+\.tar\.gz")


def _word(v: str) -> str:
    """A name or tag: what an image tag and a --ext value can carry."""
    if not re.match(r"^[a-z][a-z0-9-]*[a-z0-9]\Z", v):
        raise ValueError(f"expected lower-case letters, digits and '-', got {v!r}")
    return v


class ExtensionSdist(_Strict):
    """The sdist the builder compiles: PyPI's file, checked by its sha256 before setup.py runs."""

    filename: str
    url: str
    sha256: str
    size: int

    _sha = field_validator("sha256")(lambda v: _sha256_hex(v))

    @field_validator("url")
    @classmethod
    def _pypi(cls, v: str) -> str:
        """The file's own PyPI address: what pip's --require-hashes download fetches by name."""
        if not _PYPI_FILE.fullmatch(v):
            raise ValueError(f"expected a https://files.pythonhosted.org/packages/... file URL, got {v!r}")
        return v

    @model_validator(mode="after")
    def _named(self):
        """The file name is the URL's last part (it becomes a path in the builder: no '/', no '..')."""
        if "/" in self.filename or self.filename.startswith(".") or not self.url.endswith("/" + self.filename):
            raise ValueError(f"filename {self.filename!r} is not the last part of its url {self.url!r}")
        return self


class SourceArchive(_Strict):
    """A source only on GitHub (FA3: hopper/ of the flash-attention repository, with the CUTLASS
    its csrc/cutlass submodule pins), as the source-built fabrics are: the archive of one commit
    (https://github.com/OWNER/REPO/archive/COMMIT.tar.gz; the source_mirror secret may replace its
    base) checked by the sha256 of its uncompressed tar stream, which `git archive` of that commit
    reproduces anywhere (GitHub's gzip layer is not promised stable). `path`: where it goes in the
    tree, '.' for the repository whose setup.py builds, a submodule's path for the others.
    `tar_sha256` None: not pinned yet, and the extension is refused by ext-source until it is."""

    name: str
    version: str  # the tag or `git describe` of the commit
    commit: str
    url: str
    tar_sha256: Optional[str] = None
    path: str = "."
    license: str
    source: str  # where the commit comes from (the tag, the superproject's gitlink)

    _sha = field_validator("tar_sha256")(lambda v: v if v is None else _sha256_hex(v))
    _n = field_validator("name")(lambda v: _word(v))

    _v = field_validator("version")(lambda v: _source_word(v))  # one word: fabric-sources.sh lists it between spaces
    _c = field_validator("commit")(lambda v: _git_commit(v))

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        if v != "." and (not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*", v)
                         or ".." in v.split("/")):
            raise ValueError(f"expected '.' or a path inside the tree like 'csrc/cutlass', got {v!r}")
        return v

    @model_validator(mode="after")
    def _archive_of_its_commit(self):
        """GitHub's archive of the commit named (or a local copy): what fabric-sources.sh reproduces."""
        github = _GITHUB_ARCHIVE.fullmatch(self.url)
        if not (github or _LOCAL_ARCHIVE.fullmatch(self.url)) or (github and github.group("commit") != self.commit):
            raise ValueError(f"url {self.url!r} is not https://github.com/OWNER/REPO/archive/{self.commit}.tar.gz "
                             f"(or an http://127.0.0.1 copy)")
        return self


class ExtensionWheel(ExtensionSdist):
    """A wheel PyPI publishes for the extension, installed instead of a compile where it fits the
    stack (rules.extension_wheel): its CPU architecture, the CUDA major its libraries link
    (libcudart.so.<major>), the torch and Python it was built for. The build audits it as it
    audits a compiled one (SASS, NEEDED libraries, undefined symbols) before the image keeps it."""

    cpu_arch: Literal["x86_64", "aarch64", "any"]  # any: a pure-Python wheel
    cuda_major: Optional[str] = None  # None: it links no CUDA library (pure Python)
    torch: Optional[str] = None  # the torch releases it loads into (None: any the extension accepts)
    python: Optional[str] = None  # the Pythons its tag admits (None: the extension's own range)
    source: str  # where its CPU, CUDA and torch facts come from

    _s = field_validator("torch", "python")(lambda v: v if v is None else _specifier(v))

    @field_validator("cuda_major")
    @classmethod
    def _major(cls, v):
        if v is not None and not re.fullmatch(r"1[1-9]", v):
            raise ValueError(f"expected a CUDA major like '12' or '13', got {v!r}")
        return v


class RunTimeCompile(_Strict):
    """An extension that compiles its kernels when they are first called (FA4: the CuTe DSL): where
    that compile's cache lives and what the image does with it (docs/extensions.md)."""

    enable_env: Optional[str] = None  # the variable that turns its on-disk cache on (None: always on)
    cache_env: str  # the variable naming the cache directory
    default: str  # where it caches when the variable is unset
    image: str  # what the image does: the per-job node-local directory env.sh sets
    source: str  # the file and line of the release that say so

    _n = field_validator("enable_env", "cache_env")(lambda v: v if v is None else _env_name(v))


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


_REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[a-z0-9-]+\])?((==|>=|<=|~=|!=|<|>)[0-9][0-9a-z.*]*)?"
                          r"(,(==|>=|<=|~=|!=|<|>)[0-9][0-9a-z.*]*)*")


def _requirement(v: str) -> str:
    """One requirement pip is given on a command line: a name, an optional extra and version
    bounds (no marker, no URL, no space: it reaches a shell)."""
    if not _REQUIREMENT.fullmatch(v):
        raise ValueError(f"expected a requirement like 'name[extra]>=1.0,<2', got {v!r}")
    return v


def requirement_key(requirement: str) -> str:
    """The canonical name of a requirement (`name[extra]>=1`; `{cuda_major}` kept as it is)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~]", requirement, maxsplit=1)[0]).lower()


class SdistRequires(_Strict):
    """An sdist's install_requires, which its setup.py computes (it imports torch), so neither pip
    nor uv can read them without building it: given here as data, from the file and lines of the
    release that declare them, and handed to uv as the package's static metadata when `envbuild
    lock` resolves the extension's own lock (as DeepSpeed's are). `{cuda_major}` is the stack's."""

    requirements: list[str]
    source: str  # the sdist's file and lines that declare them

    @field_validator("requirements")
    @classmethod
    def _each(cls, v: list[str]) -> list[str]:
        for r in v:
            _requirement(r.replace("{cuda_major}", "13"))
        return v


class Conflict(_Strict):
    """Another extension this one cannot share an image with (refused at render, rule
    ext-conflict): the reason, from the two releases' own files."""

    name: str  # the other extension
    why: str
    source: str  # the files of both releases that say so

    _n = field_validator("name")(lambda v: _word(v))


class NvccFloor(_Strict):
    """The nvcc a source build needs to emit code for GPUs from `min_cc` up: an older one compiles
    none for them (its setup.py adds their -gencode only from that nvcc, and no PTX)."""

    min_cc: str
    nvcc: str  # the nvcc releases that emit it
    source: str  # the setup.py lines that say so

    _c = field_validator("min_cc")(_cc)
    _s = field_validator("nvcc")(_specifier)


class CudaExtension(_Strict):
    """A CUDA extension compiled from its sdist in the builder stage, against the image's torch,
    for the GPU profile's arches only (envbuild/buildsteps/extensions.py), then verified:
    it imports with no undefined symbol and every shared library carries SASS for the GPU."""

    name: str  # the PyPI distribution name, as users write it in requirements
    tag: str  # what the image tag says for it, with its version: fa2.8.3
    description: str
    version: str
    sdist: Optional[ExtensionSdist] = None  # compiled from it where no wheel fits (None: wheels only)
    # compiled from these where PyPI has no sdist that builds (FA3): the repository first, then the
    # submodules it needs at their paths
    archives: list[SourceArchive] = []
    subdirectory: Optional[str] = None  # the source directory whose setup.py builds it (FA3: hopper)
    wheels: list[ExtensionWheel] = []  # PyPI's wheels, each installed where it fits the stack
    needs: list[str] = []  # extensions it needs in the same image ({cuda_major}: the stack's)
    stable_abi: Optional[str] = None  # the torch releases torch's stable C ABI it targets spans
    device_code: bool = True  # False: a host-only library (TE's torch binding calls the core's kernels)
    run_time_compile: Optional[RunTimeCompile] = None
    unbuildable: Optional[str] = None  # why nothing on PyPI builds it, with the file that says so: refused at render
    aliases: list[str] = []  # other names --ext takes (fa3)
    packages: list[str]  # the import names of its Python packages
    modules: list[str]  # its compiled Python extension modules (PyInit_*: imported by the build check and the smoke test)
    # torch op libraries (no PyInit_*: registered with TORCH_LIBRARY and loaded by torch.ops.load_library, as
    # xformers/_C.so), relative to site-packages: the build check and the smoke test load each so, after torch
    op_libraries: list[str] = []
    requires: list[str] = []  # its Requires-Dist names: each must already be in the stack's venv
    build_only: list[str] = []  # Requires-Dist it needs only to compile (ninja): dropped like DeepSpeed's
    build_requires: list[str] = []  # what setup.py imports besides torch (in the venv: --no-build-isolation)
    # Requirements for the stack's CUDA major, beside `requires` (FA4: the CuTe DSL's cu13 libraries,
    # cuda-bindings bounded to the major): keyed by the major, e.g. "13"
    requires_by_cuda: dict[str, list[str]] = {}
    # The sdist's own install_requires, with their bounds (setup.py computes them: uv cannot read
    # them without building it): the extension lock resolves them, unlocked stacks install them
    requires_dist: Optional[SdistRequires] = None
    # The oldest glibc a CPU architecture's image needs for the extension's closure (mamba-ssm's
    # tilelang has one aarch64 wheel, manylinux_2_34; its sdist compiles TVM): rule ext-glibc
    min_glibc: dict[Literal["x86_64", "aarch64"], str] = {}
    # CUDA libraries it loads at import that torch's own wheels may not bring (TE's core: curand),
    # from the stack's toolchain extra of that name: the venv installs that section of the lock
    loads: list[Literal["curand"]] = []
    build_headers: list[str] = []  # headers its compile includes that the CUDA toolkit lacks (cudnn.h): from pip's nvidia-*
    conflicts: list[Conflict] = []  # extensions it cannot share an image with (refused together at render)
    nvcc_for_cc: list[NvccFloor] = []  # the nvcc its source build needs for newer GPUs (older ones are refused at render)
    min_cc: str  # the oldest compute capability its kernels support
    max_cc: Optional[str] = None  # the newest (None: no ceiling known)
    torch: str  # the torch releases its source builds against
    cuda: str  # the CUDA releases its setup.py accepts
    python: str  # its Requires-Python
    cpu_arch: list[Literal["x86_64", "aarch64"]] = ["x86_64"]  # architectures it has been built for
    arch_env: Optional[str] = None  # its own arch variable (None: it follows TORCH_CUDA_ARCH_LIST)
    build_env: dict[str, str] = {}  # what makes setup.py compile here instead of downloading a wheel
    patches: list[SourcePatch] = []  # upstream fixes newer than the sdist, for the torch that needs them
    memory_per_job_gib: Optional[float] = None  # peak memory of one compile job: MAX_JOBS = memory // this
    nvcc_threads: Optional[int] = None  # NVCC_THREADS: nvcc's own threads per job (memory grows with it)
    gpu_check: Optional[Literal["attention", "causal-conv1d", "flash-attn-3", "flash-attn-4", "transformer-engine",
                                "selective-scan", "xformers"]] = None  # the smoke test's GPU check
    build_time: str  # measured, with the machine
    sources: dict[str, str]  # fact -> public source (a URL, a file of a named release)

    _e = field_validator("build_env")(lambda v: _env_pairs(v))
    _v = field_validator("version")(lambda v: _version(v))
    _c = field_validator("min_cc", "max_cc")(lambda v: v if v is None else _cc(v))
    _s = field_validator("torch", "cuda", "python")(_specifier)
    _abi = field_validator("stable_abi")(lambda v: v if v is None else _specifier(v))

    @field_validator("requires_by_cuda")
    @classmethod
    def _by_major(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for major, reqs in v.items():
            if not re.fullmatch(r"1[1-9]", major):
                raise ValueError(f"expected a CUDA major like '12' or '13' as key, got {major!r}")
            for r in reqs:
                _requirement(r)
        return v

    _g = field_validator("min_glibc")(lambda v: {arch: _version(g) for arch, g in v.items()})

    @model_validator(mode="after")
    def _requires_agree(self):
        """requires_dist names what `requires` and `build_only` name, besides torch and the
        extensions it needs (installed by their own hash)."""
        if self.requires_dist is None:
            return self
        named = {requirement_key(r) for r in self.requires_dist.requirements} - {"torch"} - {requirement_key(n) for n in self.needs}
        listed = {requirement_key(r) for r in (*self.requires, *self.build_only)}
        if named != listed:
            raise ValueError(f"{self.name}: requires_dist names {sorted(named)}, requires and build_only "
                             f"{sorted(listed)}: they must agree")
        return self

    @field_validator("build_headers")
    @classmethod
    def _headers(cls, v: list[str]) -> list[str]:
        for h in v:
            if not re.fullmatch(r"[A-Za-z0-9_]+\.h", h):
                raise ValueError(f"expected a header file name like 'cudnn.h', got {h!r}")
        return v

    @field_validator("op_libraries")
    @classmethod
    def _op_libraries(cls, v: list[str]) -> list[str]:
        """A path inside site-packages (it reaches the build's and the smoke test's loader): relative,
        plain names, no `..`, a shared library."""
        for lib in v:
            if not _OP_LIBRARY.fullmatch(lib) or ".." in lib.split("/"):
                raise ValueError(f"expected a shared library relative to site-packages, like 'xformers/_C.so', got {lib!r}")
        return v

    @model_validator(mode="after")
    def _op_libraries_not_imported(self):
        """An op library is not also a module to import: that import fails however sound the
        library is (xformers._C, issue 42)."""
        for lib in self.op_libraries:
            folder, _, file = lib.rpartition("/")  # _C.so or _C.cpython-311-x86_64-linux-gnu.so: module _C
            module = ".".join([*filter(None, folder.split("/")), file.split(".")[0]])
            if module in self.modules:
                raise ValueError(f"{self.name}: modules names {module}, which op_libraries loads as {lib}: a torch op "
                                 f"library has no PyInit_* to import; drop it from modules")
        return self

    @field_validator("subdirectory")
    @classmethod
    def _inside(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", v):
            raise ValueError(f"expected one directory name inside the sdist, like 'hopper', got {v!r}")
        return v

    @model_validator(mode="after")
    def _installable(self):
        """Something to install: an sdist to compile (with the memory one compile job takes) or a
        wheel."""
        if self.sdist is None and not self.archives and not self.wheels and not self.unbuildable:
            raise ValueError(f"{self.name} has neither an sdist or archives to compile nor a wheel to install")
        if self.sdist is not None and self.archives:
            raise ValueError(f"{self.name} names an sdist and archives: one source to compile")
        if (self.sdist is not None or self.archives) and not self.unbuildable and not self.memory_per_job_gib:
            raise ValueError(f"{self.name} compiles from its source and needs memory_per_job_gib (MAX_JOBS)")
        if self.archives and ([a.path for a in self.archives].count(".") != 1 or self.archives[0].path != "."):
            raise ValueError(f"{self.name}: the first archive is the repository (path '.'), the others submodules")
        if len({a.path for a in self.archives}) != len(self.archives):
            raise ValueError(f"{self.name}: two archives go to one path")
        return self

    @property
    def compiled(self) -> bool:
        """It has a source to compile: PyPI's sdist or GitHub archives."""
        return self.sdist is not None or bool(self.archives)

    @property
    def unpinned(self) -> list[str]:
        """Its archives with no recorded tar sha256 (refused until pinned: rule ext-source)."""
        return [a.name for a in self.archives if a.tar_sha256 is None]

    @field_validator("name", "tag")
    @classmethod
    def _name(cls, v: str) -> str:
        return _word(v)

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        return [_word(alias) for alias in v]


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
