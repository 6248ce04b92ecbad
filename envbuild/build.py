"""Build images with BuildKit: secrets for mirrors and CAs, progress, a full log, and two
tags (readable + content) applied only after the whole build succeeded.

BuildKit is driven through Debian's own ``/usr/bin/docker`` with ``DOCKER_BUILDKIT=1``:
the Docker SDK only drives the legacy builder, which has no secret mounts, and another
``docker`` client first on PATH may demand a buildx plugin (build-notes.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

from .errors import EnvbuildError

DOCKER_CLI_CANDIDATES = ("/usr/bin/docker", "docker")
LOG_NAME = "build.log"
TAG_MAX = 128


@dataclass(frozen=True)
class BuildSecrets:
    """Mirror URLs and an extra CA, handed to the build as BuildKit secrets only.

    They are never rendered into a file of the build directory, a layer, the history or a
    label: setup.sh reads them from /run/secrets inside one RUN step and removes its copy.
    """

    ca_cert: Optional[Path] = None
    pip_index_url: Optional[str] = None
    torch_index_url: Optional[str] = None
    apt_mirror: Optional[str] = None

    def values(self) -> list[str]:
        """The secret strings, for leak scans."""
        return [v for v in (self.pip_index_url, self.torch_index_url, self.apt_mirror) if v]


@dataclass
class BuildResult:
    image_id: str
    tags: list[str]
    log: Path
    seconds: float
    steps: list[tuple[str, float]] = field(default_factory=list)


def docker_cli() -> str:
    """Debian's docker CLI (BuildKit works through it), else whatever `docker` is."""
    override = os.environ.get("ENVBUILD_DOCKER_CLI")
    for c in ([override] if override else []) + list(DOCKER_CLI_CANDIDATES):
        path = shutil.which(c) if not os.path.isabs(c) else (c if os.access(c, os.X_OK) else None)
        if path:
            return path
    raise EnvbuildError("no docker CLI found; install Docker (Debian: apt-get install docker.io) and start dockerd.")


def content_hash(build_dir: Path) -> str:
    """sha256 over every rendered file (path, mode, bytes), excluding the build log."""
    h = hashlib.sha256()
    for p in sorted(build_dir.rglob("*")):
        if p.is_file() and p.name != LOG_NAME:
            rel = p.relative_to(build_dir).as_posix()
            h.update(f"{rel}\0{p.stat().st_mode & 0o111 != 0}\0".encode())
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def content_tag(readable: str, build_dir: Path) -> str:
    """The immutable tag: the readable tag plus 12 hex digits of the rendered inputs."""
    tag = f"{readable}-{content_hash(build_dir)[:12]}"
    if len(tag) > TAG_MAX:
        tag = f"{readable[:TAG_MAX - 13]}-{content_hash(build_dir)[:12]}"
    return tag


def _secret_args(secrets: BuildSecrets, tmp: Path) -> list[str]:
    """`--secret` flags; each field name of BuildSecrets is its BuildKit secret id."""
    args = []
    for f in fields(secrets):
        value = getattr(secrets, f.name)
        if not value:
            continue
        if isinstance(value, Path):
            src = value.resolve()
        else:
            src = tmp / f.name
            src.touch(mode=0o600)
            src.write_text(value + "\n")
        args += ["--secret", f"id={f.name},src={src}"]
    return args


_STEP = re.compile(r"^#(\d+) \[([^\]]+)\] (.*)$")
_DONE = re.compile(r"^#(\d+) (DONE|CACHED|ERROR)(?: ([\d.]+)s)?")


