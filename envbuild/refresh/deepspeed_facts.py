"""Derive the facts of one DeepSpeed release from its PyPI sdist, by reading the sources.

- ops: the builder classes DeepSpeed's CUDA accelerator collects (`op_builder/*.py`, plus
  the classes `accelerator/cuda_accelerator.py` takes from a sub-package such as
  `op_builder/cpu/` in 0.19.8), each with its NAME, BUILD_VAR, kind and the libraries its
  `is_compatible()` link test needs;
- torch: the requirement in requirements/requirements.txt;
- gpu_free_install: whether `setup.py` (run with DS_ACCELERATOR=cuda on a machine with no GPU)
  imports a module that, at import time, calls a CUDA_Accelerator method reaching
  torch.cuda.get_device_capability() & co. without an `is_available()` early return;
- nvcc_free_install: whether `setup.py`, run with DS_ACCELERATOR=cuda, calls outside any
  function (on a path its `if` tests allow, not under a `try` that catches
  MissingCUDAException) an op_builder function that runs `nvcc`. What the op builders do
  when they compile is not analysed: from 0.16 on CUDAOpBuilder.builder() catches a missing
  nvcc and builds a CPU extension.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Optional

from packaging.requirements import InvalidRequirement, Requirement

from envbuild.base.errors import EnvbuildError
from envbuild.refresh.static import (
    accelerator_method,
    call_name,
    function_calls_unguarded,
    import_closure,
    import_time_nodes,
    parse,
    reachable_module_calls,
)

DEVICE_CALLS = {"get_device_capability", "get_device_properties", "get_device_name", "current_device"}
CPU_BASES = {"TorchCPUOpBuilder", "CPUOpBuilder"}
ABSTRACT = {"OpBuilder", "CUDAOpBuilder", "TorchCPUOpBuilder", "CPUOpBuilder"}
# setup.py runs with DS_ACCELERATOR=cuda and a CUDA (not ROCm) torch installed.
SETUP_ASSUMPTIONS = {"torch_available": True, "is_rocm_pytorch": False}
LIBRARY_NEEDS = {"aio": "libaio", "cufile": "cufile"}  # -l<name> of a link test -> bases.yaml capability
# CUDA libraries an op links (-l<name> in its builder's extra_ldflags) beyond what torch's
# cpp_extension adds (cudart, c10, torch): a capability of the toolchain (bases.yaml `provides`).
# -lcuda is the driver's library: linked through the toolkit's stub, loaded from the driver.
CUDA_LIBRARY_NEEDS = {"curand": "curand", "cuda": "libcuda"}


@dataclass(frozen=True)
class OpFacts:
    name: str
    env: str
    kind: str  # "cpu" (host compiler) or "cuda"
    cuda_extension: bool  # a CUDAOpBuilder: links CUDA when a toolkit is present
    needs: tuple[str, ...]
    path: str


@dataclass
class SdistFacts:
    version: str
    ops: dict[str, OpFacts] = field(default_factory=dict)
    torch: str = ""
    gpu_free_install: Optional[bool] = None
    gpu_hazard: str = ""
    nvcc_free_install: Optional[bool] = None
    nvcc_call: str = ""


@dataclass
class _Class:
    name: str
    bases: list[str]
    node: ast.ClassDef
    path: str
    attrs: dict[str, str]


def _classes(files: dict[str, bytes], directory: str) -> dict[str, _Class]:
    """Classes defined in `directory/*.py` (one level), by name."""
    out = {}
    for path in sorted(files):
        if not (path.startswith(directory + "/") and path.endswith(".py") and path.count("/") == directory.count("/") + 1):
            continue
        tree = parse(files, path)
        if tree is None:
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                attrs = {t.id: s.value.value for s in node.body if isinstance(s, ast.Assign)
                         for t in s.targets if isinstance(t, ast.Name) and isinstance(s.value, ast.Constant)
                         and isinstance(s.value.value, str)}
                out[node.name] = _Class(node.name, [ast.unparse(b).rpartition(".")[2] for b in node.bases],
                                        node, path, attrs)
    return out


def _cuda_overrides(files: dict[str, bytes]) -> tuple[Optional[str], list[str]]:
    """(sub-package, class names) that the CUDA accelerator takes from op_builder/<sub>/
    instead of op_builder/ (0.19.8: the CPU optimizers from op_builder/cpu)."""
    path = next((p for p in ("accelerator/cuda_accelerator.py", "deepspeed/accelerator/cuda_accelerator.py")
                 if p in files), None)
    tree = parse(files, path) if path else None
    if tree is None:
        return None, []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "_lazy_init_class_dict"):
            continue
        sub = next((m.group(1) for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    for m in [re.fullmatch(r"\{\}\.(\w+)", n.value)] if m), None)
        names = [e.value for loop in ast.walk(fn) if isinstance(loop, ast.For) and isinstance(loop.iter, ast.List)
                 for e in loop.iter.elts if isinstance(e, ast.Constant) and str(e.value).endswith("Builder")]
        if sub and names:
            return sub, names
    return None, []


def _ancestors(cls: _Class, *scopes: dict[str, _Class]) -> list[_Class]:
    out, todo = [], [cls]
    while todo:
        current = todo.pop(0)
        out.append(current)
        for base in current.bases:
            found = next((s[base] for s in scopes if base in s), None)
            if found is not None and found not in out:
                todo.append(found)
    return out


def _needs(lineage: list[_Class]) -> tuple[str, ...]:
    """Libraries named by the `has_function(func, libraries)` link tests of the class and
    its op_builder ancestors."""
    needs = set()
    for cls in lineage:
        for node in ast.walk(cls.node):
            if isinstance(node, ast.Call) and call_name(node) == "has_function":
                libs = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "libraries"), None)
                for lib in getattr(libs, "elts", []):
                    if isinstance(lib, ast.Constant) and isinstance(lib.value, str):
                        needs.add(LIBRARY_NEEDS.get(lib.value, "lib" + lib.value))
    # extra_ldflags returning '-lcurand' or '-lcuda' (its non-ROCm branch): the nearest definition
    # counts, as Python's method resolution picks it (StochasticTransformer inherits Transformer's),
    # and the next one up too where it calls super().extra_ldflags() (GDS extends async_io's).
    definitions = [fn for cls in lineage for fn in cls.node.body
                   if isinstance(fn, ast.FunctionDef) and fn.name == "extra_ldflags"]
    for ldflags in definitions:
        for node in ast.walk(ldflags):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("-l")
                    and node.value[2:] in CUDA_LIBRARY_NEEDS):
                needs.add(CUDA_LIBRARY_NEEDS[node.value[2:]])
        if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "extra_ldflags"
                   and isinstance(n.func.value, ast.Call) and call_name(n.func.value) == "super"
                   for n in ast.walk(ldflags)):
            break
    return tuple(sorted(needs))


def ops(files: dict[str, bytes], where: str) -> dict[str, OpFacts]:
    """The ops DeepSpeed's CUDA accelerator builds, by NAME."""
    top = _classes(files, "op_builder")
    sub, overrides = _cuda_overrides(files)
    sub_classes = _classes(files, f"op_builder/{sub}") if sub else {}
    chosen = {n: c for n, c in top.items() if n not in ABSTRACT}
    for name in overrides:
        if name not in sub_classes:
            raise EnvbuildError(f"{where}: the CUDA accelerator takes {name} from op_builder/{sub}/, "
                                f"which does not define it; the sources changed shape.")
        chosen[name] = sub_classes[name]
    out = {}
    for cls in chosen.values():
        op_name, build_var = cls.attrs.get("NAME"), cls.attrs.get("BUILD_VAR")
        if not op_name or not build_var:
            continue
        lineage = _ancestors(cls, sub_classes if cls.path.startswith(f"op_builder/{sub}/") else {}, top)
        names = {c.name for c in lineage} | {b for c in lineage for b in c.bases}
        cuda_ext = "CUDAOpBuilder" in names
        kind = "cpu" if names & CPU_BASES or not cuda_ext else "cuda"
        local = [c for c in lineage if c.name not in ABSTRACT]
        out[op_name] = OpFacts(op_name, build_var.removeprefix("DS_BUILD_"), kind, cuda_ext, _needs(local), cls.path)
    return out


