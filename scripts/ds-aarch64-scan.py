#!/usr/bin/env python3
"""Which DeepSpeed sources include x86-only headers outside an x86/AVX guard: the evidence
behind deepspeed.yaml `aarch64` (an op with such an include cannot compile for aarch64).

Usage: python3 scripts/ds-aarch64-scan.py DIR...   (unpacked PyPI sdists, deepspeed-X.Y.Z/)
Prints, per sdist, every unguarded include of immintrin.h, x86intrin.h, cpuid.h or an
SSE/AVX header under csrc/, and whether csrc/includes/simd.h has a __NEON__ path.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

X86_HEADER = re.compile(r'#\s*include\s*[<"](immintrin|x86intrin|cpuid|[xepstn]mmintrin|avx\w*intrin)\.h[>"]')
X86_GUARD = re.compile(r"__x86_64__|__i386__|__AVX|__SSE|__amd64__")
SOURCES = (".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu")


def unguarded_includes(path: Path, root: Path) -> list[str]:
    """x86 header includes not inside an #if/#elif that names an x86 or AVX/SSE macro."""
    guards: list[bool] = []
    hits = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#if"):
            guards.append(bool(X86_GUARD.search(stripped)))
        elif stripped.startswith("#elif") and guards:
            guards[-1] = guards[-1] or bool(X86_GUARD.search(stripped))
        elif stripped.startswith("#endif") and guards:
            guards.pop()
        match = X86_HEADER.search(stripped)
        if match and not any(guards):
            hits.append(f"{path.relative_to(root)}:{number} {match.group(0)}")
    return hits


def main(dirs: list[str]) -> int:
    for name in dirs:
        root = Path(name)
        hits = [hit for path in sorted((root / "csrc").rglob("*")) if path.suffix in SOURCES and path.is_file()
                for hit in unguarded_includes(path, root)]
        simd = root / "csrc" / "includes" / "simd.h"
        neon = simd.is_file() and "__NEON__" in simd.read_text(errors="replace")
        print(f"{root.name}: NEON path in simd.h: {'yes' if neon else 'no'}; unguarded x86 includes: "
              f"{', '.join(hits) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
