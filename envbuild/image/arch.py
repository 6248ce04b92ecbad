"""The GPU-arch rule, defined once: does code built for an arch list run on a device?

Used by the resolver (envbuild/knowledge/rules/gpus.py, the `gpu-arch` rule) and by the smoke test inside
the image (every device's compute capability against TORCH_CUDA_ARCH_LIST).
"""

from __future__ import annotations

import re

_ENTRY = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?", re.IGNORECASE)


def parse_arch_list(arch_list: str) -> list[tuple[int, int, bool]]:
    """TORCH_CUDA_ARCH_LIST ('8.0;9.0+PTX', spaces or commas allowed) -> [(8, 0, False), (9, 0, True)].

    An arch-specific suffix ('9.0a', '10.0f') keeps its major.minor; other words are ignored.
    """
    out = []
    for entry in re.split(r"[;,\s]+", arch_list or ""):
        match = _ENTRY.fullmatch(entry.strip())
        if match:
            out.append((int(match.group(1)), int(match.group(2)), bool(match.group(3))))
    return out


def arch_runs_on(cc: str, arch_list: str) -> bool:
    """True if code built for `arch_list` runs on a GPU of compute capability `cc` ('8.6').

    A cubin runs on later minors of the same major (sm_80 code on 8.6 and 8.9); PTX is
    JIT-compiled by the driver for any later arch.
    """
    major, minor = (int(part) for part in cc.split(".")[:2])
    for a_major, a_minor, ptx in parse_arch_list(arch_list):
        if a_major == major and a_minor <= minor:
            return True
        if ptx and (a_major, a_minor) <= (major, minor):
            return True
    return False
