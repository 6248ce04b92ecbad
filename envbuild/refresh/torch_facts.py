"""Derive each torch release row of matrices/torch.yaml from the PyPI wheels themselves.

Read per release: the Linux x86_64 wheel's METADATA (pins, Requires-Python), its
torch/version.py (default CUDA), torch/utils/cpp_extension.py (JIT arch list and lock) and
the arch-flags string inside torch/lib/libtorch_python.so (inflated only until found); the
aarch64 wheel's version.py (and arch string when it is a CUDA build); the index's wheel tags
of torch, the paired torchvision and the pinned triton.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.refresh.metadata import (
    PythonTags,
    exact_pin,
    linux_wheels,
    python_admits,
    python_range,
    read_metadata,
    requirement,
)
from envbuild.refresh.pypi import DistFile, Index

TRACK_FROM = Version("2.4")  # the oldest torch minor the matrix tracks
ARCH_MEMBER = "torch/lib/libtorch_python.so"
# The CUDA_ARCH_FLAGS string torch.cuda.get_arch_list() splits: "sm_75 sm_80 ...\0". Only its end
# is delimited: in 2.8.0 the bytes before it are another array's, with no NUL in between.
ARCH_PATTERN = rb"((?:sm|compute)_\d+[a-z]?(?: (?:sm|compute)_\d+[a-z]?)+)\x00"
NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


@dataclass
class TorchFacts:
    """The derived fields of one torch row, in the file's field order, plus where they came from."""

    fields: dict = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    nccl_package: str = ""  # the NCCL wheel family the Requires-Dist pin names (nccl.yaml's `torch`)


def tracked_releases(index: Index) -> list[Version]:
    """The newest patch of every torch minor from TRACK_FROM that has a manylinux x86_64 wheel."""
    newest: dict[tuple[int, int], Version] = {}
    for f in index.files("torch"):
        v = f.version
        if v.is_prerelease or v.is_devrelease or v < TRACK_FROM or f.yanked:
            continue
        if not linux_wheels([f], v, "x86_64"):
            continue
        key = (v.major, v.minor)
        if key not in newest or v > newest[key]:
            newest[key] = v
    if not newest:
        raise EnvbuildError(f"PyPI lists no torch release >= {TRACK_FROM} with a manylinux x86_64 wheel; "
                            f"the index changed shape.")
    return [newest[k] for k in sorted(newest)]


def parse_arch_string(raw: bytes, where: str) -> str:
    """b'sm_75 sm_80 compute_80' -> '7.5;8.0+PTX' (sm_XY -> X.Y, compute_XY -> X.Y+PTX)."""
    arches: dict[str, bool] = {}
    for token in raw.decode("ascii", "replace").split():
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([a-z]?)", token)
        if not match:
            continue
        arch = f"{match.group(2)}.{match.group(3)}{match.group(4)}"
        arches[arch] = arches.get(arch, False) or match.group(1) == "compute"
    if not arches:
        raise EnvbuildError(f"{where}: the arch string {raw[:80]!r} parses to no architecture; "
                            f"the binary changed shape.")

    def key(arch: str):
        major, minor = arch.split(".")
        return int(major), int(re.sub(r"\D", "", minor) or 0), minor
    return ";".join(a + ("+PTX" if arches[a] else "") for a in sorted(arches, key=key))


def version_py_cuda(text: bytes, where: str) -> Optional[str]:
    """`cuda` from torch/version.py (None for a CPU build)."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise EnvbuildError(f"{where}: torch/version.py does not parse ({e}).") from None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value
    raise EnvbuildError(f"{where}: torch/version.py assigns no `cuda`; the file changed shape.")


def cpp_extension_facts(text: bytes, where: str) -> tuple[str, str]:
    """(supported arch list, lock kind) from torch/utils/cpp_extension.py: the list
    `_get_cuda_arch_flags` validates TORCH_CUDA_ARCH_LIST against, and whether `_jit_compile`
    serialises builds with FileBaton (a lock file whose existence blocks: 'filebaton') or
    FileLock (an flock the kernel drops when the holder dies: 'flock')."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise EnvbuildError(f"{where}: cpp_extension.py does not parse ({e}).") from None
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    arches: list[str] = []
    for node in ast.walk(functions.get("_get_cuda_arch_flags", ast.Module(body=[], type_ignores=[]))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AugAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "supported_arches" for t in targets) \
                and isinstance(node.value, ast.List):
            arches += [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if not arches:
        raise EnvbuildError(f"{where}: no `supported_arches` list in cpp_extension._get_cuda_arch_flags; "
                            f"the file changed shape.")
    called = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
              for n in ast.walk(functions.get("_jit_compile", ast.Module(body=[], type_ignores=[])))
              if isinstance(n, ast.Call)}
    locks = sorted({"FileBaton": "filebaton", "FileLock": "flock"}[c] for c in called & {"FileBaton", "FileLock"})
    if len(locks) != 1:
        raise EnvbuildError(f"{where}: cpp_extension._jit_compile uses {locks or 'neither FileBaton nor FileLock'}; "
                            f"expected exactly one; the file changed shape.")
    return ";".join(arches), locks[0]