def torch_requirement(files: dict[str, bytes], where: str) -> str:
    """The torch specifier of requirements/requirements.txt ('' when unversioned)."""
    text = files.get("requirements/requirements.txt")
    if text is None:
        raise EnvbuildError(f"{where}: no requirements/requirements.txt in the sdist.")
    for line in text.decode("utf-8", "replace").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() == "torch":
            return str(req.specifier)
    raise EnvbuildError(f"{where}: requirements/requirements.txt names no torch requirement.")


def _unguarded_methods(files: dict[str, bytes]) -> set[str]:
    """CUDA_Accelerator methods that reach a device query with no is_available() early return."""
    path = next((p for p in ("deepspeed/accelerator/cuda_accelerator.py", "accelerator/cuda_accelerator.py")
                 if p in files), None)
    tree = parse(files, path) if path else None
    if tree is None:
        return set()
    methods = {f.name: f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "CUDA_Accelerator"
               for f in c.body if isinstance(f, ast.FunctionDef)}
    hazards = set(DEVICE_CALLS)
    while True:
        found = {name for name, fn in methods.items() if function_calls_unguarded(fn.body, hazards, "is_available")}
        if found <= hazards:
            return found
        hazards |= found


def gpu_free_install(files: dict[str, bytes]) -> tuple[bool, str]:
    """(True, '') when setup.py's imports call no unguarded device query at import time;
    else (False, the import chain and the call)."""
    unguarded = _unguarded_methods(files)
    for module, chain in sorted(import_closure(files, "setup.py").items(), key=lambda kv: kv[1]):
        tree = parse(files, chain[-1])
        for node in import_time_nodes(tree) if tree else ():
            if not isinstance(node, ast.Call):
                continue
            method = accelerator_method(node)
            if (method in unguarded) or call_name(node) in DEVICE_CALLS:
                what = f"get_accelerator().{method}()" if method else f"{call_name(node)}()"
                return False, f"{' -> '.join(chain)} calls {what} at import (line {node.lineno})"
    return True, ""


