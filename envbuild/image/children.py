"""What the sandboxed children run (``--child ops`` / ``--child collective``): the only code
here that needs torch and DeepSpeed, imported inside each function."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

from .collectives import run_collectives
from .sandbox import HANG_ENV, sha256_file, unresolved_libraries, write_json

JIT_ENTRY_POINTS = ("load", "load_inline", "_jit_compile")
# The GPU driver's library: on a GPU node the NVIDIA Container Toolkit (or --nv) mounts it; an op
# that records it (linked with -lcuda against a stub with the driver's symbols, as NVIDIA's devel
# images have) cannot load on a host without it.
DRIVER_LIBRARY = "libcuda.so.1"


def missing_libraries(path: str) -> set[str]:
    """The shared libraries `path` needs that the loader cannot find here; empty if ldd cannot tell."""
    try:
        return set(unresolved_libraries(path)[0])
    except (OSError, subprocess.SubprocessError):
        return set()


def driver_only_failure(op: str, error: Exception) -> str:
    """Why `op`'s load failure on a host without the GPU driver is not the op's fault, or '':
    the driver's libcuda.so.1 must be its only library the loader cannot find (ldd), so any other
    missing library still fails the check."""
    if DRIVER_LIBRARY not in str(error):
        return ""
    import importlib.util

    with contextlib.suppress(Exception):
        spec = importlib.util.find_spec(find_builder(op).absolute_name())
        if spec and spec.origin and missing_libraries(spec.origin) == {DRIVER_LIBRARY}:
            return (f"not loaded here: it links the GPU driver's {DRIVER_LIBRARY}, absent on this host and its "
                    f"only missing library (ldd); on a GPU node `envbuild smoke IMAGE --gpus all` loads it")
    return ""


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


def _one_step(optimizer, **hp) -> tuple:
    """One step of `optimizer` on a CUDA parameter with a seeded gradient: (before, gradient, after)."""
    import torch

    torch.manual_seed(0)
    init, grad = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    param = torch.nn.Parameter(init.clone())
    param.grad = grad.clone()
    optimizer([param], **hp).step()
    torch.cuda.synchronize()
    return init, grad, param.detach()


def fused_adam_numerics() -> dict:
    """On a GPU, one FusedAdam step must equal torch.optim.Adam: the pre-built sm_XX code
    really runs on this device."""
    import torch
    from deepspeed.ops.adam import FusedAdam

    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    _, _, fused = _one_step(FusedAdam, adam_w_mode=False, **hp)
    _, _, ref = _one_step(torch.optim.Adam, **hp)
    return {"max_abs_diff": (fused - ref).abs().max().item()}


def fused_lion_numerics() -> dict:
    """On a GPU, one FusedLion step against Lion's first step written out in torch, as DeepSpeed's
    csrc/lion/multi_tensor_lion.cu computes it: p = p*(1 - lr*wd) - lr*sign(c), where c is
    (1 - beta1)*g (the moment starts at zero) and c <= 0 counts as negative."""
    import torch
    from deepspeed.ops.lion import FusedLion

    lr, beta1, wd = 1e-3, 0.9, 0.01
    init, grad, fused = _one_step(FusedLion, lr=lr, betas=(beta1, 0.99), weight_decay=wd)
    c = (1 - beta1) * grad
    ref = init * (1 - lr * wd) + torch.where(c > 0, -lr, lr)
    return {"max_abs_diff": (fused - ref).abs().max().item()}


def fused_lamb_numerics() -> dict:
    """On a GPU, one FusedLamb step against LAMB's first step written out in torch, as DeepSpeed's
    csrc/lamb/fused_lamb_cuda_kernel.cu computes it: the update m/(sqrt(v)+eps) + wd*p, the
    trust ratio |p|/|update| clamped to [min_coeff, max_coeff], the bias correction folded
    into the step size lr*sqrt(1-beta2)/(1-beta1)."""
    from deepspeed.ops.lamb import FusedLamb

    lr, (b1, b2), eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01
    init, grad, fused = _one_step(FusedLamb, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    m, v = (1 - b1) * grad, (1 - b2) * grad * grad
    update = m / (v.sqrt() + eps) + wd * init
    ratio = (init.norm() / update.norm()).clamp(0.01, 10.0)
    ref = init - lr * (1 - b2) ** 0.5 / (1 - b1) * ratio * update
    return {"max_abs_diff": (fused - ref).abs().max().item()}


# The CUDA optimizers' one-step checks (GPU mode): op -> (check, class, its reference in plain torch).
GPU_OPTIMIZERS = {"fused_adam": (fused_adam_numerics, "FusedAdam", "torch.optim.Adam"),
                  "fused_lamb": (fused_lamb_numerics, "FusedLamb", "LAMB in torch"),
                  "fused_lion": (fused_lion_numerics, "FusedLion", "Lion in torch")}


def _numerics(fn) -> dict:
    start = time.monotonic()
    try:
        res = dict(fn(), ok=True, detail="")
    except Exception as error:  # noqa: BLE001
        res = {"ok": False, "detail": f"{type(error).__name__}: {error}"}
    res["seconds"] = time.monotonic() - start
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
        start = time.monotonic()
        try:
            find_builder(op).load()
            entry = {"ok": True, "detail": ""}
        except Exception as error:  # noqa: BLE001
            deferred = "" if args.gpu_numerics else driver_only_failure(op, error)
            entry = ({"ok": True, "detail": deferred} if deferred else
                     {"ok": False, "detail": f"{type(error).__name__}: {error}{_record_hint(op)}"})
        out["ops"][op] = dict(entry, seconds=time.monotonic() - start)
        write_json(args.result, out)
    if "cpu_adam" in ops:
        out["adam"] = _numerics(adam_numerics)
        write_json(args.result, out)
    for op in [o for o in GPU_OPTIMIZERS if o in ops and args.gpu_numerics]:
        out[op] = _numerics(GPU_OPTIMIZERS[op][0])
        write_json(args.result, out)
    out["extensions"] = {}
    for ext in json.loads(getattr(args, "extensions", None) or "[]"):
        entry = _import_extension(ext)
        if entry["ok"] and args.gpu_numerics and ext.get("gpu_check") in GPU_CHECKS:
            entry["gpu"] = _numerics(GPU_CHECKS[ext["gpu_check"]])
        elif entry["ok"]:  # said in the check's line: a passing import is not a passing kernel
            entry["gpu_skipped"] = "no GPU" if not args.gpu_numerics else "envbuild has no GPU check for it"
        out["extensions"][ext["name"]] = entry
        write_json(args.result, out)
    return 0


def compiled_files_changed(name: str, path: list[str] | None = None) -> str:
    """'' when every compiled library (.so) of distribution `name` has the sha256 its wheel's
    RECORD gives, else what differs: the wheel's sha256 in the build record says what was
    built, this says that it is what is installed (not a file copied over it).

    >>> compiled_files_changed("no-such-distribution-envbuild")
    'no-such-distribution-envbuild: not installed'
    """
    import base64
    import sys
    from importlib import metadata

    found = list(metadata.distributions(name=name, path=path or sys.path))
    if not found:
        return f"{name}: not installed"
    changed, checked = [], 0
    for file in found[0].files or []:
        if not file.name.endswith(".so") or not file.hash or file.hash.mode != "sha256":
            continue
        checked += 1
        digest = sha256_file(str(file.locate()))
        if digest is None:
            changed.append(f"{file} (unreadable)")
        elif base64.urlsafe_b64encode(bytes.fromhex(digest)).rstrip(b"=").decode() != file.hash.value:
            changed.append(str(file))
    if changed:
        return (f"{', '.join(changed)} {'differs' if len(changed) == 1 else 'differ'} from the wheel's RECORD "
                f"(replaced after the build?); rebuild the image rather than trust it")
    return "" if checked else f"{name}: its RECORD lists no compiled library"


def load_op_library(name: str, lib: str) -> str:
    """Load a torch op library of distribution `name` (`lib` relative to site-packages: a .so with
    no PyInit_*, registered with TORCH_LIBRARY, as xformers/_C.so) the way its package does, with
    torch.ops.load_library: '' when it loads, else the library and the loader's error (its package
    would only log a warning, and importing the .so fails however sound it is)."""
    from importlib import metadata

    import torch

    path = metadata.distribution(name).locate_file(lib)
    if not path.is_file():
        return f"torch op library {lib} is not installed (no {path})"
    try:
        torch.ops.load_library(str(path))
    except Exception as error:  # noqa: BLE001
        cause = error.__cause__ or error.__context__
        said = f" ({cause})" if cause and str(cause) not in str(error) else ""
        return f"torch.ops.load_library({lib}) failed: {type(error).__name__}: {error}{said}"
    return ""


def _import_extension(ext: dict) -> dict:
    """Import a CUDA extension's packages and compiled modules and load its torch op libraries
    (with JIT refused): one built for another torch fails here with `undefined symbol`; its
    installed version is the manifest's."""
    import importlib
    from importlib import metadata

    start = time.monotonic()
    libraries = ext.get("op_libraries") or []  # absent from a manifest written before op_libraries
    try:
        for module in [*ext["modules"], *ext["packages"]]:
            importlib.import_module(module)
        version = metadata.version(ext["name"])
        ok = version == ext["version"]
        detail = "" if ok else f"installed {ext['name']} {version}, the image was built with {ext['version']}"
        if ok:
            detail = "; ".join(filter(None, (load_op_library(ext["name"], lib) for lib in libraries)))
            ok = not detail
        if ok and (ext["modules"] or libraries):  # a pure-Python wheel (FA4) has no compiled library to compare
            detail = compiled_files_changed(ext["name"])
            ok = not detail
    except Exception as error:  # noqa: BLE001
        ok, detail = False, f"{type(error).__name__}: {error}"
    return {"ok": ok, "detail": detail, "seconds": time.monotonic() - start}


