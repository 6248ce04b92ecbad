"""What a user asks for, declared once: each field of the request with the option that sets it.

The CLI's request options, the keys an ``envbuild.yaml`` project file may hold and
:meth:`Request.describe` are all read from these declarations, so a new request field is one
entry here (stdlib only: ``--help`` loads none of the resolver). The field order is the order
of the image manifest's ``request`` record, which ``envbuild rebuild`` re-renders byte for byte:
a new field goes last."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from envbuild.knowledge.rules import DEFAULT_CPU_TARGET, DEFAULT_OPS


@dataclass(frozen=True)
class Flag:
    """How the command line gives one request field (and envbuild.yaml, where `project`)."""

    name: str  # the option: --gpu
    help: str
    metavar: Optional[str] = None
    switch: bool = False  # on or off (click's is_flag)
    repeated: bool = False  # given any number of times: a tuple of the values
    refuse_empty: bool = False  # '' is refused by name rather than read as the default
    project: bool = False  # a key of envbuild.yaml, spelled as the option without its dashes (ds_ops, ext)
    described: bool = False  # part of describe(): what picks the same stack and tag again

    @property
    def key(self) -> str:
        """The option's name as a project-file key and a Python identifier: --ds-ops -> ds_ops."""
        return self.name[2:].replace("-", "_")


def _given(flag: Flag, default: Any = None, **kw):
    return field(default=default, metadata={"flag": flag}, **kw)


# Derived fields: not one option of their own (each names where its value comes from).
DERIVED = {"image_repo": "--registry and --image-repo (running.image_repo)"}


@dataclass(frozen=True)
class Request:
    """What the user asked for. Version fields take a version or a PEP 440 specifier."""

    gpu: str = field(metadata={"flag": Flag("--gpu", "GPU profile or alias (h20, H100, nvidia-a100, ...).",
                                            project=True, described=True)})
    python: Optional[str] = _given(Flag("--python", "Python version or PEP 440 specifier.", project=True,
                                        described=True))
    cuda: Optional[str] = _given(Flag("--cuda", "CUDA version or specifier (13.0, '>=12.6').", project=True,
                                      described=True))
    torch: Optional[str] = _given(Flag("--torch", "torch version or specifier ('>=2.5,<2.8').", project=True,
                                       described=True))
    deepspeed: Optional[str] = _given(Flag("--deepspeed", "DeepSpeed version or specifier.", project=True,
                                           described=True))
    stack: Optional[str] = _given(Flag("--stack", "Pick a matrix row by id (see `envbuild matrix`).", project=True,
                                       described=True))
    ds_ops: str = _given(Flag("--ds-ops", "Ops to pre-build: training (the default), all, none, or a comma list "
                                          "(cpu_adam,fused_adam).", project=True), DEFAULT_OPS)
    base_image: Optional[str] = _given(Flag("--base-image", "Replace the OS base image (same distro release), e.g. a "
                                                            "private mirror."))
    builder_image: Optional[str] = _given(Flag("--builder-image", "Replace the builder stage's base image (needs nvcc "
                                                                  "for NVIDIA stacks)."))
    env: tuple[tuple[str, str], ...] = _given(Flag("--env", "Add or override an environment default baked into the "
                                                            "image (repeatable).", metavar="NAME=VALUE",
                                                   repeated=True), ())
    cpu_target: Optional[str] = _given(Flag(  # None: the image architecture's default for the GPU's host CPU
        "--cpu-target", f"CPU the CPU ops are compiled for instead of the build machine's -march=native: x86-64, "
                        f"x86-64-v2, x86-64-v3 (default on x86_64: {DEFAULT_CPU_TARGET}), x86-64-v4; armv8-a, "
                        f"armv9-a, neoverse-v2 (aarch64 default: the GPU's host CPU, e.g. Grace's neoverse-v2 where "
                        f"the OS's GCC knows it)."))
    keep_toolchain: bool = _given(Flag("--keep-toolchain", "Keep compilers in the final image (larger).",
                                       switch=True), False)
    no_compiler: bool = _given(Flag(  # a final image without a C compiler: torch.compile cannot run
        "--no-compiler", "Leave the C compiler and Python headers out of the final image (smaller; torch.compile "
                         "then cannot run).", switch=True), False)
    qemu: bool = _given(Flag(  # bind a stub CPU sysfs (plan/components/deepspeed.py)
        "--qemu", "An arm64 image built under qemu-user emulation on an x86-64 machine: bind a stub CPU sysfs into "
                  "the build steps (torch crashes at import without it there). Not for real arm64 builders.",
        switch=True), False)
    image_repo: str = "envbuild"  # DERIVED
    fabric: Optional[str] = _given(Flag(  # None: fabrics.yaml's default (the verbs user space for InfiniBand/RoCE)
        "--fabric", "How NCCL reaches other nodes: ib (default: InfiniBand/RoCE verbs user space in every image), "
                    "none, or a cloud fabric (`envbuild fabrics` lists them with what each adds).", metavar="NAME",
        refuse_empty=True, described=True))
    extensions: tuple[str, ...] = _given(Flag(  # CUDA extensions to pre-build (extensions.yaml names), canonical
        "--ext", "CUDA extensions to pre-build from source for the GPU's arches, verified like the ops: flash-attn, "
                 "causal-conv1d (`envbuild extensions` lists them and what each fits).", metavar="NAME[,NAME]",
        project=True, described=True), ())
    nccl: Optional[str] = _given(Flag(  # an NCCL release installed in place of torch's pin (matrices/nccl.yaml)
        "--nccl", "Install this NCCL release (its nvidia-nccl-cuXX wheel, hash-locked) in place of the one torch "
                  "pins: a 2.x of the same CUDA major, not older than torch's pin (matrices/nccl.yaml lists PyPI's "
                  "releases; a refused one is named with the nearest accepted). The tag gets -ncclVERSION.",
        metavar="VERSION", refuse_empty=True, project=True, described=True))

    def describe(self) -> str:
        """The options that pick this stack and tag again, as a user would type them."""
        parts = []
        for name, flag in flags().items():
            value = getattr(self, name)
            if flag.described and value:
                parts.append(f"{flag.name} {','.join(value) if isinstance(value, tuple) else value}")
        return " ".join(parts)


def flags() -> dict[str, Flag]:
    """Request field -> the option that sets it, in field order (the derived fields left out)."""
    return {f.name: f.metadata["flag"] for f in fields(Request) if "flag" in f.metadata}


def defaults() -> dict[str, Any]:
    """Each option's value when it is not given, by field name: None, False for a switch, () when repeated."""
    return {name: False if flag.switch else () if flag.repeated else None for name, flag in flags().items()}