def nvcc_free_install(files: dict[str, bytes]) -> tuple[bool, str]:
    """(True, '') when setup.py runs no nvcc-running op_builder function outside a function body."""
    tree = parse(files, "op_builder/builder.py")
    if tree is None:
        raise EnvbuildError("no op_builder/builder.py in the sdist; the layout changed.")
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    runs_nvcc = {name for name, fn in functions.items()
                 if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "nvcc" in n.value
                        for n in ast.walk(fn))
                 and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                         and ast.unparse(n.func.value) == "subprocess" for n in ast.walk(fn))}
    while True:
        callers = {name for name, fn in functions.items()
                   if any(isinstance(n, ast.Call) and call_name(n) in runs_nvcc for n in ast.walk(fn))}
        if callers <= runs_nvcc:
            break
        runs_nvcc |= callers
    setup = parse(files, "setup.py")
    if setup is None:
        raise EnvbuildError("no parsable setup.py in the sdist.")
    for node in reachable_module_calls(setup, SETUP_ASSUMPTIONS, "cuda", {"MissingCUDAException"}):
        if call_name(node) in runs_nvcc:
            return False, f"setup.py line {node.lineno} calls {call_name(node)}(), which runs nvcc"
    return True, ""


def analyse(files: dict[str, bytes], version: str, full: bool = True) -> SdistFacts:
    """Facts of one sdist; `full=False` reads only the ops (enough for since/until bisects)."""
    where = f"deepspeed {version} sdist"
    facts = SdistFacts(version=version, ops=ops(files, where))
    if full:
        facts.torch = torch_requirement(files, where)
        facts.gpu_free_install, facts.gpu_hazard = gpu_free_install(files)
        facts.nvcc_free_install, facts.nvcc_call = nvcc_free_install(files)
    return facts