def attention_numerics() -> dict:
    """On a GPU, flash-attn's forward and backward (causal, fp16) against torch's
    scaled_dot_product_attention: the pre-built kernels run on this device and compute attention."""
    import torch
    import torch.nn.functional as F
    from flash_attn import flash_attn_func

    torch.manual_seed(0)
    shape = (2, 256, 4, 64)  # batch, sequence, heads, head dim (flash-attn's layout)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad)
    torch.cuda.synchronize()
    return {"max_abs_diff": max(float((a - b).abs().max()) for a, b in ((out, ref), (dq, rq), (dk, rk), (dv, rv)))}


def causal_conv1d_numerics() -> dict:
    """On a GPU, causal_conv1d_fn (with SiLU) forward and backward against the same causal
    convolution in plain torch: the output and the gradients of the input, weight and bias
    (training runs the backward kernel, a separate compile: causal_conv1d_bwd)."""
    import torch
    import torch.nn.functional as F
    from causal_conv1d import causal_conv1d_fn

    torch.manual_seed(0)
    batch, dim, length, width = 2, 64, 128, 4
    x = torch.randn(batch, dim, length, device="cuda", requires_grad=True)
    weight = torch.randn(dim, width, device="cuda", requires_grad=True)
    bias = torch.randn(dim, device="cuda", requires_grad=True)
    out = causal_conv1d_fn(x, weight, bias, activation="silu")
    ref = F.silu(F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)[..., :length])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, weight, bias), grad)
    want = torch.autograd.grad(ref, (x, weight, bias), grad)
    torch.cuda.synchronize()
    return {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip((out, *got), (ref, *want)))}


