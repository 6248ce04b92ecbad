"""The smoke test's checks of the image itself: versions, DeepSpeed's op record, ops loading
with JIT impossible, optimizer numerics, compilers, the baked environment, the GPU arch, the
driver floor and the node's conditional environment.

torch and deepspeed are imported inside the checks that need them, so a broken install is a
failed check, and this module imports with the standard library alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys

from . import node, nodefacts, paths, sandbox
from .arch import arch_runs_on
from .children import GPU_OPTIMIZERS
from .report import Skipped
from .versions import major_minor, normalize_version, version_matches

COMPILERS = ("ninja", "gcc", "g++", "cc", "c++", "nvcc", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++",
             "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++")
# ELF e_machine of each CPU architecture an image can be built for (the ELF specification).
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
JIT_TOOLS = ("ninja", "nvcc")  # what a DeepSpeed/cpp_extension JIT build needs beyond a C compiler
JIT_HANG_MSG = "hung: a JIT compile waiting on a lock — field report 1"
ADAM_TOLERANCE = 1e-5


# ----------------------------------------------------------------------------- CPU architecture


def elf_arch(path: str) -> str | None:
    """The CPU architecture an ELF file is code for ('aarch64'), from its header; None if not ELF."""
    with open(path, "rb") as handle:
        header = handle.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    machine = int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")
    return ELF_MACHINES.get(machine, f"e_machine {machine}")


def check_cpu_arch(manifest: dict, machine: str | None = None, ops_dir: str | None = None):
    """The image runs on the CPU it was built for, and every pre-built op library is code for it
    (an x86 image on a Grace node cannot start at all; an op built for the wrong CPU would)."""
    import glob
    import platform

    want = manifest.get("arch")
    if not want:
        return Skipped("the manifest names no CPU architecture (built by an older envbuild)")
    machine = machine or platform.machine()
    if ops_dir is None:
        import importlib.util

        spec = importlib.util.find_spec("deepspeed")
        ops_dir = os.path.join(os.path.dirname(spec.origin), "ops") if spec and spec.origin else ""
    libraries = sorted(glob.glob(os.path.join(ops_dir, "**", "*.so"), recursive=True)) if ops_dir else []
    wrong = [f"{os.path.basename(lib)}={arch}" for lib in libraries if (arch := elf_arch(lib)) != want]
    detail = (f"machine {machine}, image {want} (cpu target {manifest.get('cpu_target')}); "
              f"{len(libraries)} op libraries are {want} code")
    if machine != want:
        return False, f"this machine is {machine} but the image is built for {want}"
    if wrong:
        return False, f"op libraries not built for {want}: {', '.join(wrong)}"
    return True, detail


# ----------------------------------------------------------------------------- versions and record
def check_versions(manifest: dict) -> tuple[bool, str]:
    """The pinned stack must be the one installed: op .so files are only valid for it. NCCL is
    the `nccl` check's (nccl.py): torch's own report of it is not the library it loaded."""
    import torch  # first: a missing torch is the root cause to report, not DeepSpeed's import of it
    import deepspeed  # noqa: I001

    def same_minor(expected, actual):
        return actual is not None and major_minor(expected) == major_minor(actual)

    rows = [("python", manifest["python"], "%d.%d.%d" % sys.version_info[:3], same_minor),
            ("torch", manifest["torch"], torch.__version__, version_matches),
            ("cuda", manifest["cuda"], torch.version.cuda, same_minor),
            ("deepspeed", manifest["deepspeed"], deepspeed.__version__, version_matches)]
    parts, ok = [], True
    for name, want, have, match in rows:
        if want is None:
            parts.append(f"{name} (not pinned)")
            continue
        good = match(want, have)
        ok &= good
        shown = normalize_version(have) if have is not None else None
        parts.append(f"{name} {shown}" + ("" if good else f" != {want}"))
    return ok, ", ".join(parts)


def check_ds_record(manifest: dict, accelerator: str) -> tuple[bool, str]:
    """DeepSpeed JIT-compiles any op not recorded as installed for the running accelerator."""
    from deepspeed.git_version_info import accelerator_name, installed_ops

    missing = [op for op in manifest["ds_ops"] if not installed_ops.get(op)]
    problems = [f"not pre-built: {', '.join(missing)}"] if missing else []
    if accelerator_name != accelerator:
        problems.append(f"accelerator recorded {accelerator_name!r}, expected {accelerator!r} "
                        "(build with DS_ACCELERATOR=cuda)")
    return not problems, "; ".join(problems) or f"{len(manifest['ds_ops'])} ops pre-built for {accelerator_name}"


# ----------------------------------------------------------------------------- no JIT
def run_ops_child(manifest: dict, args, work: str) -> dict:
    """Load every op in a child with JIT impossible; returns the child's JSON plus sandbox facts."""
    ops = list(manifest.get("ds_ops") or [])
    ext = os.path.join(work, "torch_extensions")
    os.makedirs(ext)
    planted = sandbox.plant_stale_locks(ext, ops)
    result_path, log_path = os.path.join(work, "ops.json"), os.path.join(work, "ops.log")
    env = dict(os.environ, DS_ACCELERATOR=args.accelerator, TORCH_EXTENSIONS_DIR=ext)
    try:
        cmd = sandbox.self_command("--child", "ops", "--result", result_path, "--ops", ",".join(ops))
        if manifest.get("extensions"):
            cmd += ["--extensions", json.dumps(manifest["extensions"])]
        if getattr(args, "gpu_numerics", False):
            cmd.append("--gpu-numerics")
        state, rc = sandbox.run_child(cmd, env, args.timeout, log_path)
        extra = sorted(sandbox.tree_entries(ext) - planted)
    finally:
        sandbox.make_writable(ext)
    res = sandbox.read_json(result_path) or {}
    res.update(state=state, rc=rc, log=sandbox.tail(log_path), extra=extra)
    return res


