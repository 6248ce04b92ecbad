"""Loading a matrix directory: each file read through the bounded YAML reader and validated by
its model (a bad field is named by its path, the stack id or GPU name in it), then the checks
across files and every stack against the rules, once, so the resolver can trust what it gets."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.files import parse_yaml, read_text, read_yaml
from envbuild.base.resources import matrices_dir
from envbuild.knowledge import rules
from envbuild.knowledge.matrix.core import Matrix
from envbuild.knowledge.matrix.files.bases_yaml import BasesFile
from envbuild.knowledge.matrix.files.cuda_yaml import CudaFile
from envbuild.knowledge.matrix.files.deepspeed_yaml import DeepspeedFile
from envbuild.knowledge.matrix.files.extensions_yaml import ExtensionsFile
from envbuild.knowledge.matrix.files.fabrics_yaml import FabricsFile
from envbuild.knowledge.matrix.files.gpus_yaml import EnvDefault, GpusFile
from envbuild.knowledge.matrix.files.nccl_yaml import NcclFile
from envbuild.knowledge.matrix.files.stacks_yaml import EXTENSIONS, PUBLISH, PublishFile, StacksFile
from envbuild.knowledge.matrix.files.torch_yaml import TorchFile

NCCL = "nccl.yaml"  # optional: the NCCL releases --nccl may install (envbuild matrix refresh writes it)
FILES = ("torch.yaml", "deepspeed.yaml", "gpus.yaml", "bases.yaml", "cuda.yaml", "stacks.yaml", "fabrics.yaml")

MODELS = {  # each matrix file and the model that reads it (docs/schemas/ is generated from them)
    "torch.yaml": TorchFile,
    "deepspeed.yaml": DeepspeedFile,
    "gpus.yaml": GpusFile,
    "bases.yaml": BasesFile,
    "cuda.yaml": CudaFile,
    "stacks.yaml": StacksFile,
    PUBLISH: PublishFile,
    "fabrics.yaml": FabricsFile,
    EXTENSIONS: ExtensionsFile,
    NCCL: NcclFile,
}


def _locate(loc: tuple, data) -> str:
    """Turn a pydantic error location into `stacks[3].base_images.builder`, naming
    the stack id or GPU name when the list element has one."""
    out = ""
    node = data
    for part in loc:
        if isinstance(part, int):
            label = ""
            if isinstance(node, list) and part < len(node) and isinstance(node[part], dict):
                key = node[part].get("id") or node[part].get("name")
                label = f" ({grammar.shown(str(key))[1:-1]})" if key else ""
            out += f"[{part}]{label}"
        else:
            out += f".{part}" if out else str(part)
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
    return out


def _load_yaml(path: Path):
    return read_yaml(path, "matrix file")


def _load_file(path: Path, text: Optional[str] = None):
    """One matrix file validated by its model; `text` is its content where it was read already."""
    model = MODELS[path.name]
    data = _load_yaml(path) if text is None else parse_yaml(text, f"matrix file {path}")
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as e:
        errs = e.errors()
        parts = []
        for err in errs[:3]:
            where = _locate(err["loc"], data) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if isinstance((err.get("ctx") or {}).get("error"), grammar.GrammarError) and isinstance(err["input"], str):
                msg = f"{grammar.shown(err['input'])}: {msg}"  # a grammar's reason names no value: name it here
            parts.append(f"at {where}: {msg}")
        more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
        raise EnvbuildError(f"matrix file {path} is malformed {'; '.join(parts)}{more}.") from None


def _check_references(m: Matrix) -> None:
    """Cross-file integrity, then every stack against the rules; the first three problems named."""
    d = m.directory
    problems = [problem for check in (_torch_problems, _deepspeed_problems, _gpu_problems, _fabric_problems,
                                      _default_problems, _node_condition_problems, _driver_problems, _stack_problems,
                                      _nccl_problems)
                for problem in check(m, d)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise EnvbuildError("the matrix is inconsistent: " + "; ".join(problems[:3]) + more + ".")


def _torch_problems(m: Matrix, d: Path) -> list[str]:
    """torch.yaml: each variant's arch list is known, and the default CUDA is the default variant."""
    problems: list[str] = []
    for name, rel in m._torch.items():
        for cuda, arch in rel.variants.items():
            if arch != "default" and arch not in m.torch_file.arch_lists:
                problems.append(f"{d/'torch.yaml'}: torch {name} variant {cuda} names unknown arch list "
                                f"'{arch}' (known: {', '.join(m.torch_file.arch_lists)})")
        if rel.variants.get(rel.default_cuda) != "default":
            problems.append(f"{d/'torch.yaml'}: torch {name}: variants[{rel.default_cuda}] (its default_cuda) must be "
                            f"'default' (the PyPI wheel's own arch list)")
    return problems


