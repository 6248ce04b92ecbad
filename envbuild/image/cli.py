"""envbuild image smoke test: prove this image runs DeepSpeed without compiling anything.

    python /opt/envbuild/smoke.py [--json] [--manifest PATH] [--timeout S] [--nproc N] [--size-mb M]
    PYTHONPATH=/opt/envbuild/lib python -m envbuild_image [same options]

Run by `envbuild smoke` (docker run IMAGE python /opt/envbuild/smoke.py --json) and by
Apptainer `%test`. Checks the image against /opt/envbuild/manifest.json (or
$ENVBUILD_MANIFEST): versions, the NCCL torch loads (its own ncclGetVersion) and the one
libnccl on the library paths, the DeepSpeed op record, op loading with JIT made impossible
and stale locks planted (the hang of field reports 1/2), cpu_adam numerics, absence of
compilers, the CPU architecture of the image and of its op libraries, the baked env, the node's driver against the image's floor, the node's conditional
env, and real collectives under a hard timeout (NCCL across local GPUs, else gloo on
127.0.0.1), with P2P on and off where there are two or more GPUs.
Exit 0 iff every check passed, 1 otherwise, 2 on usage errors.

Test hooks (not for users): `--accelerator NAME` expects/forces that DeepSpeed accelerator
instead of "cuda" (a CPU-only dev box records "cpu"); ENVBUILD_SMOKE_TEST_HANG=collective
or =no_jit makes those child processes sleep forever, to exercise the timeout path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from . import checks, collectives, fabric, nccl, nodefacts, transport
from .children import GPU_OPTIMIZERS, child_collective, child_compile, child_ops
from .manifest import UsageError, load_manifest, manifest_path
from .report import build_report, exit_code, render_text, run_check


def parser() -> argparse.ArgumentParser:
    """smoke.py's options (tests check the docs' examples against them)."""
    parser = argparse.ArgumentParser(prog="smoke.py",
                                     description="envbuild image smoke test (exit 0 iff every check passed).")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--manifest", help="default $ENVBUILD_MANIFEST or /opt/envbuild/manifest.json")
    parser.add_argument("--timeout", type=float, default=120.0, help="hard limit per subprocess check (s)")
    parser.add_argument("--nproc", type=int, default=0,
                        help="ranks for the collectives (default: all GPUs, or 2 on CPU)")
    parser.add_argument("--size-mb", type=float, default=64.0, help="collective message size in MiB")
    parser.add_argument("--multinode", action="store_true",
                        help="multi-node mode: run one process per rank under torchrun or srun; the ranks "
                             "compare fingerprints, then run collectives across all nodes (see multinode.py)")
    parser.add_argument("--accelerator", default="cuda", help=argparse.SUPPRESS)  # test hook, see docstring
    parser.add_argument("--child", choices=("ops", "collective", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--ops", default="", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-numerics", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--extensions", default="", help=argparse.SUPPRESS)  # the manifest's, as JSON
    parser.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None):
    return parser().parse_args(argv)


def count_gpus() -> int:
    """GPUs torch can use here (0 when torch is broken: the versions check reports that)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def run_all(manifest: dict, args, path: str, gpus: int | None = None) -> dict:
    """Every check, in order; GPU checks only where torch sees a GPU."""
    results = [run_check("cpu_arch", checks.check_cpu_arch, manifest),
               run_check("versions", checks.check_versions, manifest),
               run_check("nccl", nccl.check_loaded, manifest),
               run_check("nccl_copies", nccl.check_copies, manifest),
               run_check("ds_record", checks.check_ds_record, manifest, args.accelerator)]
    ops = list(manifest.get("ds_ops") or [])
    gpus = count_gpus() if gpus is None else gpus
    args.gpu_numerics = bool(gpus)
    facts = nodefacts.probe()
    with tempfile.TemporaryDirectory(prefix="envbuild-smoke-", ignore_cleanup_errors=True) as work:
        res: dict = {}

        def no_jit():
            res.update(checks.run_ops_child(manifest, args, work))
            return checks.check_no_jit(res, ops, args.timeout)

        results.append(run_check("no_jit", no_jit))
        if "cpu_adam" in ops:
            results.append(run_check("cpu_adam", checks.check_cpu_adam, res))
        for op in [o for o in GPU_OPTIMIZERS if o in ops and gpus]:
            results.append(run_check(op, checks.check_gpu_optimizer, res, op))
        if manifest.get("extensions"):
            results.append(run_check("extensions", checks.check_extensions, manifest, res))
        results.append(run_check("compilers", checks.check_compilers, manifest))
        results.append(run_check("guard", checks.check_guard, manifest))
        results.append(run_check("lock", checks.check_lock, manifest))
        results.append(run_check("torch_compile", checks.check_torch_compile, manifest,
                                 lambda: checks.run_compile_child(manifest, args, work)))
        results.append(run_check("env", checks.check_env, manifest))
        results.append(run_check("fabric", fabric.check_fabric, manifest))
        results.append(run_check("transport", transport.check_transport, manifest, gpus, args, work))
        results.append(run_check("driver", checks.check_driver, manifest, bool(gpus), facts))
        results.append(run_check("node_env", checks.check_node_env, manifest, bool(gpus), facts))
        if gpus:
            results.append(run_check("gpu_arch", checks.check_gpu_arch, manifest))
            nproc = min(args.nproc or gpus, gpus)
            results.append(run_check("collectives", collectives.check_collectives, "nccl", nproc, args, work))
        else:
            results.append(run_check("collectives", collectives.check_collectives, "gloo", args.nproc or 2, args,
                                     work))
        results.append(run_check("p2p", collectives.check_p2p, gpus, args, work))
    return build_report(manifest, "gpu" if gpus else "cpu", results, path)


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


def _raise(error: BaseException):
    raise error


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "ops":
        return child_ops(args)
    if args.child == "collective":
        return child_collective(args)
    if args.child == "compile":
        return child_compile(args)
    if args.multinode:
        from . import multinode

        return multinode.main(args, stdout_reserved)
    path = manifest_path(args.manifest)
    try:
        manifest = load_manifest(path)
    except UsageError as error:
        print(f"smoke.py: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(error), "checks": []}))
        return 2
    with stdout_reserved(args.json) as out:
        try:
            report = run_all(manifest, args, path)
        except Exception as error:  # noqa: BLE001 - last resort: still one report, never a traceback
            report = build_report(manifest, "cpu", [run_check("smoke", _raise, error)], path)
        print(json.dumps(report, indent=2) if args.json else render_text(report), file=out)
    return exit_code(report)
