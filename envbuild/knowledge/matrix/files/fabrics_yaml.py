"""fabrics.yaml: the networks between nodes: what each puts in the image, and what NCCL must pick."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import Field, field_validator

from envbuild.base import grammar
from envbuild.knowledge.matrix.fields import _env_pairs, _sha256_hex, _specifier, _Strict
from envbuild.knowledge.matrix.files.gpus_yaml import CONDITION_NAME, DeviceCondition, EnvDefault, _condition_name


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
