"""What a plan is: the facts a layout template may show (``ImageFacts``), and the ``BuildPlan``
every renderer reads and nothing else. The stack fold (stack.py) and the layer on a stack image
(extend.py) both make one."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from envbuild import buildsteps
from envbuild import image as image_package
from envbuild.base.emulation import QEMU_CPU_SYSFS, qemu_cpu_stub
from envbuild.base.resources import templates_dir
from envbuild.image import paths
from envbuild.knowledge.lock import Lock
from envbuild.knowledge.oslock import OsLock
from envbuild.plan.blocks import STEPS_SOURCE, Copy, Label, Stage
from envbuild.resolve.resolver import EnvVar


@dataclass(frozen=True)
class ImageFacts:
    """What the rendered files say about the image in their comments and headers: the only
    view of the request a layout template has."""

    tag: str
    image_repo: str
    stack: str
    torch: str
    cuda: str
    python: str
    deepspeed: str
    gpu: str
    sm: str
    arch_list: str
    arch: str
    host_cpu: str
    ops: tuple[str, ...]
    lock_sha256: Optional[str]
    local_only: bool  # no registry serves image_repo: Singularity.def cannot pull its From:
    os_lock: Optional[OsLock] = None  # the OS lock, when it pins some stage
    os_locked: tuple[str, ...] = ()  # the stages it pins

    @property
    def image_ref(self) -> str:
        return f"{self.image_repo}:{self.tag}"


@dataclass(frozen=True)
class LayerFacts:
    """What a layer image (`envbuild extend`) adds, for its layouts' comments."""

    requirements: tuple[str, ...]
    lock_sha256: str
    base: str  # the stack image it starts from (by digest where known)
    stack_tag: str


STACK_LAYOUTS = (("Dockerfile", "docker/Dockerfile.j2"), ("Singularity.def", "singularity/Singularity.def.j2"),
                 ("Singularity.standalone.def", "singularity/Singularity.standalone.def.j2"))
EXTENSION_LAYOUTS = (("Dockerfile", "docker/Dockerfile.extend.j2"),
                     ("Singularity.def", "singularity/Singularity.extend.def.j2"))
MANIFEST_NAME = "manifest.json"  # the build directory's copy of the plan's manifest
# What a build writes beside the rendered files stays out of the context, and so do the temporary
# files of a render killed half-way (envbuild/base/files.py names them; the next render removes them).
DOCKERIGNORE = "build.log\n*.sif\n**/.*.envbuild-tmp-*\n**/.*.envbuild-old-*\n"


@dataclass(frozen=True)
class BuildPlan:
    """Everything the renderers need, for every kind of image: a stack image
    (:func:`stack_plan`) or a layer on one (:func:`layer_plan`). A layout
    template sees this and nothing else."""

    image: ImageFacts
    builder: Optional[Stage]  # None: the image is one stage on an existing image (a layer)
    runtime: Stage
    toolchain_home: Optional[str]  # where the builder has nvcc (None: it has none)
    kept_toolchain_home: Optional[str]  # the same, when the runtime keeps it
    image_env: tuple[EnvVar, ...]  # the final image's environment, stack-wide part first
    image_files: Copy
    image_package: Copy  # the in-image package, one directory
    manifest_file: Copy
    labels: Label
    manifest: dict
    build_files: dict[str, Path] = field(default_factory=dict)  # build dir path -> the file it copies
    generated_files: dict[str, str] = field(default_factory=dict)  # build dir path -> its text (the lock's parts)
    dropped: tuple[str, ...] = ()  # build-only packages the final image drops (ninja)
    node_env: tuple = ()  # defaults the node decides at start-up (EnvDefault), with their conditions
    layouts: tuple[tuple[str, str], ...] = STACK_LAYOUTS  # build-directory file -> its layout template
    layer: Optional[LayerFacts] = None
    lock: Optional[Lock] = field(default=None, repr=False)  # the stack's lock (None: not hash-locked)

    @property
    def base_env(self) -> tuple[EnvVar, ...]:
        return tuple(e for e in self.image_env if e.layer == "base")

    @property
    def gpu_env(self) -> tuple[EnvVar, ...]:
        return tuple(e for e in self.image_env if e.layer == "gpu")

    @property
    def tag(self) -> str:
        return self.image.tag

    @property
    def gpu_env_notes(self) -> tuple[str, ...]:
        """One line per late-layer default: what it is for, what it costs, where from."""
        return tuple(f"{e.name}={e.value}: {e.reason}" + (f". Cost: {e.cost}" if e.cost else "") + f" [{e.source}]"
                     for e in self.gpu_env)

    @property
    def node_env_notes(self) -> tuple[str, ...]:
        """One line per default the node decides at start-up, with its condition."""
        return tuple(f"{d.name}={d.value} where {json.dumps(d.node.model_dump(exclude_none=True))}: {d.reason}"
                     for d in self.node_env)

    def apptainer_final(self) -> dict[str, list[str]]:
        """The final stage's Apptainer sections: the runtime stage plus the image's files."""
        sections = self.runtime.apptainer()
        sections["files"] = sections["files"] + [*self.image_files.apptainer()["files"],
                                                 *self.image_package.apptainer()["files"],
                                                 *self.manifest_file.apptainer()["files"]]
        return sections


def build_files(steps, image_files: Copy, qemu: bool = False, generated=(), package: bool = True) -> dict[str, Path]:
    """Build-directory path -> the file it is a copy of (templates/files, or the in-image
    package); the `generated` paths (the lock's parts) are written from text, not copied."""
    files = templates_dir() / "files"
    stub = qemu_cpu_stub()
    emulation = {f"{QEMU_CPU_SYSFS[0]}/{p.relative_to(stub).as_posix()}": p
                 for p in sorted(stub.rglob("*")) if p.is_file()} if qemu else {}
    package_dir = Path(image_package.__file__).parent
    out: dict[str, Path] = {f"envbuild/lib/{paths.PACKAGE}/{name}": package_dir / name
                            for name in image_package.modules()} if package else {}
    out.update(emulation)
    for copy in [f for step in steps for f in step.files] + list(image_files.files):
        name = posixpath.basename(copy.source)
        if copy.source in generated or copy.source == MANIFEST_NAME:  # written from the plan
            continue
        if copy.source.startswith(STEPS_SOURCE + "/"):  # a bash step, or the build stage's Python
            out[copy.source] = buildsteps.path(name) if name in buildsteps.SCRIPTS else files / "steps" / name
        else:
            out[copy.source] = files / name
    return out