def _attention_vs_sdpa(attend, shape=(2, 256, 4, 64)) -> dict:
    """`attend(q, k, v)` (causal, fp16, layout batch, sequence, heads, head dim) forward and
    backward against torch's scaled_dot_product_attention."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = attend(q, k, v)
    out = out[0] if isinstance(out, tuple) else out  # FA4's flash_attn_func returns (out, lse)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.cuda.synchronize()
    return {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip((out, *got), (ref, *want)))}


def fa4_numerics() -> dict:
    """On a GPU, FA4's flash_attn_func (its CuTe DSL kernels, compiled at this first call) forward
    and backward against scaled_dot_product_attention; head dim 128, which every FA4 arch serves."""
    from flash_attn.cute import flash_attn_func

    return _attention_vs_sdpa(lambda q, k, v: flash_attn_func(q, k, v, causal=True), (2, 256, 4, 128))


def fa3_numerics() -> dict:
    """On a GPU, FA3's flash_attn_interface.flash_attn_func (its sm_90a kernels: Hopper only) forward
    and backward against scaled_dot_product_attention; head dim 128, one FA3 compiles."""
    from flash_attn_interface import flash_attn_func

    return _attention_vs_sdpa(lambda q, k, v: flash_attn_func(q, k, v, causal=True), (2, 256, 4, 128))


def xformers_numerics() -> dict:
    """On a GPU, xformers' memory_efficient_attention with a causal mask, forward and backward,
    against scaled_dot_product_attention."""
    from xformers.ops import LowerTriangularMask, memory_efficient_attention

    return _attention_vs_sdpa(lambda q, k, v: memory_efficient_attention(q, k, v, attn_bias=LowerTriangularMask()))


def te_linear_numerics() -> dict:
    """On a GPU, Transformer Engine's te.Linear (its core library's GEMM through the compiled
    binding) forward and backward against F.linear with the same weight and bias, in fp32."""
    import torch
    import torch.nn.functional as F
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    layer = te.Linear(256, 128, bias=True, params_dtype=torch.float32).cuda()
    x = torch.randn(32, 256, device="cuda", requires_grad=True)
    out = layer(x)
    ref = F.linear(x, layer.weight, layer.bias)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, layer.weight, layer.bias), grad)
    want = torch.autograd.grad(ref, (x, layer.weight, layer.bias), grad)
    torch.cuda.synchronize()
    return {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip((out, *got), (ref, *want)))}


def selective_scan_numerics() -> dict:
    """On a GPU, mamba-ssm's selective_scan_fn (the compiled selective_scan_cuda, with z, D and
    delta's softplus) forward and backward against its own pure-torch selective_scan_ref, fp32."""
    import torch
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn, selective_scan_ref

    torch.manual_seed(0)
    batch, dim, state, length = 2, 16, 8, 64
    leaf = lambda *s, scale=1.0: (torch.randn(*s, device="cuda") * scale).requires_grad_()  # noqa: E731
    u, delta, z = leaf(batch, dim, length), leaf(batch, dim, length, scale=0.5), leaf(batch, dim, length)
    A = (-0.5 * torch.rand(dim, state, device="cuda")).requires_grad_()
    B, C = leaf(batch, state, length), leaf(batch, state, length)
    D, bias = leaf(dim), leaf(dim, scale=0.1)
    inputs = (u, delta, A, B, C, D, z, bias)
    out = selective_scan_fn(*inputs[:6], z=z, delta_bias=bias, delta_softplus=True)
    ref = selective_scan_ref(*inputs[:6], z=z, delta_bias=bias, delta_softplus=True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    torch.cuda.synchronize()
    return {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip((out, *got), (ref, *want)))}


