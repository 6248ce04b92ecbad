"""The enroot artifact of an image: a squashfs file that `srun --container-image=/shared/x.sqsh`
(pyxis) or `enroot create` starts without importing, made once and staged on shared storage
(:mod:`envbuild.builds.staging`).

`export_sqsh` does what `enroot import dockerd://IMAGE` does (enroot v4.1.2, src/docker.sh:
`docker create` + `docker export` into a rootfs without /dev/* and /.dockerenv, permissions
fixed as `common::fixperms` does, then `docker::configure` writes /etc/environment from the
image's Env, /etc/fstab from its Volumes, /etc/rc from its labels, WorkingDir, Entrypoint and
Cmd, an empty /etc/rc.local; `mksquashfs -all-root`), with what makes it reproducible: the same
image gives the same bytes (fixed superblock time, fixed times on the files envbuild writes,
no time-dependent compression), so the file's sha256 identifies the image.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import sha256_file, temp_path
from envbuild.base.grammar import escaped

COMPRESSIONS = {"zstd": ["-comp", "zstd", "-Xcompression-level", "3"], "gzip": ["-comp", "gzip"],
                "none": ["-noI", "-noD", "-noF", "-noX"]}  # enroot/squashfuse read all three
FIXED_TIME = 0  # the superblock's time and the files envbuild writes: the same bytes every time
SUFFIX = ".sqsh"
# What `docker create` adds to a container's filesystem, with the time it ran: the mount points of
# the files it injects (and their directories). Their times are fixed so an export is reproducible.
DOCKER_MADE = ("", "etc", "etc/hosts", "etc/hostname", "etc/resolv.conf", "etc/mtab", "dev", "proc", "sys")


@dataclass(frozen=True)
class Sqsh:
    path: Path
    sha256: str
    size: int


# ---------------------------------------------------------------- what enroot writes into the rootfs


def _quote(word: str) -> str:
    """bash's ${word@Q} for printable text: 'word', with ' written as '\\''."""
    return "'" + word.replace("'", "'\\''") + "'"


def enroot_files(config: dict) -> dict[str, bytes]:
    """/etc/environment, /etc/fstab, /etc/rc and /etc/rc.local as enroot v4.1.2's
    docker::configure writes them from an image config (the `Config` object: Env, Volumes,
    Labels, WorkingDir, Entrypoint, Cmd).

    >>> files = enroot_files({"Env": ["PATH=/usr/bin"], "Entrypoint": ["/e.sh"], "Cmd": ["/bin/bash"],
    ...                       "Labels": {"a": "b"}})
    >>> print(files["etc/rc"].decode())
    # a b
    <BLANKLINE>
    mkdir -p "/" 2> /dev/null
    cd "/" && unset OLDPWD || exit 1
    <BLANKLINE>
    if [ -s /etc/rc.local ]; then
        . /etc/rc.local
    fi
    <BLANKLINE>
    if [ $# -gt 0 ]; then
        exec '/e.sh' "$@"
    else
        exec '/e.sh' '/bin/bash'
    fi
    <BLANKLINE>
    """
    env = "".join(f"{line}\n" for line in config.get("Env") or [])
    fstab = "".join(f"${{ENROOT_ROOTFS}}{v} {v} none x-create=dir,bind,rw,nosuid,nodev\n"
                    for v in sorted(config.get("Volumes") or {}))
    labels = "".join(f"# {k} {str(v).replace(chr(10), ' ')}\n" for k, v in (config.get("Labels") or {}).items())
    entrypoint = [_quote(w) for w in config.get("Entrypoint") or []]
    cmd = [_quote(w) for w in config.get("Cmd") or []]
    if not entrypoint and not cmd:
        cmd = [_quote("/bin/sh")]
    workdir = config.get("WorkingDir") or "/"
    ep = " ".join(entrypoint)
    rc = (labels + ("\n" if labels else "")
          + f'mkdir -p "{workdir}" 2> /dev/null\n'
          + f'cd "{workdir}" && unset OLDPWD || exit 1\n\n'
          + "if [ -s /etc/rc.local ]; then\n    . /etc/rc.local\nfi\n\n"
          + "if [ $# -gt 0 ]; then\n"
          + f'    exec {ep} "$@"\n'
          + "else\n"
          + f"    exec {' '.join([*entrypoint, *cmd])}\n"
          + "fi\n")
    rclocal = ("# This file is sourced by /etc/rc when the container starts.\n"
               "# It can be used to manipulate the entrypoint or the command of the container.\n")
    return {"etc/environment": env.encode(), "etc/fstab": fstab.encode(), "etc/rc": rc.encode(),
            "etc/rc.local": rclocal.encode()}


# ---------------------------------------------------------------- export


MKSQUASHFS_FROM = "Debian and Ubuntu: apt-get install squashfs-tools"  # where the tool comes from, said once


def _mksquashfs() -> str:
    found = shutil.which("mksquashfs")
    if not found:
        raise EnvbuildError(f"envbuild export --enroot needs mksquashfs ({MKSQUASHFS_FROM}; it is what enroot itself "
                            f"uses).")
    return found