def _wheel(index: Index, version: Version, machine: str) -> Optional[DistFile]:
    wheels = linux_wheels(index.files("torch"), version, machine)
    return wheels[0] if wheels else None


def _arches(index: Index, dist: DistFile) -> str:
    raw = index.search_member(dist, ARCH_MEMBER, ARCH_PATTERN)
    if raw is None:
        raise EnvbuildError(f"torch {dist.version} ({dist.filename}): no arch-flags string in {ARCH_MEMBER}; "
                            f"the binary changed shape.")
    return parse_arch_string(raw, f"{dist.filename} {ARCH_MEMBER}")


def pair_torchvision(index: Index, version: Version) -> tuple[Optional[DistFile], str]:
    """The newest torchvision whose torch requirement (== or >=) admits `version`."""
    files = index.files("torchvision")
    versions = sorted({f.version for f in files if not f.version.is_prerelease and not f.yanked}, reverse=True)
    for tv in versions:
        wheels = linux_wheels(files, tv, "x86_64")
        if not wheels:
            continue
        meta = read_metadata(index, wheels[0])
        found = requirement(meta, "torch", "x86_64", _newest_minor(wheels), wheels[0].filename)
        if found and found[0].specifier and SpecifierSet(found[1]).contains(version):
            return wheels[0], str(tv)
    raise EnvbuildError(f"torch {version}: no torchvision on the index requires a torch that admits it; "
                        f"pairing failed (the torchvision metadata changed shape).")


def _newest_minor(wheels: list[DistFile]) -> int:
    """A Python the wheels install on, to evaluate markers with (12 for py3-none wheels:
    torchvision's torch requirement carries no Python marker)."""
    tags = PythonTags(wheels)
    return max(tags.exact) if tags.exact else (tags.from_minor or 12)


def derive_release(index: Index, version: Version) -> TorchFacts:
    """Every derivable field of one torch release row."""
    name = f"torch {version}"
    x86 = linux_wheels(index.files("torch"), version, "x86_64")
    if not x86:
        raise EnvbuildError(f"{name}: no manylinux x86_64 wheel on the index.")
    wheel = x86[0]
    torch_tags = PythonTags(x86)
    if not torch_tags.exact:
        raise EnvbuildError(f"{name}: no cpXY tags on its manylinux x86_64 wheels; the index changed shape.")
    meta = read_metadata(index, wheel)
    triton, nccl, toolkit = _pins(name, meta, torch_tags, wheel)
    minors, tv_wheel, tv_version, triton_versions = _pythons(index, version, meta, torch_tags, wheel, triton[1])

    cuda = version_py_cuda(index.member(wheel, "torch/version.py"), wheel.filename)
    if not cuda:
        raise EnvbuildError(f"{name} ({wheel.filename}): torch/version.py says cuda = None; the PyPI x86_64 "
                            f"wheel is expected to be a CUDA build.")
    cpp_arches, lock = cpp_extension_facts(index.member(wheel, "torch/utils/cpp_extension.py"), wheel.filename)
    platforms = sorted(p.removesuffix("_x86_64") for p in wheel.platforms if p.startswith("manylinux"))

    facts = TorchFacts(nccl_package=str(nccl[0].name))
    facts.fields = {
        "torch": str(version),
        "python": python_range(minors),
        "torchvision": tv_version,
        "triton": triton[1],
        "nccl": exact_pin(nccl[1]) or nccl[1],
        "manylinux": platforms[0],
        "default_cuda": cuda,
    }
    if toolkit:
        facts.fields["cuda_toolkit"] = exact_pin(toolkit[1]) or toolkit[1]
    facts.fields["default_arches"] = _arches(index, wheel)
    facts.fields["cuda_platforms"] = ["x86_64"]
    facts.sources.append(f"{wheel.filename} (METADATA, torch/version.py, torch/utils/cpp_extension.py, "
                         f"{ARCH_MEMBER} arch string)")
    _add_aarch64(index, version, facts)
    facts.fields["cpp_extension_arches"] = cpp_arches
    facts.fields["extension_lock"] = lock
    facts.sources.append(f"{tv_wheel.filename} (METADATA)")
    facts.sources.append(f"triton {', '.join(map(str, triton_versions)) or 'none'} wheel tags")
    return facts


