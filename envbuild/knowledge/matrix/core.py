"""The matrix: every file loaded, with lookups by name and alias (a GPU by any spelling
nvidia-smi prints, a fabric or extension by any alias) and the facts derived from them once."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.files import StatCache, read_yaml
from envbuild.base.grammar import shown
from envbuild.base.resources import CATALOGUES, KNOWN_ISSUES
from envbuild.knowledge import rules
from envbuild.knowledge.matrix.files.bases_yaml import BasesFile, Family
from envbuild.knowledge.matrix.files.cuda_yaml import CudaFile, DriverFloor
from envbuild.knowledge.matrix.files.deepspeed_yaml import DeepspeedFile, DsRelease, Op
from envbuild.knowledge.matrix.files.extensions_yaml import CudaExtension, ExtensionsFile
from envbuild.knowledge.matrix.files.fabrics_yaml import Fabric, FabricsFile
from envbuild.knowledge.matrix.files.gpus_yaml import GpuProfile, GpusFile
from envbuild.knowledge.matrix.files.nccl_yaml import NcclFile, NcclPackage
from envbuild.knowledge.matrix.files.stacks_yaml import PUBLISH, Stack, StacksFile
from envbuild.knowledge.matrix.files.torch_yaml import TorchFile, TorchRelease
from envbuild.knowledge.validate import gpu_spellings, unknown_gpu

ALLOWLIST = "vulnerabilities.yaml"  # optional: the advisories the publish gate accepts, each until a date (audit.py)
BASE_DIGESTS = "base-digests.yaml"  # optional: written by `envbuild lock --bases` (digests.py)
# Which images CI publishes, its gate, and doctor's signatures and catalogues: no file (or folder)
# here changes an image, so none is in the digest an image records (a new doctor signature or a
# lab's choice of variants re-renders no image, so nothing is rebuilt and no rebuild breaks).
NOT_IN_IMAGES = (PUBLISH, ALLOWLIST, KNOWN_ISSUES, CATALOGUES)
_DIGESTS = StatCache()  # Matrix.sha256 by the matrix files' stat


def _image_files(root: Path) -> list[str]:
    """The files of a matrix directory that can change an image, relative, in Path order (by
    parts): not NOT_IN_IMAGES at the top, nothing hidden, no __pycache__."""
    found = []
    for where, dirs, names in os.walk(root):
        rel = Path(where).relative_to(root).parts
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__" and (rel or d not in NOT_IN_IMAGES)]
        found += [(*rel, n) for n in names if not n.startswith(".") and (rel or n not in NOT_IN_IMAGES)
                  and os.path.isfile(os.path.join(where, n))]
    return ["/".join(parts) for parts in sorted(found)]


def _digest(root: Path, files: list[str]) -> str:
    digest = hashlib.sha256()
    for rel in files:
        digest.update(f"{rel}\0{hashlib.sha256((root / rel).read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


class Matrix:
    """All matrix files, cross-checked, with lookups by name and alias."""

    def __init__(self, directory: Path, torch: TorchFile, deepspeed: DeepspeedFile,
                 gpus: GpusFile, bases: BasesFile, cuda: CudaFile, stacks: StacksFile, fabrics: FabricsFile,
                 extensions: Optional[ExtensionsFile] = None, nccl: Optional[NcclFile] = None):
        self.directory = directory
        self.cuda_file = cuda
        self.torch_file = torch
        self.deepspeed_file = deepspeed
        self.gpus_file = gpus
        self.bases = bases
        self.stacks = stacks.stacks
        self.fabrics_file = fabrics
        self._torch = {r.torch: r for r in torch.releases}
        self._ds = {r.deepspeed: r for r in deepspeed.releases}
        self._gpu_names: dict[str, GpuProfile] = {}
        self.extensions_file = extensions or ExtensionsFile()
        self.nccl_file = nccl or NcclFile()  # no nccl.yaml: no release can replace torch's NCCL
        self.base_digests = _base_digests(directory)  # ref -> the digest the publishing CI recorded

    @property
    def sha256(self) -> str:
        """One digest of every file of the matrix directory that can change an image (YAML files,
        locks, OS locks): what an image records, so `envbuild rebuild` knows whether this matrix is
        the one it was made from. What CI publishes and which advisories its gate allows
        and what doctor knows (NOT_IN_IMAGES) change no image: a lab choosing its variants breaks no
        rebuild, and a new doctor signature republishes nothing. Looked at each time: the Matrix is
        cached by its YAML files' text, and a lock written since is not among them. A digest is
        kept (a publish plan resolves every variant) while no file's size, inode or times change,
        and every file has settled (base/files.py StatCache)."""
        root = Path(self.directory)
        files = _image_files(root)
        return _DIGESTS.get((str(root.resolve()), tuple(files)), [root / rel for rel in files],
                            lambda: _digest(root, files))

    # lookups ----------------------------------------------------------
    def torch_release(self, version: str) -> TorchRelease:
        return self._torch[version]

    def ds_release(self, version: str) -> DsRelease:
        return self._ds[version]

    @property
    def ops(self) -> dict[str, Op]:
        return self.deepspeed_file.ops

    @property
    def gpus(self) -> list[GpuProfile]:
        return self.gpus_file.profiles

    def gpu_names(self) -> dict[str, GpuProfile]:
        """Every accepted spelling (lower-case) -> profile."""
        if not self._gpu_names:
            for p in self.gpus:
                for n in [p.name, *p.aliases]:
                    for spelling in (n, f"nvidia-{n}"):
                        self._gpu_names[spelling.lower()] = p
        return self._gpu_names

    def gpu(self, name: str) -> GpuProfile:
        """A profile by name, alias or the name nvidia-smi prints ('NVIDIA H100 80GB HBM3')."""
        names = self.gpu_names()
        spellings = gpu_spellings(name)
        for key in spellings:
            if key in names:
                return names[key]
        for scope in self.gpus_file.out_of_scope:
            if any(s in scope.names or any(s.startswith(p) for p in scope.prefixes) for s in spellings):
                source = f" (source: {scope.source})" if scope.source else ""
                what = f"{scope.what} is" if scope.what else f"{scope.vendor} GPUs are"
                raise EnvbuildError(f"--gpu {name}: {what} out of scope: {scope.why.rstrip('.')}{source}.")
        raise unknown_gpu(name, spellings, [p.name for p in self.gpus], str(self.directory / "gpus.yaml"))

    @property
    def fabrics(self) -> list[Fabric]:
        return self.fabrics_file.fabrics

    def fabric(self, name: Optional[str]) -> Fabric:
        """A fabric by name or alias; None is the default (fabrics.yaml `default`)."""
        wanted = (name or self.fabrics_file.default).strip().lower()
        for f in self.fabrics:
            if wanted in (f.name, *f.aliases):
                return f
        names = [f.name for f in self.fabrics]
        hint = nearest(wanted, [n for f in self.fabrics for n in (f.name, *f.aliases)])
        did = f" did you mean {', '.join(hint)}?" if hint else ""
        raise EnvbuildError(
            f"--fabric {shown(name or '')} is not a known fabric;{did} Known fabrics: {', '.join(names)} (default: "
            f"{self.fabrics_file.default}; `envbuild fabrics` shows what each puts in the image).")

    @property
    def extensions(self) -> dict[str, CudaExtension]:
        return {e.name: e for e in self.extensions_file.extensions}

    def extension(self, name: str) -> CudaExtension:
        """An extension by its PyPI name, in any spelling pip accepts (flash_attn, Flash-Attn)."""
        wanted = re.sub(r"[-_.]+", "-", name.strip()).lower()
        if wanted in self.extensions:
            return self.extensions[wanted]
        aliased = next((e for e in self.extensions.values() if wanted in e.aliases), None)
        if aliased is not None:
            return aliased
        why = rules.extension_not_prebuilt(self, wanted)
        if why:
            raise EnvbuildError(f"--ext {shown(name)}: {why.message} (rule {why.rule}). Pre-built: "
                                f"{', '.join(self.extensions)} (`envbuild extensions`).")
        try:  # a requirement (flash-attn==2.8, flash-attn[x]) rather than a name
            req = Requirement(name)
        except InvalidRequirement:
            req = None
        if req and (req.specifier or req.extras or req.url or req.marker) and canonicalize_name(req.name) in self.extensions:
            ext = self.extensions[canonicalize_name(req.name)]
            raise EnvbuildError(f"--ext {shown(name)}: --ext takes names, not versions or extras; envbuild builds "
                                f"{ext.name} {ext.version} only (extensions.yaml). Nearest valid choice: "
                                f"--ext {ext.name}.")
        hint = nearest(wanted, self.extensions)
        did = f" did you mean {', '.join(hint)}?" if hint else ""
        known = ", ".join(self.extensions) or "none (this matrix has no extensions.yaml)"
        raise EnvbuildError(f"--ext {shown(name)} is not a CUDA extension envbuild can pre-build;{did} Known: {known} "
                            f"(`envbuild extensions` shows which GPUs and stacks each fits).")

    def stack(self, stack_id: str) -> Stack:
        for s in self.stacks:
            if s.id == stack_id:
                return s
        hint = nearest(stack_id, [s.id for s in self.stacks])
        did = f" did you mean {', '.join(hint)}?" if hint else ""
        raise EnvbuildError(
            f"unknown stack {shown(stack_id)} for --stack;{did} `envbuild matrix` lists all "
            f"{len(self.stacks)} stacks.")

    def arch_list(self, release: TorchRelease, cuda: str, arch: str = "x86_64") -> str:
        """The GPU arches torch's `cuda` build for CPU architecture `arch` carries code for."""
        if arch == "aarch64":
            return release.aarch64_arches or ""
        name = release.variants[cuda]
        return release.default_arches if name == "default" else self.torch_file.arch_lists[name]

    def stack_arches(self, s: Stack) -> list[str]:
        """The CPU architectures PyPI has CUDA torch wheels for, for this stack's torch and CUDA.

        The aarch64 wheels on PyPI are the release's default CUDA build, and CUDA builds only
        from torch 2.11.0 (torch.yaml cuda_platforms); PyTorch's own index for other CUDA
        variants is not read here, so no aarch64 variant is claimed from it.
        """
        rel = self.torch_release(s.torch)
        arches = ["x86_64"] if s.cuda in rel.variants else []
        if "aarch64" in rel.cuda_platforms and s.cuda == rel.default_cuda:
            arches.append("aarch64")
        return arches

    def cpu_target_for(self, arch: str, gpu: GpuProfile, family: Family) -> str:
        """The default CPU target: the GPU host's best target the OS's GCC knows, else the
        architecture's portable one."""
        gcc = Version(family.gcc)
        targets = self.gpus_file.cpu_targets
        wanted = [*gpu.cpu_targets, *self.gpus_file.default_cpu_targets[arch]]
        for name in wanted:
            if targets[name].arch == arch and gcc >= Version(targets[name].min_gcc):
                return name
        raise KeyError(f"no CPU target for {arch} that GCC {family.gcc} knows")

    def driver_floor(self, cuda: str, gpu: Optional[GpuProfile] = None) -> DriverFloor:
        """The oldest driver that runs CUDA `cuda` ('13.0' -> the CUDA 13 floor), and, with `gpu`,
        knows that GPU: the largest of the stack's floor, the GPU generation's and the GPU's own."""
        major = cuda.split(".")[0]
        floor = next((f for f in self.cuda_file.driver_floors if f.cuda == major), None)
        if floor is None:
            raise KeyError(cuda)
        if gpu is None:
            return floor
        for what, own in ((f"{gpu.generation} GPUs ({gpu.name})", self.cuda_file.generation_driver_floors.get(gpu.generation)),
                          (gpu.name, self.cuda_file.gpu_driver_floors.get(gpu.name))):
            if own and Version(own.min_driver) > Version(floor.min_driver):
                floor = DriverFloor(cuda=major, min_driver=own.min_driver, branch=own.branch,
                                    source=f"{what}: {own.source}")
        return floor

    def nccl_package(self, torch: str) -> Optional[NcclPackage]:
        """The NCCL wheel family torch's Linux wheel pins (nccl.yaml), or None where unknown."""
        return next((p for p in self.nccl_file.packages if torch in p.torch), None)

    def torch_index(self, release: TorchRelease, cuda: str) -> Optional[str]:
        """PyTorch's own index for a non-default CUDA variant; None means plain PyPI."""
        if cuda == release.default_cuda:
            return None
        return self.torch_file.variant_index.format(cuda_nodot=cuda.replace(".", ""))


def _base_digests(directory: Path) -> dict[str, str]:
    """ref -> digest recorded by `envbuild lock --bases` (empty when none were reachable)."""
    path = Path(directory) / BASE_DIGESTS
    if not os.path.lexists(path):
        return {}
    data = read_yaml(path, "matrix file") or {}
    try:
        return {str(ref): str(entry["digest"]) for ref, entry in (data.get("bases") or {}).items()}
    except (AttributeError, KeyError, TypeError):
        raise EnvbuildError(f"matrix file {path} is malformed: each entry under `bases` needs a `digest`; "
                            f"regenerate it with `envbuild lock --bases`.") from None