def _deepspeed_problems(m: Matrix, d: Path) -> list[str]:
    """deepspeed.yaml: what aarch64 cannot build and each preset name known ops."""
    problems: list[str] = []
    for op in m.deepspeed_file.aarch64.not_buildable:
        if op not in m.ops:
            problems.append(f"{d/'deepspeed.yaml'}: aarch64.not_buildable names unknown op '{op}'")
    for preset, ops in m.deepspeed_file.presets.items():
        for op in ops:
            if op not in m.ops:
                problems.append(f"{d/'deepspeed.yaml'}: presets.{preset} names unknown op '{op}'")
    return problems


def _gpu_problems(m: Matrix, d: Path) -> list[str]:
    """gpus.yaml: one profile per name or alias, and CPU targets for the right architecture."""
    problems: list[str] = []
    seen: dict[str, tuple[int, str]] = {}
    for i, p in enumerate(m.gpus_file.profiles):
        for n in dict.fromkeys(x.lower() for x in [p.name, *p.aliases]):
            if n in seen:
                other = seen[n][1]
                problems.append(f"{d/'gpus.yaml'}: two profiles are named '{n}' (they would get one image tag)"
                                if other == p.name else
                                f"{d/'gpus.yaml'}: {'name' if n == p.name.lower() else 'alias'} '{n}' is used by "
                                f"both {other} and {p.name}")
            seen[n] = (i, p.name)
    known_targets = m.gpus_file.cpu_targets
    for arch, names in m.gpus_file.default_cpu_targets.items():
        for name in names:
            if name not in known_targets or known_targets[name].arch != arch:
                problems.append(f"{d/'gpus.yaml'}: default_cpu_targets.{arch} names '{name}', which is not an "
                                f"{arch} entry of cpu_targets (known: {', '.join(known_targets)})")
    for p in m.gpus:
        for name in p.cpu_targets:
            if name not in known_targets or known_targets[name].arch not in p.host_arch:
                problems.append(f"{d/'gpus.yaml'}: {p.name}.cpu_targets names '{name}', which is not a cpu_targets "
                                f"entry for its host_arch {', '.join(p.host_arch)}")
    return problems


def _fabric_problems(m: Matrix, d: Path) -> list[str]:
    """fabrics.yaml: one fabric per name, the default's empty suffix, known GPUs and capabilities."""
    problems: list[str] = []
    fabric_names: dict[str, str] = {}
    for f in m.fabrics:
        for n in (f.name, *f.aliases):
            if n in fabric_names:
                problems.append(f"{d/'fabrics.yaml'}: name '{n}' is used by both {fabric_names[n]} and {f.name}")
            fabric_names[n] = f.name
        if (f.name == m.fabrics_file.default) != (f.tag == ""):
            problems.append(f"{d/'fabrics.yaml'}: {f.name}: only the default fabric has an empty tag suffix")
        for g in (f.requires.gpus if f.requires else ()):
            if g not in {p.name for p in m.gpus}:
                problems.append(f"{d/'fabrics.yaml'}: {f.name}.requires.gpus names '{g}', which is not a gpus.yaml "
                                f"profile")
        for need in f.needs:
            if not any(need in fam.capabilities for fam in m.bases.families.values()):
                problems.append(f"{d/'fabrics.yaml'}: {f.name}.needs names '{need}', a capability no bases.yaml "
                                f"family provides")
    if m.fabrics_file.default not in fabric_names:
        problems.append(f"{d/'fabrics.yaml'}: default '{m.fabrics_file.default}' is not a fabric "
                        f"(known: {', '.join(f.name for f in m.fabrics)})")
    return problems


