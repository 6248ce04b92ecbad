"""Build images: secrets for mirrors and CAs, progress, a full log, and two tags (readable +
content) applied only after the whole build succeeded.

The engine (:mod:`envbuild.engine`; Docker with BuildKit by default) runs the build; this
module names the tags and words the failure, the same for every engine.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import redact
from envbuild.engine import BuildFailed, BuildSecrets, Engine, RegistryError, get_engine
from envbuild.oci.registry import CONTENT_TAG_DIGITS, check_readable_tag
from envbuild.render.output import RECORD, recorded_files

LOG_NAME = "build.log"
STAGE_LOG_NAME = "builder-stage.log"  # with a layer cache, the builder stage is built first, on its own

__all__ = ["BuildResult", "BuildSecrets", "LOG_NAME", "LayerCache", "build_image", "check_compile_cache", "compiles",
           "content_hash", "content_tag"]

BUILDER_STAGE = "builder"  # the stage of a stack's Dockerfile that compiles (templates/docker/Dockerfile.j2)


@dataclass(frozen=True)
class LayerCache:
    """Where a publish job's layers are cached between runs, in the registry it publishes to.

    Docker 20.10's BuildKit (Debian's) exports a cache only inline, in the image it builds, and
    only for that image's own stage. So each variant has two references: the builder stage,
    built on its own (``--target builder``) and pushed to ``builder`` (``REPO:<tag>-<arch>-builder``:
    the compilers' work, DeepSpeed's ops and the CUDA extensions), and the published image itself
    (``final``: its per-platform tag). A run imports both (``--cache-from``) and so, on an empty
    engine, pulls what an unchanged job built instead of building it again. The builder image
    holds what the builder stage's layers hold: mirrors, CA and tokens are secret mounts and reach
    no layer (tests/docker/test_docker_e2e.py scans the builder stage too)."""
    builder: str
    final: str

    def args(self) -> tuple[str, ...]:
        return ("--build-arg", "BUILDKIT_INLINE_CACHE=1", "--cache-from", self.builder, "--cache-from", self.final)


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
                extra_args: tuple[str, ...] = (), engine: Optional[Engine] = None,
                cache: Optional[LayerCache] = None, say: Callable[[str], None] = lambda _: None) -> BuildResult:
    """Build `build_dir` and tag it `repo:readable_tag` and `repo:<content tag>`.

    Parameters
    ----------
    build_dir:
        A directory written by :func:`envbuild.render.builddir.write_build_dir`.
    readable_tag, repo:
        Where the image is tagged (after success only).
    secrets:
        Mirrors and CA, passed as build secrets.
    on_step:
        Callback ``(event, step name)`` for progress display.
    engine:
        The container engine (default: :func:`envbuild.engine.get_engine`).
    cache:
        A publish job's layer cache in its registry: imported, and exported for the next run.

    Raises
    ------
    EnvbuildError
        With the failing step, its last lines and the log path; nothing is tagged.
    """
    engine = engine or get_engine()
    log_path = build_dir / LOG_NAME
    tags = [f"{repo}:{readable_tag}", f"{repo}:{content_tag(readable_tag, build_dir)}"]
    start = time.monotonic()
    staged = False
    if cache:
        extra_args = (*cache.args(), *extra_args)
        staged = _build_stage(engine, build_dir, cache, secrets, log_path, on_step, extra_args, say)
    try:
        outcome = engine.build(build_dir, tags, secrets, log_path, on_step=on_step, extra_args=extra_args)
    except BuildFailed as failed:
        raise _failed(failed, log_path) from None
    finally:
        if staged:
            _untag(engine, cache.builder)
    return BuildResult(outcome.image_id, tags, log_path, time.monotonic() - start, outcome.steps)


def _untag(engine: Engine, ref: str) -> None:
    """The builder stage's tag goes once the image is built: until then it holds the stage's
    layers, so the engine's build-cache collector cannot free what the runtime stage's COPY
    --from=builder reads (the layers stay in the build cache; the tag was for the push)."""
    try:
        engine.untag(ref)
    except Exception:  # another engine's untag, or gone already: nothing to free
        pass


def _failed(failed: BuildFailed, log_path: Path) -> EnvbuildError:
    return EnvbuildError(
        f"image build failed at step {failed.step}.{failed.hint} Last lines:\n    " + "\n    ".join(failed.lines)
        + f"\nFull log: {log_path}. No tag was applied.", exit_code=1)


def _build_stage(engine: Engine, build_dir: Path, cache: LayerCache, secrets: BuildSecrets, log_path: Path,
                 on_step, extra_args: tuple[str, ...], say: Callable[[str], None]) -> bool:
    """The builder stage on its own, tagged and pushed as its cache image; the whole build after
    it takes that stage from the engine's own cache. A push that fails costs the next run its
    compiles, never this run its image: it is said, and the build goes on. True when the stage
    was tagged (the caller untags it after the whole build)."""
    if f" AS {BUILDER_STAGE}\n" not in (build_dir / "Dockerfile").read_text():
        return False
    try:
        engine.build(build_dir, [cache.builder], secrets, log_path.with_name(STAGE_LOG_NAME), on_step=on_step,
                     extra_args=("--target", BUILDER_STAGE, *extra_args))
    except BuildFailed as failed:
        raise _failed(failed, log_path.with_name(STAGE_LOG_NAME)) from None
    try:
        engine.push(cache.builder)
        say(f"layer cache: the builder stage is {cache.builder}")
    except (EnvbuildError, RegistryError) as e:
        say(f"warning: layer cache: {cache.builder} was not pushed ({e.message}); the next run builds this stage again")
    except BaseException:  # Ctrl-C during the push: the tag goes with the run
        _untag(engine, cache.builder)
        raise
    return True


def check_compile_cache(secrets: BuildSecrets, timeout: float = 5.0) -> None:
    """A Redis compile cache answers PING before anything builds: a cache that does not answer
    is exit 2 in the first seconds, naming it, not a build step failing an hour in (the step
    checks it again with a probe compile, and so do S3 and the GitHub Actions cache, which
    cannot be asked from here without their SDKs)."""
    lines = dict(line.split("=", 1) for line in (secrets.compile_cache or "").splitlines() if "=" in line)
    url = lines.get("SCCACHE_REDIS_ENDPOINT")
    if not url:
        return
    parts = urlsplit(url)
    shown = redact(url) + (" (with a password)" if lines.get("SCCACHE_REDIS_PASSWORD") else "")
    try:
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=timeout) as raw:
            sock = (ssl.create_default_context().wrap_socket(raw, server_hostname=parts.hostname)
                    if parts.scheme.lower() == "rediss" else raw)
            auth = [a for a in (lines.get("SCCACHE_REDIS_USERNAME"), lines.get("SCCACHE_REDIS_PASSWORD")) if a]
            commands = ([["AUTH", *auth]] if auth else []) + [["PING"]]
            sock.sendall(b"".join(_resp(c) for c in commands))
            replies = sock.recv(4096).decode("utf-8", "replace").splitlines()
    except (OSError, ssl.SSLError) as e:
        raise EnvbuildError(f"--compile-cache {shown}: nothing answers there ({e.strerror or e}); start the cache "
                            f"(scripts/host-setup.sh starts a Redis on 127.0.0.1:6379 with ENVBUILD_REDIS=1) or leave "
                            f"--compile-cache out (every unit is then compiled). Nothing was built.") from None
    wrong = [r for r in replies if r.startswith("-")]
    if wrong or not any(r == "+PONG" for r in replies):
        said = (wrong or replies or ["nothing"])[0][:200]
        raise EnvbuildError(f"--compile-cache {shown}: the server answered {said!r}, not PONG (a wrong or missing password: "
                            f"redis://:PASSWORD@HOST:PORT); nothing was built.")


def _resp(words: list[str]) -> bytes:
    """One Redis command in its wire format (RESP arrays of bulk strings)."""
    out = f"*{len(words)}\r\n".encode()
    for w in words:
        b = w.encode()
        out += f"${len(b)}\r\n".encode() + b + b"\r\n"
    return out


_COMPILES = re.compile(r"envbuild: compiles (\{[^\n]{0,4000}\})$", re.M)


def compiles(log_text: str) -> dict:
    """What a build's compiling steps compiled, summed from their `envbuild: compiles` lines
    (lib.sh compile_cache_report): each compiler's runs and the compile cache's hits, misses and
    errors by category; {} when no step compiled (a step the layer cache served prints none). A
    line that is not one the steps write is skipped: the log also holds what builds printed."""
    total: dict = {}
    for line in _COMPILES.findall(log_text):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        for what in ("runs", "hits", "misses", "errors"):
            counts = data.get(what, {}) if isinstance(data, dict) else {}
            for name, n in (counts.items() if isinstance(counts, dict) else ()):
                if isinstance(name, str) and len(name) <= 64 and isinstance(n, int) and 0 <= n < 10 ** 9:
                    total.setdefault(what, {})[name] = total.get(what, {}).get(name, 0) + n
    return total
