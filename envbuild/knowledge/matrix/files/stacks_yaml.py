"""stacks.yaml: the stacks (torch, CUDA, Python, DeepSpeed, OS, toolchain, bases), and publish.yaml."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import field_validator

from envbuild.base import grammar
from envbuild.knowledge import rules
from envbuild.knowledge.matrix.fields import _Strict, _version
from envbuild.oci.registry import reference_problems


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
