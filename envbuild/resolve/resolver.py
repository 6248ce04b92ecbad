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
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_bytes
from envbuild.image import paths
from envbuild.knowledge import rules, validate
from envbuild.knowledge.lock import Lock, stack_lock
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

OPS_IN_TAG = 40  # a longer op list is named by 8 hex digits of its hash: every readable tag fits the tag rule


@dataclass(frozen=True)
class NcclOverride:
    """The NCCL wheel `--nccl` installs in place of the one torch pins, hash-locked."""

    package: str  # the wheel family torch pins (nvidia-nccl-cu13)
    version: str
    replaced: str  # torch's own pin of `package`
    source: str  # the release's page on PyPI
    wheels: tuple[tuple[str, str], ...]  # (file, sha256) of the wheels that install on the image


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


def extension_builds(s: Stack, extensions: tuple[CudaExtension, ...], arch: str) -> tuple[ExtensionBuild, ...]:
    """Each extension after those it needs (mamba-ssm after causal-conv1d: its import check
    imports them), with how it is made."""
    names = {e.name for e in extensions}
    needed = {n for e in extensions for need in e.needs for n in rules.extension_needs(need) if n in names}
    return tuple(ExtensionBuild(ext=e, wheel=rules.extension_wheel(e, s, arch)[0] if e.wheels else None,
                                patches=tuple(rules.extension_patches(e, s)),
                                stable_abi=bool(e.stable_abi) and rules.contains(e.stable_abi, s.torch))
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
    locked_alternative: Optional[str] = None  # no lock: the newest other stack the rules allow that has one
    os_lock: Optional[OsLock] = field(default=None, repr=False)  # matrices/locks/os: None = OS packages float
    os_locked: tuple[str, ...] = ()  # the stages whose OS packages the OS lock pins (their base is the lock's)
    os_unlocked: Optional[str] = None  # why some stage's OS packages are not pinned (None: all are)
    matrix_sha256: str = ""  # the matrix it was resolved from (Matrix.sha256): recorded in the image
    toolchain_adds: tuple[str, ...] = ()  # needs of the chosen ops an extra of the toolchain adds (curand)
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
            rej += rules.extension_rejections(m, s, m.extension(name), arch, _locked_names(m, s, arch))
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


def _locked_names(m: Matrix, s: Stack, arch: Optional[str]) -> Optional[set[str]]:
    """The canonical names a stack's lock holds (None: no lock, or one that would not load)."""
    lock = _lock_if_loads(m, s, arch)
    return set(lock.pins()) if lock else None


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
    pin = _torch_nccl_pin(rel, s)
    lock, override = _lock_with_nccl(m, s, pin, req, arch, fabric)
    return Resolution(
        request=req, stack=s, gpu=gpu, torchvision=rel.torchvision,
        nccl=override.version if override else pin, nccl_override=override,
        arch_list=arch_list, ops=ops, dropped_ops=dropped,
        toolchain_adds=tuple(sorted({n for o in ops for n in m.ops[o].needs if n in toolchain.adds})),
        nvcc_reason=rules.nvcc_required(m, s, ops, fabric, req.extensions),
        torch_index=m.torch_index(rel, s.cuda), base_images=base_images,
        env=_env(m, s, gpu, req, fabric), node_env=_node_env(m, s, gpu, req, fabric),
        driver=m.driver_floor(s.cuda, gpu),
        # --env values get their own readable tag; a --base-image is meant to be a mirror of
        # the same base, told apart by the content tag only.
        tag=readable_tag(s, gpu, ops, default_ops, cpu_target, req.keep_toolchain, tuple(req.env),
                         req.no_compiler, default_target, fabric.tag, extensions,
                         override.version if override else None),
        extensions=extensions, extension_builds=extension_builds(s, extensions, arch), fabric=fabric, arch=arch, cpu_target=cpu_target,
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


def _torch_nccl_pin(rel, s: Stack) -> Optional[str]:
    """The NCCL release torch pins in stack `s`: read from the PyPI default wheel, so unknown for
    another CUDA variant (it may bundle another)."""
    return rel.nccl if s.cuda == rel.default_cuda else None


def _lock_with_nccl(m: Matrix, s: Stack, pin: Optional[str], req: Request, arch: str,
                    fabric: Fabric) -> tuple[Optional[Lock], Optional[NcclOverride]]:
    """The stack's lock, with the [nccl] section --nccl adds (and the override it records)."""
    lock = stack_lock(m, s, arch)
    override = _nccl_override(m, s, pin, lock, req.nccl, arch, fabric) if req.nccl else None
    if override:
        lock = lock.with_nccl(override.package, override.version, tuple(sha for _, sha in override.wheels),
                              (f"replaces {override.package}=={override.replaced}, the pin of torch {s.torch}: "
                               f"--nccl {override.version}", f"from {override.source}"))
    return lock, override


def _facts(m: Matrix, s: Stack, ops: list[str], cpu_target: str) -> BuildFacts:
    """The matrix's facts the plan needs beside the resolution, so it reads no matrix."""
    return BuildFacts(family=m.bases.families[s.os], toolchain=m.bases.toolchains[s.toolchain],
                      ops={o: m.ops[o] for o in ops}, ds_build_requires=tuple(m.deepspeed_file.build_requires),
                      ds_build_only=dict(m.deepspeed_file.build_only), forward_compat=m.cuda_file.forward_compat,
                      image_env=tuple(m.gpus_file.image_env), cpu_target=m.gpus_file.cpu_targets[cpu_target],
                      installer=m.bases.installer, compile_cache=m.bases.compile_cache)


@dataclass(frozen=True)
class NcclChoices:
    """What `--nccl` may install in one stack's image for one CPU architecture."""

    stack: Stack
    arch: str
    package: Optional[str]  # the wheel family torch pins (nvidia-nccl-cu13), None where unknown
    pin: Optional[str]  # torch's own pin of it
    accepted: tuple[str, ...]  # the releases --nccl accepts, oldest first (torch's pin among them)
    unusable: Optional[str]  # why no --nccl can be used with the stack, and what to do instead


def nccl_choices(m: Matrix) -> list[NcclChoices]:
    """Each stack, for each CPU architecture it has a lock for (x86_64 where it has none): the
    NCCL releases --nccl accepts, decided by the rules that decide a render's (rules.accepted_nccl)."""
    out = []
    for s in m.stacks:
        pin = _torch_nccl_pin(m.torch_release(s.torch), s)
        locks = {arch: stack_lock(m, s, arch) for arch in PLATFORMS}
        for arch in [a for a, lock in locks.items() if lock is not None] or ["x86_64"]:
            lock, package = locks[arch], m.nccl_package(s.torch)
            unusable = rules.nccl_unusable(m, s, pin, lock.pins() if lock else None)
            accepted = () if unusable else tuple(r.version for r in rules.accepted_nccl(m, s, package, pin, arch))
            out.append(NcclChoices(s, arch, package.package if package else None, pin, accepted, unusable))
    return out


def _nccl_override(m: Matrix, s: Stack, pin: Optional[str], lock: Optional[Lock], version: str, arch: str,
                   fabric: Fabric) -> Optional[NcclOverride]:
    """What --nccl installs (rules.select_nccl decides whether it may); None when it names the
    release torch pins already (one image, so one tag)."""
    package, release = rules.select_nccl(m, s, pin, lock.pins() if lock else None, version, arch, fabric)
    if Version(release.version) == Version(pin):
        return None
    wheels = rules.nccl_wheels(release, arch, m.bases.families[s.os].glibc, s.python)
    return NcclOverride(package=package.package, version=release.version, replaced=pin, source=release.source,
                        wheels=tuple((w.file, w.sha256) for w in wheels))


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


def parse_env_pairs(pairs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for p in pairs:
        if "=" not in p:
            raise EnvbuildError(f"--env '{p}' must be NAME=VALUE, e.g. --env NCCL_P2P_DISABLE=0.")
        name, value = p.split("=", 1)
        out.append((name, value))
    return tuple(out)


def apt_key_file(path: Optional[str]) -> Optional[Path]:
    """Validate --apt-key: an OpenPGP public key (armored, or apt's binary keyring)."""
    if not path:
        return None
    p = Path(path)
    data = read_bytes(p, "--apt-key", "ca")
    armored = b"-----BEGIN PGP PUBLIC KEY BLOCK-----" in data[:4096]
    # A binary keyring starts with a public-key packet: tag 6, old format (0x98/0x99) or new (0xc6).
    if not armored and (not data or data[0] not in (0x98, 0x99, 0xC6)):
        raise EnvbuildError(f"--apt-key {path} is not an OpenPGP public key (neither a '-----BEGIN PGP PUBLIC KEY "
                            f"BLOCK-----' file nor a binary keyring): give the key that signs the mirror's Release "
                            f"files, e.g. from `gpg --export --armor KEYID > key.asc`.")
    return p


def ca_file(path: Optional[str]) -> Optional[Path]:
    """Validate --ca-cert: a readable PEM file."""
    if not path:
        return None
    p = Path(path)
    text = read_bytes(p, "--ca-cert", "ca").decode("ascii", errors="replace")
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise EnvbuildError(f"--ca-cert {path} holds no PEM certificate (no '-----BEGIN CERTIFICATE-----' line); give "
                            f"the CA's certificate in PEM, such as /etc/ssl/certs/ca-certificates.crt.")
    try:  # OpenSSL reads every certificate of the bundle, as pip, uv and apt inside the build will
        count = _certificates(text)
    except ssl.SSLError as e:
        why = e.reason or str(e).split(" (_ssl")[0]
        raise EnvbuildError(f"--ca-cert {path} is not a PEM certificate bundle OpenSSL can read ({why}): a "
                            f"block between its BEGIN and END lines is not a certificate; give the CA's certificate "
                            f"as its issuer exported it (`openssl x509 -in CA.crt -text` prints it), such as "
                            f"/etc/ssl/certs/ca-certificates.crt.") from None
    if count == 0:
        raise EnvbuildError(f"--ca-cert {path} holds no certificate OpenSSL can read; give the CA's certificate in "
                            f"PEM, such as /etc/ssl/certs/ca-certificates.crt.")
    return p


def _certificates(pem: str) -> int:
    """How many certificates OpenSSL reads from `pem` (ssl.SSLError: a block that is not one)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    blocks = re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", pem, re.S)
    if not blocks:
        return 0
    context.load_verify_locations(cadata="\n".join(blocks))
    return context.cert_store_stats()["x509"]
