"""From a user's request to one pinned, valid build: the resolver.

Every stack in the matrix is a candidate; :mod:`envbuild.knowledge.rules` rejects the ones that do
not fit the request and the GPU; the newest survivor wins, deterministically (torch, then
CUDA, then DeepSpeed, then Python, then the stack id).

Examples
--------
>>> from envbuild.knowledge.matrix import load_matrix
>>> r = resolve(load_matrix(), Request(gpu="h20"))
>>> r.gpu.name, r.arch_list
('h20', '9.0')
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Optional

from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.image import paths
from envbuild.knowledge import rules, validate
from envbuild.knowledge.lock import Lock, ext_lock, stack_lock
from envbuild.knowledge.matrix import (
    CompileCacheTool,
    CpuTarget,
    CudaExtension,
    DriverFloor,
    EnvDefault,
    Fabric,
    Family,
    GpuProfile,
    ImageEnv,
    Installer,
    Matrix,
    Op,
    Stack,
    Toolchain,
)
from envbuild.knowledge.oslock import OsLock, load_os_lock
from envbuild.knowledge.request import Request
from envbuild.knowledge.rules import DEFAULT_CPU_TARGET, PLATFORMS
from envbuild.oci.registry import READABLE_TAG_MAX, check_readable_tag
from envbuild.resolve.nccl import NcclOverride, lock_with_nccl, torch_nccl_pin

OPS_IN_TAG = 40  # a longer op list is named by 8 hex digits of its hash: every readable tag fits the tag rule


@dataclass(frozen=True)
class EnvVar:
    """One environment variable the image sets, with why and where it comes from."""

    name: str
    value: str
    reason: str
    source: str
    layer: str  # "base" (stack-wide) or "gpu" (the late, per-GPU layer)
    cost: str = ""


@dataclass
class Candidate:
    stack: Stack
    rejections: list[rules.Rejection]


@dataclass(frozen=True)
class BuildFacts:
    """The matrix facts a build plan needs beyond the stack row, picked for this stack (so a
    resolution carries no raw matrix and the plan reads nothing else)."""

    family: Family  # the stack's OS release: its packages per stage and per capability
    toolchain: Toolchain  # where nvcc comes from
    ops: dict[str, Op]  # the chosen ops' facts (DS_BUILD_ variable, OS capabilities)
    ds_build_requires: tuple[str, ...]  # what DeepSpeed's setup.py needs in the venv (unlocked stacks)
    ds_build_only: dict[str, str]  # package -> why the final image drops it
    forward_compat: str  # how an older driver runs this CUDA (cuda.yaml)
    image_env: tuple[ImageEnv, ...] = ()  # what every image bakes (gpus.yaml image_env), not yet filled in
    cpu_target: Optional[CpuTarget] = None  # the chosen target's compiler flag and SIMD macro (cc-wrapper.sh)
    installer: Optional[Installer] = None  # what installs the lock parts (bases.yaml installer: uv); None: pip
    compile_cache: Optional[CompileCacheTool] = None  # what caches the compiles (bases.yaml compile_cache: sccache)


@dataclass(frozen=True)
class ExtensionBuild:
    """How one requested CUDA extension is made for the chosen stack, as the rules decide it:
    PyPI's wheel that fits (None: compile its sdist), the source patches the stack's torch needs,
    and whether it builds against torch's stable ABI (its cache key then ignores torch's build)."""
    ext: CudaExtension
    wheel: Optional[object] = None  # an ExtensionWheel of extensions.yaml
    patches: tuple = ()
    stable_abi: bool = False
    requirements: tuple[str, ...] = ()  # what it needs installed beside it on this stack (its CUDA major's too)
    lock: Optional[Lock] = field(default=None, repr=False)  # matrices/locks/ext: what it needs beyond the stack's lock


def extension_builds(s: Stack, extensions: tuple[CudaExtension, ...], arch: str, m: Optional[Matrix] = None,
                     lock: Optional[Lock] = None) -> tuple[ExtensionBuild, ...]:
    """Each extension after those it needs (mamba-ssm after causal-conv1d: its import check
    imports them), with how it is made and the lock of what it needs beyond the stack's."""
    names = {e.name for e in extensions}
    needed = {n for e in extensions for need in e.needs for n in rules.extension_needs(need) if n in names}
    return tuple(ExtensionBuild(ext=e, wheel=rules.extension_wheel(e, s, arch)[0] if e.wheels else None,
                                patches=tuple(rules.extension_patches(e, s)),
                                stable_abi=bool(e.stable_abi) and rules.contains(e.stable_abi, s.torch),
                                requirements=tuple(rules.extension_requirements(e, s)),
                                lock=ext_lock(m, e, s, arch, lock) if m is not None else None)
                 for e in sorted(extensions, key=lambda e: e.name not in needed))


