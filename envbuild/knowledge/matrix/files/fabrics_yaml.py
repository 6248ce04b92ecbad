"""fabrics.yaml: the networks between nodes: what each puts in the image, and what NCCL must pick."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from envbuild.base import grammar
from envbuild.knowledge.matrix.fields import _env_pairs, _git_commit, _sha256_hex, _source_word, _specifier, _Strict
from envbuild.knowledge.matrix.files.gpus_yaml import CONDITION_NAME, DeviceCondition, EnvDefault, _condition_name


# A source-built fabric is data, as hpccm's generic_autotools and generic_cmake building blocks
# are: each source's archive and pin, its build system and options, its prefix; the build's
# post-install links, what is dropped before the runtime stage copies the prefixes, and what is
# checked. templates/files/steps/fabric.sh runs it as a loop and knows no fabric by name.
# Placeholders in a value: {prefix} (the source's), {prefix:NAME} (an earlier source's, named in
# `after`), and what only the builder knows: {cuda} (CUDA_HOME), {cuda_include} (its headers and
# the build's header wheels side by side), {cuda_lib} (its lib64 or lib), {venv} (the venv).
PLACEHOLDER = re.compile(r"\{([a-z_]+)(?::([a-z0-9][a-z0-9-]*))?\}")
BUILDER_PLACEHOLDERS = ("cuda", "cuda_include", "cuda_lib", "venv")
# An option is one argument word of configure, cmake or make: letters, digits, space (a word such
# as "CPPFLAGS=-I/a -I/b" holds one) and ._+@%=,:/~- only; nothing a shell would read as code.
_OPTION = re.compile(r"^[A-Za-z0-9 ._+@%=,:/~{}-]+\Z")
_GLOB = re.compile(r"^[A-Za-z0-9._+@%=,:/~{}*?\[\]-]+\Z")
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_RELATIVE = re.compile(r"^[A-Za-z0-9._+@%=,~-]+(/[A-Za-z0-9._+@%=,~-]+)*\Z")
# Where a source may be downloaded from: https, or a server of this machine (a test's mirror).
_SOURCE_URL = re.compile(r"^(https://[A-Za-z0-9.-]+(:[0-9]{1,5})?|http://127\.0\.0\.1(:[0-9]{1,5})?)"
                         r"/[A-Za-z0-9._~%+/-]*\Z")


def _option(v: str) -> str:
    if not _OPTION.match(v) or "{}" in v:
        bad = sorted({c for c in v if not _OPTION.match(c)})
        raise ValueError(f"expected one configure/cmake/make argument of letters, digits, spaces and ._+@%=,:/~- "
                         f"(and {{placeholders}}), got {v!r}" + (f": {' '.join(map(repr, bad))} would be shell code"
                                                                  if bad else ""))
    _placeholders(v)
    return v


def _placeholders(v: str) -> list[tuple[str, str]]:
    """The placeholders in `v` as (name, source); a '{' or '}' outside one is refused."""
    found = [(m.group(1), m.group(2) or "") for m in PLACEHOLDER.finditer(v)]
    if "{" in PLACEHOLDER.sub("", v) or "}" in PLACEHOLDER.sub("", v):
        raise ValueError(f"{v!r} holds a '{{' or '}}' that is no placeholder like {{prefix}} or {{cuda}}")
    for name, source in found:
        if name == "prefix" or (name in BUILDER_PLACEHOLDERS and not source):
            continue
        raise ValueError(f"{v!r}: unknown placeholder {{{name}{':' + source if source else ''}}}; known: {{prefix}}, "
                         f"{{prefix:SOURCE}}, {', '.join('{' + n + '}' for n in BUILDER_PLACEHOLDERS)}")
    return found


def _source_url(v: str) -> str:
    if not _SOURCE_URL.match(v):
        raise ValueError(f"expected an https URL (or http://127.0.0.1 for a local mirror) of letters, digits and "
                         f"._~%+/- such as 'https://github.com/OWNER/REPO/archive/COMMIT.tar.gz', got {v!r}")
    return v


def _relative(v: str) -> str:
    if not _RELATIVE.match(v) or ".." in v.split("/"):
        raise ValueError(f"expected a path inside the unpacked source like 'include/config.h', got {v!r}")
    return v


def _symbol(v: str) -> str:
    if not _SYMBOL.match(v):
        raise ValueError(f"expected a C identifier like HAVE_CUDA, got {v!r}")
    return v


class FabricDefine(_Strict):
    """A macro the source's configure must have set to 1 in its config header, and why: a build
    that silently configured without it would lack what the fabric is for."""

    name: str
    why: str

    _n = field_validator("name")(lambda v: _symbol(v))


class FabricSource(_Strict):
    """A source a fabric builds from, and how (hpccm's generic_autotools / generic_cmake): the
    real URL (what the publishing CI fetches) and the sha256 of its uncompressed tar stream,
    which a local mirror of the same commit reproduces (GitHub's /archive/ gzip bytes are not
    promised stable; the tar inside is `git archive`). `build`: autotools (./configure, made by
    ./autogen.sh or autoreconf when the archive has none, then make and make install), cmake
    (configure, build, the install target) or make (make OPTIONS, make OPTIONS install)."""

    name: str
    version: str
    commit: Optional[str] = None  # the git commit a GitHub archive is of
    url: str
    tar_sha256: str
    license: str
    source: str
    build: Literal["autotools", "cmake", "make"]
    prefix: str  # --prefix / CMAKE_INSTALL_PREFIX (make: name it in `options`)
    after: list[str] = []  # earlier sources this one builds against ({prefix:NAME} names only these)
    options: list[str] = []  # configure / cmake / make arguments, one word each
    version_file: Optional[str] = None  # a file the archive lacks that holds the version (a release tarball's)
    config_header: str = "config.h"  # where configure wrote its macros (for `defines`)
    defines: list[FabricDefine] = []
    why: str = ""  # why these options

    _sha = field_validator("tar_sha256")(lambda v: _sha256_hex(v))
    _u = field_validator("url")(lambda v: _source_url(v))
    _p = field_validator("prefix")(lambda v: grammar.path_word(v))
    _o = field_validator("options")(lambda v: [_option(x) for x in v])
    _r = field_validator("version_file", "config_header")(lambda v: v if v is None else _relative(v))

    _w = field_validator("name", "version")(lambda v: _source_word(v))
    _c = field_validator("commit")(lambda v: _git_commit(v))


class FabricLink(_Strict):
    """A link the build makes after installing (inside a prefix, so the runtime stage copies it):
    to the first file matching `to`, a glob ({venv} and absolute paths), found in the builder."""

    path: str
    to: str
    why: str

    _p = field_validator("path")(lambda v: grammar.path_word(v))

    @field_validator("to")
    @classmethod
    def _glob(cls, v: str) -> str:
        if not _GLOB.match(v) or not (v.startswith("/") or v.startswith("{venv}/")) or \
                any(name != "venv" for name, _ in _placeholders(v)):
            raise ValueError(f"expected an absolute glob or one under {{venv}}/ (the one placeholder a link takes) of "
                             f"letters, digits and ._+@%=,:/~-*?[], got {v!r}")
        return v


class FabricExports(_Strict):
    """A built library that must export these symbols (what the program dlopening it looks up)."""

    file: str
    symbols: list[str]

    _p = field_validator("file")(lambda v: grammar.path_word(v))
    _s = field_validator("symbols")(lambda v: [_symbol(x) for x in v])


class FabricProbe(_Strict):
    """A built tool run after the build (argv split at spaces, no shell): it must succeed, and
    print `expect` where given; its output is logged."""

    run: str
    expect: str = ""

    @field_validator("run")
    @classmethod
    def _argv(cls, v: str) -> str:
        if not _OPTION.match(v) or "{" in v or not v.startswith("/"):
            raise ValueError(f"expected a built tool's absolute path and its arguments, of letters, digits, spaces and "
                             f"._+@%=,:/~-, got {v!r}")
        return v

    @field_validator("expect")
    @classmethod
    def _expect(cls, v: str) -> str:
        if v and not _OPTION.match(v.replace("{", "").replace("}", "")):
            raise ValueError(f"expected plain text of letters, digits, spaces and ._+@%=,:/~-, got {v!r}")
        return v


class FabricBuild(_Strict):
    """What the builder stage compiles for a fabric (templates/files/steps/fabric.sh, one loop
    over `sources` in order), and what the runtime stage takes from it: every source's prefix,
    less `drop`, registered with the dynamic linker in the file `ld_conf` (NCCL dlopens its net
    plugin by name: no LD_LIBRARY_PATH to lose), each prefix's bin/ on PATH."""

    sources: list[FabricSource]
    ld_conf: str  # /etc/ld.so.conf.d file naming every prefix's lib directory
    drop: list[str] = []  # paths inside the prefixes the runtime stage need not carry (headers, daemons)
    links: list[FabricLink] = []
    exports: list[FabricExports] = []
    probes: list[FabricProbe] = []
    # pip requirement lines (hash-pinned, no dependencies) for headers the build needs that the
    # stack's CUDA wheels lack: libfabric's CUDA support includes nvml.h.
    headers: list[str] = []
    time: str  # measured build time, with the machine
    source: str

    _p = field_validator("ld_conf")(lambda v: grammar.path_word(v))
    _d = field_validator("drop")(lambda v: [grammar.path_word(x) for x in v])

    @property
    def prefixes(self) -> tuple[str, ...]:
        """Every source's prefix, once each, in build order: what the runtime stage copies."""
        return tuple(dict.fromkeys(s.prefix for s in self.sources))

    def expanded(self, value: str, source: FabricSource) -> str:
        """`value` with {prefix} (`source`'s) and {prefix:NAME} (an earlier source's) filled in:
        static, so the rendered step shows the real paths; the builder's own ({cuda}, ...) stay."""
        prefixes = {s.name: s.prefix for s in self.sources}
        return PLACEHOLDER.sub(lambda m: (prefixes[m.group(2)] if m.group(2) else source.prefix)
                               if m.group(1) == "prefix" else m.group(0), value)

    @property
    def uses_cuda(self) -> bool:
        return bool(self.headers) or any(name.startswith("cuda") for s in self.sources for o in s.options
                                         for name, _ in _placeholders(o))

    @model_validator(mode="after")
    def _consistent(self) -> "FabricBuild":
        """Names once, `after` names earlier sources, {prefix:NAME} only those in `after`, and
        what the build writes (drop, links, checked files) lies inside a prefix."""
        seen: list[str] = []
        for i, s in enumerate(self.sources):
            if s.name in seen:
                raise ValueError(f"sources.{i}.name: {s.name!r} is given twice")
            for dep in s.after:
                if dep not in seen:
                    raise ValueError(f"sources.{i}.after: {dep!r} is not an earlier source (earlier: {seen or 'none'})")
            for j, option in enumerate(s.options):
                for _, dep in _placeholders(option):
                    if dep and dep not in s.after:
                        raise ValueError(f"sources.{i}.options.{j}: {{prefix:{dep}}} names a source not in its `after` "
                                         f"({s.after or 'none'})")
            seen.append(s.name)
        inside = [(f"drop.{i}", p) for i, p in enumerate(self.drop)] + \
            [(f"links.{i}.path", link.path) for i, link in enumerate(self.links)] + \
            [(f"exports.{i}.file", e.file) for i, e in enumerate(self.exports)] + \
            [(f"probes.{i}.run", p.run.split(" ")[0]) for i, p in enumerate(self.probes)]
        for where, path in inside:
            if not any(path.startswith(prefix + "/") for prefix in self.prefixes) or ".." in path.split("/"):
                raise ValueError(f"{where}: {path!r} is not inside a source's prefix ({', '.join(self.prefixes)})")
        return self


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


class KubeResource(_Strict):
    """One device plugin's resource a pod asks for beside its GPUs, in the same container's
    limits: its name as the plugin advertises it, how many a pod asks for, and where that is said."""

    name: str
    count: int = Field(ge=1, le=1024)  # a device plugin counts slots or NICs: p5.48xlarge has 32 EFA
    source: str

    _n = field_validator("name")(lambda v: grammar.extended_resource(v))


class FabricKubernetes(_Strict):
    """How a pod on Kubernetes reaches this fabric (`envbuild job --k8s`): the resources its
    device plugin advertises (overridable with --fabric-resource), and the most GPUs a node of
    this fabric holds where the fabric is one machine type."""

    resources: list[KubeResource] = []
    max_gpus_per_node: Optional[int] = Field(default=None, ge=1, le=64)
    source: str = ""


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
    kubernetes: FabricKubernetes = FabricKubernetes()  # what a pod asks for to reach it (envbuild job --k8s)
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
    # The node's devices a default's `node:` may name (gpus.yaml and fabrics.yaml alike): each
    # name once, here; the manifest carries the ones an image's node_env names.
    node_conditions: dict[str, DeviceCondition] = Field(
        default={}, json_schema_extra={"propertyNames": {"pattern": f"^{CONDITION_NAME.pattern}$"}})
    fabrics: list[Fabric]

    @field_validator("node_conditions")
    @classmethod
    def _condition_names(cls, v: dict[str, DeviceCondition]) -> dict[str, DeviceCondition]:
        for name in v:
            _condition_name(name)
        return v
