"""Docker as an :class:`~envbuild.engine.base.Engine`.

Builds go through BuildKit driven by Debian's own ``/usr/bin/docker`` with
``DOCKER_BUILDKIT=1``: the Docker SDK only drives the legacy builder, which has no secret
mounts, and another ``docker`` client first on PATH may demand a buildx plugin (Docker
23+ clients hand `docker build` to buildx). Everything else (inspect, run, tag, push, pull) goes through the Docker SDK.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import BinaryIO, Iterator, Optional, Sequence

import docker
from docker.errors import DockerException, ImageNotFound, NotFound
from docker.types import DeviceRequest, Ulimit

from envbuild.base.errors import EnvbuildError
from envbuild.engine.base import (
    BuildFailed,
    BuildOutcome,
    BuildSecrets,
    ImageConfig,
    ImageInfo,
    RegistryError,
    RunResult,
    StepCallback,
)
from envbuild.image import paths
from envbuild.oci.registry import registry_of

DOCKER_CLI_CANDIDATES = ("/usr/bin/docker", "docker")
CLI_ENV = "ENVBUILD_DOCKER_CLI"          # the docker client to build with
BUILD_ARGS_ENV = "ENVBUILD_DOCKER_BUILD_ARGS"  # extra `docker build` flags (e.g. --no-cache, --pull)
DAEMON_DOWN = "Cannot connect to the Docker daemon"


def docker_cli() -> str:
    """Debian's docker CLI (BuildKit works through it), else whatever `docker` is."""
    override = os.environ.get(CLI_ENV)
    for candidate in ([override] if override else []) + list(DOCKER_CLI_CANDIDATES):
        path = shutil.which(candidate) if not os.path.isabs(candidate) else (
            candidate if os.access(candidate, os.X_OK) else None)
        if path:
            return path
    raise EnvbuildError("no docker CLI found; install Docker (Debian: apt-get install docker.io) and start dockerd.")


CANCEL_WAIT_S = 30  # how long the docker CLI gets to cancel its build before it is killed
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _prctl():
    """libc's prctl, looked up here in the parent: a preexec_fn must not load libraries (it runs
    after fork, while other threads, rich's refresh among them, may hold locks)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: cancel_build still covers Ctrl-C and SIGTERM
        return None


def _cancel_with(parent: int, prctl):
    """A preexec_fn for the docker CLI: the kernel sends it SIGINT when envbuild dies, even by
    SIGKILL, so the build it started is cancelled rather than left running for hours (Linux).
    SIGINT is its default again (a background envbuild inherits it ignored). If envbuild died
    before the prctl took hold, the CLI cancels at once."""
    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGINT)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGINT)
    return preexec


def cancel_build(proc: subprocess.Popen) -> None:
    """Stop a `docker build` envbuild is leaving: on SIGINT the CLI cancels the build in the
    daemon (BuildKit stops the RUN step and releases its cache mounts: an extension compile's
    finished objects stay there for the next build); killed if it has not gone in CANCEL_WAIT_S."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(CANCEL_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def secret_args(secrets: BuildSecrets, tmp: Path) -> list[str]:
    """`--secret` flags; each field name of BuildSecrets is its BuildKit secret id. Values that
    are strings go to private files in `tmp`, never onto the command line."""
    args = []
    for spec in fields(secrets):
        value = getattr(secrets, spec.name)
        if not value:
            continue
        if isinstance(value, Path):
            src = value.resolve()
        else:
            src = tmp / spec.name
            src.touch(mode=0o600)
            src.write_text(value + "\n")
        args += ["--secret", f"id={spec.name},src={src}"]
    return args


_STEP = re.compile(r"^#(\d+) \[([^\]]+)\] (.*)$")
_DONE = re.compile(r"^#(\d+) (DONE|CACHED|ERROR)(?: ([\d.]+)s)?(?:: (.*))?")
# The engine's own reason, printed after a failed step: BuildKit's last line (`failed to compute
# cache key: ...`, `executor failed running [...]: ...`, `error: failed to solve: ...`).
_NO_SPACE = "no space left on device"


class _ChunkStream(io.RawIOBase):
    """A file object over an iterator of byte chunks (the Docker SDK's export and archive streams)."""

    def __init__(self, chunks):
        self._chunks = iter(chunks)
        self._rest = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._rest:
            self._rest = next(self._chunks, None)
            if self._rest is None:
                self._rest = b""
                return 0
        n = min(len(buffer), len(self._rest))
        buffer[:n], self._rest = self._rest[:n], self._rest[n:]
        return n