def check_no_jit(res: dict, ops: list[str], timeout: float) -> tuple[bool, str]:
    done = res.get("ops") or {}
    parts = [f"{op} {'ok' if done[op]['ok'] else 'FAILED'} {done[op]['seconds']:.3f}s"
             + (f" ({done[op]['detail']})" if done[op]["detail"] else "") for op in ops if op in done]
    if res["state"] == "timeout":
        waiting = [op for op in ops if op not in done]
        stuck = waiting[0] if waiting else "cpu_adam numerics"
        return False, "; ".join([f"{JIT_HANG_MSG} (killed after {timeout:g}s, stuck on {stuck})", *parts])
    if res["extra"]:
        return False, f"the extensions dir was written to (a JIT build ran): {res['extra'][:5]}; " + "; ".join(parts)
    if res["rc"] != 0 or set(done) != set(ops):
        return False, f"child exited {res['rc']} after {sorted(done)}: {res['log']}"
    return all(v["ok"] for v in done.values()), "; ".join(parts) or "no ops in manifest"


def check_cpu_adam(res: dict, key: str = "adam", label: str = "DeepSpeedCPUAdam",
                   reference: str = "torch.optim.Adam") -> tuple[bool, str, float]:
    adam = res.get(key)
    if not adam:
        return False, f"no result from the op child ({res.get('state')}, rc={res.get('rc')})", 0.0
    if not adam["ok"]:
        return False, adam["detail"], adam["seconds"]
    diff = adam["max_abs_diff"]
    detail = f"max|{label} - {reference}| = {diff:.2e} (tol {ADAM_TOLERANCE:g})"
    return diff <= ADAM_TOLERANCE, detail, adam["seconds"]


def check_gpu_optimizer(res: dict, op: str) -> tuple[bool, str, float]:
    """One step of a pre-built CUDA optimizer on this GPU equals its reference in plain torch."""
    return check_cpu_adam(res, op, *GPU_OPTIMIZERS[op][1:])


# Tolerances of the extensions' GPU checks against plain torch (fp16 attention: flash-attn's own
# tests compare with a reference at about this size; fp32 causal conv1d with fast math).
# FA3, FA4 and xformers: fp16 attention as flash-attn's; te.Linear and the selective scan in fp32 (TF32 off
# for the reference; the scan's backward sums over the sequence, as mamba's own tests allow for).
EXTENSION_TOLERANCE = {"attention": 2e-2, "causal-conv1d": 1e-3, "flash-attn-3": 2e-2, "flash-attn-4": 2e-2, "xformers": 2e-2,
                       "transformer-engine": 1e-2, "selective-scan": 5e-3}


