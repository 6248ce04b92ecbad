"""The building blocks of a plan, each rendering itself to every output format (the hpccm idea):
``Step``, ``Copy``, ``Environment`` and ``Label`` have one method per format, and a ``Stage``
puts them in that format's order. A new output format is one method per building block plus
a layout template.

>>> step = Step("venv", ("/usr/bin/python3.11",), files=(FileCopy("envbuild/steps/venv.sh", "/opt/envbuild-setup/venv.sh"),))
>>> print(step.render("docker"))
COPY envbuild/steps/venv.sh /opt/envbuild-setup/venv.sh
RUN bash /opt/envbuild-setup/venv.sh /usr/bin/python3.11
>>> step.render("apptainer")
{'files': ['envbuild/steps/venv.sh /opt/envbuild-setup/venv.sh'], 'post': ['bash /opt/envbuild-setup/venv.sh /usr/bin/python3.11']}
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass
from typing import Optional

from envbuild.base.buildcache import cache_mount
from envbuild.base.emulation import PLATFORM_MACHINES
from envbuild.image import paths
from envbuild.resolve.resolver import EnvVar

DOCKER = "docker"
APPTAINER = "apptainer"
FORMATS = (DOCKER, APPTAINER)
SYSTEM_PATH = paths.SYSTEM_PATH
STEPS_SOURCE = "envbuild/steps"  # build-directory folder of the step scripts (templates/files/steps)
# Apptainer sections in the order a definition file lists them.
APPTAINER_SECTIONS = ("files", "post", "environment", "labels")


# BuildKit cache mounts of the package downloads (Docker only; lib.sh names the same directories and
# uses each only where it is mounted, so an Apptainer build, which has none, downloads as before):
# apt's archives and index files (os.sh), pip's and uv's caches (uv.sh, torch.sh, cuda-toolkit.sh,
# deepspeed.sh). A second build downloads nothing, and nothing under them reaches a layer.
APT_CACHE = ("envbuild-apt", "/var/cache/envbuild-apt")
PY_CACHE = ("envbuild-py", "/var/cache/envbuild-py")


def step_files(*names: str) -> tuple["FileCopy", ...]:
    """Step scripts of templates/files/steps, each copied to the setup directory."""
    return tuple(FileCopy(f"{STEPS_SOURCE}/{n}", f"{paths.SETUP_DIR}/{n}") for n in names)


# Variables that name directories inside the image: the host's value never wins for them.
IMAGE_OWNED = ("VIRTUAL_ENV", "CUDA_HOME")


def _render(block, fmt: str, **kw):
    if fmt not in FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; known: {', '.join(FORMATS)}")
    return getattr(block, fmt)(**kw)


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
