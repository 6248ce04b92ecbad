"""envbuild image smoke test: prove this image runs DeepSpeed without compiling anything.

    python /opt/envbuild/smoke.py [--json] [--manifest PATH] [--timeout S] [--nproc N] [--size-mb M]

Run by `docker run IMAGE python /opt/envbuild/smoke.py --json` and by Apptainer `%test`.
Checks the image against /opt/envbuild/manifest.json (or $ENVBUILD_MANIFEST): versions, the
DeepSpeed op record, op loading with JIT made impossible and stale locks planted (the hang of
field reports 1/2), cpu_adam numerics, absence of compilers, the baked env, and a real
all_reduce/all_gather under a hard timeout (NCCL across local GPUs, else gloo on 127.0.0.1).
Exit 0 iff every check passed, 1 otherwise, 2 on usage errors. Stdlib only at import time:
torch and deepspeed are imported inside the checks, so a broken install is a failed check.

Test hooks (not for users): `--accelerator NAME` expects/forces that DeepSpeed accelerator
instead of "cuda" (a CPU-only dev box records "cpu"); ENVBUILD_SMOKE_TEST_HANG=collective
or =no_jit makes those child processes sleep forever, to exercise the timeout path.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

DEFAULT_MANIFEST = "/opt/envbuild/manifest.json"
REQUIRED_KEYS = ("python", "torch", "cuda", "deepspeed", "ds_ops")
COMPILERS = ("ninja", "gcc", "g++", "cc", "c++", "nvcc", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++")
JIT_ENTRY_POINTS = ("load", "load_inline", "_jit_compile")
HANG_ENV = "ENVBUILD_SMOKE_TEST_HANG"
JIT_HANG_MSG = "hung: a JIT compile waiting on a lock — field report 1"
ADAM_TOLERANCE = 1e-5


class UsageError(Exception):
    """A problem with how the script was called (exit 2), not with the image."""


# ----------------------------------------------------------------------------- pure logic
def load_manifest(path: str) -> dict:
    """Read the manifest; a missing or malformed one is a usage error, not a failed image."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"manifest not found: {path} (use --manifest PATH or ENVBUILD_MANIFEST)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read manifest {path}: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"manifest {path} is not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise UsageError(f"manifest {path} lacks keys: {', '.join(missing)}")
    return data


def normalize_version(v: object) -> str:
    """'2.11.0+cu130' -> '2.11.0'; (2, 28, 9) -> '2.28.9': local build tags are not part of the pin."""
    if isinstance(v, (tuple, list)):
        v = ".".join(str(x) for x in v)
    return str(v).strip().split("+", 1)[0]


def major_minor(v: object) -> str:
    """'13.0.2' -> '13.0': CUDA is pinned by major.minor (torch.version.cuda has no patch)."""
    return ".".join(normalize_version(v).split(".")[:2])


def version_matches(expected: object, actual: object) -> bool:
    """True if every component of `expected` equals the same component of `actual` ('3.11' ~ '3.11.7')."""
    if actual is None:
        return False
    exp = normalize_version(expected).split(".")
    act = normalize_version(actual).split(".")
    return len(act) >= len(exp) and act[: len(exp)] == exp


def parse_arch_list(arch_list: str) -> list[tuple[int, int, bool]]:
    """TORCH_CUDA_ARCH_LIST ('8.0;9.0+PTX', spaces allowed) -> [(8, 0, False), (9, 0, True)]."""
    out = []
    for entry in re.split(r"[;,\s]+", arch_list or ""):
        m = re.fullmatch(r"(\d+)\.(\d+)[a-z]?(\+PTX)?", entry.strip(), re.IGNORECASE)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), bool(m.group(3))))
    return out


def arch_satisfied(capability: str, arch_list: str) -> bool:
    """A device runs the ops if a cubin of its major and an equal-or-lower minor was built
    (sm_80 code runs on 8.6 and 8.9), or PTX for an older-or-equal arch (driver JIT).
    Same rule as envbuild/rules.py arch_runs_on."""
    major, minor = (int(x) for x in capability.split(".")[:2])
    for a_major, a_minor, ptx in parse_arch_list(arch_list):
        if (a_major == major and a_minor <= minor) or (ptx and (a_major, a_minor) <= (major, minor)):
            return True
    return False


