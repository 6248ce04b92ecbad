"""DeepSpeed's ops (deepspeed.yaml): which can be pre-built for a stack, GPU arch list and CPU
architecture (rule ds-op), ``--ds-ops`` resolved to the ops to build, and why the builder
needs nvcc at all."""

from __future__ import annotations

from typing import Optional

from packaging.version import Version

from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.rules.rejection import Rejection
from envbuild.knowledge.rules.versions import compute_capability, contains, pin_overlaps

DEFAULT_OPS = "training"  # the op preset an image gets when nobody names one (--ds-ops, envbuild.yaml)


def capabilities(m, s, sections: frozenset[str] = frozenset()) -> set[str]:
    """What the stack's build can provide to ops that need something (`needs:`): the OS
    family's packages, the toolchain's CUDA libraries, and those an extra of the toolchain adds
    where the stack's lock holds that extra's section (`sections`: the lock's section names)."""
    toolchain = m.bases.toolchains[s.toolchain]
    return (set(m.bases.families[s.os].capabilities) | set(toolchain.provides)
            | {need for need in toolchain.adds if need in sections})


def _unlocked_add(m, s, need: str) -> str:
    """Why a need the toolchain adds is missing: the stack's lock has no section for it."""
    toolchain = m.bases.toolchains[s.toolchain]
    return (f"the {s.toolchain} toolchain adds {need} from {toolchain.install.package}[{toolchain.adds[need].extra}], "
            f"hash-locked in the stack's lock, and the lock of {s.id} has no [{need}] section: "
            f"`envbuild lock --stack {s.id}` writes it")


def op_rejection(m, s, op_name: str, arch_list: str, cpu_arch: str = "x86_64",
                 sections: frozenset[str] = frozenset()) -> Optional[Rejection]:
    """Why `op_name` cannot be pre-built for this stack, GPU arch list and CPU architecture
    (None: it can). `sections`: the section names of the stack's lock (what it adds)."""
    op = m.ops[op_name]
    if cpu_arch == "aarch64" and op_name in m.deepspeed_file.aarch64.not_buildable:
        return Rejection("ds-op", f"{op_name} cannot be built for aarch64: "
                                  f"{m.deepspeed_file.aarch64.not_buildable[op_name]}")
    ds = Version(s.deepspeed)
    if ds < Version(op.since):
        return Rejection("ds-op", f"{op_name} first appears in DeepSpeed {op.since}")
    if op.until and ds >= Version(op.until):
        return Rejection("ds-op", f"{op_name} was removed in DeepSpeed {op.until}")
    if op.torch and not contains(op.torch, s.torch):
        return Rejection("ds-op", f"{op_name}: {op.reason or f'needs torch {op.torch}'}")
    if op.cuda and not contains(op.cuda, s.cuda):  # the builder's nvcc is the stack's CUDA (rule toolchain)
        return Rejection("ds-op", f"{op_name} compiles with CUDA {op.cuda} only and the stack has CUDA {s.cuda}: "
                                  f"{op.cuda_reason}")
    missing = [n for n in op.needs if n not in capabilities(m, s, sections)]
    if missing:
        known = {n: _unlocked_add(m, s, n) for n in m.bases.toolchains[s.toolchain].adds}  # how it adds them
        why = [known[n] for n in missing if n in known]  # each missing need with its own reason
        if op.reason and any(n not in known for n in missing):
            why.insert(0, op.reason)  # the op's curated reason covers the needs no toolchain explains
        return Rejection("ds-op", f"{op_name}: needs {', '.join(missing)}, which envbuild's {s.os} base and its "
                                  f"{s.toolchain} toolchain do not provide" + (f": {'; '.join(why)}" if why else ""))
    if op.min_cc:
        lowest = min(compute_capability(a.removesuffix("+PTX")) for a in arch_list.split(";") if a)
        if lowest < compute_capability(op.min_cc):
            return Rejection("ds-op", f"{op_name} needs compute capability >= {op.min_cc}, "
                                      f"the arch list is {arch_list}")
    triton = m.torch_release(s.torch).triton
    for rule in op.triton:
        if contains(rule.deepspeed, s.deepspeed) and not any(pin_overlaps(triton, t) for t in rule.triton):
            return Rejection("ds-op", f"{op_name}: DeepSpeed {s.deepspeed} accepts triton "
                                      f"{' or '.join(rule.triton)}, torch {s.torch} pins triton {triton}")
    return None


