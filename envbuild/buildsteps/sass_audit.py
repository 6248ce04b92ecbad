"""Does every shared library carry machine code (SASS) for each GPU arch of the image? GPU-less.

NVIDIA's own cuobjdump lists the cubins (`--list-elf`: `ELF file 1: x.sm_90.cubin`) and PTX
(`--list-ptx`) embedded in a library. A cubin for sm_XY runs on X.Z for Z >= Y (sm_90a and
sm_100f only on their own arch); PTX counts only where the arch list allows it (`9.0+PTX`),
because it is JIT-compiled by the driver at first launch. A library without the code fails
at run time with "no kernel image is available for execution on the device"; this finds it
at build time. Used by extensions.py and, for the DeepSpeed ops, by deepspeed.sh:

    python sass_audit.py ARCH_LIST CUDA_HOME LIB...

>>> runs_on("sm_80", "8.6"), runs_on("sm_90a", "9.0"), runs_on("sm_90", "10.0"), runs_on("compute_80", "9.0+PTX")
(True, True, False, True)
>>> parse_listing("ELF file    1: flash_attn_2_cuda.1.sm_90.cubin\\nELF file    2: x.2.sm_80.cubin\\n")
['sm_80', 'sm_90']
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

_CODE = re.compile(r"\b(sm|compute)_(\d+)([af]?)\b")


def _arch(text: str) -> int:
    """'9.0' -> 90, '12.1' -> 121."""
    major, minor = text.split("+")[0].split(".")
    return int(major) * 10 + int(minor)


def runs_on(code: str, arch: str) -> bool:
    """Does the embedded `code` (sm_80, sm_90a, compute_90) run on `arch` ('8.6', '9.0+PTX')?"""
    found = _CODE.fullmatch(code)
    if not found:
        return False
    kind, number, suffix = found.group(1), int(found.group(2)), found.group(3)
    want = _arch(arch)
    if kind == "compute":
        return arch.endswith("+PTX") and number <= want
    if suffix == "a":
        return number == want
    return number // 10 == want // 10 and number <= want


def parse_listing(text: str) -> list[str]:
    """The sm_XY / compute_XY codes named in cuobjdump's --list-elf or --list-ptx output."""
    codes = set()
    for line in text.splitlines():
        if line.startswith(("ELF file", "PTX file")):
            for m in _CODE.finditer(line.split(":", 1)[-1]):
                codes.add(m.group(0))
    return sorted(codes)


def find_cuobjdump(cuda_home: str = "") -> str:
    """cuobjdump from the toolchain (CUDA_HOME/bin: the NVIDIA devel image, or PyPI's
    nvidia-cuda-cuobjdump wheel installed with the toolchain), else on PATH."""
    for candidate in ([os.path.join(cuda_home, "bin", "cuobjdump")] if cuda_home else []) + ["/usr/local/cuda/bin/cuobjdump"]:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("cuobjdump")
    if not found:
        print("envbuild: SASS audit FAILED: no cuobjdump in CUDA_HOME/bin or on PATH: the toolchain step "
              "installs it (bases.yaml toolchains)", file=sys.stderr)
        sys.exit(1)
    return found


def listing(cuobjdump: str, lib: Path) -> list[str]:
    codes = []
    for flag in ("--list-elf", "--list-ptx"):
        r = subprocess.run([cuobjdump, flag, str(lib)], capture_output=True, text=True)
        text = r.stdout + r.stderr
        if r.returncode != 0 and "does not contain device code" not in text:
            print(f"envbuild: SASS audit FAILED: `cuobjdump {flag} {lib}` exited {r.returncode}: {text.strip()[-300:]}",
                  file=sys.stderr)
            sys.exit(1)
        codes += parse_listing(r.stdout)
    return sorted(set(codes))


def audit(libs, arch_list: str, cuobjdump: str, require_device_code: bool) -> dict:
    """{libraries: {lib: codes}, problems: [...], summary}; `require_device_code`: a library with
    no device code at all is a problem (a CUDA extension), not a host-only library (cpu_adam)."""
    arches = [a for a in arch_list.split(";") if a]
    result, problems = {}, []
    for lib in libs:
        codes = listing(cuobjdump, Path(lib))
        result[Path(lib).name] = codes
        if not codes:
            if require_device_code:
                problems.append(f"{Path(lib).name} carries no device code at all")
            continue
        missing = [a for a in arches if not any(runs_on(c, a) for c in codes)]
        if missing:
            problems.append(f"{Path(lib).name} has no code that runs on {', '.join(missing)} (it carries "
                            f"{', '.join(codes)}): it would fail with 'no kernel image is available'")
    summary = ", ".join(f"{name}: {' '.join(codes) or 'host only'}" for name, codes in result.items())
    return {"libraries": result, "problems": problems, "summary": summary}


def main(argv: list[str]) -> int:
    arch_list, cuda_home, *libs = argv
    result = audit(libs, arch_list, find_cuobjdump(cuda_home), require_device_code=False)
    if result["problems"]:
        print("envbuild: SASS audit FAILED: " + "; ".join(result["problems"]), file=sys.stderr)
        return 1
    print(f"envbuild: SASS for {arch_list}: {result['summary'] or '(no libraries)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
