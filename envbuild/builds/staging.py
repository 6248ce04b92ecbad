"""An image's enroot .sqsh on a cluster's shared storage, and the .sqsh published beside an image.

`stage` puts such a file on a cluster's shared storage once, keyed by the image ID: a lock so
two jobs staging at once import once, a free-space check before writing, a copy under a
temporary name verified against its checksum before it takes the final name, and a refusal,
with the checksum, of a partial or corrupt file found there. What it stages
(`staging_source`) is a .sqsh file (its superblock checked first), the .sqsh published beside
an image in a registry (downloaded by digest), or a local image exported here
(:mod:`envbuild.builds.enroot`).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import (
    locked,
    open_regular,
    owned_file,
    remove_stale_temps,
    replace_owned,
    sha256_file,
    still,
    temp_path,
    write_atomic,
)
from envbuild.base.grammar import escaped
from envbuild.builds.enroot import SUFFIX, export_sqsh, local_image
from envbuild.engine import RegistryError, get_engine
from envbuild.oci.artifacts import Descriptor, is_index, parse_index, parse_manifest
from envbuild.oci.artifacts import client as registry_client
from envbuild.oci.registry import ANY_MANIFEST, check_image_reference, registry_of, split_reference

CHECKSUM_SUFFIX = ".sqsh.sha256"
# The .sqsh published beside an image (`envbuild publish`): an OCI artifact whose subject is the
# image's manifest digest, one layer holding the file.
SQSH_TYPE = "application/vnd.envbuild.enroot.sqsh.v1"


# ---------------------------------------------------------------- stage


def staged_name(image_id: str) -> str:
    """The name a staged file has: the image ID (the sha256 of its config), so one image is
    staged once whatever its tags.

    >>> staged_name("sha256:" + "ab" * 32)
    'envbuild-abababababab.sqsh'
    """
    return f"envbuild-{image_id.split(':', 1)[-1][:12]}{SUFFIX}"


@dataclass(frozen=True)
class Staged:
    path: Path
    sha256: str
    copied: bool  # False: it was there already (verified), nothing was exported or copied


def _verify(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise EnvbuildError(f"{path} is partial or corrupt: its sha256 is {got[:16]}..., its checksum file "
                            f"({path.name.removesuffix(SUFFIX)}{CHECKSUM_SUFFIX}) says {expected[:16]}.... Remove both "
                            f"and stage again.")


def check_stage_directory(directory: Path) -> Path:
    """--to: an existing directory (checked before any registry is asked or anything exported)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise EnvbuildError(f"stage directory {escaped(str(directory))} does not exist; create it on the shared "
                            f"filesystem the compute nodes mount (e.g. /shared/containers), or choose another --to.")
    return directory


