"""Build images: secrets for mirrors and CAs, progress, a full log, and two tags (readable +
content) applied only after the whole build succeeded.

The engine (:mod:`envbuild.engine`; Docker with BuildKit by default) runs the build; this
module names the tags and words the failure, the same for every engine.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .engine import BuildFailed, BuildSecrets, Engine, get_engine
from .errors import EnvbuildError
from .output import RECORD, recorded_files
from .registry import CONTENT_TAG_DIGITS, check_readable_tag

LOG_NAME = "build.log"

__all__ = ["BuildResult", "BuildSecrets", "LOG_NAME", "build_image", "content_hash", "content_tag"]


@dataclass
class BuildResult:
    image_id: str
    tags: list[str]
    log: Path
    seconds: float
    steps: list[tuple[str, float]] = field(default_factory=list)


def content_hash(build_dir: Path) -> str:
    """sha256 over every file envbuild rendered (path, mode, bytes): the files its record
    lists, so a build.log, a .sif or the user's own files beside them change nothing."""
    rendered = recorded_files(build_dir)
    if not rendered:
        raise EnvbuildError(f"{build_dir} has no {RECORD}: it is not a directory envbuild rendered, so its "
                            f"content tag would vouch for nothing; render it with `envbuild render -o {build_dir}`.")
    h = hashlib.sha256()
    for rel in rendered:
        p = build_dir / rel
        h.update(f"{rel}\0{p.stat().st_mode & 0o111 != 0}\0".encode())
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def content_tag(readable: str, build_dir: Path) -> str:
    """The immutable tag: the readable tag plus 12 hex digits of the rendered inputs."""
    return f"{check_readable_tag(readable, 'the readable tag')}-{content_hash(build_dir)[:CONTENT_TAG_DIGITS]}"


def build_image(build_dir: Path, readable_tag: str, repo: str, secrets: BuildSecrets,
                on_step: Optional[Callable[[str, str], None]] = None,
                extra_args: tuple[str, ...] = (), engine: Optional[Engine] = None) -> BuildResult:
    """Build `build_dir` and tag it `repo:readable_tag` and `repo:<content tag>`.

    Parameters
    ----------
    build_dir:
        A directory written by :func:`envbuild.render.write_build_dir`.
    readable_tag, repo:
        Where the image is tagged (after success only).
    secrets:
        Mirrors and CA, passed as build secrets.
    on_step:
        Callback ``(event, step name)`` for progress display.
    engine:
        The container engine (default: :func:`envbuild.engine.get_engine`).

    Raises
    ------
    EnvbuildError
        With the failing step, its last lines and the log path; nothing is tagged.
    """
    engine = engine or get_engine()
    log_path = build_dir / LOG_NAME
    tags = [f"{repo}:{readable_tag}", f"{repo}:{content_tag(readable_tag, build_dir)}"]
    start = time.monotonic()
    try:
        outcome = engine.build(build_dir, tags, secrets, log_path, on_step=on_step, extra_args=extra_args)
    except BuildFailed as failed:
        raise EnvbuildError(
            f"image build failed at step {failed.step}.{failed.hint} Last lines:\n    " + "\n    ".join(failed.lines)
            + f"\nFull log: {log_path}. No tag was applied.", exit_code=1) from None
    return BuildResult(outcome.image_id, tags, log_path, time.monotonic() - start, outcome.steps)