def check_extensions(manifest: dict, res: dict, record_path: str | None = None) -> tuple[bool, str]:
    """Each pre-built CUDA extension imports in the no-JIT child at the version the image was
    built with (an `undefined symbol` here means torch was swapped under it: the guard was
    bypassed), the build recorded its wheel's sha256 and SASS audit, and on a GPU one forward
    (and backward) matches plain torch within tolerance."""
    wanted = manifest.get("extensions") or []
    done = res.get("extensions") or {}
    record = {}
    with contextlib.suppress(OSError, ValueError):
        with open(record_path or paths.EXTENSIONS_RECORD) as f:
            record = {r["name"]: r for r in json.load(f)}
    ok, parts = True, []
    for ext in wanted:
        name = ext["name"]
        got = done.get(name)
        if got is None:
            ok = False
            parts.append(f"{name}: not checked (child {res.get('state')}, rc={res.get('rc')}: {res.get('log', '')[-200:]})")
            continue
        if not got["ok"]:
            ok = False
            hint = (" -- compiled against another torch than the one loaded: torch was replaced under it "
                    "(the guard PIP_CONSTRAINT bypassed?); put back the image's torch or rebuild with --ext"
                    if "undefined symbol" in got["detail"] else "")
            parts.append(f"{name}: FAILED {got['detail']}{hint}")
            continue
        built = record.get(name)
        if not built or built.get("version") != ext["version"]:
            ok = False
            parts.append(f"{name}: no build record in {record_path or paths.EXTENSIONS_RECORD}")
            continue
        part = f"{name} {ext['version']} imports (wheel sha256 {built['sha256'][:12]}, SASS {ext['arch_list']})"
        gpu = got.get("gpu")
        if gpu is not None:
            tol = EXTENSION_TOLERANCE[ext["gpu_check"]]
            good = gpu["ok"] and gpu["max_abs_diff"] <= tol
            ok &= good
            part += (f"; GPU forward+backward max|diff| vs torch {gpu['max_abs_diff']:.2e} (tol {tol:g})" if gpu["ok"]
                     else f"; GPU check FAILED {gpu['detail']}")
        elif got.get("gpu_skipped"):
            part += f"; GPU check not run ({got['gpu_skipped']})"
        parts.append(part + _run_time_compile(ext))
    return ok, "; ".join(parts)


def _run_time_compile(ext: dict) -> str:
    """Where an extension that compiles its kernels at first call (FA4's CuTe DSL) keeps them in
    this container: the per-job node-local directory env.sh set, or memory only (every process
    compiles again) where its cache is off."""
    jit = ext.get("run_time_compile")
    if not jit:
        return ""
    enabled = not jit.get("enable_env") or os.environ.get(jit["enable_env"]) == "1"
    where = os.environ.get(jit["cache_env"]) if enabled else None
    return (f"; kernels compile at first call into {where} ({jit['cache_env']}, per job and node)" if where else
            f"; kernels compile at first call and are kept in memory only ({jit.get('enable_env')} is not 1: "
            f"each process compiles them again)")


# ----------------------------------------------------------------------------- image contents
def check_compilers(manifest: dict, path: str | None = None) -> tuple[bool, str]:
    """ninja or nvcc in the image is what lets a silent DeepSpeed JIT compile start at all:
    neither may be there unless the toolchain is kept. A C compiler is there on purpose for
    torch.compile (Triton's launcher, Inductor's C++ code) unless the image was built with
    --no-compiler (manifest runtime_compiler false; older manifests have no key: the same)."""
    found = {name: where for name in COMPILERS if (where := shutil.which(name, path=path))}
    listed = [f"{name}={where}" for name, where in found.items()]
    if manifest.get("toolchain_kept"):
        return True, "toolchain kept on purpose" + (f": {', '.join(listed)}" if listed else "")
    jit = [f"{name}={found[name]}" for name in JIT_TOOLS if name in found]
    c_compilers = [f"{name}={where}" for name, where in found.items() if name not in JIT_TOOLS]
    if jit:
        return False, f"found: {', '.join(jit)} (a DeepSpeed op could JIT-compile at run time)"
    if manifest.get("runtime_compiler"):
        if not c_compilers:
            return False, "no C compiler, so torch.compile cannot run, but the manifest says runtime_compiler"
        return True, f"no {' or '.join(JIT_TOOLS)}; C compiler for torch.compile: {', '.join(c_compilers)}"
    return (not listed), ("found: " + ", ".join(listed)) if listed else "none of " + " ".join(COMPILERS)