def _defaults(m: Matrix) -> list[tuple[str, str, int, EnvDefault]]:
    """Every environment default of the matrix: (file, its list there, its index, the default)."""
    defaults = [("gpus.yaml", "common_env", i, e) for i, e in enumerate(m.gpus_file.common_env)]
    defaults += [("gpus.yaml", f"{p.name}.env", i, e) for p in m.gpus for i, e in enumerate(p.env)]
    defaults += [("fabrics.yaml", f"{f.name}.env", i, e) for f in m.fabrics for i, e in enumerate(f.env)]
    return defaults


def _default_problems(m: Matrix, d: Path) -> list[str]:
    """Every default the matrix bakes holds the grammar `--env` is held to."""
    problems: list[str] = []
    for file, where, _, default in _defaults(m):  # the matrix's own defaults in the grammar --env is held to
        known = m.gpus_file.variables.get(default.name)
        why = known.problem(default.name, default.value) if known else None
        if why:
            problems.append(f"{d / file}: {where}: {why}")
    return problems


def _node_condition_problems(m: Matrix, d: Path) -> list[str]:
    """Each node condition a default names is declared in fabrics.yaml's node_conditions."""
    problems: list[str] = []
    declared = m.fabrics_file.node_conditions
    for file, where, index, default in _defaults(m):
        for name in (default.node.conditions if default.node else ()):
            if name not in declared:
                close = nearest(name, declared)
                problems.append(
                    f"{d / file}: {where}[{index}] ({default.name}): node names '{name}', a node condition "
                    f"{d / 'fabrics.yaml'} does not declare under node_conditions"
                    + (f"; nearest valid: {', '.join(close)}" if close else "")
                    + (f" (declared: {', '.join(declared)}, and the built-in driver_below)" if declared else
                       " (it declares none, as a matrix older than the table: copy node_conditions from envbuild's "
                       "matrices/fabrics.yaml, or declare the condition with label, devices, means and source)"))
    return problems


def _driver_problems(m: Matrix, d: Path) -> list[str]:
    """cuda.yaml: floors for known generations and GPUs, one for every CUDA major a torch has."""
    problems: list[str] = []
    majors = {f.cuda for f in m.cuda_file.driver_floors}
    generations = {p.generation for p in m.gpus}
    for gen in m.cuda_file.generation_driver_floors:
        if gen not in generations:
            problems.append(f"{d/'cuda.yaml'}: generation_driver_floors names '{gen}', a generation no gpus.yaml "
                            f"profile has (known: {', '.join(sorted(generations))})")
    for name in m.cuda_file.gpu_driver_floors:
        if name not in {p.name for p in m.gpus}:
            problems.append(f"{d/'cuda.yaml'}: gpu_driver_floors names '{name}', which is not a gpus.yaml profile")
    for rel in m.torch_file.releases:
        if "aarch64" in rel.cuda_platforms and not rel.aarch64_arches:
            problems.append(f"{d/'torch.yaml'}: torch {rel.torch} has aarch64 in cuda_platforms but no aarch64_arches")
        for cuda in rel.variants:
            if cuda.split(".")[0] not in majors:
                problems.append(f"{d/'cuda.yaml'}: no driver floor for CUDA {cuda} (torch {rel.torch}); "
                                f"known majors: {', '.join(sorted(majors))}")
    return problems


