"""The compiled wheels' build cache, named once for both sides: the plan mounts it in the
builder and records what it built there; `envbuild ext-cache` and the publish job read the same
mount and records back on another machine (builds/extcache.py), without building a plan."""

from __future__ import annotations

EXTENSION_CACHE_ID = "envbuild-ext"  # the BuildKit cache mount shared by every build of this machine
EXTENSION_SPEC = "extensions.json"  # under envbuild/ in the build directory: what extensions.py builds
DEEPSPEED_RECORD = "deepspeed.json"  # under envbuild/ in the build directory: the DeepSpeed wheel's cache key


def cache_mount(cache_id: str, target: str) -> str:
    """A BuildKit cache mount as every envbuild build (and `ext-cache`) asks for it: `locked`, so
    two builds never write one cache at once.

    >>> cache_mount("envbuild-ext", "/var/cache/envbuild-ext")
    '--mount=type=cache,id=envbuild-ext,target=/var/cache/envbuild-ext,sharing=locked'
    """
    return f"--mount=type=cache,id={cache_id},target={target},sharing=locked"