@dataclass(frozen=True)
class Resolution:
    request: Request
    stack: Stack
    gpu: GpuProfile
    torchvision: str
    nccl: Optional[str]
    arch_list: str
    ops: list[str]
    dropped_ops: list[tuple[str, str]]
    nvcc_reason: Optional[str]
    torch_index: Optional[str]
    base_images: dict[str, str]
    env: list[EnvVar]
    node_env: list[EnvDefault]
    driver: DriverFloor
    tag: str
    fabric: Optional[Fabric] = None  # how NCCL reaches other nodes (fabrics.yaml); None only in old tests
    arch: str = "x86_64"  # the image's CPU architecture (the GPU's nodes': Grace is aarch64)
    cpu_target: str = DEFAULT_CPU_TARGET  # what the host-compiled ops are built for (gpus.yaml cpu_targets)
    lock: Optional[Lock] = field(default=None, repr=False)  # matrices/locks: None = not hash-locked
    facts: Optional[BuildFacts] = field(default=None, repr=False)
    extensions: tuple[CudaExtension, ...] = ()  # CUDA extensions compiled in the builder (extensions.yaml)
    extension_builds: tuple[ExtensionBuild, ...] = ()  # the same, in build order, each with how it is made
    node_conditions: dict = field(default_factory=dict)  # name -> DeviceCondition, for those node_env names
    locked_alternative: Optional[str] = None  # no lock: the newest other stack the rules allow that has one
    os_lock: Optional[OsLock] = field(default=None, repr=False)  # matrices/locks/os: None = OS packages float
    os_locked: tuple[str, ...] = ()  # the stages whose OS packages the OS lock pins (their base is the lock's)
    os_unlocked: Optional[str] = None  # why some stage's OS packages are not pinned (None: all are)
    matrix_sha256: str = ""  # the matrix it was resolved from (Matrix.sha256): recorded in the image
    toolchain_adds: tuple[str, ...] = ()  # needs of the chosen ops an extra of the toolchain adds (curand)
    extension_loads: tuple[str, ...] = ()  # libraries the extensions load at import that such an extra adds (TE: curand)
    nccl_override: Optional[NcclOverride] = None  # --nccl: `nccl` is then its version, not torch's pin

    @property
    def image_ref(self) -> str:
        return f"{self.request.image_repo}:{self.tag}"

    @property
    def platform(self) -> str:
        """The OCI platform: linux/amd64 or linux/arm64."""
        return PLATFORMS[self.arch]


def _sort_key(s: Stack):
    return (Version(s.torch), Version(s.cuda), Version(s.deepspeed), Version(s.python), s.id)


def _nodot(v: str) -> str:
    return v.replace(".", "")