def _pins(name: str, meta: dict, torch_tags: PythonTags, wheel: DistFile) -> tuple:
    """torch's triton, NCCL and cuda-toolkit requirements for Linux x86_64, as (name, specifier):
    every torch 2.x Linux x86_64 wheel pins triton and NCCL, so either missing is an error."""
    some_minor = max(torch_tags.exact)
    triton = next((r for r in (requirement(meta, "triton", "x86_64", m, wheel.filename)
                               for m in sorted(torch_tags.exact)) if r), None)
    if triton is None:
        raise EnvbuildError(f"{name} ({wheel.filename}): no triton requirement for Linux x86_64 in METADATA; "
                            f"every torch 2.x Linux x86_64 wheel pins one.")
    nccl = next((r for r in (requirement(meta, p, "x86_64", some_minor, wheel.filename) for p in NCCL_PACKAGES) if r),
                None)
    if nccl is None:
        raise EnvbuildError(f"{name} ({wheel.filename}): no nvidia-nccl-cu1X requirement for Linux x86_64.")
    return triton, nccl, requirement(meta, "cuda-toolkit", "x86_64", some_minor, wheel.filename)


def _pythons(index: Index, version: Version, meta: dict, torch_tags: PythonTags, wheel: DistFile,
             triton_pin: str) -> tuple[list[int], DistFile, str, list]:
    """The Python minors torch, its torchvision and its triton all install on: (minors, the
    torchvision wheel and version, the triton versions the pin admits)."""
    requires_python = (meta.get("requires-python") or [None])[0]
    tv_wheel, tv_version = pair_torchvision(index, version)
    tv_tags = PythonTags(linux_wheels(index.files("torchvision"), Version(tv_version), "x86_64"))
    tv_python = (read_metadata(index, tv_wheel).get("requires-python") or [None])[0]
    triton_spec = SpecifierSet(triton_pin)
    triton_files = [f for f in index.files("triton") if f.version in triton_spec and not f.yanked]
    triton_versions = sorted({f.version for f in triton_files})
    triton_tags = PythonTags([w for v in triton_versions for w in linux_wheels(triton_files, v, "x86_64")])

    minors = []
    for minor in sorted(torch_tags.exact):
        if not (python_admits(requires_python, minor) and tv_tags.admits(minor) and python_admits(tv_python, minor)):
            continue
        pin = requirement(meta, "triton", "x86_64", minor, wheel.filename)
        if pin is not None and not triton_tags.admits(minor):
            continue
        minors.append(minor)
    if not minors:
        raise EnvbuildError(f"torch {version}: no Python is admitted by torch's cp tags, Requires-Python "
                            f"{requires_python}, torchvision {tv_version} and triton {triton_pin} together.")
    return minors, tv_wheel, tv_version, triton_versions


def _add_aarch64(index: Index, version: Version, facts: TorchFacts) -> None:
    """The aarch64 wheel's CUDA arches where that wheel is a CUDA build; a CPU build is only noted."""
    arm = _wheel(index, version, "aarch64")
    if arm is None:
        return
    arm_cuda = version_py_cuda(index.member(arm, "torch/version.py"), arm.filename)
    if arm_cuda:
        facts.fields["cuda_platforms"].append("aarch64")
        facts.fields["aarch64_arches"] = _arches(index, arm)
        facts.sources.append(f"{arm.filename} (torch/version.py, {ARCH_MEMBER} arch string)")
    else:
        facts.sources.append(f"{arm.filename} (torch/version.py: CPU build)")
