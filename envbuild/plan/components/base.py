"""What every component of a stack image gives the plan (``Part``), and the decisions made once
before any component runs (``Context``): where the CUDA toolchain lives and whether the final
image keeps it, the lock, the platform. A component is a module with ``part(ctx) -> Part``;
stack.py lists them and folds their parts (hpccm's building blocks: each owns its build half
and what the runtime stage takes from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

from envbuild.base.emulation import QEMU_CPU_SYSFS
from envbuild.plan.blocks import FileCopy, Step
from envbuild.resolve.resolver import Resolution


@dataclass(frozen=True)
class Context:
    """A resolution plus the facts several components need, each decided here once."""

    resolution: Resolution
    toolchain_home: Optional[str]  # where the builder has nvcc (None: it has none)
    kept_toolchain_home: Optional[str]  # the same, when the final image keeps it (--keep-toolchain)
    installs_toolchain: bool  # a step installs nvcc (the base image does not bring it)
    platform: Optional[str]  # an OCI platform when the image is not for the build host's (arm64)
    emulation: tuple[FileCopy, ...]  # --qemu: the stub CPU sysfs bound over the step that imports torch

    @classmethod
    def of(cls, resolution: Resolution) -> "Context":
        toolchain, request = resolution.facts.toolchain, resolution.request
        installs = toolchain.install is not None and resolution.nvcc_reason is not None
        home = toolchain.cuda_home if (toolchain.install is None or installs) else None
        # x86_64 images keep the build host's platform (CI builds them on x86 runners); others name theirs.
        platform = resolution.platform if resolution.arch != "x86_64" else None
        return cls(resolution=resolution, toolchain_home=home,
                   kept_toolchain_home=home if request.keep_toolchain else None, installs_toolchain=installs,
                   platform=platform,
                   emulation=(FileCopy(*QEMU_CPU_SYSFS),) if request.qemu and platform else ())

    @property
    def keep(self) -> bool:
        """--keep-toolchain: the final image is the builder, compilers included."""
        return self.resolution.request.keep_toolchain

    @property
    def lock(self):
        """The stack's Python lock (None: not hash-locked), as the resolver found it."""
        return self.resolution.lock

    @property
    def venv_sections(self) -> tuple[str, ...]:
        """The lock's sections the venv installs: [venv], what the toolchain adds for the chosen
        ops or that the extensions load at import ([curand]), and --nccl's [nccl], last: its wheel
        replaces the venv's pin of it."""
        r = self.resolution
        return ("venv", *sorted({*r.toolchain_adds, *r.extension_loads}), *(("nccl",) if r.nccl_override else ()))

    @property
    def python_pkg(self) -> str:
        """The OS's Python package of the stack's Python (python3.12)."""
        return self.resolution.facts.family.python[self.resolution.stack.python]

    @property
    def ds_build_only(self) -> tuple[str, ...]:
        """What only DeepSpeed's compiles need (ninja): the final image drops it unless it keeps the toolchain."""
        return () if self.keep else tuple(sorted(self.resolution.facts.ds_build_only))


@dataclass(frozen=True)
class Part:
    """One component's share of the image. Empty by default: a component gives only what it owns."""

    builder_steps: tuple[Step, ...] = ()  # in the builder stage, in the components' order
    runtime_steps: tuple[Step, ...] = ()  # in the runtime stage, before it copies from the builder
    after_copy: tuple[Step, ...] = ()  # in the runtime stage, after it copied from the builder
    from_builder: tuple[str, ...] = ()  # directories the runtime stage copies from the builder
    image_files: tuple[FileCopy, ...] = ()  # build-directory files the final image carries
    generated: tuple[tuple[str, str], ...] = ()  # build-directory files written from text (path, text)


@runtime_checkable
class Component(Protocol):
    """A component: a module of plan/components/ with one function, `part(ctx)`, and a docstring
    that says what it owns (docs/components.md is generated from it). stack.py folds them."""

    def part(self, ctx: Context) -> Part: ...