def readable_tag(s: Stack, gpu: GpuProfile, ops: list[str], default_ops: list[str],
                 cpu_target: str, keep_toolchain: bool, custom: tuple = (), no_compiler: bool = False,
                 default_cpu_target: str = DEFAULT_CPU_TARGET, fabric_tag: str = "",
                 extensions: tuple[CudaExtension, ...] = (), nccl: Optional[str] = None) -> str:
    """`torch2.11.0-cu130-py3.11-ds0.19.8-h20`, plus short suffixes for non-default choices;
    an op list that would not fit the tag rule is named by 8 hex digits of its hash."""
    head = f"torch{s.torch}-cu{_nodot(s.cuda)}-py{s.python}-ds{s.deepspeed}-{gpu.name}"
    if fabric_tag:
        head += "-" + fabric_tag
    head += "".join(f"-{e.tag}{e.version}" for e in extensions)
    if nccl:
        head += f"-nccl{nccl}"
    tail = ""
    if cpu_target != default_cpu_target:
        tail += "-" + cpu_target.replace("x86-64", "x86_64")
    if keep_toolchain:
        tail += "-devel"
    elif no_compiler:
        tail += "-nocc"
    if custom:
        tail += "-custom-" + hashlib.sha256(repr(sorted(custom)).encode()).hexdigest()[:8]  # order-free
    middle = ""
    if ops != default_ops:
        names = ".".join(ops) or "none"
        if len(names) > OPS_IN_TAG or len(head) + len("-ops-") + len(names) + len(tail) > READABLE_TAG_MAX:
            names = hashlib.sha256(names.encode()).hexdigest()[:8]
        middle = "-ops-" + names
    tag = head + middle + tail
    return check_readable_tag(tag, "the readable tag")


def _applies(d: EnvDefault, s: Stack) -> bool:
    return not d.when or rules.contains(d.when["torch"], s.torch)


def _node_env(m: Matrix, s: Stack, gpu: GpuProfile, req: Request, fabric: Fabric) -> list[EnvDefault]:
    """Defaults the node decides at start-up (driver, InfiniBand); a --env of the same name
    bakes the user's value instead."""
    overridden = {name for name, _ in req.env}
    return [d for d in [*m.gpus_file.common_env, *gpu.env, *fabric.env]
            if d.node and _applies(d, s) and d.name not in overridden]


def _node_conditions(m: Matrix, node_env: list[EnvDefault]) -> dict:
    """The declarations (fabrics.yaml node_conditions) of the device conditions the image's
    node-dependent defaults name: what its manifest carries for the start-up check to decide."""
    names = {name for d in node_env for name in d.node.conditions}
    return {name: c for name, c in m.fabrics_file.node_conditions.items() if name in names}


def _env(m: Matrix, s: Stack, gpu: GpuProfile, req: Request, fabric: Fabric) -> list[EnvVar]:
    """The matrix's defaults for this stack, GPU and fabric (gpus.yaml common_env, fabrics.yaml,
    the GPU's env), then the user's --env, which replaces a default of the same name. The
    variables every image bakes (gpus.yaml image_env) are filled in by the plan."""
    out = []
    for d in [*m.gpus_file.common_env, *fabric.env, *gpu.env]:
        if _applies(d, s) and not d.node:
            out.append(EnvVar(d.name, d.value, d.reason, d.source, "gpu", d.cost))
    for name, value in req.env:
        out = [e for e in out if e.name != name]
        out.append(EnvVar(name, value, "set with --env at render time", "user", "gpu"))
    return out


def _check_request(m: Matrix, req: Request) -> None:
    """Fail early, with the nearest valid choices, on input no stack could ever match."""
    validate.check_request(m, req, paths.RUNTIME_PATH)  # every version flag parses, or it said why
    rules.check_request(m, req)
    rules.check_extensions(m, m.gpu(req.gpu), req.extensions)


def candidates(m: Matrix, req: Request, gpu: GpuProfile) -> list[Candidate]:
    """Every stack with the rules that reject it for this request (empty list: valid)."""
    pool = [m.stack(req.stack)] if req.stack else m.stacks
    fabric = m.fabric(req.fabric)
    out = []
    for s in sorted(pool, key=_sort_key, reverse=True):
        rej = rules.request_rejections(m, s, req) + rules.gpu_rejections(m, s, gpu)
        arch = rules.image_arch(m, s, gpu)
        rej += rules.fabric_rejections(m, s, fabric, arch, gpu)
        if req.cpu_target is not None and arch is not None:
            why = rules.cpu_target_rejection(m, s, req.cpu_target, arch)
            rej += [why] if why else []
        elif arch is not None:
            why = rules.default_cpu_target_rejection(m, s, gpu, arch)
            rej += [why] if why else []
        for name in req.extensions:
            rej += rules.extension_rejections(m, s, m.extension(name), arch, _locked_names(m, s, arch, name), gpu)
        out.append(Candidate(s, rej))
    return out