GPU_CHECKS = {"attention": attention_numerics, "causal-conv1d": causal_conv1d_numerics, "flash-attn-3": fa3_numerics,
              "flash-attn-4": fa4_numerics, "transformer-engine": te_linear_numerics,
              "selective-scan": selective_scan_numerics, "xformers": xformers_numerics}


def _inductor_cpu_isa(torch) -> str:
    """Which vector code Inductor generated for this CPU, and the capability ATen dispatches
    to: on aarch64 the SVE vector length picks them (at Grace's 128 bits: Inductor asimd,
    ATen SVE128), so the record of an emulated run says which path it tested."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return f"Inductor {pick_vec_isa()}, ATen {torch.backends.cpu.get_cpu_capability()}"
    except Exception as failure:  # noqa: BLE001 - a private API: its absence is not a failure
        return f"unknown ({type(failure).__name__})"


def child_compile(args) -> int:
    """torch.compile of a small function, checked against eager mode, on CPU and (with a
    GPU) CUDA; each device's outcome is written as soon as it is known."""
    import torch

    def function(x):
        return torch.sin(x) * 2 + x

    out: dict = {}
    for device in ["cpu"] + (["cuda"] if args.gpu_numerics else []):
        start = time.monotonic()
        try:
            x = torch.randn(1024, device=device)
            error = float((torch.compile(function)(x) - function(x)).abs().max())
            out[device] = {"ok": error < 1e-5, "error": error, "seconds": time.monotonic() - start}
            if device == "cpu":
                out[device]["isa"] = _inductor_cpu_isa(torch)
        except Exception as failure:  # noqa: BLE001
            out[device] = {"ok": False, "detail": f"{type(failure).__name__}: {str(failure)[:400]}",
                           "seconds": time.monotonic() - start}
        write_json(args.result, out)
    return 0


def child_collective(args) -> int:
    """One rank: all_reduce(sum) and all_gather with value checks, timed over a few iterations
    (collectives.run_collectives, the loop the multi-node ranks run too)."""
    from datetime import timedelta

    if os.environ.get(HANG_ENV) == "collective":
        time.sleep(1e9)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    size = max(world, int(args.size_mb * 2**20) // 4 // world * world) * 4
    res = run_collectives(rank, world, args.backend, rank, [size], 5)
    out = {"ok": res["ok"], "detail": res["detail"], "size_bytes": size}
    if res["ok"]:
        out.update({op + "_s": res["times"][op][str(size)] for op in ("all_reduce", "all_gather")})
    write_json(args.result, out)
    dist.destroy_process_group()
    return 0