class _Progress:
    """Follows BuildKit's plain progress: which step runs, how long each took."""

    def __init__(self, on_step: Optional[Callable[[str, str], None]]):
        self.on_step = on_step
        self.names: dict[str, str] = {}
        self.output: dict[str, list[str]] = {}
        self.steps: list[tuple[str, float]] = []
        self.failed: Optional[str] = None

    def feed(self, line: str) -> None:
        m = _STEP.match(line)
        if m:
            self.names[m.group(1)] = f"[{m.group(2)}] {m.group(3)}"
            if self.on_step:
                self.on_step("start", self.names[m.group(1)])
            return
        m = _DONE.match(line)
        if m and m.group(1) in self.names:
            name = self.names[m.group(1)]
            if m.group(2) == "ERROR":
                self.failed = self.failed or m.group(1)
            elif m.group(2) == "DONE" and m.group(3):
                self.steps.append((name, float(m.group(3))))
            if self.on_step:
                self.on_step(m.group(2).lower(), name)
            return
        num = line.split(" ", 1)[0].lstrip("#")
        if num.isdigit():
            self.output.setdefault(num, []).append(line.split(" ", 2)[-1] if line.count(" ") >= 2 else line)

    def failure(self, tail: list[str]) -> tuple[str, list[str]]:
        if self.failed:
            return self.names.get(self.failed, f"step #{self.failed}"), self.output.get(self.failed, [])[-25:]
        return "(unknown step)", tail[-25:]


def build_image(build_dir: Path, readable_tag: str, repo: str, secrets: BuildSecrets,
                on_step: Optional[Callable[[str, str], None]] = None,
                extra_args: tuple[str, ...] = ()) -> BuildResult:
    """Build `build_dir` and tag it `repo:readable_tag` and `repo:<content tag>`.

    Parameters
    ----------
    build_dir:
        A directory written by :func:`envbuild.render.write_build_dir`.
    readable_tag, repo:
        Where the image is tagged (after success only).
    secrets:
        Mirrors and CA, passed as BuildKit secrets.
    on_step:
        Callback ``(event, step name)`` for progress display.

    Raises
    ------
    EnvbuildError
        With the failing step, its last lines and the log path; nothing is tagged.
    """
    cli = docker_cli()
    log_path = build_dir / LOG_NAME
    ctag = content_tag(readable_tag, build_dir)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="envbuild-secrets-") as tmp:
        iidfile = Path(tmp) / "iid"
        # ENVBUILD_DOCKER_BUILD_ARGS: extra `docker build` flags (e.g. --no-cache, --pull).
        env_args = shlex.split(os.environ.get("ENVBUILD_DOCKER_BUILD_ARGS", ""))
        cmd = [cli, "build", "--network", "host", "--progress", "plain", "--iidfile", str(iidfile),
               *_secret_args(secrets, Path(tmp)), *env_args, *extra_args, str(build_dir)]
        env = {**os.environ, "DOCKER_BUILDKIT": "1"}
        progress = _Progress(on_step)
        tail: list[str] = []
        with open(log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            try:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                        text=True, errors="replace", bufsize=1)
            except OSError as e:
                raise EnvbuildError(f"cannot run {cli}: {e.strerror}.") from None
            assert proc.stdout
            for line in proc.stdout:
                log.write(line)
                line = line.rstrip("\n")
                tail = (tail + [line])[-40:]
                progress.feed(line)
            rc = proc.wait()
        if rc != 0:
            step, lines = progress.failure(tail)
            daemon = "Cannot connect to the Docker daemon" in "\n".join(tail)
            hint = " Is dockerd running? (scripts/host-setup.sh starts one.)" if daemon else ""
            raise EnvbuildError(
                f"image build failed at step {step}.{hint} Last lines:\n    " + "\n    ".join(lines)
                + f"\nFull log: {log_path}. No tag was applied.", exit_code=1)
        image_id = iidfile.read_text().strip()
    tags = [f"{repo}:{readable_tag}", f"{repo}:{ctag}"]
    for t in tags:
        r = subprocess.run([cli, "tag", image_id, t], capture_output=True, text=True)
        if r.returncode != 0:
            raise EnvbuildError(f"built {image_id} but could not tag it {t}: {r.stderr.strip()}", exit_code=1)
    return BuildResult(image_id, tags, log_path, time.monotonic() - start, progress.steps)
