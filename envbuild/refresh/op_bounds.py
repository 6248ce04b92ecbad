"""Derive a DeepSpeed op's CUDA bound by compiling it with PyPI's nvcc of each CUDA release.

The matrix's `ops.<op>.cuda` bound ("<13.0") says which CUDA releases cannot build an op. It
is a fact about the op's source and each nvcc, so it is checked the way it arises: the op's
CUDA translation units (op_builder/<op>.py sources(), the .cu files) from the sdist the matrix
pins are compiled (`nvcc -c`, one arch) against torch's headers and the CUDA headers of ONE
release at a time (the cuda-toolkit[...] pins of one cuda-toolkit version: mixing two
releases' headers is refused by nvcc). Each release accepts, rejects (the front end's
`file(line): error: ...`), or is not tried (a reason: PyPI's CUDA 12 nvcc wheels have no
bin/nvcc). The bound is "<X.Y", X.Y the oldest release that rejects, when every newer one tried
rejects too; a missing header or a crash is a broken set-up, never a rejection.

Downloads (about 4 GB unpacked: torch's wheel for its include/, the nvcc, nvvm and header wheels) go
under a work directory the caller gives and deletes; scripts/derive_op_bounds.py runs it.
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import re
import subprocess
import sysconfig
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.base.untrusted import loads_yaml
from envbuild.refresh import deepspeed_facts
from envbuild.refresh.metadata import marker_env, read_metadata
from envbuild.refresh.pypi import USER_AGENT, DistFile, Index, sdist_text_files

# One cuda-toolkit version per CUDA release tried (13.0.2: the nvidia/cuda:13.0.2 bases of the
# cu130 stacks; 13.2.2: the stacks' cuda_toolkit pin; 12.9.1: the newest CUDA 12).
TOOLKITS = ("12.9.1", "13.0.2", "13.1.2.0", "13.2.2")
EXTRAS = ("nvcc", "nvvm", "crt", "cudart", "cccl", "profiler", "curand", "cublas", "cusparse", "cusolver")
# nvcc (its crt, nvvm) plus the headers the ops (cuda_profiler_api.h: profiler) and ATen/cuda/CUDAContext.h include
WHOLE_WHEEL_LIMIT = 150 << 20  # larger wheels (cuBLAS: 400 MB of libraries): only include/ members are read
ARCH = "90"  # sm_90 (Hopper): an arch every CUDA 12 and 13 nvcc has

_ERROR = re.compile(r"^(?P<file>[^\s()][^()\n]*)\((?P<line>\d+)\): (?:catastrophic )?error: (?P<text>.+)$", re.M)
# nvcc's and the host compiler's ways of saying the set-up is broken, not the source
_BROKEN = re.compile(r"fatal error: .*No such file or directory|cannot open source file|"
                     r"nvcc fatal|unsupported GNU version|Segmentation fault|internal error", re.I)


@dataclass(frozen=True)
class CompileError:
    """One front-end error: where (the source's path inside the sdist) and what."""

    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


@dataclass
class ReleaseResult:
    """What one CUDA release's nvcc did with the op: accepts, rejects or not-tried."""

    toolkit: str  # the cuda-toolkit version whose pins were used
    cuda: str  # major.minor
    outcome: str
    nvcc: str = ""  # `nvcc --version`'s release line, V13.0.88
    errors: list[CompileError] = field(default_factory=list)
    reason: str = ""  # why not tried


def parse_nvcc_log(log: str, source_root: str = "") -> list[CompileError]:
    """The distinct `file(line): error: text` entries of an nvcc log, paths relative to
    source_root (the unpacked sdist), in the order nvcc printed them."""
    out: list[CompileError] = []
    for m in _ERROR.finditer(log):
        path = m["file"].strip()
        if source_root and path.startswith(source_root.rstrip("/") + "/"):
            path = path[len(source_root.rstrip("/")) + 1:]
        err = CompileError(path, int(m["line"]), m["text"].strip())
        if err not in out:
            out.append(err)
    return out


def classify(returncode: int, log: str, source_root: str, where: str) -> tuple[str, list[CompileError]]:
    """("accepts", []) or ("rejects", errors); a log that shows a broken set-up (missing header,
    nvcc refusing its own options, a crash) or a failure without a front-end error raises, so a
    broken download can never pass for a rejection."""
    if returncode == 0:
        return "accepts", []
    broken = _BROKEN.search(log)
    errors = parse_nvcc_log(log, source_root)
    if broken or not errors:
        line = (broken.group(0) if broken else log.strip().splitlines()[-1:] or ["(no output)"])
        shown = line if isinstance(line, str) else line[0]
        raise EnvbuildError(f"{where}: nvcc exited {returncode} without a source error the bound could rest on "
                            f"({shown[:300]!r}); the compile set-up is broken (headers of two releases, a missing "
                            f"wheel), so no bound is derived from it.")
    return "rejects", errors


def decide_bound(results: list[ReleaseResult], where: str) -> str:
    """The `cuda` bound the results support: "" when every release tried accepts, "<X.Y" when
    the releases from X.Y on all reject and the older ones tried accept; anything else (a newer
    release accepting again) cannot be one upper bound and raises."""
    tried = sorted((r for r in results if r.outcome in ("accepts", "rejects")), key=lambda r: Version(r.cuda))
    if not tried:
        raise EnvbuildError(f"{where}: no CUDA release could be tried, so no bound can be derived.")
    first = next((i for i, r in enumerate(tried) if r.outcome == "rejects"), None)
    if first is None:
        return ""
    accepting_after = [r.cuda for r in tried[first:] if r.outcome == "accepts"]
    if accepting_after:
        raise EnvbuildError(f"{where}: CUDA {tried[first].cuda} rejects the op but {', '.join(accepting_after)} "
                            f"accept it; that is no single upper bound (write the bound by hand with its reason).")
    return f"<{tried[first].cuda}"


# ---------------------------------------------------------------- the op's source


def _literal_list(node: ast.expr, names: dict[str, ast.expr]) -> Optional[list[str]]:
    """A list of str literals, directly or through a name assigned one earlier in the body."""
    if isinstance(node, ast.Name) and node.id in names:
        node = names[node.id]
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def _literal_return(tree: ast.Module, method: str, where: str) -> list[str]:
    """What `method` returns when its body is assignments of literal lists and a return of one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == method:
            names: dict[str, ast.expr] = {}
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    names[stmt.targets[0].id] = stmt.value
                elif isinstance(stmt, ast.Return) and stmt.value is not None:
                    value = _literal_list(stmt.value, names)
                    if value is not None:
                        return value
                    break
            raise EnvbuildError(f"{where}: {method}() does not return a literal list of paths; "
                                f"this op's compile cannot be derived statically.")
    if method == "sources":  # inherited (stochastic_transformer from transformer): its own file does not say
        raise EnvbuildError(f"{where} does not define sources() itself (its base class does); this op's "
                            f"compile cannot be derived statically.")
    return []


def op_sources(files: dict[str, bytes], op: str) -> tuple[list[str], list[str]]:
    """The CUDA sources (.cu) and include paths the builder of `op` (its NAME) returns from
    sources() and include_paths(), read without running DeepSpeed (literal lists only)."""
    found = deepspeed_facts.ops(files, "the deepspeed sdist")
    if op not in found:
        raise EnvbuildError(f"the deepspeed sdist has no op {op!r}; its ops: {', '.join(sorted(found))}.")
    where = found[op].path
    tree = ast.parse(files[where])
    cuda_sources = [s for s in _literal_return(tree, "sources", where) if s.endswith(".cu")]
    if not cuda_sources:  # a cpu op, or .cpp only: a compile says nothing of a CUDA bound
        raise EnvbuildError(f"{where}: sources() lists no .cu file, so nvcc compiles nothing of op {op} "
                            f"and no CUDA bound follows from a compile.")
    return cuda_sources, _literal_return(tree, "include_paths", where)


def nvcc_command(nvcc: Path, cuda_home: Path, torch_include: Path, sdist: Path, source: str,
                 includes: list[str], cuda: str, out: Path) -> list[str]:
    """The nvcc line torch's CUDAExtension and DeepSpeed's CUDAOpBuilder.nvcc_args() give one
    .cu (their defines, -std, the op's include paths), for sm_90 only."""
    major, minor = (int(p) for p in cuda.split(".")[:2])
    std = "-std=c++20" if (major, minor) >= (12, 5) else "-std=c++17"
    incs = [f"-I{sdist / i}" for i in includes] + [
        f"-I{torch_include}", f"-I{torch_include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{cuda_home / 'include'}", f"-I{sysconfig.get_paths()['include']}"]
    return [str(nvcc), "-c", str(sdist / source), "-o", str(out), *incs,
            "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr", "--compiler-options", "-fPIC",
            "-O3", "--use_fast_math", std, "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_HALF2_OPERATORS__", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}", "-DBF16_AVAILABLE",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=op", "-D_GLIBCXX_USE_CXX11_ABI=1"]


# ---------------------------------------------------------------- downloads


def toolkit_pins(index: Index, toolkit: str, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """project -> exact version of each wheel cuda-toolkit[<extras>]==toolkit installs on
    Linux x86_64 (its METADATA's Requires-Dist, `==X.*` pins)."""
    wheels = [d for d in index.files("cuda-toolkit") if d.is_wheel and d.version == Version(toolkit)]
    if not wheels:
        raise EnvbuildError(f"PyPI has no cuda-toolkit {toolkit} wheel; pick one of its releases.")
    pins: dict[str, str] = {}
    for line in read_metadata(index, wheels[0]).get("requires-dist", []):
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        env = marker_env("x86_64", 12)
        specs = list(req.specifier)
        if req.marker is None or not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
            continue
        if len(specs) == 1 and specs[0].operator == "==":  # a range (nvjitlink>=13.1,<14) is a library's own dependency
            pins[req.name] = specs[0].version.removesuffix(".*")
    return pins


def _wheel(index: Index, project: str, version: str) -> DistFile:
    for dist in index.files(project):
        if (dist.is_wheel and str(dist.version).startswith(version) and "x86_64" in dist.filename
                and "manylinux" in dist.filename and not dist.yanked):
            return dist
    raise EnvbuildError(f"PyPI has no manylinux x86_64 wheel of {project} {version}.")


def download(dist: DistFile, dest: Path) -> Path:
    """The whole file, streamed to dest/<filename> and checked against the index's sha256."""
    path = dest / dist.filename
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == dist.sha256:
        return path
    digest = hashlib.sha256()
    request = urllib.request.Request(dist.url, headers={"User-Agent": USER_AGENT})
    with urllib.request.urlopen(request, timeout=120) as response, open(path, "wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if dist.sha256 and digest.hexdigest() != dist.sha256:
        path.unlink()
        raise EnvbuildError(f"{dist.filename}: sha256 does not match the index.")
    return path


def unpack_wheel(index: Index, dist: DistFile, dest: Path, downloads: Path, prefix: str = "") -> None:
    """A wheel's members (those under `prefix` when given) into dest: small wheels whole, large
    ones member by member (only their include/ headers: cuBLAS's libraries are not needed)."""
    if dist.size <= WHOLE_WHEEL_LIMIT or prefix:
        with zipfile.ZipFile(download(dist, downloads)) as wheel:
            for name in wheel.namelist():
                if name.startswith(prefix) and not name.endswith("/") and ".." not in name.split("/"):
                    target = dest / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(wheel.read(name))
                    if "/bin/" in name or "/nvvm/bin/" in name:
                        target.chmod(0o755)
        return
    for name in index.members(dist):
        if "/include/" in name and not name.endswith("/") and ".." not in name.split("/"):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(index.member(dist, name))


def unpack_sdist(index: Index, project: str, version: str, dest: Path, downloads: Path) -> tuple[Path, dict]:
    """The sdist's csrc/ and op_builder/ under dest; returns its top directory and its text files."""
    sdists = [d for d in index.files(project) if not d.is_wheel and d.version == Version(version)]
    if not sdists:
        raise EnvbuildError(f"PyPI has no sdist of {project} {version}.")
    data = download(sdists[0], downloads).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for info in tar:
            parts = info.name.split("/")
            if info.isfile() and len(parts) > 2 and parts[1] in ("csrc", "op_builder") and ".." not in parts:
                target = dest.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(info).read())
    return dest / f"{project}-{version}", sdist_text_files(data)


def cuda_home(root: Path) -> Optional[Path]:
    """Where the unpacked wheels put bin/nvcc: nvidia/cu13 (CUDA 13's one tree); None if no nvcc."""
    found = sorted(root.glob("nvidia/*/bin/nvcc"))
    return found[0].parent.parent if found else None


# ---------------------------------------------------------------- compiling


def nvcc_release(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"release [\d.]+, (V[\d.]+)", out)
    return found.group(1) if found else out.strip()[-80:]


def try_release(index: Index, toolkit: str, work: Path, sdist: tuple[Path, dict], torch_include: Path,
                op: str, downloads: Path) -> ReleaseResult:
    """Unpack cuda-toolkit[EXTRAS]==toolkit's wheels into a tree of their own and compile the op."""
    cuda = ".".join(toolkit.split(".")[:2])
    tree = work / f"cuda-{toolkit}"
    pins = toolkit_pins(index, toolkit)
    for project, version in sorted(pins.items()):
        unpack_wheel(index, _wheel(index, project, version), tree, downloads)
    home = cuda_home(tree)
    nvcc_pin = next((f"{p} {v}" for p, v in pins.items() if p.startswith("nvidia-cuda-nvcc")), "no nvcc pin")
    if home is None:
        return ReleaseResult(toolkit, cuda, "not-tried", reason=f"{nvcc_pin} (cuda-toolkit[nvcc]=={toolkit}) "
                             f"holds no bin/nvcc (ptxas and headers only)")
    result = ReleaseResult(toolkit, cuda, "accepts", nvcc=nvcc_release(home / "bin" / "nvcc"))
    root, files = sdist
    sources, includes = op_sources(files, op)
    for source in sources:
        command = nvcc_command(home / "bin" / "nvcc", home, torch_include, root, source, includes, cuda,
                               work / "op.o")
        run = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "CUDA_HOME": str(home)})
        log = work / "logs" / f"{op}-nvcc-{result.nvcc}-{Path(source).name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(command)}\n{run.stdout}{run.stderr}exit {run.returncode}\n")
        outcome, errors = classify(run.returncode, run.stdout + run.stderr, str(root), f"{op} {source} "
                                   f"with nvcc {result.nvcc}")
        if outcome == "rejects":
            result.outcome = "rejects"
            result.errors += errors
    return result