def check_guard(manifest: dict, environ=None) -> tuple[bool, str] | Skipped:
    """The constraints file pins the torch and DeepSpeed the ops were built against, and pip
    and uv read it: a `pip install` that needs another torch then fails instead of replacing it."""
    path = manifest.get("constraints")
    if not path:
        return Skipped("the manifest predates the guard (no constraints)")
    environ = os.environ if environ is None else environ
    try:
        with open(path, encoding="utf-8") as handle:
            pins = {line.split("==", 1)[0].lower(): line.strip().split("==", 1)[1]
                    for line in handle if "==" in line}
    except OSError as error:
        return False, f"{path} cannot be read ({error.strerror}): nothing stops a pip install from replacing torch"
    pins = {_canonical(name): version for name, version in pins.items()}
    wanted = {name: manifest.get(name) for name in ("torch", "deepspeed")}
    wanted.update({_canonical(e["name"]): e["version"] for e in manifest.get("extensions") or []})
    wrong = [f"{name}=={pins.get(name, '(missing)')} (want {want})" for name, want in wanted.items()
             if want and pins.get(name, "").split("+")[0] != want]
    unread = [var for var in ("PIP_CONSTRAINT", "UV_CONSTRAINT") if environ.get(var) != path]
    problems = wrong + [f"{var} is not {path}" for var in unread]
    if problems:
        return False, "; ".join(problems)
    return True, f"{len(pins)} pins in {path} (torch=={pins['torch']}), read by pip and uv"


