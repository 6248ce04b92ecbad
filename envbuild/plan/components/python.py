"""Python and the virtual environment with torch: the venv, then torch and everything of the
stack's lock but DeepSpeed, each hash checked (the lock's parts are generated here). The lock's
parts install with uv (`uv pip install --require-hashes --no-deps`, the matrix's pinned uv,
itself installed by its hashes outside the venv) where the matrix names it (bases.yaml installer),
else with pip; the downloads come from a BuildKit cache mount."""

from __future__ import annotations

import posixpath

from envbuild.image import paths
from envbuild.plan.blocks import PY_CACHE, FileCopy, Step, step_files
from envbuild.plan.components.base import Context, Part

PIP_SECRETS = ("ca_cert", "pip_index_url")
# The lock's parts in the build directory (under envbuild/), one per step that installs one.
LOCK_PARTS = {"venv": "lock/venv.txt", "deepspeed": "lock/deepspeed.txt", "toolchain": "lock/toolchain.txt",
              "uv": "lock/uv.txt"}
# The installer of the lock parts, in the builder only (outside the venv: the final image carries pip).
UV_PREFIX = "/opt/envbuild-uv"
UV_BIN = f"{UV_PREFIX}/bin/uv"


def lock_part(name: str) -> tuple[str, FileCopy]:
    """A lock part's path in the image and the copy that puts it there."""
    target = f"{paths.SETUP_DIR}/{LOCK_PARTS[name]}"
    return target, FileCopy(f"envbuild/{LOCK_PARTS[name]}", target)


def uv_env(ctx: Context) -> tuple[tuple[str, str], ...]:
    """The environment of a step that installs a lock part: ENVBUILD_UV names the uv to install
    it with (none: pip, for a matrix without an installer or a stack without a lock)."""
    return (("ENVBUILD_UV", UV_BIN),) if uses_uv(ctx) else ()


def uses_uv(ctx: Context) -> bool:
    return bool(ctx.lock) and ctx.resolution.facts.installer is not None


def _uv_step(ctx: Context) -> Step:
    installer = ctx.resolution.facts.installer
    target, copy = lock_part("uv")
    return Step("uv", (UV_PREFIX, target), files=step_files("uv.sh") + (copy,), secrets=PIP_SECRETS, caches=(PY_CACHE,),
                comment=f"uv {installer.version}, which installs the lock's parts: PyPI's wheel by its hashes "
                        f"(matrices/bases.yaml installer), outside the venv, in the builder only")


def _lock_files(lock, sections: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The whole lock (copied into the image) and its parts: the venv but DeepSpeed (the torch
    step) with the other `sections` the venv installs (Context.venv_sections: cuRAND for the ops
    that link it, --nccl's wheel in place of the venv's pin of it), DeepSpeed alone (built after
    torch, --no-build-isolation), the PyPI toolchain."""
    if lock is None:
        return ()
    venv = (lock.requirements("venv", exclude=("deepspeed", *lock.replaced()))
            + "".join(lock.requirements(section) for section in sections if section != "venv"))
    files = [(f"envbuild/{posixpath.basename(paths.LOCK)}", lock.text),
             (f"envbuild/{LOCK_PARTS['venv']}", venv),
             (f"envbuild/{LOCK_PARTS['deepspeed']}", lock.requirements("venv", only=("deepspeed",)))]
    if lock.sections.get("toolchain"):
        files.append((f"envbuild/{LOCK_PARTS['toolchain']}", lock.requirements("toolchain")))
    return tuple(files)


def _uv_part(ctx: Context) -> tuple[tuple[str, str], ...]:
    return ((f"envbuild/{LOCK_PARTS['uv']}", ctx.resolution.facts.installer.requirement + "\n"),) if uses_uv(ctx) else ()


def part(ctx: Context) -> Part:
    resolution, lock = ctx.resolution, ctx.lock
    stack = resolution.stack
    if lock:
        target, copy = lock_part("venv")
        venv_install, venv_files = ("--require-hashes", "--no-deps", "-r", target), (copy,)
    else:
        venv_install, venv_files = (f"torch=={stack.torch}", f"torchvision=={resolution.torchvision}"), ()
    steps = (
        Step("venv", (f"/usr/bin/{ctx.python_pkg}",), files=step_files("venv.sh"),
             comment="one virtual environment holds the whole stack"),
        *((_uv_step(ctx),) if uses_uv(ctx) else ()),
        Step("torch", (resolution.torch_index or "-", *venv_install), env=uv_env(ctx), caches=(PY_CACHE,),
             files=step_files("torch.sh") + venv_files, secrets=(*PIP_SECRETS, "torch_index_url"),
             comment=f"torch first: DeepSpeed's ops compile against it (CUDA {stack.cuda}"
                     f"{', ' + resolution.torch_index if resolution.torch_index else ', the PyPI default wheel'})"
                     + ("; the whole venv but DeepSpeed, from the stack's lock, every hash checked"
                        + "".join(f", with its [{need}] section (ops link it)" for need in resolution.toolchain_adds)
                        + "".join(f", with its [{need}] section (extensions load it)" for need in resolution.extension_loads
                                  if need not in resolution.toolchain_adds)
                        + (", by uv" if uses_uv(ctx) else ", by pip")
                        if lock else
                        "; NOT hash-locked: this stack has no lock in matrices/locks")),
    )
    override = resolution.nccl_override
    if override:  # --nccl: torch's Requires-Dist of its NCCL wheel follows the release installed
        steps += (Step("nccl", (override.package, override.replaced, override.version), files=step_files("nccl.sh", "requires.py"),
                       comment=f"--nccl {override.version}: {override.package} {override.version} replaced torch's "
                               f"pin {override.replaced} (the lock's [nccl] section); torch's requirement follows"),)
    # --keep-toolchain keeps the step scripts too (Apptainer copies what Docker's FROM builder has).
    return Part(builder_steps=steps, from_builder=(paths.VENV, paths.SETUP_DIR) if ctx.keep else (paths.VENV,),
                generated=_lock_files(lock, ctx.venv_sections) + _uv_part(ctx))
