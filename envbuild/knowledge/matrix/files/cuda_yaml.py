"""cuda.yaml: the driver floors per CUDA major, GPU generation and GPU."""

from __future__ import annotations

from pydantic import field_validator

from envbuild.knowledge.matrix.fields import _driver, _Strict


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