def select_ops(m, s, arch_list: str, choice: str, cpu_arch: str = "x86_64",
               sections_of=lambda stack: frozenset()) -> tuple[list[str], list[tuple[str, str]]]:
    """Resolve ``--ds-ops`` into (ops to pre-build, [(op dropped from a preset, why)]).

    Presets (``training``, ``none``, the computed ``all``) quietly drop what the stack
    cannot build, and say so in ``--explain``; an op named explicitly that cannot be
    built is an error.
    """
    choice = (choice or DEFAULT_OPS).strip()
    presets = m.deepspeed_file.presets
    sections = sections_of(s)  # `sections_of(stack)`: its lock's section names (what the lock adds)
    if choice == "all" or choice in presets:
        names = list(m.ops) if choice == "all" else presets[choice]
        chosen, dropped = [], []
        for n in names:
            why = op_rejection(m, s, n, arch_list, cpu_arch, sections)
            (dropped.append((n, why.message)) if why else chosen.append(n))
        return sorted(chosen), dropped
    names = [n.strip() for n in choice.split(",") if n.strip()]  # known op names: validate.check_ds_ops
    chosen = []
    for n in names:
        why = op_rejection(m, s, n, arch_list, cpu_arch, sections)
        if why:
            ok = [o for o in m.ops if not op_rejection(m, s, o, arch_list, cpu_arch, sections)]
            builds = [t.id for t in reversed(m.stacks)  # newest last in the matrix: the nearest first
                      if t.id != s.id and not op_rejection(m, t, n, arch_list, cpu_arch, sections_of(t))][:3]
            raise EnvbuildError(
                f"--ds-ops: op '{n}' cannot be pre-built for stack {s.id} ({cpu_arch}): {why.message}. "
                f"Ops this stack can pre-build: {', '.join(ok)}."
                + (f" Stacks that can pre-build {n}: {', '.join(builds)} (--stack ID; `envbuild render --explain` "
                   f"says whether the GPU allows each)." if builds else ""))
        if n not in chosen:
            chosen.append(n)
    return sorted(chosen), []


def nvcc_required(m, s, ops: list[str], fabric=None, extensions=()) -> Optional[str]:
    """Why the builder needs the CUDA toolchain (None: it does not). DeepSpeed < 0.19.8 runs
    `nvcc -V` in setup.py under DS_ACCELERATOR=cuda even for CPU-only ops; a fabric built from
    source (aws-efa) compiles libfabric and its NCCL plugin against CUDA's headers. `extensions`:
    each one's build (its `ext`, and the PyPI `wheel` that fits, None: compiled from its sdist);
    a fitting wheel compiles nothing, and needs the toolchain only for the audit's cuobjdump
    where it carries device code (rule ext-audit), none where it is pure Python (FA4)."""
    cuda_ops = [o for o in ops if m.ops[o].kind == "cuda"]
    compiled = [b.ext.name for b in extensions if b.wheel is None]
    listed = ([f"CUDA ops {', '.join(cuda_ops)}"] if cuda_ops else []) + \
        ([f"CUDA extensions {', '.join(compiled)}"] if compiled else [])
    if listed:
        return f"{' and '.join(listed)} are compiled with nvcc"
    if not m.ds_release(s.deepspeed).nvcc_free_install:
        return f"DeepSpeed {s.deepspeed} runs `nvcc -V` at install time with DS_ACCELERATOR=cuda"
    if fabric is not None and fabric.build is not None:
        return f"fabric {fabric.name} builds {', '.join(src.name for src in fabric.build.sources)} against CUDA's headers"
    audited = [b.ext.name for b in extensions if b.wheel is not None and b.ext.device_code]
    if audited:
        return f"its cuobjdump audits the SASS of the PyPI wheels of {', '.join(audited)}; nothing is compiled"
    return None
