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
import struct
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


def which_cuobjdump(cuda_home: str = "") -> str:
    """cuobjdump from the toolchain (CUDA_HOME/bin: the NVIDIA devel image, or PyPI's
    nvidia-cuda-cuobjdump wheel installed with the toolchain), else on PATH; "" if none."""
    for candidate in ([os.path.join(cuda_home, "bin", "cuobjdump")] if cuda_home else []) + ["/usr/local/cuda/bin/cuobjdump"]:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("cuobjdump") or ""


def find_cuobjdump(cuda_home: str = "") -> str:
    """cuobjdump (which_cuobjdump), or the build fails naming what installs it."""
    found = which_cuobjdump(cuda_home)
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


# CUDA libraries whose soname major is the CUDA major (libcudart.so.12 is CUDA 12's runtime);
# cuFFT, cuSPARSE, cuSOLVER and cuRAND number their sonames on their own, so they are not read.
_CUDA_SONAME = re.compile(r"lib(cudart|cublas|cublasLt|nvrtc|nvJitLink)\.so\.(\d+)\Z")
_TORCH_SYMBOL = re.compile(r"_ZN(3c10|2at|5torch)|aoti_torch_|torch_")


def elf_dynamic(path) -> tuple[list[str], set[str], set[str]]:
    """(NEEDED libraries, undefined symbols, defined symbols) of a 64-bit little-endian ELF shared
    library, from its section headers (.dynamic, .dynsym and their string tables): what the dynamic
    loader reads, without readelf (the builder may not have binutils). Weak undefined symbols are
    left out: the loader accepts them missing."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def text(strtab: int, offset: int) -> str:
        start = sections[strtab][4] + offset
        return data[start:data.index(b"\0", start)].decode(errors="replace")

    needed, undefined, defined = [], set(), set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind == 6:  # SHT_DYNAMIC: (tag, value) pairs; DT_NEEDED = 1
            for at in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, at)
                if tag == 1:
                    needed.append(text(link, value))
        elif kind == 11:  # SHT_DYNSYM
            for at in range(offset + entsize, offset + size, entsize):
                name, info, _, shndx = struct.unpack_from("<IBBH", data, at)
                symbol = text(link, name)
                if symbol and shndx == 0 and info >> 4 != 2:
                    undefined.add(symbol)
                elif symbol and shndx != 0:
                    defined.add(symbol)
    return needed, undefined, defined


def link_problems(lib, cuda_major: str, torch_symbols=None) -> list[str]:
    """Why `lib` cannot load in this image: a CUDA library of another major (libcudart.so.12 in a
    CUDA 13 image: the wheel was built for another CUDA) or a torch symbol this torch's libraries
    do not define (`torch_symbols`: built against another torch's C++ ABI; None: not checked)."""
    needed, undefined, _ = elf_dynamic(lib)
    name, problems = Path(lib).name, []
    for soname in needed:
        found = _CUDA_SONAME.match(soname)
        if found and found.group(2) != cuda_major:
            problems.append(f"{name} needs {soname}, a CUDA {found.group(2)} library, and the image is CUDA "
                            f"{cuda_major} (built for another CUDA major)")
    if torch_symbols is not None:
        missing = sorted(s for s in undefined if _TORCH_SYMBOL.match(s) and s not in torch_symbols)
        if missing:
            problems.append(f"{name} needs {len(missing)} torch symbol(s) this torch's libraries do not define, such "
                            f"as {missing[0]} (built against another torch)")
    return problems


def torch_symbols(torch_lib: Path) -> set[str]:
    """Every symbol torch's own shared libraries define (torch/lib/*.so)."""
    return {s for lib in sorted(Path(torch_lib).glob("*.so*")) for s in elf_dynamic(lib)[2]}


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