def stage(directory: Path, name: str, need_bytes: int, produce: Callable[[Path], str], wait: float = 3600,
          progress: Callable[[str], None] = lambda _: None) -> Staged:
    """Put a file at `directory/name` once: `produce(path)` writes it there under a temporary name
    and returns the sha256 it must have (an export: the file's own; a copy: its source's).

    Two runs at once: the second waits for the first's lock (a POSIX lock on
    `directory/.envbuild-stage.lock`, which NFS honours) and then finds the file there, verified,
    without producing it again. Before producing: `need_bytes` free (plus 5 %). The new file is
    fsynced and checked against the sha256 before it takes its name; the sha256 goes beside it
    (`NAME.sha256`, `sha256sum -c` format). A file found there whose sha256 is not its checksum
    file's (a partial copy, a corrupt disk) is refused, not used."""
    directory = check_stage_directory(directory)
    final, checksum = directory / name, directory / (name.removesuffix(SUFFIX) + CHECKSUM_SUFFIX)
    with locked(directory, "staging into", wait, lock_file=".envbuild-stage.lock", progress=progress):
        remove_stale_temps(directory, recursive=False)  # what a killed stage left (we hold the lock)
        refusal = "envbuild stages only where nothing is, or where it staged before: remove it, or choose another --to."
        found = owned_file(final, lambda f: True, refusal)  # a regular file, not a link, device or FIFO
        written = owned_file(checksum, lambda f: bool(re.fullmatch(rb"[0-9a-f]{64}  " + re.escape(name.encode()) + rb"\n",
                                                                   f.read(len(name) + 68))), refusal)
        if found:
            if not written:
                raise EnvbuildError(f"{final} exists without its checksum file {checksum.name}: envbuild did not "
                                    f"finish staging it (or another tool wrote it); remove it and stage again.")
            expected = checksum.read_text().split()[0]
            _verify(final, expected)
            return Staged(final, expected, copied=False)
        free = shutil.disk_usage(directory).free
        if free < need_bytes * 1.05:
            raise EnvbuildError(f"{directory} has {free / 2**30:.2f} GiB free; staging {name} needs "
                                f"{need_bytes * 1.05 / 2**30:.2f} GiB. Nothing was written.")
        tmp = temp_path(final)
        try:
            expected = produce(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            got = sha256_file(tmp)
            if got != expected:
                raise EnvbuildError(f"the file written at {tmp} does not match (sha256 {got[:16]}... against "
                                    f"{expected[:16]}...): the filesystem lost data; nothing was staged.")
            os.chmod(tmp, 0o644)
            replace_owned(tmp, final, None, refusal)
            still(checksum, written, refusal)
            write_atomic(checksum, f"{expected}  {final.name}\n".encode())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return Staged(final, expected, copied=True)


# The squashfs superblock (Linux fs/squashfs/squashfs_fs.h, struct squashfs_super_block): 96
# bytes, little-endian; what `stage` checks before it copies a .sqsh to shared storage.
SQUASHFS_MAGIC = b"hsqs"
SUPERBLOCK = struct.Struct("<4sIIIIHHHHHHQQQQQQQQ")  # magic ... lookup_table_start


def check_squashfs(path: Path) -> None:
    """`path` is a squashfs image that enroot can mount: a regular file with the squashfs magic,
    a version 4 superblock whose block size is a power of two from 4 KiB to 1 MiB and whose
    filesystem fits in the file; and, where unsquashfs is installed, one it reads. Checked
    before anything is copied to shared storage (random bytes or an empty file named .sqsh
    were staged with the sha256 of whatever they held)."""
    refusal = ("give a .sqsh that `envbuild export --enroot` (or `enroot import`) wrote, or the image itself: "
               "`envbuild stage IMAGE --to DIR` exports it")
    with open_regular(path, "stage", "squashfs") as f:
        head = f.read(SUPERBLOCK.size)
        size = os.fstat(f.fileno()).st_size
    if len(head) < SUPERBLOCK.size or head[:4] != SQUASHFS_MAGIC:
        what = "empty" if not head else f"{len(head)} bytes long" if len(head) < SUPERBLOCK.size else "not a squashfs"
        raise EnvbuildError(f"stage {escaped(str(path))} is {what}: a squashfs image starts with a {SUPERBLOCK.size}-byte superblock "
                            f"and the magic 'hsqs'; nothing was staged. {refusal[0].upper()}{refusal[1:]}.")
    fields = SUPERBLOCK.unpack(head)
    block_size, block_log, major, bytes_used = fields[3], fields[6], fields[9], fields[12]
    # struct squashfs_super_block (linux fs/squashfs/squashfs_fs.h): a filesystem has its root inode and
    # one uid/gid at least, and its id, inode and directory tables lie after the superblock, inside it;
    # `unsquashfs -s` reads the superblock alone, so a forged one passed it
    inodes, ids, tables = fields[1], fields[8], (fields[13], fields[15], fields[16])
    problem = (f"its squashfs version is {major}, not 4 (enroot's mksquashfs writes 4)" if major != 4 else
               f"its block size {block_size} is not a power of two from 4 KiB to 1 MiB"
               if block_size not in [1 << n for n in range(12, 21)] or 1 << block_log != block_size else
               f"its superblock says the filesystem is {bytes_used} bytes and the file has {size}: it is cut short"
               if bytes_used > size else
               f"its superblock counts {inodes} inodes and {ids} ids and places its tables at {list(tables)}, outside "
               f"the {bytes_used} bytes after the superblock" if inodes < 1 or ids < 1
               or not all(SUPERBLOCK.size <= t < bytes_used for t in tables) else None)
    if problem is None and shutil.which("unsquashfs"):
        done = subprocess.run(["unsquashfs", "-s", str(path)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            problem = f"unsquashfs -s cannot read it ({(done.stderr or done.stdout).strip().splitlines()[-1:]})"
    if problem:
        raise EnvbuildError(f"stage {escaped(str(path))} is not a squashfs image enroot can mount: {problem}; nothing was "
                            f"staged. {refusal[0].upper()}{refusal[1:]}.")


def copy_producer(source: Path) -> Callable[[Path], str]:
    """Stage an existing .sqsh: copy it (its own sha256 is what the copy must have)."""
    want = sha256_file(source)

    def produce(dest: Path) -> str:
        with open(source, "rb") as src, open(dest, "xb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        return want
    return produce


# ---------------------------------------------------------------- the .sqsh published beside an image


@dataclass(frozen=True)
class Published:
    """The .sqsh a registry holds for one platform image of a reference."""

    registry: str
    name: str
    image_digest: str  # the platform image's manifest digest
    image_id: str      # its config digest (what the staged file is named by)
    layer: Descriptor  # the .sqsh blob: digest = sha256 of the file, size


def is_registry_reference(source: str) -> bool:
    """A reference that names its registry (HOST/NAME:TAG or HOST/NAME@DIGEST), not a local image."""
    host = registry_of(source)
    return host != "docker.io" and source.startswith(host + "/") and not source.endswith(SUFFIX)


def host_platform() -> str:
    machine = os.uname().machine.lower()
    return "linux/" + {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def published_sqsh(source: str, platform: Optional[str] = None) -> tuple[Optional[Published], str, str]:
    """UNVERIFIED (`stage --unverified`): the .sqsh attached beside `source`'s image for
    `platform` (this host's by default), or None; with the platform image's digest and config
    digest either way. No signature is checked (envbuild.supply.verify.signed_sqsh does): the one
    candidate is taken, and more than one is a refusal naming them, never a choice by position."""
    host = registry_of(source)
    name, tag, digest = split_reference(source)
    name = name[len(host) + 1:]
    client = registry_client(host)
    desc, body = client.manifest(name, digest or tag or "latest", ANY_MANIFEST)
    platform = platform or host_platform()
    if is_index(desc.media_type):
        entries = parse_index(body, f"the manifest list {escaped(source)}").manifests
        served = [m.platform.name() if m.platform else "linux/unknown" for m in entries]
        if platform not in served:
            raise EnvbuildError(f"{source} serves no {platform} image (it serves {', '.join(served)}); give --platform.")
        entry = entries[served.index(platform)]
        desc, body = client.manifest(name, entry.digest)
    doc = parse_manifest(body, f"the image manifest {host}/{name}@{desc.digest}")
    image_id = doc.config.digest if doc.config else ""
    layers = [layer for art in client.referrers(name, desc.digest, SQSH_TYPE) for layer in client.layers(name, art)]
    found = {layer.digest: layer for layer in layers}
    if len(found) > 1:
        raise EnvbuildError(f"{source}: {len(found)} .sqsh files are attached to {desc.digest[:19]}... "
                            f"({', '.join(found)}); unverified, none can be told from another. Stage with --key or "
                            f"--certificate-identity-regexp: the signed provenance names the one.", exit_code=1)
    if found and image_id:
        return Published(host, name, desc.digest, image_id, layers[0]), desc.digest, image_id
    return None, desc.digest, image_id


def download_producer(published: Published, progress: Callable[[str], None] = lambda _: None) -> Callable[[Path], str]:
    """Stage a published .sqsh: download it by digest, never more than its declared size; its
    sha256 is the digest it was published under."""
    def produce(dest: Path) -> str:
        step = max(published.layer.size // 10, 1 << 26)
        marks = {"next": step}

        def seen(n: int) -> None:
            if n >= marks["next"]:
                progress(f"downloaded {n / 2**20:.0f} of {published.layer.size / 2**20:.0f} MiB")
                marks["next"] += step
        registry_client(published.registry).fetch(published.name, published.layer, dest, progress=seen)
        return published.layer.digest.split(":", 1)[1]
    return produce


def source_kind(source: str) -> str:
    """What `envbuild stage` was given: 'file' (a .sqsh), 'registry' (a published image, its
    reference's grammar checked) or 'local' (an image of the local engine)."""
    if source.endswith(SUFFIX) and os.path.lexists(source):
        return "file"
    if is_registry_reference(source):
        check_image_reference("SOURCE", source)  # a newline in the host is no unreachable registry (exit 1)
        return "registry"
    return "local"


def staging_source(source: str, compression: str, platform: Optional[str] = None,
                   progress: Callable[[str], None] = lambda _: None,
                   verified: Optional[Callable[[str, Optional[str]], Published]] = None,
                   ) -> tuple[str, int, Callable[[Path], str]]:
    """(staged name, bytes needed, producer) for what `envbuild stage` is given: a .sqsh file
    (copied), a published image, or a local image (exported).

    A published image with `verified` (envbuild.supply.verify.signed_sqsh: the .sqsh its signed
    provenance names) stages that .sqsh or nothing. Without it (`--unverified`) the one .sqsh
    attached is downloaded, or where none is the image is pulled and exported here (or, the
    registry unreadable, a local image of that name), and the caller says the bytes are unverified."""
    kind = source_kind(source)
    if kind == "file":
        check_squashfs(Path(source))  # before anything is copied: a .sqsh that is none is refused
        return Path(source).name, Path(source).stat().st_size, copy_producer(Path(source))
    if kind == "registry" and verified is not None:
        found = verified(source, platform)
        progress(f"fetching the signed .sqsh of {source} ({found.layer.size / 2**20:.0f} MiB, sha256 "
                 f"{found.layer.digest[7:19]}...)")
        return staged_name(found.image_id), found.layer.size, download_producer(found, progress)
    if kind == "registry":
        return _unverified_source(source, compression, platform, progress)
    return _local_source(source, compression, progress)


def _unverified_source(source: str, compression: str, platform: Optional[str], progress: Callable[[str], None]):
    """staging_source of a published image without a signature checked (`stage --unverified`)."""
    try:
        found, digest, image_id = published_sqsh(source, platform)
    except EnvbuildError as e:  # a registry name this machine cannot read: its local image, if any
        if e.exit_code == 2 or _local_id(source) is None:
            raise
        progress(f"{source}: {e.message} Exporting the local image of that name instead.")
        return _local_source(source, compression, progress)
    if found is not None:
        progress(f"fetching the published .sqsh of {source} ({found.layer.size / 2**20:.0f} MiB, sha256 "
                 f"{found.layer.digest[7:19]}...)")
        return staged_name(image_id), found.layer.size, download_producer(found, progress)
    ref = f"{split_reference(source)[0]}@{digest}"
    progress(f"no .sqsh is published beside {source}; pulling {ref} and exporting it here")
    engine = get_engine()
    try:
        image = engine.pull(ref)
    except RegistryError as e:
        raise EnvbuildError(f"pulling {ref} failed: {e.message}", exit_code=1) from None
    return _local_source(image, compression, progress)


def _local_source(image: str, compression: str, progress: Callable[[str], None]):
    attrs = local_image(image)
    return (staged_name(attrs["Id"]), int(attrs.get("Size") or 0),
            lambda dest: export_sqsh(image, dest, compression, progress=progress).sha256)


def _local_id(image: str) -> Optional[str]:
    try:
        return local_image(image)["Id"]
    except EnvbuildError:
        return None
