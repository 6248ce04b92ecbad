"""The image a log came from, for the signatures that compare a log with it (`image:` in
matrices/known_issues.yaml): its manifest, named with `envbuild doctor --manifest`, or the
image's own /opt/envbuild/manifest.json when doctor runs inside an envbuild image.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.image import paths
from envbuild.doctor.reading import read_regular

MANIFEST_LIMIT = 1 << 20  # an image's manifest is a few KiB
VERSION = re.compile(r"\d+(?:\.\d+){1,3}")
FACTS = ("nccl",)  # what a signature can compare with (KnownIssue.image)


@dataclass(frozen=True)
class Image:
    manifest: str
    tag: Optional[str]
    facts: dict[str, Optional[str]]

    def as_dict(self) -> dict:
        return {"manifest": self.manifest, "tag": self.tag, **self.facts}

    def describe(self) -> str:
        pinned = ", ".join(f"{name.upper()} {value}" for name, value in self.facts.items() if value)
        return (f"Image: {self.tag or '(untagged)'} ({self.manifest}): "
                + (f"{pinned}; the log's versions are compared with it." if pinned else
                   "the manifest pins no NCCL, so the log's NCCL version is not compared."))


def read_image(path: str) -> Image:
    """The facts of the manifest at `path`; exit 2 naming the file when it is not an envbuild manifest."""
    data = read_regular(path, "--manifest", MANIFEST_LIMIT)
    hint = f"give an image's manifest.json (`docker run --rm IMAGE cat {paths.MANIFEST}`)"
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise EnvbuildError(f"--manifest {path} is not JSON ({e}); {hint}.") from None
    if not isinstance(manifest, dict) or "torch" not in manifest:
        raise EnvbuildError(f"--manifest {path} is not an envbuild manifest (a JSON object with `torch`); {hint}.")
    facts: dict[str, Optional[str]] = {}
    for name in FACTS:
        value = manifest.get(name)
        if value is not None and not (isinstance(value, str) and VERSION.fullmatch(value)):
            raise EnvbuildError(f"--manifest {path}: `{name}` is {value!r}, not a version such as 2.21.5; {hint}.")
        facts[name] = value
    tag = manifest.get("tag")
    return Image(path, tag if isinstance(tag, str) else None, facts)


def find_image(explicit: Optional[str], environ=None) -> Optional[Image]:
    """--manifest, else the manifest of the image doctor runs in ($ENVBUILD_MANIFEST or
    /opt/envbuild/manifest.json, where it exists), else None: no comparison with an image."""
    if explicit:
        return read_image(explicit)
    environ = os.environ if environ is None else environ
    own = environ.get(paths.MANIFEST_ENV) or paths.MANIFEST
    return read_image(own) if os.path.isfile(own) else None
