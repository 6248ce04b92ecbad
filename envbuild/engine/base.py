"""What envbuild asks of a container engine, and the plain data it gets back.

build.py, smoke.py and publish.py talk to an :class:`Engine` only; Docker is one
implementation (:mod:`.docker`). Another engine (Apptainer, Enroot, Podman) is one new class
with these methods, not edits in three modules. Errors a user can act on are
:class:`~envbuild.base.errors.EnvbuildError`; a failed build is :class:`BuildFailed` (build.py words
the message, the same for every engine); a registry's refusal is :class:`RegistryError`
(publish.py decides whether to retry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Optional, Protocol, Sequence, runtime_checkable

# on_step(event, step name): event is 'start', 'done', 'cached' or 'error'.
StepCallback = Callable[[str, str], None]


@dataclass(frozen=True)
class BuildSecrets:
    """Mirror URLs and an extra CA, handed to the build as secrets only.

    They are never rendered into a file of the build directory, a layer, the history or a
    label: the step scripts read them from /run/secrets inside one build step and removes its copy.
    Each field name is the secret's id.
    """

    ca_cert: Optional[Path] = None
    pip_index_url: Optional[str] = None
    torch_index_url: Optional[str] = None
    apt_mirror: Optional[str] = None
    source_mirror: Optional[str] = None  # replaces https://github.com in a fabric's or an extension's source URLs
    apt_snapshot: Optional[str] = None  # a mirror of the OS lock's moment of the archive ({archive}, {timestamp})
    apt_key: Optional[Path] = None  # the public key that signs that mirror (apt's signed-by)
    compile_cache: Optional[str] = None  # sccache's storage variables, NAME=VALUE lines (validate.compile_cache_secret)

    def values(self) -> list[str]:
        """The secret strings, for leak scans."""
        cache = [line.split("=", 1)[1] for line in (self.compile_cache or "").splitlines() if "=" in line]
        return [v for v in (self.pip_index_url, self.torch_index_url, self.apt_mirror, self.source_mirror,
                            self.apt_snapshot, *cache) if v]


@dataclass
class BuildOutcome:
    """A finished build: the image's ID and each step's duration (cached steps excluded)."""

    image_id: str
    steps: list[tuple[str, float]] = field(default_factory=list)


class BuildFailed(Exception):
    """The build ran and failed: the failing step, its last output lines, and an engine hint."""

    def __init__(self, step: str, lines: list[str], hint: str = ""):
        super().__init__(step)
        self.step = step
        self.lines = lines
        self.hint = hint


@dataclass
class ImageInfo:
    """A local image: its ID (sha256 of its config: what a smoke record vouches for) and its tags."""

    id: str
    tags: list[str]
    platform: str = "linux/amd64"  # OS/architecture of the image config (linux/arm64 for Grace images)
    repo_digests: tuple[str, ...] = ()  # 'repo@sha256:...' of each registry it was pushed to or pulled from
    labels: tuple[tuple[str, str], ...] = ()  # the image config's labels (io.envbuild.*: what it was built as)


@dataclass(frozen=True)
class ImageConfig:
    """What an image runs with (its config), and its layers oldest first: (what made it, bytes)."""

    id: str
    env: tuple[str, ...]
    labels: tuple[tuple[str, str], ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    workdir: str
    user: str
    layers: tuple[tuple[str, int], ...]


@dataclass
class RunResult:
    """A finished (or killed) container run; stdout and stderr kept apart."""

    exit_code: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool = False


class RegistryError(Exception):
    """A registry refused or failed a push/pull; `message` carries the registry's own words."""

    def __init__(self, message: str, registry: str):
        super().__init__(message)
        self.message = message
        self.registry = registry


@runtime_checkable
class Engine(Protocol):
    """Build, inspect, run, tag, push and pull images."""

    name: str

    def check_usable(self) -> None:
        """EnvbuildError (exit 2) when the engine cannot be used at all (no daemon answers)."""

    def build(self, context: Path, tags: Sequence[str], secrets: BuildSecrets, log_path: Path,
              on_step: Optional[StepCallback] = None, extra_args: Sequence[str] = ()) -> BuildOutcome:
        """Build `context`, write the full log to `log_path`, then (only after success) apply `tags`.

        Raises BuildFailed when the build fails (nothing tagged), EnvbuildError when the engine
        cannot be reached or a tag cannot be applied.
        """

    def inspect(self, ref: str) -> ImageInfo:
        """The local image `ref` names; EnvbuildError if there is none."""

    def run(self, image: str, argv: Sequence[str], *, timeout: float, gpus: Optional[str] = None,
            network: Optional[str] = "none", env: Optional[dict] = None,
            entrypoint: Optional[Sequence[str]] = None, mounts: Optional[dict] = None,
            rdma: bool = False, platform: Optional[str] = None) -> RunResult:
        """Run `argv` in a new container of `image` and remove it; killed after `timeout` s
        (``timed_out``). `gpus` is 'all' or a count, None for no GPU. `mounts`: host directory ->
        path in the container, read-only. `rdma`: hand it the host's RDMA devices as a multi-node
        job needs them (/dev/infiniband, unlimited memlock, CAP_IPC_LOCK). `platform`: the image's
        (linux/arm64 runs under the host's qemu-user); None takes the engine's default."""

    def config(self, ref: str) -> ImageConfig:
        """What the local image `ref` runs with, and its layers; EnvbuildError if there is none."""

    def export(self, ref: str) -> ContextManager[BinaryIO]:
        """The image's filesystem as one tar stream (as `docker export` of a container never
        started); the container is removed when the stream is closed."""

    def read_file(self, ref: str, path: str, limit: int) -> Optional[bytes]:
        """One file of the image (None when it has none), at most `limit` bytes; nothing runs."""

    def tag(self, image: str, ref: str) -> None:
        """Give image (ID or ref) the name `ref` (REPO:TAG)."""

    def untag(self, ref: str) -> None:
        """Remove the name `ref`; the image stays."""

    def push(self, ref: str) -> str:
        """Push `ref`; its manifest digest (sha256:...). RegistryError on the registry's refusal."""

    def pull(self, ref: str) -> str:
        """Pull `ref` (REPO@DIGEST); the pulled image's ID. RegistryError on the registry's refusal."""