def bus_bandwidth(op: str, size_bytes: float, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s as nccl-tests defines it (size = the all_gather output size)."""
    if seconds <= 0 or nranks < 1:
        return 0.0
    factor = {"all_reduce": 2.0 * (nranks - 1) / nranks, "all_gather": (nranks - 1) / nranks}[op]
    return size_bytes * factor / seconds / 1e9


def check_compilers(manifest: dict, path: str | None = None) -> tuple[bool, str]:
    """A compiler (or ninja) in the image is what lets a silent JIT compile start at all."""
    found = [f"{n}={p}" for n in COMPILERS if (p := shutil.which(n, path=path))]
    if manifest.get("toolchain_kept"):
        return True, "toolchain kept on purpose" + (f": {', '.join(found)}" if found else "")
    return (not found), ("found: " + ", ".join(found)) if found else "none of " + " ".join(COMPILERS)


def check_env(manifest: dict, environ=None) -> tuple[bool, str]:
    """The per-GPU NCCL defaults are only a fix if they reach the process. A missing one
    fails; one set to another value was overridden on purpose (docker run -e, apptainer
    --env, the host's environment under Apptainer) and is reported, not failed. PATH only
    needs the venv first (Apptainer prepends it to the host's PATH)."""
    environ = os.environ if environ is None else environ
    missing, overridden = [], []
    for key, want in sorted((manifest.get("env") or {}).items()):
        have = environ.get(key)
        if have is None:
            missing.append(f"{key} missing (want {want!r})")
        elif key == "PATH":
            first = str(want).split(":", 1)[0]
            if have.split(":", 1)[0] != first:
                missing.append(f"PATH does not start with {first} (PATH={have!r})")
        elif have != str(want):
            overridden.append(f"{key}={have!r} (default {want!r})")
    info = f"TORCH_EXTENSIONS_DIR={environ.get('TORCH_EXTENSIONS_DIR', '(unset)')}"
    notes = ([f"overridden: {', '.join(overridden)}"] if overridden else []) + [info]
    if missing:
        return False, "; ".join(missing + notes)
    return True, "; ".join([f"{len(manifest.get('env') or {})} vars present"] + notes)


def hang_hint(backend: str, timeout: float) -> str:
    """Name the usual culprits, so a hung collective points at a fix, not at the user's code."""
    msg = (f"timed out after {timeout:g}s: the {backend} collective hung. Likely causes: NCCL P2P transport "
           "(try NCCL_P2P_DISABLE=1, as on H20); /dev/shm too small (docker --shm-size=16g or --ipc=host); "
           "NVLS (NCCL_NVLS_ENABLE=0); driver / fabric-manager version mismatch. Re-run with NCCL_DEBUG=INFO.")
    if backend == "gloo":
        msg += " For gloo on 127.0.0.1: loopback blocked or hostname unresolvable (try GLOO_SOCKET_IFNAME=lo)."
    return msg


def run_check(name: str, fn, *args) -> dict:
    """Run one check; any exception becomes a failed check with its text, never a traceback."""
    t0 = time.monotonic()
    try:
        res = fn(*args)
        ok, detail = bool(res[0]), str(res[1])
        seconds = res[2] if len(res) > 2 else time.monotonic() - t0
    except BaseException as e:  # noqa: BLE001 - a check must never kill the report
        if isinstance(e, KeyboardInterrupt):
            raise
        ok, detail, seconds = False, f"{type(e).__name__}: {e}", time.monotonic() - t0
    return {"name": name, "ok": ok, "detail": detail, "seconds": round(float(seconds), 3)}


def build_report(manifest: dict, mode: str, checks: list[dict], manifest_path: str = "") -> dict:
    """The one JSON object CI and users parse: ok iff every check is ok (and there is one)."""
    image = {k: manifest.get(k) for k in ("tag", "gpu", "python", "torch", "cuda", "deepspeed")}
    image["manifest"] = manifest_path
    return {"ok": bool(checks) and all(c["ok"] for c in checks), "mode": mode, "image": image, "checks": checks}


def _raise(e: BaseException):
    raise e


def exit_code(report: dict) -> int:
    return 0 if report.get("ok") else 1


def render_text(report: dict) -> str:
    """A plain aligned table for humans (Apptainer %test, docker run without --json)."""
    img = report["image"]
    lines = [f"envbuild smoke test: {img.get('tag') or '(untagged)'} gpu={img.get('gpu')} mode={report['mode']}"]
    width = max([len(c["name"]) for c in report["checks"]] + [5])
    for c in report["checks"]:
        lines.append(f"  {c['name']:<{width}}  {'ok' if c['ok'] else 'FAIL':<4}  {c['seconds']:>8.3f}s  {c['detail']}")
    lines.append("RESULT: " + ("ok" if report["ok"] else "FAILED"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- subprocesses
def _run_child(cmd: list[str], env: dict, timeout: float, log_path: str) -> tuple[str, int | None]:
    """Run cmd in its own session; on timeout kill the whole process group. Returns (state, rc)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return "done", proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return "timeout", None


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(path: str, n: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-n:].strip().replace("\n", " | ")
    except OSError:
        return ""


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _self_cmd(*args: str) -> list[str]:
    return [sys.executable, "-u", os.path.abspath(__file__), *args]


def plant_stale_locks(root: str, ops: list[str]) -> set[str]:
    """Recreate field reports 1/2: a stale <op>/lock per op, then the tree made read-only."""
    planted = set()
    for op in ops:
        os.makedirs(os.path.join(root, op), exist_ok=True)
        open(os.path.join(root, op, "lock"), "w").close()
        planted |= {op, os.path.join(op, "lock")}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chmod(os.path.join(dirpath, name), 0o555)
    os.chmod(root, 0o555)
    return planted


def tree_entries(root: str) -> set[str]:
    """Every path under root; root ignores modes, so this is how a write is caught."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        out |= {os.path.relpath(os.path.join(dirpath, n), root) for n in dirnames + filenames}
    return out


def run_ops_child(manifest: dict, args, work: str) -> dict:
    """Load every op in a child with JIT impossible; returns the child's JSON plus sandbox facts."""
    ops = list(manifest.get("ds_ops") or [])
    ext = os.path.join(work, "torch_extensions")
    os.makedirs(ext)
    planted = plant_stale_locks(ext, ops)
    result_path, log_path = os.path.join(work, "ops.json"), os.path.join(work, "ops.log")
    env = dict(os.environ, DS_ACCELERATOR=args.accelerator, TORCH_EXTENSIONS_DIR=ext)
    try:
        cmd = _self_cmd("--child", "ops", "--result", result_path, "--ops", ",".join(ops))
        if getattr(args, "gpu_numerics", False):
            cmd.append("--gpu-numerics")
        state, rc = _run_child(cmd, env, args.timeout, log_path)
        extra = sorted(tree_entries(ext) - planted)
    finally:
        for dirpath, _, _ in os.walk(ext):
            os.chmod(dirpath, 0o755)  # so the temp dir can be removed without root
    res = _read_json(result_path) or {}
    res.update(state=state, rc=rc, log=_tail(log_path), extra=extra)
    return res


def check_no_jit(res: dict, ops: list[str], timeout: float) -> tuple[bool, str]:
    done = res.get("ops") or {}
    parts = [f"{op} {'ok' if done[op]['ok'] else 'FAILED'} {done[op]['seconds']:.3f}s"
             + ("" if done[op]["ok"] else f" ({done[op]['detail']})") for op in ops if op in done]
    if res["state"] == "timeout":
        waiting = [op for op in ops if op not in done]
        stuck = waiting[0] if waiting else "cpu_adam numerics"
        return False, "; ".join([f"{JIT_HANG_MSG} (killed after {timeout:g}s, stuck on {stuck})", *parts])
    if res["extra"]:
        return False, f"the extensions dir was written to (a JIT build ran): {res['extra'][:5]}; " + "; ".join(parts)
    if res["rc"] != 0 or set(done) != set(ops):
        return False, f"child exited {res['rc']} after {sorted(done)}: {res['log']}"
    return all(v["ok"] for v in done.values()), "; ".join(parts) or "no ops in manifest"


def check_cpu_adam(res: dict, key: str = "adam", label: str = "DeepSpeedCPUAdam") -> tuple[bool, str, float]:
    adam = res.get(key)
    if not adam:
        return False, f"no result from the op child ({res.get('state')}, rc={res.get('rc')})", 0.0
    if not adam["ok"]:
        return False, adam["detail"], adam["seconds"]
    diff = adam["max_abs_diff"]
    detail = f"max|{label} - torch.optim.Adam| = {diff:.2e} (tol {ADAM_TOLERANCE:g})"
    return diff <= ADAM_TOLERANCE, detail, adam["seconds"]


def check_fused_adam(res: dict) -> tuple[bool, str, float]:
    return check_cpu_adam(res, "fused_adam", "FusedAdam")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_collectives(backend: str, nproc: int, args, work: str) -> tuple[bool, str]:
    """Spawn nproc ranks doing all_reduce + all_gather; any hang is killed at the deadline."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc))
    if backend == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, logs = [], []
    for rank in range(nproc):
        logs.append(os.path.join(work, f"rank{rank}.log"))
        cmd = _self_cmd("--child", "collective", "--backend", backend, "--size-mb", str(args.size_mb),
                        "--timeout", str(args.timeout), "--result", os.path.join(work, f"rank{rank}.json"))
        with open(logs[-1], "wb") as log:
            procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                return False, f"rank {failed[0]} exited {procs[failed[0]].returncode}: {_tail(logs[failed[0]])}"
            if all(p.poll() is not None for p in procs):
                break
            if time.monotonic() > deadline:
                return False, hang_hint(backend, args.timeout)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
    results = [_read_json(os.path.join(work, f"rank{r}.json")) for r in range(nproc)]
    bad = [r for r, res in enumerate(results) if not res or not res.get("ok")]
    if bad:
        r = bad[0]
        return False, f"rank {r}: {(results[r] or {}).get('detail') or _tail(logs[r])}"
    size = results[0]["size_bytes"]
    parts = [f"{op} {results[0][op + '_s'] * 1e3:.2f} ms busbw "
             f"{bus_bandwidth(op, size, results[0][op + '_s'], nproc):.2f} GB/s" for op in ("all_reduce", "all_gather")]
    return True, f"{backend} x{nproc}, {size / 2**20:g} MiB: " + "; ".join(parts) + "; values ok"


# ----------------------------------------------------------------------------- image checks
def check_versions(manifest: dict) -> tuple[bool, str]:
    """The pinned stack must be the one installed: op .so files are only valid for it."""
    import importlib.metadata as md

    import torch
    import deepspeed

    def nccl_version():
        with contextlib.suppress(Exception):
            return torch.cuda.nccl.version()
        for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
            with contextlib.suppress(md.PackageNotFoundError):
                return md.version(dist)
        return None

    def same_minor(expected, actual):
        return actual is not None and major_minor(expected) == major_minor(actual)

    rows = [("python", manifest["python"], "%d.%d.%d" % sys.version_info[:3], same_minor),
            ("torch", manifest["torch"], torch.__version__, version_matches),
            ("cuda", manifest["cuda"], torch.version.cuda, same_minor),
            ("deepspeed", manifest["deepspeed"], deepspeed.__version__, version_matches)]
    if manifest.get("nccl") is not None:
        rows.append(("nccl", manifest["nccl"], nccl_version(), version_matches))
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


def check_gpu_arch(manifest: dict) -> tuple[bool, str]:
    """Ops built for other SMs would fail (or JIT) on this GPU."""
    import torch

    arch = manifest.get("torch_cuda_arch_list") or ""
    parts, ok = [], True
    for i in range(torch.cuda.device_count()):
        cc = "%d.%d" % torch.cuda.get_device_capability(i)
        good = arch_satisfied(cc, arch)
        ok &= good
        parts.append(f"cuda:{i} {torch.cuda.get_device_name(i)} sm {cc}" + ("" if good else " NOT BUILT"))
    return ok, f"arch list {arch!r}: " + "; ".join(parts)


def run_all(manifest: dict, args, manifest_path: str) -> dict:
    checks = [run_check("versions", check_versions, manifest),
              run_check("ds_record", check_ds_record, manifest, args.accelerator)]
    ops = list(manifest.get("ds_ops") or [])
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - the versions check already reports a broken torch
        gpus = 0
    args.gpu_numerics = bool(gpus)
    with tempfile.TemporaryDirectory(prefix="envbuild-smoke-", ignore_cleanup_errors=True) as work:
        res: dict = {}

        def no_jit():
            res.update(run_ops_child(manifest, args, work))
            return check_no_jit(res, ops, args.timeout)

        checks.append(run_check("no_jit", no_jit))
        if "cpu_adam" in ops:
            checks.append(run_check("cpu_adam", check_cpu_adam, res))
        if "fused_adam" in ops and gpus:
            checks.append(run_check("fused_adam", check_fused_adam, res))
        checks.append(run_check("compilers", check_compilers, manifest))
        checks.append(run_check("env", check_env, manifest))
        if gpus:
            checks.append(run_check("gpu_arch", check_gpu_arch, manifest))
            n = min(args.nproc or gpus, gpus)
            checks.append(run_check("collectives", check_collectives, "nccl", n, args, work))
        else:
            checks.append(run_check("collectives", check_collectives, "gloo", args.nproc or 2, args, work))
    return build_report(manifest, "gpu" if gpus else "cpu", checks, manifest_path)


# ----------------------------------------------------------------------------- child processes
def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def find_builder(name: str):
    """ALL_OPS[name]; else scan the builder classes (the module layout moves between versions)."""
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except ImportError:
        ALL_OPS = {}
    if name in ALL_OPS:
        return ALL_OPS[name]
    import deepspeed.ops.op_builder as ob
    from deepspeed.accelerator import get_accelerator

    for attr in dir(ob):
        cls = get_accelerator().get_op_builder(attr) if attr.endswith("Builder") else None
        if cls is not None and getattr(cls, "NAME", None) == name:
            return cls()
    raise KeyError(f"no op builder named {name!r} for accelerator {get_accelerator()._name!r}")


def _record_hint(op: str) -> str:
    """Say why load() went the JIT way: the build record, not the loader, is usually at fault."""
    with contextlib.suppress(Exception):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops

        running = get_accelerator()._name
        if not installed_ops.get(op):
            return " [not in DeepSpeed's installed_ops: load() falls back to JIT]"
        if accelerator_name != running:
            return f" [ops recorded for {accelerator_name!r}, running {running!r}: load() falls back to JIT]"
    return ""


def adam_numerics() -> dict:
    """One DeepSpeedCPUAdam step must equal torch.optim.Adam: a mis-built .so can load yet compute garbage."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    init, grad = torch.randn(4096), torch.randn(4096)
    ds_p, ref_p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ds_p.grad, ref_p.grad = grad.clone(), grad.clone()
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    DeepSpeedCPUAdam([ds_p], adamw_mode=False, **hp).step()
    torch.optim.Adam([ref_p], **hp).step()
    return {"max_abs_diff": (ds_p.detach() - ref_p.detach()).abs().max().item()}


def fused_adam_numerics() -> dict:
    """On a GPU, one FusedAdam step must equal torch.optim.Adam: the pre-built sm_XX code
    really runs on this device."""
    import torch
    from deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    init, grad = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    ds_p, ref_p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ds_p.grad, ref_p.grad = grad.clone(), grad.clone()
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    FusedAdam([ds_p], adam_w_mode=False, **hp).step()
    torch.optim.Adam([ref_p], **hp).step()
    torch.cuda.synchronize()
    return {"max_abs_diff": (ds_p.detach() - ref_p.detach()).abs().max().item()}


def _numerics(fn) -> dict:
    t0 = time.monotonic()
    try:
        res = dict(fn(), ok=True, detail="")
    except Exception as e:  # noqa: BLE001
        res = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
    res["seconds"] = time.monotonic() - t0
    return res


def child_ops(args) -> int:
    """In the no-JIT sandbox: refuse every cpp_extension JIT entry point, then load each op."""
    if os.environ.get(HANG_ENV) == "no_jit":
        time.sleep(1e9)
    import torch.utils.cpp_extension as cpp_extension

    def refuse(*_a, **_k):
        raise RuntimeError("JIT compile attempted")

    for name in JIT_ENTRY_POINTS:
        setattr(cpp_extension, name, refuse)
    out: dict = {"ops": {}, "adam": None}
    ops = [o for o in args.ops.split(",") if o]
    for op in ops:
        t0 = time.monotonic()
        try:
            find_builder(op).load()
            entry = {"ok": True, "detail": ""}
        except Exception as e:  # noqa: BLE001
            entry = {"ok": False, "detail": f"{type(e).__name__}: {e}{_record_hint(op)}"}
        out["ops"][op] = dict(entry, seconds=time.monotonic() - t0)
        _write_json(args.result, out)
    if "cpu_adam" in ops:
        out["adam"] = _numerics(adam_numerics)
        _write_json(args.result, out)
    if "fused_adam" in ops and args.gpu_numerics:
        out["fused_adam"] = _numerics(fused_adam_numerics)
        _write_json(args.result, out)
    return 0


def child_collective(args) -> int:
    """One rank: all_reduce(sum) and all_gather with value checks, timed over a few iterations."""
    from datetime import timedelta

    if os.environ.get(HANG_ENV) == "collective":
        time.sleep(1e9)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    numel = max(world, int(args.size_mb * 2**20) // 4 // world * world)
    out = {"ok": True, "detail": "", "size_bytes": numel * 4}
    x = torch.empty(numel, dtype=torch.float32, device=device)
    chunk = torch.full((numel // world,), float(rank), device=device)
    gathered = [torch.empty_like(chunk) for _ in range(world)]
    times = {}
    for op, iters in (("all_reduce", 5), ("all_gather", 5)):
        for i in range(iters + 1):  # the first iteration is warm-up (connection set-up)
            if i == 1:
                dist.barrier()
                sync()
                t0 = time.perf_counter()
            if op == "all_reduce":
                x.fill_(rank + 1)
                dist.all_reduce(x)
            else:
                dist.all_gather(gathered, chunk)
        sync()
        times[op + "_s"] = (time.perf_counter() - t0) / iters
        want = world * (world + 1) / 2
        if op == "all_reduce" and not bool((x == want).all()):
            out.update(ok=False, detail=f"all_reduce sum wrong: got {x[0].item()} want {want}")
        if op == "all_gather" and not all(bool((g == r).all()) for r, g in enumerate(gathered)):
            out.update(ok=False, detail="all_gather contents wrong")
    out.update(times)
    _write_json(args.result, out)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- entry point
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="envbuild image smoke test (exit 0 iff every check passed).")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--manifest", help=f"default $ENVBUILD_MANIFEST or {DEFAULT_MANIFEST}")
    p.add_argument("--timeout", type=float, default=120.0, help="hard limit per subprocess check (s)")
    p.add_argument("--nproc", type=int, default=0, help="ranks for the collective (default: all GPUs, or 2 on CPU)")
    p.add_argument("--size-mb", type=float, default=64.0, help="collective message size in MiB")
    p.add_argument("--accelerator", default="cuda", help=argparse.SUPPRESS)  # test hook, see docstring
    p.add_argument("--child", choices=("ops", "collective"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--ops", default="", help=argparse.SUPPRESS)
    p.add_argument("--gpu-numerics", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    return p.parse_args(argv)


@contextlib.contextmanager
def stdout_reserved(enabled: bool):
    """With --json, fd 1 must carry only our JSON: libraries' prints (even C-level) go to stderr."""
    if not enabled:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(os.dup(saved), "w") as real:
            yield real
            real.flush()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "ops":
        return child_ops(args)
    if args.child == "collective":
        return child_collective(args)
    path = args.manifest or os.environ.get("ENVBUILD_MANIFEST") or DEFAULT_MANIFEST
    try:
        manifest = load_manifest(path)
    except UsageError as e:
        print(f"smoke.py: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(e), "checks": []}))
        return 2
    with stdout_reserved(args.json) as out:
        try:
            report = run_all(manifest, args, path)
        except Exception as e:  # noqa: BLE001 - last resort: still one report, never a traceback
            report = build_report(manifest, "cpu", [run_check("smoke", _raise, e)], path)
        print(json.dumps(report, indent=2) if args.json else render_text(report), file=out)
    return exit_code(report)


if __name__ == "__main__":
    sys.exit(main())
