"""gpus.yaml: the GPU profiles, the defaults each bakes (with reason, source and cost), the CPU
targets, the variables' grammars, and what is out of scope."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from envbuild.base import grammar
from envbuild.knowledge.matrix.fields import _cc, _driver, _env_name, _env_value, _specifier, _Strict, _version


# A node condition's name: what a default's `node:` says (`{infiniband: present}`) and the
# manifest's node_conditions carries; driver_below is the one built-in comparison, no device set.
CONDITION_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
BUILT_IN_CONDITIONS = ("driver_below",)
# The port link layers the kernel writes to /sys/class/infiniband/*/ports/*/link_layer
# (drivers/infiniband/core/sysfs.c: show_port_link_layer): Unknown is what EFA's ports say.
LinkLayer = Literal["InfiniBand", "Ethernet", "Unknown"]


def _condition_name(v: str) -> str:
    if not CONDITION_NAME.fullmatch(v):
        raise ValueError(f"expected a node condition name of lower-case letters, digits and '_' (at most 32, a "
                         f"letter first) like 'infiniband', got {v!r}")
    if v in BUILT_IN_CONDITIONS:
        raise ValueError(f"{v!r} is a built-in condition (the node's driver version), not a set of devices")
    return v


def _kernel_driver(v: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", v):
        raise ValueError(f"expected a kernel driver name like 'mlx5_core' or 'efa', got {v!r}")
    return v


class DeviceMatch(_Strict):
    """Which RDMA devices (the entries of /sys/class/infiniband) a condition counts: those whose
    kernel driver is one of `drivers` and (when both are given) that have a port whose link layer
    is one of `link_layers`."""

    # the kernel driver of the device's parent, the basename of /sys/class/infiniband/<dev>/device/driver
    # (image/nodefacts.py rdma_devices): efa, mlx5_core for ConnectX, bnxt_en under bnxt_re, ice or i40e under irdma
    drivers: list[str] = []
    link_layers: list[LinkLayer] = []  # any port's /sys/class/infiniband/<dev>/ports/<n>/link_layer

    _d = field_validator("drivers")(lambda v: [_kernel_driver(d) for d in v])

    @model_validator(mode="after")
    def _some(self):
        if not self.drivers and not self.link_layers:
            raise ValueError("names neither drivers nor link_layers: write `devices: any` for every RDMA device")
        return self


class DeviceCondition(_Strict):
    """A node condition on the node's RDMA devices (fabrics.yaml node_conditions): a default with
    `node: {NAME: present}` applies where at least one device counts, `absent` where none does.
    The manifest carries the definition, and the image decides it at start-up (image/node.py)."""

    label: str  # how messages and tables name the devices: "no InfiniBand device", "EFA rdmap0s6"
    # any: every RDMA device the kernel lists; else those of the named drivers and link layers
    devices: Annotated[Union[Annotated[Literal["any"], Tag("any")], Annotated[DeviceMatch, Tag("match")]],
                       Discriminator(lambda v: "match" if isinstance(v, (dict, DeviceMatch)) else "any")]
    means: str
    source: str

    @field_validator("label")
    @classmethod
    def _label(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 ./+-]{0,39}", v):
            raise ValueError(f"expected a short name of the devices like 'InfiniBand' or 'EFA', got {v!r}")
        return v

    def record(self) -> dict:
        """What the manifest carries: enough for the image to decide it, and what it means."""
        devices = self.devices if isinstance(self.devices, str) else self.devices.model_dump(exclude_defaults=True)
        return {"label": self.label, "devices": devices, "means": self.means}


class NodeCondition(_Strict):
    """A condition only the node can answer (its driver, its network), checked at start-up
    by the image's entrypoint / Apptainer environment instead of being baked blindly:
    `driver_below` (built in), and `NAME: present | absent` for each device condition
    fabrics.yaml's node_conditions declares (the loader refuses a name it does not declare)."""

    model_config = ConfigDict(extra="allow", frozen=True,
                              json_schema_extra={"propertyNames": {"pattern": f"^{CONDITION_NAME.pattern}$"}})
    __pydantic_extra__: dict[str, Literal["absent", "present"]] = Field(init=False)

    driver_below: Optional[str] = None

    _v = field_validator("driver_below")(lambda v: v if v is None else _driver(v))

    @model_validator(mode="after")
    def _names(self):
        for name in self.conditions:
            _condition_name(name)
        return self

    @property
    def conditions(self) -> dict[str, str]:
        """The device conditions, name -> absent or present, as written."""
        return dict(self.__pydantic_extra__ or {})



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