def _lock_if_loads(m: Matrix, s: Stack, arch: Optional[str]) -> Optional[Lock]:
    """A stack's lock, for what other stacks could do (None: no lock, or one that would not
    load: that is said where the lock is used)."""
    try:
        return stack_lock(m, s, arch or "x86_64")
    except EnvbuildError:
        return None


def _lock_sections(m: Matrix, s: Stack, arch: Optional[str]) -> frozenset[str]:
    """The section names of a stack's lock (what it adds beyond the venv)."""
    lock = _lock_if_loads(m, s, arch)
    return frozenset(lock.sections) if lock else frozenset()


def _locked_names(m: Matrix, s: Stack, arch: Optional[str], ext: Optional[str] = None) -> Optional[set[str]]:
    """The canonical names a stack's lock holds, with those of extension `ext`'s own lock for it
    (matrices/locks/ext) where one agrees with both (None: no lock, or one that would not load)."""
    lock = _lock_if_loads(m, s, arch)
    if lock is None:
        return None
    extra = ext_lock(m, m.extension(ext), s, arch or "x86_64", lock) if ext else None
    return set(lock.pins()) | set(extra.pins() if extra else ())


def _no_stack_error(m: Matrix, req: Request, gpu: GpuProfile, cands: list[Candidate]) -> EnvbuildError:
    reasons = []
    for c in cands:
        if any(r.rule == "request" for r in c.rejections):
            continue  # the user ruled this stack out; its other problems are noise
        for r in c.rejections:
            if r.message not in reasons:
                reasons.append(r.message)
    for_gpu = [c.stack for c in candidates(m, Request(gpu=req.gpu, extensions=req.extensions), gpu) if not c.rejections]
    for_gpu.sort(key=lambda s: _distance(s, req))
    choices = ", ".join(f"--torch {s.torch} --cuda {s.cuda} --python {s.python} (stack {s.id})"
                        for s in for_gpu[:3])
    why = "; ".join(reasons[:3]) if reasons else "no stack in the matrix matches those versions"
    if req.extensions and not for_gpu:
        return EnvbuildError(
            f"no stack fits {req.describe()}: {why}. No stack in the matrix can pre-build --ext "
            f"{','.join(req.extensions)} for {gpu.name}; drop --ext (`envbuild render {req.describe()} --explain` "
            f"shows every candidate).")
    fabric = m.fabric(req.fabric)
    if fabric.requires and fabric.requires.gpus and gpu.name not in fabric.requires.gpus:
        fits = [f.name for f in m.fabrics if not (f.requires and f.requires.gpus and gpu.name not in f.requires.gpus)]
        return EnvbuildError(
            f"no stack fits {req.describe()}: {why}. Nearest valid choices: --gpu "
            f"{' or --gpu '.join(fabric.requires.gpus)} with --fabric {fabric.name}, or --fabric "
            f"{' or --fabric '.join(fits)} for {gpu.name} (`envbuild fabrics` lists them).")
    return EnvbuildError(
        f"no stack fits {req.describe()}: {why}. "
        f"Nearest valid choices for {gpu.name}: {choices or 'none'} "
        f"(`envbuild render {req.describe()} --explain` shows every candidate).")


def _distance(s: Stack, req: Request) -> int:
    """How far a stack is from the versions the user asked for (for 'nearest' hints)."""
    total = 0
    for attr in ("python", "cuda", "torch", "deepspeed"):
        found = re.search(r"\d+(\.\d+)?", getattr(req, attr) or "")
        if found:
            want, have = Version(found.group(0)), Version(getattr(s, attr))
            total += abs((want.major * 100 + want.minor) - (have.major * 100 + have.minor))
    return total