def _canonical(name: str) -> str:
    """PEP 503 name (stdlib-only twin of packaging.utils.canonicalize_name)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(path: str, section: str = "venv") -> dict[str, str]:
    """Canonical name -> version of one section of an envbuild lock file."""
    pins, current = {}, None
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("# ["):
                current = line[3:].split("]", 1)[0]
            elif current == section and re.match(r"[A-Za-z0-9]", line) and "==" in line:
                name, version = line.split("==", 1)
                pins[_canonical(name.split("[", 1)[0])] = version.split()[0].rstrip("\\").strip()
    return pins


def installed_distributions(site_dirs=None) -> dict[str, str]:
    """Canonical name -> version of every distribution the venv holds."""
    from importlib import metadata

    found = {}
    for dist in metadata.distributions(**({"path": site_dirs} if site_dirs else {})):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(_canonical(name), dist.version)
    return found


def check_lock(manifest: dict, installed=None) -> tuple[bool, str] | Skipped:
    """The venv holds exactly what the stack's lock lists (names and versions), less what
    the lock marks build-only and the image drops: nothing more, nothing less, nothing else."""
    lock = manifest.get("lock")
    if not lock:
        return Skipped("the stack has no lock (matrices/locks): its packages below torch and DeepSpeed float")
    want: dict[str, str] = {}
    try:  # the sections the venv installed: [venv], and what the toolchain added for the ops ([curand])
        for section in lock.get("sections", ["venv"]):
            want.update(lock_pins(lock["path"], section))
    except OSError as error:
        return False, f"{lock['path']} cannot be read ({error.strerror})"
    for name in lock.get("dropped", []):
        want.pop(_canonical(name), None)
    compiled = manifest.get("extensions") or []
    if compiled:  # the CUDA extensions the builder compiled: their wheels' lock lines
        try:
            want.update(lock_pins(compiled[0]["lock"], "extensions"))
        except OSError as error:
            return False, f"{compiled[0]['lock']} cannot be read ({error.strerror})"
    extension = (manifest.get("extend") or {}).get("lock")
    if extension:  # envbuild extend: the user's layer, locked against the stack's lock
        try:
            want.update(lock_pins(extension["path"]))
        except OSError as error:
            return False, f"{extension['path']} cannot be read ({error.strerror})"
    have = installed_distributions() if installed is None else installed
    missing = sorted(f"{n}=={v}" for n, v in want.items() if n not in have)
    other = sorted(f"{n}=={have[n]} (lock: {v})" for n, v in want.items() if n in have and have[n] != v)
    extra = sorted(f"{n}=={v}" for n, v in have.items() if n not in want)
    problems = ([f"missing {', '.join(missing)}"] if missing else []) + \
               ([f"other versions {', '.join(other)}"] if other else []) + \
               ([f"not in the lock {', '.join(extra)}"] if extra else [])
    if problems:
        return False, "; ".join(problems)
    return True, (f"{len(have)} distributions, exactly the lock's (sha256 {lock.get('sha256', '?')[:12]})"
                  + (f", the compiled {', '.join(e['name'] for e in compiled)}" if compiled else "")
                  + (f" and the extension's ({extension.get('sha256', '?')[:12]})" if extension else ""))


def run_compile_child(manifest: dict, args, work: str) -> dict:
    """torch.compile in a child under the hard timeout, with its caches in the work dir."""
    result_path, log_path = os.path.join(work, "compile.json"), os.path.join(work, "compile.log")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"),
               TRITON_CACHE_DIR=os.path.join(work, "triton"))
    cmd = sandbox.self_command("--child", "compile", "--result", result_path)
    if getattr(args, "gpu_numerics", False):
        cmd.append("--gpu-numerics")
    state, rc = sandbox.run_child(cmd, env, args.timeout, log_path)
    res = sandbox.read_json(result_path) or {}
    res.update(state=state, rc=rc, log=sandbox.tail(log_path))
    return res


def check_torch_compile(manifest: dict, res_of) -> tuple[bool, str] | Skipped:
    """torch.compile of a small function matches eager mode: on CPU (Inductor's C++ code,
    which needs the image's C compiler and Python headers) and, with a GPU, through Triton."""
    if not (manifest.get("runtime_compiler") or manifest.get("toolchain_kept")):
        return Skipped("built with --no-compiler: torch.compile needs a C compiler at run time")
    res = res_of()
    if res.get("state") == "timeout":
        return False, f"torch.compile did not finish before the hard timeout; log: {res.get('log', '')[-300:]}"
    devices = [d for d in ("cpu", "cuda") if d in res]
    if not devices:
        return False, f"the torch.compile child wrote no result (exit {res.get('rc')}): {res.get('log', '')[-300:]}"
    return all(res[d]["ok"] for d in devices), "; ".join(_compile_outcome(d, res[d]) for d in devices)


def _compile_outcome(device: str, result: dict) -> str:
    """One device's torch.compile outcome, with the vector ISA Inductor used when known.

    >>> _compile_outcome("cpu", {"ok": True, "error": 0.0, "seconds": 1.25, "isa": "Inductor avx2, ATen AVX2"})
    'cpu ok, max error 0.0e+00, 1.2s (Inductor avx2, ATen AVX2)'
    >>> _compile_outcome("cuda", {"ok": False, "detail": "InductorError: no compiler"})
    'cuda FAILED: InductorError: no compiler'
    """
    if not result["ok"]:
        return f"{device} FAILED: {result.get('detail') or result.get('error')}"
    isa = f" ({result['isa']})" if result.get("isa") else ""
    return f"{device} ok, max error {result['error']:.1e}, {result['seconds']:.1f}s{isa}"


def image_path_entries(path: str) -> list[str]:
    """The image's own directories of a baked PATH: everything before the system's.

    >>> image_path_entries("/opt/venv/bin:/usr/local/cuda/bin:" + paths.SYSTEM_PATH)
    ['/opt/venv/bin', '/usr/local/cuda/bin']
    """
    return path.removesuffix(":" + paths.SYSTEM_PATH).split(":")


def check_env(manifest: dict, environ=None) -> tuple[bool, str]:
    """The per-GPU NCCL defaults are only a fix if they reach the process. A missing one
    fails; one set to another value was overridden on purpose (docker run -e, apptainer
    --env, the host's environment under Apptainer) and is reported, not failed. PATH needs
    the image's own directories first, in order (the venv, and a kept nvcc): Apptainer puts
    them in front of the host's PATH, Docker in front of the system's."""
    environ = os.environ if environ is None else environ
    missing, overridden = [], []
    for key, want in sorted((manifest.get("env") or {}).items()):
        have = environ.get(key)
        if have is None:
            missing.append(f"{key} missing (want {want!r})")
        elif key == "PATH":
            own = image_path_entries(str(want))
            if have.split(":")[:len(own)] != own:
                missing.append(f"PATH does not start with {':'.join(own)} (PATH={have!r})")
        elif have != str(want):
            overridden.append(f"{key}={have!r} (default {want!r})")
    info = f"TORCH_EXTENSIONS_DIR={environ.get('TORCH_EXTENSIONS_DIR', '(unset)')}"
    notes = ([f"overridden: {', '.join(overridden)}"] if overridden else []) + [info]
    if missing:
        return False, "; ".join(missing + notes)
    return True, "; ".join([f"{len(manifest.get('env') or {})} vars present"] + notes)


# ----------------------------------------------------------------------------- the GPU and the node
def check_gpu_arch(manifest: dict) -> tuple[bool, str]:
    """Ops built for other SMs would fail (or JIT) on this GPU."""
    import torch

    arch = manifest.get("torch_cuda_arch_list") or ""
    parts, ok = [], True
    for index in range(torch.cuda.device_count()):
        cc = "%d.%d" % torch.cuda.get_device_capability(index)
        good = arch_runs_on(cc, arch)
        ok &= good
        parts.append(f"cuda:{index} {torch.cuda.get_device_name(index)} sm {cc}" + ("" if good else " NOT BUILT"))
    return ok, f"arch list {arch!r}: " + "; ".join(parts)


def check_driver(manifest: dict, gpu_mode: bool, facts=None, environ=None):
    """The node's driver against the image's floor (CUDA error 803/804 otherwise).

    In CPU mode a visible driver below the floor still fails: it is why torch sees no GPU.
    With no GPU handed to the container there is nothing to check.
    """
    facts = nodefacts.probe() if facts is None else facts
    minimum, source = node.driver_floor(manifest, environ)
    data = {"driver": facts.driver, "min_driver": minimum, "floor_from": source}
    if not gpu_mode and not facts.gpu_visible:
        return Skipped("CPU mode: no GPU handed to this container (no /dev/nvidiactl, no nvidia-smi)", data)
    if not minimum:
        return True, f"driver {facts.driver or '(unknown)'}; no driver floor recorded in the manifest", None, data
    if not nodefacts.is_dotted_number(minimum):
        return False, f"invalid driver floor {minimum!r} (from {source}); expected a version like 580.65.06", None, data
    if not facts.driver:
        return True, f"driver version not readable ({facts.driver_source}); floor {minimum} not checked", None, data
    problem = node.driver_problem(facts, manifest, environ)
    if problem:
        return False, problem, None, data
    cuda = (manifest.get("driver") or {}).get("cuda") or manifest.get("cuda")
    return True, (f"driver {facts.driver} >= {minimum} (CUDA {cuda}; floor from {source}; "
                  f"read from {facts.driver_source})"), None, data


def check_node_env(manifest: dict, gpu_mode: bool, facts=None, environ=None):
    """The manifest's conditional settings reached this process where their condition holds.

    env.sh applies them only where a GPU is visible (they tune NCCL), so CPU mode skips.
    """
    facts = nodefacts.probe() if facts is None else facts
    environ = os.environ if environ is None else environ
    entries = manifest.get("node_env") or []
    if not entries:
        return Skipped("the manifest has no node_env entries")
    if not gpu_mode and not facts.gpu_visible:
        return Skipped("CPU mode: env.sh applies node_env only where a GPU is visible")
    parts, ok = [], True
    for decision in node.node_env_decisions(manifest, facts, environ):
        name, value, state = decision["name"], decision["value"], decision["state"]
        if state == "invalid":
            ok = False
            parts.append(f"{name}: invalid entry ({decision['why']})")
        elif state == "skip":
            parts.append(f"{name}={value} not needed ({decision['why']})")
        elif decision["have"] == value:
            parts.append(f"{name}={value} set ({decision['why']})")
        elif decision["have"]:
            parts.append(f"{name}={decision['have']!r} set by the user (node_env would set {value!r}: {decision['why']})")
        else:
            ok = False
            parts.append(f"{name} unset but needed here ({decision['why']}): env.sh did not run?")
    return ok, "; ".join(parts)
