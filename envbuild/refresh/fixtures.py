"""The package-index interface over saved real files: the offline tests and
`envbuild matrix refresh --offline DIR` read tests/fixtures/upstream through it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.refresh.pypi import DistFile, _parse_files


class FixtureIndex:
    """The Index interface over saved real files (offline tests, `--offline DIR`).

    Layout: `index/<project>.json` is a trimmed PEP 691 page; each artifact is a directory
    named after its file (`torch-2.5.1-cp39-cp39-manylinux1_x86_64.whl/`) holding the
    members that were read from it at their paths, plus SOURCE.txt (URL, sha256, what was kept).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / "index").is_dir():
            raise EnvbuildError(f"--offline {root}: not a fixture directory (it has no index/ folder "
                                f"of saved PEP 691 pages).")

    def files(self, project: str) -> list[DistFile]:
        path = self.root / "index" / f"{project}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise EnvbuildError(f"fixture index {path} cannot be read ({e}).") from None
        return _parse_files(project, data, str(path))

    def _dir(self, dist: DistFile) -> Path:
        d = self.root / dist.filename
        if not d.is_dir():
            raise EnvbuildError(f"the fixtures in {self.root} hold nothing of {dist.filename}; "
                                f"save its members in {d}/ with a SOURCE.txt.")
        return d

    def members(self, dist: DistFile) -> list[str]:
        d = self._dir(dist)
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != "SOURCE.txt")

    def member(self, dist: DistFile, name: str) -> bytes:
        path = self._dir(dist) / name
        if not path.is_file():
            raise EnvbuildError(f"{dist.filename} has no member {name} in the fixtures ({path}).")
        return path.read_bytes()

    def search_member(self, dist: DistFile, name: str, pattern: bytes) -> Optional[bytes]:
        match = re.search(pattern, self.member(dist, name))
        if not match:
            return None
        return match.group(1) if match.re.groups else match.group(0)

    def sdist_files(self, dist: DistFile) -> dict[str, bytes]:
        d = self._dir(dist)
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
                if p.is_file() and p.name != "SOURCE.txt"}
