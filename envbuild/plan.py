"""The build plan: every fact the renderers need, derived once from a Resolution.

A resolution says *what* to build (a stack, a GPU, ops, defaults); the plan says *how*:
the stages with their base images and steps, which files each step needs, what the runtime
stage takes from the builder, the image's environment, labels and manifest. Each derived
fact is decided here and only here (where the CUDA toolchain lives, whether it is kept, the
image's PATH), and the renderers -- a Jinja layout per output format -- read nothing else.

Every building block renders itself to every format, with the format as an argument (the
hpccm idea): ``Step``, ``Copy``, ``Environment`` and ``Label`` each have one method per
format, and a ``Stage`` puts them in that format's order. A new output format is one method
per building block plus a layout template.

Examples
--------
>>> step = Step("venv", ("/usr/bin/python3.11",), files=(FileCopy("envbuild/steps/venv.sh", "/opt/envbuild-setup/venv.sh"),))
>>> print(step.render("docker"))
COPY envbuild/steps/venv.sh /opt/envbuild-setup/venv.sh
RUN bash /opt/envbuild-setup/venv.sh /usr/bin/python3.11
>>> step.render("apptainer")
{'files': ['envbuild/steps/venv.sh /opt/envbuild-setup/venv.sh'], 'post': ['bash /opt/envbuild-setup/venv.sh /usr/bin/python3.11']}
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from pathlib import Path
import shlex
from dataclasses import dataclass, field, fields, replace
from typing import Optional

from . import __version__
from . import image as image_package
from . import rules
from .emulation import PLATFORM_MACHINES, QEMU_CPU_SYSFS, qemu_cpu_stub
from .image import paths
from .resources import templates_dir
from .extend import Extension
from .lock import Lock
from .oslock import OsLock, archive_url, stage_part
from .errors import EnvbuildError
from .registry import CONTENT_TAG_DIGITS, READABLE_TAG_MAX, TAG_MAX, check_readable_tag, local_only
from .resolve import EnvVar, Resolution

DOCKER = "docker"
APPTAINER = "apptainer"
FORMATS = (DOCKER, APPTAINER)

SYSTEM_PATH = paths.SYSTEM_PATH
STEPS_SOURCE = "envbuild/steps"  # build-directory folder of the step scripts (templates/files/steps)
PIP_SECRETS = ("ca_cert", "pip_index_url")
APT_SECRETS = ("ca_cert", "apt_mirror")
FABRIC_SECRETS = ("ca_cert", "pip_index_url", "source_mirror")
FABRIC_HEADERS = "fabric/headers.txt"  # under envbuild/ in the build directory: the fabric's pip header lines
# Apptainer sections in the order a definition file lists them.
APPTAINER_SECTIONS = ("files", "post", "environment", "labels")
# The nvidia-* wheels' libraries, each group its own layer of the final image (layers.sh): a pull
# downloads them in parallel, and stacks with the same CUDA wheels share them.
LAYERS_DIR = "/opt/envbuild-layers"
# Which layer each package directory of site-packages/nvidia goes in: shell globs, the first
# match wins, `other` takes the rest (nvidia-*-cu13 wheels' directory names, read from the wheels).
CUDA_LAYER_PACKAGES = (
    ("cuda", ("cu1[0-9]", "cublas", "cuda_*", "cufft", "cufile", "curand", "cusolver", "cusparse", "nvjitlink",
              "nvtx")),
    ("cudnn", ("cudnn",)),
    ("nccl", ("nccl", "nvshmem")),
    ("other", ("*",)),
)
CUDA_LAYERS = tuple(layer for layer, _ in CUDA_LAYER_PACKAGES)
# The guard (PIP_CONSTRAINT): the distributions pinned as built, an extended regular expression
# over `pip freeze` lines (deepspeed.sh): what the pre-built ops were compiled against.
GUARD_PACKAGES = "torch|torchvision|triton|deepspeed|nvidia-[a-z0-9._-]+|cuda-[a-z0-9._-]+"
EXTENSION_SPEC = "extensions.json"  # under envbuild/ in the build directory: what extensions.py builds
EXTENSION_CACHE_ID = "envbuild-ext"  # the BuildKit cache mount shared by every build of this machine
# Bumped when extensions.py changes how a wheel is made: every cached wheel is then rebuilt.
EXTENSION_BUILD_RECIPE = 2


def cache_mount(cache_id: str, target: str) -> str:
    """A BuildKit cache mount as every envbuild build (and `ext-cache`) asks for it: `locked`, so
    two builds never write one cache at once.

    >>> cache_mount(EXTENSION_CACHE_ID, "/var/cache/envbuild-ext")
    '--mount=type=cache,id=envbuild-ext,target=/var/cache/envbuild-ext,sharing=locked'
    """
    return f"--mount=type=cache,id={cache_id},target={target},sharing=locked"


def guard_packages(extensions=()) -> str:
    """The guard's pattern, with the CUDA extensions pinned like torch (any spelling pip freeze uses).

    >>> guard_packages() == GUARD_PACKAGES
    True
    >>> class Ext: name = "flash-attn"
    >>> guard_packages([Ext()]).endswith("|flash[-_.]attn")
    True
    """
    return GUARD_PACKAGES + "".join("|" + "[-_.]".join(e.name.split("-")) for e in extensions)


def cuda_layer_args() -> tuple[str, ...]:
    """layers.sh's LAYER=GLOB,GLOB arguments.

    >>> cuda_layer_args()[1:]
    ('cudnn=cudnn', 'nccl=nccl,nvshmem', 'other=*')
    """
    return tuple(f"{layer}={','.join(globs)}" for layer, globs in CUDA_LAYER_PACKAGES)
# Variables that name directories inside the image: the host's value never wins for them.
IMAGE_OWNED = ("VIRTUAL_ENV", "CUDA_HOME")


def _render(block, fmt: str, **kw):
    if fmt not in FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; known: {', '.join(FORMATS)}")
    return getattr(block, fmt)(**kw)


# ---------------------------------------------------------------- building blocks


@dataclass(frozen=True)
class FileCopy:
    """A file of the build directory and where it goes in the image."""

    source: str
    target: str


@dataclass(frozen=True)
class Copy:
    """Files copied into the image (COPY in Docker, %files in Apptainer)."""

    files: tuple[FileCopy, ...]

    def render(self, fmt: str):
        return _render(self, fmt)

    def docker(self) -> str:
        if len(self.files) == 1:
            return f"COPY {self.files[0].source} {self.files[0].target}"
        by_dir: dict[str, list[str]] = {}
        lines = []
        for f in self.files:
            if posixpath.basename(f.source) == posixpath.basename(f.target):
                by_dir.setdefault(posixpath.dirname(f.target) + "/", []).append(f.source)
            else:  # a renamed file keeps its own COPY (grouping would drop the new name)
                lines.append(f"COPY {f.source} {f.target}")
        return "\n".join([*(f"COPY {' '.join(sources)} {target}" for target, sources in by_dir.items()), *lines])

    def apptainer(self) -> dict[str, list[str]]:
        return {"files": [f"{f.source} {f.target}" for f in self.files]}


@dataclass(frozen=True)
class Step:
    """One build command: a step script run with arguments, the files it needs copied in
    just before it (so editing one step's script re-runs only that step), inline
    environment for this command only (never persisted), and the secrets it may read."""

    name: str
    args: tuple[str, ...]
    files: tuple[FileCopy, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    secrets: tuple[str, ...] = ()
    comment: str = ""
    # Docker only, --qemu: build-directory folders bound over system paths for this RUN (the stub
    # CPU sysfs torch needs under qemu-user); nothing of them reaches a layer.
    emulation_binds: tuple[FileCopy, ...] = ()
    # Docker only: BuildKit cache mounts (id, target) that outlive the layer: the compiled extension
    # wheels, keyed inside by what determines them (extensions.py). Apptainer builds without them.
    caches: tuple[tuple[str, str], ...] = ()

    @property
    def command(self) -> str:
        return " ".join([f"bash {paths.SETUP_DIR}/{self.name}.sh", *([shlex.join(self.args)] if self.args else [])])

    @property
    def env_words(self) -> list[str]:
        return [f"{k}={shlex.quote(v)}" for k, v in self.env]

    def render(self, fmt: str, binds: tuple[str, ...] = ()):
        return _render(self, fmt, binds=binds)

    def docker(self, binds: tuple[str, ...] = ()) -> str:
        lines = [f"# {self.comment}"] if self.comment else []
        if self.files:
            lines.append(Copy(self.files).docker())
        mounts = [*(f"--mount=type=bind,source={b.source},target={b.target}" for b in self.emulation_binds),
                  *binds, *(cache_mount(cid, target) for cid, target in self.caches),
                  *(f"--mount=type=secret,id={sid}" for sid in self.secrets)]
        words = ([" ".join(mounts)] if mounts else []) + self.env_words + [self.command]
        lines.append("RUN " + " \\\n    ".join(words))
        return "\n".join(lines)

    def apptainer(self, binds: tuple[str, ...] = ()) -> dict[str, list[str]]:
        post = ([f"# {self.comment}"] if self.comment else []) + [" ".join([*self.env_words, self.command])]
        return {"files": Copy(self.files).apptainer()["files"], "post": post}


@dataclass(frozen=True)
class Environment:
    """Environment variables of the image (ENV in Docker; %environment in Apptainer, where a
    value the user already set wins). PATH is the image's own directories, then the
    system's -- in Apptainer the host's PATH takes the system's place."""

    variables: tuple[EnvVar, ...]
    comments: tuple[str, ...] = ()

    def render(self, fmt: str):
        return _render(self, fmt)

    def docker(self) -> str:
        if not self.variables:
            return ""
        lines = [f"# {c}" for c in self.comments]
        pairs = [f"{e.name}={json.dumps(e.value, ensure_ascii=False)}" for e in self.variables]
        return "\n".join([*lines, "ENV " + " \\\n    ".join(pairs)])

    def apptainer(self) -> dict[str, list[str]]:
        out = []
        for e in self.variables:
            if e.name == "PATH":
                own, system = split_path(e.value)
                out.append(f'PATH="{own}:${{PATH:-{system}}}"')
            elif e.name in IMAGE_OWNED:  # a host's value (module load cuda) would point outside the image
                out.append(f'{e.name}="{e.value}"')
            else:
                out.append(f'{e.name}="${{{e.name}:-{e.value}}}"')
            out.append(f"export {e.name}")
        return {"environment": out}


@dataclass(frozen=True)
class Label:
    """Image labels (LABEL in Docker, %labels in Apptainer)."""

    pairs: tuple[tuple[str, str], ...]

    def render(self, fmt: str):
        return _render(self, fmt)

    def docker(self) -> str:
        return "LABEL " + " \\\n      ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in self.pairs)

    def apptainer(self) -> dict[str, list[str]]:
        return {"labels": [f"{k} {v}" for k, v in self.pairs]}


def split_path(value: str) -> tuple[str, str]:
    """PATH -> (the image's own directories, the system's).

    >>> split_path("/opt/venv/bin:/usr/local/cuda/bin:" + SYSTEM_PATH)[0]
    '/opt/venv/bin:/usr/local/cuda/bin'
    """
    own = value.removesuffix(":" + SYSTEM_PATH)
    return own, SYSTEM_PATH


# ---------------------------------------------------------------- stages


@dataclass(frozen=True)
class Stage:
    """A build stage: a base image, the environment its steps see, and its steps. A runtime
    stage also says what it takes from the builder; `reuses_builder` (--keep-toolchain) means
    the runtime *is* the builder, compilers included -- one property that each format
    renders its own way (Docker: FROM builder; Apptainer, which cannot start from a stage:
    the builder's base, its OS step again, and the builder's products copied)."""

    name: str
    base: str
    steps: tuple[Step, ...]
    env: tuple[EnvVar, ...] = ()
    from_builder: tuple[str, ...] = ()  # directories copied from the builder stage
    binds_context: tuple[FileCopy, ...] = ()  # build-directory folders its steps read (bind mounts)
    reuses_builder: bool = False
    platform: Optional[str] = None  # an OCI platform (linux/arm64) when it is not the build host's
    after_copy: tuple[Step, ...] = ()  # steps that need what the stage took from the builder

    def render(self, fmt: str):
        return _render(self, fmt)

    def docker(self) -> str:
        if self.reuses_builder:
            return f"FROM builder AS {self.name}"
        platform = f"--platform={self.platform} " if self.platform else ""
        head = [f"FROM {platform}{self.base} AS {self.name}", 'SHELL ["/bin/bash", "-o", "pipefail", "-c"]']
        if self.env:
            head.append(Environment(self.env).docker())
        # Bound from the build context, not the builder: this stage does not wait for the
        # builder, and re-runs only when the scripts it runs change.
        binds = tuple(f"--mount=type=bind,source={b.source},target={b.target}" for b in self.binds_context)
        blocks = ["\n".join(head), *(step.docker(binds=binds) for step in self.steps)]
        if self.from_builder:
            blocks.append("\n".join(f"COPY --from=builder {d} {d}" for d in self.from_builder))
        blocks += [step.docker(binds=binds) for step in self.after_copy]
        return "\n".join(blocks[:2]) + "".join("\n\n" + b for b in blocks[2:])

    def apptainer(self) -> dict[str, list[str]]:
        sections: dict[str, list[str]] = {"from_builder": [], "files": [], "post": ["set -e"]}
        if self.platform:  # a definition file cannot name a platform: refuse to build for another one
            machine = PLATFORM_MACHINES[self.platform]
            sections["post"].append(
                f'[ "$(uname -m)" = {machine} ] || {{ echo "this image is for {self.platform}: apptainer build '
                f'--arch {self.platform.split("/")[1]} on an {machine} host (or under qemu-user emulation)" >&2; '
                f'exit 1; }}')
        for e in self.env:
            sections["post"].append(f'export {e.name}="{e.value}"')
        for step in (*self.steps, *self.after_copy):  # %files (the builder's too) precede %post
            for key, lines in step.apptainer().items():
                sections[key] += lines
        # Apptainer has no build-time bind mounts: what Docker binds is copied in, then removed.
        sections["from_builder"] = [f"{d} {d}" for d in self.from_builder]
        sections["files"] = [f"{b.source} {b.target}" for b in self.binds_context] + sections["files"]
        if paths.SETUP_DIR in self.from_builder or any(b.target == paths.SETUP_DIR for b in self.binds_context):
            sections["post"].append(f"rm -rf {paths.SETUP_DIR}")
        return sections


# ---------------------------------------------------------------- the plan


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
class ExtensionFacts:
    """What an extension image adds, for its layouts' comments."""

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
# files of a render killed half-way (envbuild/files.py names them; the next render removes them).
DOCKERIGNORE = "build.log\n*.sif\n**/.*.envbuild-tmp-*\n**/.*.envbuild-old-*\n"


@dataclass(frozen=True)
class BuildPlan:
    """Everything the renderers need, for every kind of image: a stack image
    (:func:`stack_plan`) or an extension layer on one (:func:`extension_plan`). A layout
    template sees this and nothing else."""

    image: ImageFacts
    builder: Optional[Stage]  # None: the image is one stage on an existing image (an extension)
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
    extension: Optional[ExtensionFacts] = None
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


def _step_files(*names: str) -> tuple[FileCopy, ...]:
    return tuple(FileCopy(f"{STEPS_SOURCE}/{n}", f"{paths.SETUP_DIR}/{n}") for n in names)


def stack_plan(resolution: Resolution) -> BuildPlan:
    """Derive the whole build of a stack image from a resolution: the one place each fact is decided."""
    facts, stack, request = resolution.facts, resolution.stack, resolution.request
    os_release = facts.family
    toolchain = facts.toolchain
    python_pkg = os_release.python[stack.python]
    needs = sorted({n for o in resolution.ops for n in facts.ops[o].needs})
    builder_pkgs = [p.replace("{python}", python_pkg) for p in os_release.builder_packages]
    runtime_pkgs = [p.replace("{python}", python_pkg) for p in os_release.runtime_packages]
    if not request.no_compiler:  # torch.compile compiles C at run time; DeepSpeed still cannot (no ninja/nvcc)
        runtime_pkgs += [p.replace("{python}", python_pkg) for p in os_release.compiler_packages]
    for need in needs:  # the OS's packages; a need the toolchain provides (curand) brings none
        builder_pkgs += os_release.capabilities.get(need, {}).get("builder", [])
        runtime_pkgs += os_release.capabilities.get(need, {}).get("runtime", [])
    fabric = resolution.fabric
    for need in (fabric.needs if fabric and fabric.build else ()):  # a fabric built from source
        builder_pkgs += [p for p in os_release.capabilities[need].get("builder", []) if p not in builder_pkgs]
    if request.keep_toolchain:  # the final image is the builder: the fabric's user space goes in there
        builder_pkgs += [p for p in fabric_packages(resolution) if p not in builder_pkgs]

    # The CUDA toolchain, decided once: the base image brings it, or a step installs it only
    # when something needs nvcc.
    installs_toolchain = toolchain.install is not None and resolution.nvcc_reason is not None
    toolchain_home = toolchain.cuda_home if (toolchain.install is None or installs_toolchain) else None
    kept_toolchain_home = toolchain_home if request.keep_toolchain else None

    # The lock (matrices/locks): each step installs its part with pip --require-hashes --no-deps.
    lock = resolution.lock
    ds_build_only = tuple(sorted(facts.ds_build_only))
    if lock:
        venv_install = ("--require-hashes", "--no-deps", "-r", f"{paths.SETUP_DIR}/{LOCK_PARTS['venv']}")
        venv_files = (FileCopy(f"envbuild/{LOCK_PARTS['venv']}", f"{paths.SETUP_DIR}/{LOCK_PARTS['venv']}"),)
    else:
        venv_install = (f"torch=={stack.torch}", f"torchvision=={resolution.torchvision}")
        venv_files = ()
    apt_env = (("ENVBUILD_APT_HOSTS", " ".join(os_release.mirror_hosts)),)
    os_step = Step("os", tuple(builder_pkgs), files=_step_files("lib.sh", "os.sh"), env=apt_env,
                   secrets=APT_SECRETS,
                   comment=f"{python_pkg} with headers and a host compiler for the DeepSpeed ops")
    os_step = _os_locked(os_step, resolution, "builder")
    steps = [
        os_step,
        Step("venv", (f"/usr/bin/{python_pkg}",), files=_step_files("venv.sh"),
             comment="one virtual environment holds the whole stack"),
        Step("torch", (resolution.torch_index or "-", *venv_install),
             files=_step_files("torch.sh") + venv_files, secrets=(*PIP_SECRETS, "torch_index_url"),
             comment=f"torch first: DeepSpeed's ops compile against it (CUDA {stack.cuda}"
                     f"{', ' + resolution.torch_index if resolution.torch_index else ', the PyPI default wheel'})"
                     + ("; the whole venv but DeepSpeed, from the stack's lock, every hash checked" if lock else
                        "; NOT hash-locked: this stack has no lock in matrices/locks")),
    ]
    if installs_toolchain:
        install = toolchain.install
        if lock and lock.sections.get("toolchain"):
            part = f"{paths.SETUP_DIR}/{LOCK_PARTS['toolchain']}"
            toolchain_install = ("--require-hashes", "--no-deps", "-r", part)
            toolchain_files = (FileCopy(f"envbuild/{LOCK_PARTS['toolchain']}", part),)
        else:
            toolchain_install = (f"{install.package}[{','.join(install.extras_for(stack.cuda_toolkit))}]=={stack.cuda_toolkit}",)
            toolchain_files = ()
        steps.append(Step("cuda-toolkit", (install.prefix, toolchain.cuda_home, *toolchain_install),
                          files=_step_files("cuda-toolkit.sh") + toolchain_files, secrets=PIP_SECRETS,
                          comment=f"nvcc {stack.cuda_toolkit} from PyPI, outside the venv ({resolution.nvcc_reason})"))
    if fabric and fabric.build:  # before DeepSpeed: another DeepSpeed or op set keeps this (minutes-long) layer
        steps.append(_fabric_build_step(fabric, toolchain_home))
    ds_env = [("DS_ACCELERATOR", "cuda"), ("DS_BUILD_OPS", "0")]
    ds_env += [(f"DS_BUILD_{facts.ops[o].env}", "1") for o in resolution.ops]
    ds_env += [("TORCH_CUDA_ARCH_LIST", resolution.arch_list), ("ENVBUILD_CPU_TARGET", resolution.cpu_target),
               ("ENVBUILD_CPU_FLAG", facts.cpu_target.flag), ("ENVBUILD_CPU_SIMD", facts.cpu_target.simd)]
    if toolchain_home:
        ds_env.append(("CUDA_HOME", toolchain_home))
        no_audit = toolchain.audit_missing(stack.cuda_toolkit)
        if no_audit:  # said in the build log and the manifest, not skipped in silence
            ds_env.append(("ENVBUILD_SASS_AUDIT", f"skipped: {no_audit}"))
    if not lock:  # with a lock they are in the venv already, at the locked versions
        ds_env.append(("ENVBUILD_DS_BUILD_REQUIRES", " ".join(facts.ds_build_requires)))
    ds_part = f"{paths.SETUP_DIR}/{LOCK_PARTS['deepspeed']}"
    steps.append(Step("deepspeed", (ds_part if lock else f"deepspeed=={stack.deepspeed}", *resolution.ops),
                      env=tuple(ds_env),
                      files=_step_files("deepspeed.sh", "cc-wrapper.sh", "verify_ops.py", "sass_audit.py")
                      + ((FileCopy(f"envbuild/{LOCK_PARTS['deepspeed']}", ds_part),) if lock else ()),
                      secrets=PIP_SECRETS,
                      comment="DeepSpeed with its ops pre-built for the target arches; the build "
                              "fails unless DeepSpeed recorded every op for cuda"))
    extension_spec = _extension_spec(resolution, toolchain_home) if resolution.extensions else None
    if extension_spec:  # after DeepSpeed: an image without extensions shares every layer before
        steps.append(Step("extensions", (f"{paths.SETUP_DIR}/{EXTENSION_SPEC}",),
                          files=_step_files("extensions.sh", "nvcc-arch.sh", "extensions.py", "sass_audit.py")
                          + (FileCopy(f"envbuild/{EXTENSION_SPEC}", f"{paths.SETUP_DIR}/{EXTENSION_SPEC}"),),
                          secrets=PIP_SECRETS, caches=((EXTENSION_CACHE_ID, paths.EXTENSION_CACHE),),
                          comment=f"CUDA extensions {', '.join(e.name for e in resolution.extensions)} compiled "
                                  f"from their sdists for {resolution.arch_list} only, cached by what determines "
                                  f"the wheel; the build fails unless each imports and carries SASS for it"))
    finish_env = [("ENVBUILD_CONSTRAINTS", paths.CONSTRAINTS),
                  ("ENVBUILD_GUARD_PACKAGES", guard_packages(resolution.extensions))]
    if not request.keep_toolchain and ds_build_only:
        finish_env.append(("ENVBUILD_DS_BUILD_ONLY", " ".join(ds_build_only)))
    steps.append(Step("finish", (), env=tuple(finish_env), files=_step_files("finish.sh", "pip_check.py"),
                      comment="the guard pins what was compiled against; the build-only packages leave; pip check"))
    steps.append(Step("layers", (paths.VENV, LAYERS_DIR, *cuda_layer_args()), files=_step_files("layers.sh"),
                      comment="the CUDA wheels' libraries out of the venv into layers of their own "
                              "(parallel pulls; shared by stacks with the same CUDA wheels)"))
    venv_env = (EnvVar("VIRTUAL_ENV", paths.VENV, "", "", "base"),
                EnvVar("PATH", f"{paths.VENV}/bin:${{PATH}}", "", "", "base"))
    # x86_64 images keep the build host's platform (CI builds them on x86 runners); others name theirs.
    platform = resolution.platform if resolution.arch != "x86_64" else None
    emulation = (FileCopy(*QEMU_CPU_SYSFS),) if request.qemu and platform else ()
    if emulation:  # only the step that imports torch (DeepSpeed's setup.py): the others keep their cache
        steps = [replace(step, emulation_binds=emulation) if step.name == "deepspeed" else step for step in steps]
    builder = Stage("builder", resolution.base_images["builder"], tuple(steps), env=venv_env, platform=platform)

    # The runtime stage, derived from the builder: --keep-toolchain is this one branch.
    if request.keep_toolchain:
        kept = (LAYERS_DIR, paths.VENV, paths.SETUP_DIR, paths.CONSTRAINTS, *((paths.BUILT,) if extension_spec else ()))
        if installs_toolchain:
            kept += (toolchain.install.prefix,)
        again = replace(os_step, files=(), comment="--keep-toolchain: the compilers of the builder base stay.")
        runtime = Stage("runtime", resolution.base_images["builder"], (again,),
                        from_builder=kept, reuses_builder=True, platform=platform)
    else:
        runtime_os = _os_locked(
            Step("os", tuple(runtime_pkgs), files=(), env=apt_env, secrets=APT_SECRETS,
                 comment=f"{python_pkg} runtime only: no compiler, no headers" if request.no_compiler
                 else f"{python_pkg} runtime, with a C compiler and Python headers for torch.compile "
                      f"(no nvcc, no ninja: DeepSpeed cannot JIT)"), resolution, "runtime")
        built = fabric.build if fabric else None
        runtime = Stage("runtime", resolution.base_images["runtime"], (runtime_os, *_fabric_steps(resolution)),
                        from_builder=(*(f"{LAYERS_DIR}/{layer}" for layer in CUDA_LAYERS), paths.VENV,
                                      paths.CONSTRAINTS, *((built.prefix, built.plugin_prefix) if built else ()),
                                      *((paths.BUILT,) if extension_spec else ())),
                        binds_context=(FileCopy(STEPS_SOURCE, paths.SETUP_DIR),), platform=platform,
                        after_copy=(_fabric_install_step(fabric),) if built else ())

    image_env = _image_env(resolution, kept_toolchain_home)
    # The image's own files: the entry scripts, and the in-image package (envbuild/image,
    # stdlib only) as /opt/envbuild/lib/envbuild_image.
    image_files = Copy(tuple(FileCopy(f"envbuild/{name}", f"{paths.HOME}/{name}") for name in IMAGE_FILES)
                       + ((FileCopy(f"envbuild/{posixpath.basename(paths.LOCK)}", paths.LOCK),) if lock else ())
                       + ((FileCopy(OS_LOCK_FILE, paths.OS_LOCK),) if resolution.os_lock else ())
                       + tuple(FileCopy(f"envbuild/{f.vendored}", f.path) for f in (fabric.files if fabric else ())))
    package = Copy((FileCopy(f"envbuild/lib/{paths.PACKAGE}", f"{paths.LIB}/{paths.PACKAGE}"),))
    generated = {**_lock_files(lock), **_os_lock_files(resolution)}
    if extension_spec:
        generated[f"envbuild/{EXTENSION_SPEC}"] = json.dumps(extension_spec, indent=2, sort_keys=True) + "\n"
    if fabric and fabric.build and fabric.build.headers:
        generated[f"envbuild/{FABRIC_HEADERS}"] = "".join(f"{line}\n" for line in fabric.build.headers)
    plan = BuildPlan(
        image=_image_facts(resolution), builder=builder, runtime=runtime, toolchain_home=toolchain_home,
        kept_toolchain_home=kept_toolchain_home, image_env=image_env, image_files=image_files,
        image_package=package,
        manifest_file=Copy((FileCopy(MANIFEST_NAME, paths.MANIFEST),)),
        labels=Label(tuple(_labels(resolution))), manifest={},
        build_files=_build_files(steps, image_files, qemu=bool(emulation), generated=generated),
        generated_files=generated,
        dropped=ds_build_only if not request.keep_toolchain else (),
        node_env=tuple(resolution.node_env), lock=lock,
    )
    object.__setattr__(plan, "manifest", _manifest(plan, resolution))
    return plan


def _extension_spec(resolution: Resolution, cuda_home: Optional[str]) -> dict:
    """What extensions.py builds, and the cache key of each wheel: everything that determines the
    compiled file (the sdist by hash, torch's exact build, nvcc, Python, CPU architecture, the
    arch list, the build variables, the recipe), so a second GPU with the same arch list, a
    rebuild or another stack with the same torch build reuses it, and any change rebuilds it."""
    stack, lock = resolution.stack, resolution.lock
    torch_build = (hashlib.sha256(next(p.block for p in lock.sections["venv"] if p.key == "torch").encode()).hexdigest()
                   if lock else f"torch=={stack.torch}+cu{stack.cuda} from {resolution.torch_index or 'PyPI'}")
    arches = [a for a in resolution.arch_list.split(";") if a]
    out = []
    for ext in resolution.extensions:
        arch_value = ";".join(a.replace(".", "").replace("+PTX", "") for a in arches) if ext.arch_env else ""
        build_env = {**ext.build_env, **({ext.arch_env: arch_value} if ext.arch_env else {})}
        patches = [{"file": p.file, "old": p.old, "new": p.new, "source": p.source}
                   for p in rules.extension_patches(ext, stack)]
        determines = {"recipe": EXTENSION_BUILD_RECIPE, "name": ext.name, "version": ext.version,
                      "sdist_sha256": ext.sdist.sha256, "torch": torch_build, "cuda": stack.cuda,
                      "nvcc": stack.cuda_toolkit or resolution.base_images["builder"], "python": stack.python, "cpu_arch": resolution.arch,
                      "arch_list": resolution.arch_list, "build_env": build_env,
                      **({"patches": patches} if patches else {})}
        key = hashlib.sha256(json.dumps(determines, sort_keys=True).encode()).hexdigest()[:16]
        out.append({"name": ext.name, "version": ext.version, "sdist": ext.sdist.model_dump(),
                    "packages": ext.packages, "modules": ext.modules, "requires": ext.requires,
                    "build_only": ext.build_only, "build_requires": ext.build_requires, "build_env": build_env,
                    "memory_per_job_gib": ext.memory_per_job_gib, "nvcc_threads": ext.nvcc_threads,
                    "patches": patches, "cache_key": key, "determines": determines})
    return {"arch_list": resolution.arch_list, "cuda_home": cuda_home or "", "cache": paths.EXTENSION_CACHE,
            "record": paths.EXTENSIONS_RECORD, "lock": paths.EXTENSIONS_LOCK, "locked": lock is not None,
            "extensions": out}


def _image_facts(resolution: Resolution) -> ImageFacts:
    stack, gpu = resolution.stack, resolution.gpu
    return ImageFacts(tag=resolution.tag, image_repo=resolution.request.image_repo, stack=stack.id,
                      torch=stack.torch, cuda=stack.cuda, python=stack.python, deepspeed=stack.deepspeed,
                      gpu=gpu.name, sm=gpu.sm, arch_list=resolution.arch_list, arch=resolution.arch,
                      host_cpu=gpu.host_cpu or resolution.arch, ops=tuple(resolution.ops),
                      lock_sha256=resolution.lock.sha256 if resolution.lock else None,
                      local_only=local_only(resolution.request.image_repo), os_lock=resolution.os_lock,
                      os_locked=resolution.os_locked)


def extension_plan(resolution: Resolution, extension: Extension, base: str) -> BuildPlan:
    """An extension image: one stage on the stack image `base` (by digest where known) that
    installs the extension lock with hash checking, runs pip check and imports each package.
    Every heavy layer is the stack image's; the manifest is the stack's plus what was added."""
    stack = stack_plan(resolution)
    tag = f"{resolution.tag}-ext-{extension.name}"
    room = READABLE_TAG_MAX - len(resolution.tag) - len("-ext-")
    if len(tag) > READABLE_TAG_MAX:  # the one tag rule, said in terms of what the user chose
        fix = (f"nearest valid choice: --name {extension.name[:room].rstrip('-.')}" if room >= 3 else
               "the stack tag leaves no room: drop a non-default option (--env, --cpu-target, --ds-ops, "
               "--keep-toolchain) from the stack image")
        raise EnvbuildError(f"--name '{extension.name}' makes the extension's tag {len(tag)} characters "
                            f"('{tag}'); a readable tag has at most {READABLE_TAG_MAX} (Docker's limit is "
                            f"{TAG_MAX}, and the content tag adds {CONTENT_TAG_DIGITS + 1}); {fix}.")
    check_readable_tag(tag, "the extension's tag")
    image = replace(stack.image, tag=tag)
    step = Step("extend", (paths.EXTEND_LOCK, paths.MANIFEST, *extension.top_level),
                files=(*_step_files(*EXTENSION_STEP_FILES), FileCopy(EXTEND_LOCK_NAME, paths.EXTEND_LOCK),
                       FileCopy(MANIFEST_NAME, paths.MANIFEST)),
                secrets=PIP_SECRETS,
                comment=f"{', '.join(extension.requirements)}: from the extension lock (every hash checked), "
                        f"then pip check and an import of each package")
    manifest = {**stack.manifest, "tag": tag, "image": image.image_ref,
                "extend": {"from": base, "stack_tag": resolution.tag, "requirements": list(extension.requirements),
                           "source": extension.source, "top_level": list(extension.top_level),
                           "lock": {"path": paths.EXTEND_LOCK, "sha256": extension.lock.sha256,
                                    "packages": len(extension.lock.sections["venv"]),
                                    "exclude_newer": extension.exclude_newer},
                           "imports": {}}}
    labels = Label((("org.opencontainers.image.title", f"envbuild {tag}"),
                    ("org.opencontainers.image.version", tag),
                    ("org.opencontainers.image.base.name", base),
                    ("io.envbuild.extends", resolution.tag),
                    ("io.envbuild.extend-lock", f"sha256:{extension.lock.sha256}"),
                    ("io.envbuild.extend-requirements", " ".join(extension.requirements))))
    generated = {EXTEND_LOCK_NAME: extension.lock.text}
    return BuildPlan(
        image=image, builder=None, runtime=Stage("extend", base, (step,)), toolchain_home=None,
        kept_toolchain_home=None, image_env=(), image_files=Copy(()), image_package=Copy(()),
        manifest_file=Copy(()), labels=labels, manifest=manifest,
        build_files=_build_files([step], Copy(()), generated=generated, package=False), generated_files=generated,
        layouts=EXTENSION_LAYOUTS, lock=stack.lock,
        extension=ExtensionFacts(requirements=extension.requirements, lock_sha256=extension.lock.sha256, base=base,
                                 stack_tag=resolution.tag))


def fabric_packages(resolution: Resolution) -> list[str]:
    """The OS packages the image's fabric needs in the final image (bases.yaml capabilities)."""
    fabric = resolution.fabric
    family = resolution.facts.family
    return [p for need in (fabric.needs if fabric else ()) for p in family.capabilities[need].get("runtime", [])]


def _fabric_build_step(fabric, cuda_home: Optional[str]) -> Step:
    """The builder compiles a fabric from its pinned sources (fabric.sh): four arguments per
    source, the real URL (the source_mirror secret may replace its GitHub base) and the sha256
    of its tar stream, checked either way."""
    build = fabric.build
    if cuda_home is None:  # rules.nvcc_required gives a source-built fabric the toolchain
        raise AssertionError(f"fabric {fabric.name} is built from source but the builder has no CUDA_HOME")
    env = [("CUDA_HOME", cuda_home), ("ENVBUILD_EFA_PREFIX", build.prefix),
           ("ENVBUILD_OFI_NCCL_PREFIX", build.plugin_prefix), ("ENVBUILD_FABRIC_LD_CONF", build.ld_conf)]
    files = _step_files("fabric.sh", "fabric-install.sh")
    if build.headers:
        env.append(("ENVBUILD_FABRIC_HEADERS", f"{paths.SETUP_DIR}/fabric-headers.txt"))
        files += (FileCopy(f"envbuild/{FABRIC_HEADERS}", f"{paths.SETUP_DIR}/fabric-headers.txt"),)
    args = tuple(word for src in build.sources for word in (src.name, src.version, src.url, src.tar_sha256))
    return Step("fabric", args, files=files, env=tuple(env), secrets=FABRIC_SECRETS,
                comment=f"fabric {fabric.name}: {', '.join(f'{s.name} {s.version}' for s in build.sources)} from "
                        f"pinned sources, each tar's sha256 checked ({build.time})")


def _fabric_install_step(fabric) -> Step:
    """After the runtime copied the fabric's prefixes: register their libraries with the dynamic
    linker (NCCL dlopens its plugin by name) and put the fabric's tools on PATH."""
    build = fabric.build
    return Step("fabric-install", (build.ld_conf, f"{build.prefix}/bin", f"{build.prefix}/lib",
                                   f"{build.plugin_prefix}/lib"),
                comment=f"fabric {fabric.name}: its libraries in the loader's cache, its tools on PATH")


OS_LOCK_FILE = "envbuild/os-lock.txt"  # the whole OS lock in the build directory (copied into the image)
OS_LOCK_PART = STEPS_SOURCE + "/os-lock-{stage}.txt"  # a stage's part, beside os.sh (the runtime binds that folder)
OS_SECRETS = ("ca_cert", "apt_snapshot", "apt_key", "apt_mirror")


def _os_locked(step: Step, resolution: Resolution, stage: str) -> Step:
    """An OS step of a stage the OS lock pins: os.sh reads the stage's part (steps/os.sh)."""
    if stage not in resolution.os_locked:
        return step
    part = OS_LOCK_PART.format(stage=stage)
    target = f"{paths.SETUP_DIR}/{posixpath.basename(part)}"
    files = step.files + ((FileCopy(part, target),) if step.files else ())  # a bound stage sees the folder
    return replace(step, files=files, env=(*step.env, ("ENVBUILD_OS_LOCK", target)), secrets=OS_SECRETS)


def _os_lock_files(resolution: Resolution) -> dict[str, str]:
    """The OS lock (into the image, for the record) and each pinned stage's part for os.sh."""
    lock = resolution.os_lock
    if lock is None:
        return {}
    apt = resolution.facts.family.apt
    snapshot = archive_url(apt.snapshot, "{archive}", lock.snapshot)
    return {OS_LOCK_FILE: lock.text,
            **{OS_LOCK_PART.format(stage=stage): stage_part(lock, stage, snapshot, apt.keyring, apt.check_valid_until)
               for stage in resolution.os_locked}}


def _fabric_steps(resolution: Resolution) -> tuple[Step, ...]:
    """The fabric's user space as a layer of its own, after the OS: fabric variants of a stack
    share everything below it, and its size is one layer's (bench/image_size.py). The runtime
    stage binds the step scripts (or, --keep-toolchain, has the builder's), so nothing is copied."""
    packages = fabric_packages(resolution)
    if not packages:
        return ()
    fabric = resolution.fabric
    family = resolution.facts.family
    step = Step("os", tuple(packages), env=(("ENVBUILD_APT_HOSTS", " ".join(family.mirror_hosts)),), secrets=APT_SECRETS,
                comment=f"fabric {fabric.name}: {fabric.description}")
    return (_os_locked(step, resolution, "runtime"),)


IMAGE_FILES = ("env.sh", "entrypoint.sh", "smoke.py")
EXTENSION_STEP_FILES = ("lib.sh", "extend.sh", "import_check.py", "pip_check.py")
EXTEND_LOCK_NAME = "envbuild/extend-lock.txt"  # the extension lock in the build directory
# The lock's parts in the build directory (under envbuild/), one per step that installs one.
LOCK_PARTS = {"venv": "lock/venv.txt", "deepspeed": "lock/deepspeed.txt", "toolchain": "lock/toolchain.txt"}


def _lock_files(lock) -> dict[str, str]:
    """The whole lock (copied into the image) and its parts: the venv but DeepSpeed (the torch
    step), DeepSpeed alone (built after torch, --no-build-isolation), the PyPI toolchain."""
    if lock is None:
        return {}
    files = {f"envbuild/{posixpath.basename(paths.LOCK)}": lock.text,
             f"envbuild/{LOCK_PARTS['venv']}": lock.requirements("venv", exclude=("deepspeed",)),
             f"envbuild/{LOCK_PARTS['deepspeed']}": lock.requirements("venv", only=("deepspeed",))}
    if lock.sections.get("toolchain"):
        files[f"envbuild/{LOCK_PARTS['toolchain']}"] = lock.requirements("toolchain")
    return files


def _build_files(steps, image_files: Copy, qemu: bool = False, generated=(), package: bool = True) -> dict[str, Path]:
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
        if copy.source.startswith(STEPS_SOURCE + "/"):
            out[copy.source] = files / "steps" / name
        else:
            out[copy.source] = files / name
    return out


def _image_env(resolution: Resolution, kept_toolchain_home: Optional[str]) -> tuple[EnvVar, ...]:
    """The final image's environment: what every image bakes (gpus.yaml image_env, in its
    order, filled in for this image), then the resolution's defaults; a user's --env of the
    same name wins."""
    facts = {"venv": paths.VENV, "constraints": paths.CONSTRAINTS, "system_path": SYSTEM_PATH,
             "cuda_home": kept_toolchain_home or "", "min_driver": resolution.driver.min_driver,
             "driver_source": resolution.driver.source, "cuda": resolution.stack.cuda,
             "arch_list": resolution.arch_list, "gpu": resolution.gpu.name, "sm": resolution.gpu.sm}
    user = {e.name for e in resolution.env if e.source == "user"}
    toolchain = "kept" if kept_toolchain_home else "lean"
    env = []
    for entry in resolution.facts.image_env:
        if entry.name in user or entry.toolchain not in (None, toolchain):
            continue
        value, reason, source = entry.filled(facts)
        env.append(EnvVar(entry.name, value, reason, source, entry.layer, entry.cost))
    return tuple(env) + tuple(resolution.env)


def _labels(resolution: Resolution) -> list[tuple[str, str]]:
    stack = resolution.stack
    return [
        ("org.opencontainers.image.title", f"envbuild {resolution.tag}"),
        ("org.opencontainers.image.description",
         f"torch {stack.torch} (CUDA {stack.cuda}, Python {stack.python}) + DeepSpeed {stack.deepspeed} with pre-built "
         f"ops for {resolution.gpu.name} ({resolution.gpu.sm})"
         + "".join(f" + {e.name} {e.version}" for e in resolution.extensions)),
        ("org.opencontainers.image.version", resolution.tag),
        ("org.opencontainers.image.base.name", resolution.base_images["runtime"]),
        ("io.envbuild.version", __version__),
        ("io.envbuild.stack", stack.id),
        ("io.envbuild.gpu", resolution.gpu.name),
        ("io.envbuild.python", stack.python),
        ("io.envbuild.cuda", stack.cuda),
        ("io.envbuild.torch", stack.torch),
        ("io.envbuild.torchvision", resolution.torchvision),
        ("io.envbuild.deepspeed", stack.deepspeed),
        ("io.envbuild.ds-ops", ",".join(resolution.ops)),
        ("io.envbuild.torch-cuda-arch-list", resolution.arch_list),
        ("io.envbuild.cpu-target", resolution.cpu_target),
        ("io.envbuild.min-driver", resolution.driver.min_driver),
        ("io.envbuild.lock", f"sha256:{resolution.lock.sha256}" if resolution.lock else "none"),
        ("io.envbuild.os-lock", f"sha256:{resolution.os_lock.sha256}" if resolution.os_lock else "none"),
        ("io.envbuild.fabric", resolution.fabric.name if resolution.fabric else "none"),
        *((("io.envbuild.extensions", ",".join(f"{e.name}=={e.version}" for e in resolution.extensions)),)
          if resolution.extensions else ()),
    ]


def _manifest(plan: BuildPlan, resolution: Resolution) -> dict:
    """The resolved build; also copied into the image as /opt/envbuild/manifest.json."""
    stack = resolution.stack
    return {
        "schema": 1,
        "envbuild": __version__,
        "tag": resolution.tag,
        "image": resolution.image_ref,
        "stack": stack.id,
        "python": stack.python,
        "cuda": stack.cuda,
        "torch": stack.torch,
        "torchvision": resolution.torchvision,
        "deepspeed": stack.deepspeed,
        "nccl": resolution.nccl,
        "gpu": resolution.gpu.name,
        "gpu_cc": resolution.gpu.cc,
        "torch_cuda_arch_list": resolution.arch_list,
        "ds_ops": resolution.ops,
        "ds_ops_dropped": [{"op": o, "reason": why} for o, why in resolution.dropped_ops],
        "arch": resolution.arch,
        "platform": resolution.platform,
        "cpu_target": resolution.cpu_target,
        "toolchain": stack.toolchain,
        "toolchain_kept": resolution.request.keep_toolchain,
        "runtime_compiler": resolution.request.keep_toolchain or not resolution.request.no_compiler,
        "constraints": paths.CONSTRAINTS,
        "lock": ({"path": paths.LOCK, "sha256": resolution.lock.sha256,
                  "packages": len(resolution.lock.sections["venv"]),
                  "exclude_newer": resolution.lock.header.get("exclude-newer"),
                  "index": resolution.lock.header.get("index"), "dropped": list(plan.dropped)}
                 if resolution.lock else None),
        "dropped_requirements": [{"package": name, "required_by": "deepspeed",
                                  "reason": resolution.facts.ds_build_only[name]}
                                 for name in plan.dropped],
        "torch_index": resolution.torch_index,
        "env": {e.name: e.value for e in plan.image_env},
        "env_reasons": [{"name": e.name, "value": e.value, "reason": e.reason, "source": e.source,
                         **({"cost": e.cost} if e.cost else {})} for e in plan.image_env],
        "node_env": [{"name": d.name, "value": d.value, "when": d.node.model_dump(exclude_none=True),
                      "reason": d.reason, "source": d.source, "cost": d.cost} for d in resolution.node_env],
        "driver": {"cuda": stack.cuda, "min_driver": resolution.driver.min_driver, "branch": resolution.driver.branch,
                   "forward_compat": resolution.facts.forward_compat, "source": resolution.driver.source},
        "base_images": dict(resolution.base_images),
        "base_pinning": base_pinning(resolution.base_images),
        "os_lock": ({"path": paths.OS_LOCK, "sha256": resolution.os_lock.sha256,
                     "snapshot": resolution.os_lock.snapshot, "packages": resolution.os_lock.packages(),
                     "stages": list(resolution.os_locked), "unlocked": resolution.os_unlocked}
                    if resolution.os_lock else {"unlocked": resolution.os_unlocked}),
        "fabric": _fabric_manifest(resolution),
        "sass_audit": (None if plan.toolchain_home is None else
                       resolution.facts.toolchain.audit_missing(stack.cuda_toolkit) or "cuobjdump"),
        # What `envbuild rebuild` re-renders from: the request as given, and the matrix it met.
        "request": request_record(resolution),
        "matrix": {"sha256": resolution.matrix_sha256},
        "extensions": [{"name": e.name, "version": e.version, "sdist_sha256": e.sdist.sha256,
                        "packages": e.packages, "modules": e.modules, "arch_list": resolution.arch_list,
                        "gpu_check": e.gpu_check, "build_record": paths.EXTENSIONS_RECORD,
                        "lock": paths.EXTENSIONS_LOCK} for e in resolution.extensions],
    }


def request_record(resolution: Resolution) -> dict:
    """The request as plain data (tuples as lists), in one spelling: what re-renders the same
    image. Two spellings of one request (--gpu H20 or nvidia-h20, --ds-ops ' cpu_adam ') are one
    build, so they record the same: the GPU's and the fabric's names, the op list trimmed."""
    request = resolution.request
    canonical = replace(request, gpu=resolution.gpu.name,
                        fabric=resolution.fabric.name if request.fabric and resolution.fabric else request.fabric,
                        ds_ops=",".join(word.strip() for word in request.ds_ops.split(",")))
    return {f.name: (list(map(list, v)) if f.name == "env" else list(v)) if isinstance(v := getattr(canonical, f.name), tuple)
            else v for f in fields(canonical)}


def base_pinning(base_images: dict[str, str]) -> dict[str, str]:
    """How each stage's base is pinned: by digest, or by tag only and why (a tag moves).

    >>> base_pinning({"builder": "ubuntu:24.04@sha256:ab", "runtime": "local/debian:bookworm"})["runtime"][:12]
    'tag only: no'
    """
    return {stage: "digest" if "@sha256:" in ref else
            ("tag only: no registry digest is known for it on the machine that rendered it (an imported "
             "or never-pushed image, or a registry it could not reach; `envbuild lock --bases` or an OS lock "
             "records one where the registry answers)")
            for stage, ref in base_images.items()}


def _fabric_manifest(resolution: Resolution) -> Optional[dict]:
    """What the image promises about the network between nodes: the smoke test's `fabric` and
    `transport` checks and the start-up checks read it (envbuild/image/fabric.py)."""
    f = resolution.fabric
    if f is None:
        return None
    baked = {e.name: e.value for e in resolution.env if any(d.name == e.name and not d.node for d in f.env)}
    return {"name": f.name, "description": f.description, "provided_by": f.provided_by, "transport": f.transport,
            "net_env": dict(f.net_env), "libraries": list(f.libraries), "providers": list(f.providers),
            "net_plugins": list(f.net_plugins), "tools": list(f.tools), "env": baked,
            "device_drivers": list(f.device_drivers), "host_paths": list(f.host_paths),
            "verbs_prefix": f.verbs_prefix, "packages": fabric_packages(resolution),
            "files": [{"path": x.path, "sha256": x.sha256, "url": x.url} for x in f.files],
            "sources": [{"name": s.name, "version": s.version, "url": s.url, "tar_sha256": s.tar_sha256}
                        for s in (f.build.sources if f.build else ())]}