def _evaluate(m: Matrix, req: Request) -> tuple[GpuProfile, list[Candidate]]:
    """The GPU and every candidate with its rejections: what resolve and --explain share."""
    gpu = m.gpu(req.gpu)
    _check_request(m, req)
    return gpu, candidates(m, req, gpu)


def resolve(m: Matrix, req: Request) -> Resolution:
    """Pick the newest valid stack for `req`, or raise EnvbuildError saying why none fits."""
    gpu, cands = _evaluate(m, req)
    valid = [c for c in cands if not c.rejections]
    if not valid:
        raise _no_stack_error(m, req, gpu, cands)
    s = valid[0].stack
    fabric = m.fabric(req.fabric)
    rules.check_base_images(m, s, req)
    rel = m.torch_release(s.torch)
    arch_list = gpu.cc
    arch = rules.image_arch(m, s, gpu)
    rules.check_emulation(m, req, gpu, arch)
    default_target = m.cpu_target_for(arch, gpu, m.bases.families[s.os])
    cpu_target = req.cpu_target or default_target
    sections: dict[str, frozenset[str]] = {}  # stack id -> its lock's sections, read once

    def sections_of(t: Stack) -> frozenset[str]:
        if t.id not in sections:
            sections[t.id] = _lock_sections(m, t, arch)
        return sections[t.id]

    ops, dropped = rules.select_ops(m, s, arch_list, req.ds_ops, arch, sections_of)
    extensions = tuple(m.extension(name) for name in req.extensions)
    default_ops, _ = rules.select_ops(m, s, arch_list, rules.DEFAULT_OPS, arch, sections_of)
    toolchain = m.bases.toolchains[s.toolchain]
    base_images, os_lock, os_locked, os_unlocked = _bases(m, s, req, arch)
    pin = torch_nccl_pin(rel, s)
    node_env = _node_env(m, s, gpu, req, fabric)
    lock, override = lock_with_nccl(m, s, pin, req, arch, fabric)
    builds = extension_builds(s, extensions, arch, m, lock)
    return Resolution(
        request=req, stack=s, gpu=gpu, torchvision=rel.torchvision,
        nccl=override.version if override else pin, nccl_override=override,
        arch_list=arch_list, ops=ops, dropped_ops=dropped,
        toolchain_adds=tuple(sorted({n for o in ops for n in m.ops[o].needs if n in toolchain.adds})),
        extension_loads=tuple(sorted({n for e in extensions for n in e.loads if n in toolchain.adds})),
        nvcc_reason=rules.nvcc_required(m, s, ops, fabric, builds),
        torch_index=m.torch_index(rel, s.cuda), base_images=base_images,
        env=_env(m, s, gpu, req, fabric), node_env=node_env, node_conditions=_node_conditions(m, node_env),
        driver=m.driver_floor(s.cuda, gpu),
        # --env values get their own readable tag; a --base-image is meant to be a mirror of
        # the same base, told apart by the content tag only.
        tag=readable_tag(s, gpu, ops, default_ops, cpu_target, req.keep_toolchain, tuple(req.env),
                         req.no_compiler, default_target, fabric.tag, extensions,
                         override.version if override else None),
        extensions=extensions, extension_builds=builds, fabric=fabric, arch=arch, cpu_target=cpu_target,
        lock=lock, os_lock=os_lock if os_locked else None, os_locked=os_locked,
        os_unlocked=os_unlocked, matrix_sha256=m.sha256,
        locked_alternative=None if lock else _newest_locked(m, [c.stack for c in valid[1:]], gpu),
        facts=_facts(m, s, ops, cpu_target),
    )