def _docker(cli: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([cli, *args], capture_output=True, **kw)


def local_image(image: str, cli: Optional[str] = None) -> dict:
    """`docker image inspect IMAGE` (Id, Size, Config), or a refusal naming what to do."""
    r = _docker(cli or shutil.which("docker") or "/usr/bin/docker", "image", "inspect", image, text=True)
    if r.returncode != 0:
        raise EnvbuildError(f"{escaped(image)}: no such local image ({(r.stderr or r.stdout).strip()[:200]}); build it "
                            f"(envbuild build) or pull it first, or give a .sqsh file.")
    return json.loads(r.stdout)[0]


def _remove_stale_exports(cli: str) -> None:
    """What an export killed with SIGKILL left: its container and its (gigabytes of) rootfs,
    both named with the dead process's ID."""
    def dead(pid: str) -> bool:
        return pid.isdigit() and not os.path.exists(f"/proc/{pid}")

    for path in Path(tempfile.gettempdir()).glob("envbuild-export-*-*"):
        if path.is_dir() and dead(path.name.split("-")[2]):
            shutil.rmtree(path, ignore_errors=True)
    names = _docker(cli, "ps", "-a", "--filter", "name=envbuild-export-", "--format", "{{.Names}}", text=True)
    for name in names.stdout.split():
        if dead(name.split("-")[2]):
            _docker(cli, "rm", "-f", name)


def export_sqsh(image: str, out: Path, compression: str = "zstd", docker_cli: Optional[str] = None,
                progress: Callable[[str], None] = lambda _: None) -> Sqsh:
    """Write `image`'s enroot squashfs to `out` (refused if `out` exists: a file is never replaced).

    Run as root (as `enroot import` needs to be for images with root-owned files it must read);
    the rootfs is extracted into a temporary directory beside nothing of the user's and removed.
    """
    if compression not in COMPRESSIONS:
        raise EnvbuildError(f"--compression {compression}: not one enroot reads; choose {', '.join(COMPRESSIONS)}.")
    out = Path(out)
    if os.path.lexists(out):
        raise EnvbuildError(f"{out} exists; envbuild export never replaces a file. Remove it, or choose another "
                            f"-o/--output.")
    mksquashfs = _mksquashfs()
    cli = docker_cli or shutil.which("docker") or "/usr/bin/docker"
    attrs = local_image(image, cli)
    config = attrs.get("Config") or {}
    _remove_stale_exports(cli)
    work = Path(tempfile.mkdtemp(prefix=f"envbuild-export-{os.getpid()}-"))
    container = f"envbuild-export-{os.getpid()}-{int(time.time())}"
    try:
        created = _docker(cli, "create", "--name", container, attrs["Id"], text=True)
        if created.returncode != 0:
            raise EnvbuildError(f"envbuild export: cannot create a container of {image}: {created.stderr.strip()[:300]}")
        rootfs = work / "rootfs"
        rootfs.mkdir()
        progress(f"extracting {image}")
        _extract(cli, container, image, rootfs)
        _as_enroot_imports(rootfs, config)
        tmp = temp_path(out)
        progress(f"writing {out} ({compression})")
        squash = subprocess.run([mksquashfs, str(rootfs), str(tmp), "-all-root", "-noappend", "-no-progress",
                                 "-mkfs-time", str(FIXED_TIME), "-no-xattrs", *COMPRESSIONS[compression]],
                                capture_output=True, text=True)
        if squash.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise EnvbuildError(f"envbuild export: mksquashfs failed: {squash.stderr.strip()[-400:]}")
        os.replace(tmp, out)
    finally:
        _docker(cli, "rm", "-f", container)
        shutil.rmtree(work, ignore_errors=True)
    return Sqsh(out, sha256_file(out), out.stat().st_size)


def _extract(cli: str, container: str, image: str, rootfs: Path) -> None:
    """The container's filesystem into `rootfs`, owners and modes kept (tar -p), without /dev's
    entries or docker's .dockerenv marker."""
    exporter = subprocess.Popen([cli, "export", container], stdout=subprocess.PIPE)
    tar = subprocess.run(["tar", "-C", str(rootfs), "--warning=no-timestamp", "--anchored", "--exclude=dev/*",
                          "--exclude=.dockerenv", "-px"], stdin=exporter.stdout, capture_output=True)
    exporter.stdout.close()
    if exporter.wait() != 0 or tar.returncode != 0:
        raise EnvbuildError(f"envbuild export: extracting {image} failed: {tar.stderr.decode()[-300:]}")


def _as_enroot_imports(rootfs: Path, config: dict) -> None:
    """What `enroot import` does to a rootfs before squashing it, with fixed times (reproducible)."""
    # enroot's common::fixperms: every file readable (and directories writable) by the owner
    subprocess.run(["chmod", "-f", "-R", "u+rX", str(rootfs)], check=False)
    subprocess.run(["find", str(rootfs), "-maxdepth", "15", "-type", "d", "!", "-perm", "-u=w", "-exec",
                    "chmod", "-f", "u+w", "{}", "+"], check=False)
    (rootfs / "etc").mkdir(exist_ok=True)
    for rel, data in enroot_files(config).items():
        path = rootfs / rel
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_bytes(data)
        os.chmod(path, 0o644)
        os.utime(path, (FIXED_TIME, FIXED_TIME))
    for rel in DOCKER_MADE:  # what `docker create` made, and its directories, stamped with its own time
        if os.path.lexists(rootfs / rel):
            os.utime(rootfs / rel, (FIXED_TIME, FIXED_TIME), follow_symlinks=False)