# The label on every container envbuild runs: which host and process own it (orphans are removed).
OWNER_LABEL = "io.envbuild.owner"


class BuildkitProgress:
    """Follows BuildKit's plain progress: which step runs, how long each took, which failed."""

    def __init__(self, on_step: Optional[StepCallback]):
        self.on_step = on_step
        self.names: dict[str, str] = {}
        self.output: dict[str, list[str]] = {}
        self.steps: list[tuple[str, float]] = []
        self.failed: Optional[str] = None

    def feed(self, line: str) -> None:
        match = _STEP.match(line)
        if match:
            self.names[match.group(1)] = f"[{match.group(2)}] {match.group(3)}"
            if self.on_step:
                self.on_step("start", self.names[match.group(1)])
            return
        match = _DONE.match(line)
        if match and match.group(1) in self.names:
            name = self.names[match.group(1)]
            if match.group(2) == "ERROR":
                self.failed = self.failed or match.group(1)
                if match.group(4):  # the step's reason: `#36 ERROR: failed to copy files: ...`
                    self.output.setdefault(match.group(1), []).append(f"ERROR: {match.group(4)}")
            elif match.group(2) == "DONE" and match.group(3):
                self.steps.append((name, float(match.group(3))))
            if self.on_step:
                self.on_step(match.group(2).lower(), name)
            return
        num = line.split(" ", 1)[0].lstrip("#")
        if num.isdigit():
            self.output.setdefault(num, []).append(line.split(" ", 2)[-1] if line.count(" ") >= 2 else line)

    def failure(self, tail: list[str]) -> tuple[str, list[str]]:
        """(failing step, its last lines and the engine's reason); the log's tail when no step
        was named. A COPY or a cache import prints no output of its own: without the reason
        (`#36 ERROR: ...`) its last lines would be a layer digest and say nothing."""
        if self.failed:
            lines = self.output.get(self.failed, [])[-25:]
            said = [ln for ln in tail if ln.startswith(("error:", "ERROR:", "failed to "))][-1:]
            return self.names.get(self.failed, f"step #{self.failed}"), lines + [ln for ln in said if ln not in lines]
        return "(unknown step)", tail[-25:]


def failure_hint(tail: list[str]) -> str:
    """What the engine's words mean, where they say more than the step: a daemon that does not
    answer, or a disk the engine filled (a layer copy of the venv needs gigabytes)."""
    text = "\n".join(tail)
    if DAEMON_DOWN in text:
        return " Is dockerd running? (scripts/host-setup.sh starts one.)"
    if _NO_SPACE in text:
        return (" The engine's disk is full: `docker system df` shows what holds it; `docker builder prune` frees "
                "its build cache (the next build compiles again).")
    return ""