def derive(index: Index, work: Path, deepspeed: str, torch: str, op: str,
           toolkits: tuple[str, ...] = TOOLKITS) -> tuple[str, list[ReleaseResult]]:
    """(bound, per-release results) for `op` of deepspeed==<deepspeed>, against
    torch==<torch>'s headers (its PyPI x86_64 wheel's include/)."""
    downloads = work / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    sdist = unpack_sdist(index, "deepspeed", deepspeed, work / "sdist", downloads)
    torch_wheel = _wheel(index, "torch", torch)
    unpack_wheel(index, torch_wheel, work / "torch", downloads, prefix="torch/include/")
    results = [try_release(index, t, work, sdist, work / "torch" / "torch" / "include", op, downloads)
               for t in toolkits]
    return decide_bound(results, f"deepspeed {deepspeed} {op}"), results


def pinned(matrix_dir: Path) -> tuple[str, str, dict]:
    """(the newest DeepSpeed release deepspeed.yaml lists, the newest torch a CUDA 13 stack pins
    with it in stacks.yaml, deepspeed.yaml's ops): what the derived bounds are about."""
    ds = loads_yaml((matrix_dir / "deepspeed.yaml").read_bytes(), f"{matrix_dir}/deepspeed.yaml", 1 << 20)
    stacks = loads_yaml((matrix_dir / "stacks.yaml").read_bytes(), f"{matrix_dir}/stacks.yaml", 1 << 20)
    newest = max((r["deepspeed"] for r in ds["releases"]), key=Version)
    torches = [s["torch"] for s in stacks["stacks"] if s.get("deepspeed") == newest and str(s["cuda"]).startswith("13.")]
    if not torches:
        raise EnvbuildError(f"{matrix_dir}/stacks.yaml has no CUDA 13 stack with deepspeed {newest}.")
    return newest, max(torches, key=Version), ds["ops"]


def describe(results: list[ReleaseResult]) -> list[str]:
    """One line per release: what the data's reason cites."""
    lines = []
    for r in results:
        if r.outcome == "not-tried":
            lines.append(f"CUDA {r.cuda} (cuda-toolkit {r.toolkit}): not tried: {r.reason}")
        elif r.outcome == "accepts":
            lines.append(f"CUDA {r.cuda} (cuda-toolkit {r.toolkit}, nvcc {r.nvcc}): accepts")
        else:
            lines.append(f"CUDA {r.cuda} (cuda-toolkit {r.toolkit}, nvcc {r.nvcc}): rejects: "
                         + "; ".join(str(e) for e in r.errors))
    return lines