def _stack_problems(m: Matrix, d: Path) -> list[str]:
    """stacks.yaml: unique ids and versions, known releases, family and toolchain, and the rules."""
    problems: list[str] = []
    ids: set[str] = set()
    seen_versions: dict[tuple, str] = {}
    for i, s in enumerate(m.stacks):
        where = f"{d/'stacks.yaml'}: stacks[{i}] ({s.id})"
        if s.id in ids:
            problems.append(f"{where}: duplicate id")
        ids.add(s.id)
        versions = (s.torch, s.cuda, s.python, s.deepspeed)
        if versions in seen_versions:
            problems.append(f"{where}: same torch/CUDA/Python/DeepSpeed as {seen_versions[versions]}, "
                            f"so both would get the same image tag")
        seen_versions[versions] = s.id
        if s.torch not in m._torch:
            problems.append(f"{where}.torch: {s.torch} is not a release in torch.yaml "
                            f"(known: {', '.join(m._torch)})")
            continue
        if s.deepspeed not in m._ds:
            problems.append(f"{where}.deepspeed: {s.deepspeed} is not a release in deepspeed.yaml "
                            f"(known: {', '.join(m._ds)})")
            continue
        if s.os not in m.bases.families:
            problems.append(f"{where}.os: unknown family '{s.os}' (known: {', '.join(m.bases.families)})")
            continue
        if s.toolchain not in m.bases.toolchains:
            problems.append(f"{where}.toolchain: unknown '{s.toolchain}' (known: {', '.join(m.bases.toolchains)})")
            continue
        for rejection in rules.stack_rejections(m, s):
            problems.append(f"{where}: breaks rule {rejection.rule}: {rejection.message}")
    return problems


def _nccl_problems(m: Matrix, d: Path) -> list[str]:
    """nccl.yaml: one entry per wheel family, each naming torch releases torch.yaml has."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for p in m.nccl_file.packages:
        for t in p.torch:
            if t not in m._torch:
                problems.append(f"{d/NCCL}: {p.package}.torch names {t}, which is not a torch.yaml release")
            elif t in seen:
                problems.append(f"{d/NCCL}: torch {t} is listed under both {seen[t]} and {p.package}")
            seen[t] = p.package
    return problems


def load_publish(directory: Path) -> PublishFile:
    """The matrix directory's publish.yaml, read and checked in one place (defaults without one)."""
    path = Path(directory) / PUBLISH
    return _load_file(path) if os.path.lexists(path) else PublishFile()


def _read_directory(d: Path) -> tuple[tuple[str, Optional[str]], ...]:
    """Every matrix file's text (None for an optional file that is absent), each read with the
    size bound; a directory that is not one, or lacks a required file, is named."""
    if not d.is_dir():
        raise EnvbuildError(f"matrix directory {d} {'is not a directory' if d.exists() else 'does not exist'}; give "
                            f"--matrix-dir a directory of matrix files such as a copy of the shipped matrices/.")
    missing = [f for f in FILES if not os.path.lexists(d / f)]
    if missing:
        raise EnvbuildError(f"matrix directory {d} lacks {', '.join(missing)}; it needs {', '.join(FILES)}.")
    return tuple((f, read_text(d / f, "matrix file", "matrix") if os.path.lexists(d / f) else None)
                 for f in (*FILES, EXTENSIONS, NCCL))


@functools.lru_cache(maxsize=8)
def _parsed(directory: str, texts: tuple[tuple[str, Optional[str]], ...]) -> Matrix:
    """Keyed by the files' content as well as the directory: a directory written again under the
    same name (a test's tmp_path reused once the last one passed, a lab editing its matrix
    between two in-process calls) is parsed again, where a key of the path alone served the
    matrix it held before."""
    d = Path(directory)
    loaded = {f: _load_file(d / f, text) if text is not None else None for f, text in texts}
    m = Matrix(d, loaded["torch.yaml"], loaded["deepspeed.yaml"], loaded["gpus.yaml"],
               loaded["bases.yaml"], loaded["cuda.yaml"], loaded["stacks.yaml"], loaded["fabrics.yaml"],
               loaded[EXTENSIONS], loaded[NCCL])
    _check_references(m)
    return m


def load_matrix(directory: Optional[Path] = None) -> Matrix:
    """Load the built-in matrix, or the one in `directory` (``--matrix-dir``)."""
    d = (Path(directory) if directory else matrices_dir()).resolve()
    return _parsed(str(d), _read_directory(d))