class DockerEngine:
    """The Docker engine: BuildKit through the docker CLI for builds, the SDK for the rest.

    Parameters
    ----------
    client:
        A docker SDK client (tests pass a stand-in); default: ``docker.from_env()`` on first use.
    cli:
        The docker CLI used for builds; default: :func:`docker_cli` on first build.
    """

    name = "docker"

    def __init__(self, client=None, cli: Optional[str] = None):
        self._client = client
        self._cli = cli

    # ------------------------------------------------------------------ SDK
    @property
    def client(self):
        if self._client is None:
            try:
                client = docker.from_env(timeout=600)
                client.ping()
            except DockerException as error:
                raise EnvbuildError(f"cannot reach the Docker engine ({error}); start dockerd "
                                    f"(scripts/host-setup.sh does) or set DOCKER_HOST.") from None
            self._client = client
        return self._client

    def check_usable(self) -> None:
        self.client  # noqa: B018  (pings the daemon: EnvbuildError when none answers)

    def _get(self, ref: str):
        try:
            return self.client.images.get(ref)
        except ImageNotFound:
            raise EnvbuildError(f"image '{ref}' does not exist locally; build it with `envbuild build` "
                                f"or pull it first.") from None

    def inspect(self, ref: str) -> ImageInfo:
        image = self._get(ref)
        attrs = getattr(image, "attrs", None) or {}
        platform = f"{attrs.get('Os') or 'linux'}/{attrs.get('Architecture') or 'amd64'}"
        labels = tuple(sorted(((attrs.get("Config") or {}).get("Labels") or {}).items()))
        return ImageInfo(image.id, list(image.tags), platform, tuple(attrs.get("RepoDigests") or ()), labels)

    def run(self, image: str, argv: Sequence[str], *, timeout: float, gpus: Optional[str] = None,
            network: Optional[str] = "none", env: Optional[dict] = None,
            entrypoint: Optional[Sequence[str]] = None, mounts: Optional[dict] = None,
            rdma: bool = False, platform: Optional[str] = None) -> RunResult:
        """`docker run` detached with a 1 GB /dev/shm; killed after `timeout`, always removed."""
        kwargs = dict(shm_size="1g", detach=True, environment=env or {})
        if platform:
            kwargs["platform"] = platform
        if rdma:  # docker run --device /dev/infiniband --ulimit memlock=-1 --cap-add IPC_LOCK
            kwargs.update(devices=[f"{paths.RDMA_DEVICES}:{paths.RDMA_DEVICES}:rwm"], cap_add=["IPC_LOCK"],
                          ulimits=[Ulimit(name="memlock", soft=-1, hard=-1)])
        if mounts:
            kwargs["volumes"] = {host: {"bind": target, "mode": "ro"} for host, target in mounts.items()}
        if network:
            kwargs["network_mode"] = network
        if entrypoint:
            kwargs["entrypoint"] = list(entrypoint)
        if gpus:
            count = -1 if gpus == "all" else int(gpus)
            kwargs["device_requests"] = [DeviceRequest(count=count, capabilities=[["gpu"]])]
        self._remove_orphans()
        owner = {OWNER_LABEL: f"{socket.gethostname()}:{os.getpid()}"}
        try:
            container = self.client.containers.run(image, list(argv), labels=owner, **kwargs)
        except DockerException as error:  # no such image (Docker tried to pull it), a refused option
            explanation = getattr(error, "explanation", None) or str(error)
            raise EnvbuildError(f"cannot start a container of {image}: {explanation}") from None
        try:
            try:
                status = container.wait(timeout=timeout)
            except Exception:  # requests' ReadTimeout, or the engine went away: either way, stop it
                container.kill()
                return RunResult(None, "", "", timed_out=True)
            stdout = container.logs(stdout=True, stderr=False).decode(errors="replace")
            stderr = container.logs(stdout=False, stderr=True).decode(errors="replace")
        finally:
            container.remove(force=True)
        return RunResult(status.get("StatusCode"), stdout, stderr)

    def _remove_orphans(self) -> None:
        """Containers an envbuild on this host started and could not remove (it was killed):
        their owner process is gone, so remove them now."""
        host = socket.gethostname()
        try:
            owned = self.client.containers.list(all=True, filters={"label": OWNER_LABEL})
        except DockerException:
            return  # the run below reports an engine that does not answer
        for c in owned:
            owner_host, _, pid = (c.labels.get(OWNER_LABEL) or "").rpartition(":")
            if owner_host == host and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    c.remove(force=True)
                except DockerException:
                    pass  # removed meanwhile by another run

    def config(self, ref: str) -> ImageConfig:
        image = self._get(ref)
        config = (getattr(image, "attrs", None) or {}).get("Config") or {}
        layers = tuple((entry.get("CreatedBy") or "", int(entry.get("Size") or 0))
                       for entry in reversed(image.history()))
        return ImageConfig(image.id, tuple(config.get("Env") or ()), tuple(sorted((config.get("Labels") or {}).items())),
                           tuple(config.get("Entrypoint") or ()), tuple(config.get("Cmd") or ()),
                           config.get("WorkingDir") or "", config.get("User") or "", layers)

    @contextlib.contextmanager
    def export(self, ref: str) -> Iterator[BinaryIO]:
        self._get(ref)
        self._remove_orphans()
        owner = {OWNER_LABEL: f"{socket.gethostname()}:{os.getpid()}"}
        container = self.client.containers.create(ref, ["/envbuild-never-runs"], labels=owner, network_disabled=True)
        try:
            yield _ChunkStream(container.export(chunk_size=1 << 20))
        finally:
            container.remove(force=True)

    def read_file(self, ref: str, path: str, limit: int) -> Optional[bytes]:
        self._get(ref)
        self._remove_orphans()
        owner = {OWNER_LABEL: f"{socket.gethostname()}:{os.getpid()}"}
        container = self.client.containers.create(ref, ["/envbuild-never-runs"], labels=owner, network_disabled=True)
        try:
            try:
                chunks, _ = container.get_archive(path)
            except NotFound:
                return None
            with tarfile.open(fileobj=_ChunkStream(chunks), mode="r|") as tar:
                for member in tar:
                    if member.isfile():
                        if member.size > limit:
                            raise EnvbuildError(f"{path} in {ref} is {member.size} bytes, more than the "
                                                f"{limit} a file of its kind may be.")
                        return tar.extractfile(member).read()
            return None
        finally:
            container.remove(force=True)

    def tag(self, image: str, ref: str) -> None:
        repo, _, tag = ref.rpartition(":")
        if not repo or "/" in tag:
            repo, tag = ref, "latest"
        self._get(image).tag(repo, tag)

    def untag(self, ref: str) -> None:
        self.client.images.remove(ref, noprune=True)

    def push(self, ref: str) -> str:
        repo, _, tag = ref.rpartition(":")
        digest = ""
        for event in self.client.images.push(repo, tag=tag, stream=True, decode=True):
            if "error" in event:
                raise RegistryError(event.get("error", ""), registry_of(ref))
            digest = (event.get("aux") or {}).get("Digest", digest)
        if not digest:
            raise RegistryError("push finished without a digest", registry_of(ref))
        return digest

    def pull(self, ref: str) -> str:
        try:
            return self.client.images.pull(ref).id
        except Exception as error:  # docker.errors.APIError carries the registry's words
            raise RegistryError(str(error), registry_of(ref)) from None

    # ------------------------------------------------------------------ BuildKit through the CLI
    def build(self, context: Path, tags: Sequence[str], secrets: BuildSecrets, log_path: Path,
              on_step: Optional[StepCallback] = None, extra_args: Sequence[str] = ()) -> BuildOutcome:
        cli = self._cli or docker_cli()
        with tempfile.TemporaryDirectory(prefix="envbuild-secrets-") as tmp:
            iidfile = Path(tmp) / "iid"
            env_args = shlex.split(os.environ.get(BUILD_ARGS_ENV, ""))
            # --output (a tar or a directory: no image) and --iidfile together fail after the build
            image_out = [] if "--output" in extra_args else ["--iidfile", str(iidfile)]
            cmd = [cli, "build", "--network", "host", "--progress", "plain", *image_out,
                   *secret_args(secrets, Path(tmp)), *env_args, *extra_args, str(context)]
            env = {**os.environ, "DOCKER_BUILDKIT": "1"}
            progress = BuildkitProgress(on_step)
            tail: list[str] = []
            with open(log_path, "w", encoding="utf-8", buffering=1) as log:  # line by line: `tail -f` follows it
                log.write("$ " + " ".join(cmd) + "\n")
                try:
                    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                            text=True, errors="replace", bufsize=1, preexec_fn=_cancel_with(os.getpid(), _prctl()))
                except OSError as error:
                    raise EnvbuildError(f"cannot run {cli}: {error.strerror}.") from None
                assert proc.stdout
                try:
                    for line in proc.stdout:
                        log.write(line)
                        line = line.rstrip("\n")
                        tail = (tail + [line])[-40:]
                        progress.feed(line)
                    rc = proc.wait()
                except BaseException:  # Ctrl-C, SIGTERM (SystemExit), an error while reading
                    cancel_build(proc)
                    raise
            if rc != 0:
                step, lines = progress.failure(tail)
                raise BuildFailed(step, lines, failure_hint(tail))
            if image_out and not iidfile.is_file():
                raise EnvbuildError(f"{cli} build finished but wrote no image ID ({iidfile}); nothing was tagged. "
                                    f"Is {cli} a Docker CLI with BuildKit?", exit_code=1)
            image_id = iidfile.read_text().strip() if image_out else ""
        for ref in tags:
            done = subprocess.run([cli, "tag", image_id, ref], capture_output=True, text=True)
            if done.returncode != 0:
                raise EnvbuildError(f"built {image_id} but could not tag it {ref}: {done.stderr.strip()}",
                                    exit_code=1)
        return BuildOutcome(image_id, progress.steps)