def _bases(m: Matrix, s: Stack, req: Request, arch: str):
    """(base image per stage, the OS lock, the stages it locks, those it cannot): the matrix's
    own bases pinned to the digests the publishing CI recorded (if any), a user's in their place,
    and an OS-locked stage on the base its lock was resolved on (by digest where it knows one)."""
    published = m.base_digests
    base_images = {stage: f"{ref}@{published[ref]}" if ref in published else ref
                   for stage, ref in (("builder", s.base_images.builder), ("runtime", s.base_images.runtime))}
    if req.base_image:
        base_images["runtime"] = req.base_image
        if m.bases.toolchains[s.toolchain].install:  # the builder is the same plain OS base
            base_images["builder"] = req.base_image
    if req.builder_image:
        base_images["builder"] = req.builder_image
    os_lock = load_os_lock(m.directory, s.id, arch)
    os_locked, os_unlocked = os_lock_stages(os_lock, base_images, s.id, arch)
    for stage in os_locked:
        base_images[stage] = os_lock.stages[stage].base_ref
    return base_images, os_lock, os_locked, os_unlocked



def _facts(m: Matrix, s: Stack, ops: list[str], cpu_target: str) -> BuildFacts:
    """The matrix's facts the plan needs beside the resolution, so it reads no matrix."""
    return BuildFacts(family=m.bases.families[s.os], toolchain=m.bases.toolchains[s.toolchain],
                      ops={o: m.ops[o] for o in ops}, ds_build_requires=tuple(m.deepspeed_file.build_requires),
                      ds_build_only=dict(m.deepspeed_file.build_only), forward_compat=m.cuda_file.forward_compat,
                      image_env=tuple(m.gpus_file.image_env), cpu_target=m.gpus_file.cpu_targets[cpu_target],
                      installer=m.bases.installer, compile_cache=m.bases.compile_cache)


def os_lock_stages(lock: Optional[OsLock], base_images: dict[str, str], stack_id: str,
                   arch: str) -> tuple[tuple[str, ...], Optional[str]]:
    """Which stages the stack's OS lock pins (a stage whose base is the one it was resolved on,
    by name; the lock's digest then wins over a tag), and why the others float.

    >>> os_lock_stages(None, {"builder": "b", "runtime": "r"}, "s1", "x86_64")[1].split(":")[0]
    'no OS lock for s1 (x86_64)'
    """
    if lock is None:
        return (), (f"no OS lock for {stack_id} ({arch}): apt installs the archive's newest packages; "
                    f"`envbuild lock --os --stack {stack_id}` makes one where the base image can be pulled")
    locked, other = [], []
    for stage in ("builder", "runtime"):
        part = lock.stages.get(stage)
        wanted = base_images[stage].split("@", 1)[0]
        if part is not None and part.base_name == wanted:
            locked.append(stage)
        else:
            other.append(f"the {stage} base {base_images[stage]} is not the one the lock was resolved on "
                         f"({part.base_ref if part else 'none'})")
    why = None if not other else (f"{'; '.join(other)}: those OS packages float; lock them for this base with "
                                  f"`envbuild lock --os --stack {stack_id} --base-image ... --matrix-dir ...`")
    return tuple(locked), why


def _newest_locked(m: Matrix, stacks: list[Stack], gpu) -> Optional[str]:
    """The first (newest) of `stacks` with a current lock for the GPU's CPU architecture: what
    to offer when the chosen stack cannot be locked (its torch is on an index this machine cannot
    reach), so a user who needs hash-locked packages has a real choice, not just a warning."""
    for stack in stacks:
        try:
            if stack_lock(m, stack, rules.image_arch(m, stack, gpu)):
                return stack.id
        except EnvbuildError:  # a stale lock is no alternative
            continue
    return None


def explain_rows(m: Matrix, req: Request) -> list[tuple[str, str, str]]:
    """(stack id, verdict, reasons) for every candidate, for ``--explain``."""
    _, cands = _evaluate(m, req)
    rows = []
    chosen = None
    for c in cands:
        if c.rejections:
            rows.append((c.stack.id, "rejected", "; ".join(f"[{r.rule}] {r.message}" for r in c.rejections)))
        elif chosen is None:
            chosen = c.stack.id
            rows.append((c.stack.id, "CHOSEN", "newest stack every rule allows"))
        else:
            rows.append((c.stack.id, "valid", "older than the chosen stack"))
    return rows
