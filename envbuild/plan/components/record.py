"""The image's record of itself: its entry scripts and the in-image package, the locks it was
built from, its environment (each default with its reason), its labels and its manifest
(/opt/envbuild/manifest.json: what the smoke test checks against and `envbuild rebuild`
re-renders from). One schema for every image, so it is made here once, from the resolution
and the decisions of the context."""

from __future__ import annotations

import posixpath
from dataclasses import fields, replace
from typing import Optional

from envbuild import __version__
from envbuild.image import paths
from envbuild.oci.registry import local_only
from envbuild.plan import schema
from envbuild.plan.blocks import SYSTEM_PATH, FileCopy
from envbuild.plan.components.base import Context, Part
from envbuild.plan.components.ospackages import OS_LOCK_FILE, fabric_packages
from envbuild.plan.model import ImageFacts
from envbuild.resolve.resolver import EnvVar, Resolution

IMAGE_FILES = ("env.sh", "entrypoint.sh", "smoke.py")
OPTIONAL_REQUEST = ("nccl",)  # recorded only when given: the records of images without it stay as they were


def part(ctx: Context) -> Part:
    """The entry scripts, then the locks the image was built from, into /opt/envbuild."""
    resolution = ctx.resolution
    files = tuple(FileCopy(f"envbuild/{name}", f"{paths.HOME}/{name}") for name in IMAGE_FILES)
    if ctx.lock:
        files += (FileCopy(f"envbuild/{posixpath.basename(paths.LOCK)}", paths.LOCK),)
    if resolution.os_lock:
        files += (FileCopy(OS_LOCK_FILE, paths.OS_LOCK),)
    return Part(image_files=files)


def image_facts(resolution: Resolution) -> ImageFacts:
    """What the rendered files say about the image in their comments and headers."""
    stack, gpu = resolution.stack, resolution.gpu
    return ImageFacts(tag=resolution.tag, image_repo=resolution.request.image_repo, stack=stack.id,
                      torch=stack.torch, cuda=stack.cuda, python=stack.python, deepspeed=stack.deepspeed,
                      gpu=gpu.name, sm=gpu.sm, arch_list=resolution.arch_list, arch=resolution.arch,
                      host_cpu=gpu.host_cpu or resolution.arch, ops=tuple(resolution.ops),
                      lock_sha256=resolution.lock.sha256 if resolution.lock else None,
                      local_only=local_only(resolution.request.image_repo), os_lock=resolution.os_lock,
                      os_locked=resolution.os_locked)


def image_env(resolution: Resolution, kept_toolchain_home: Optional[str]) -> tuple[EnvVar, ...]:
    """The final image's environment: what every image bakes (gpus.yaml image_env, in its
    order, filled in for this image), then the resolution's defaults; a user's --env of the
    same name wins."""
    facts = {"venv": paths.VENV, "constraints": paths.CONSTRAINTS, "system_path": SYSTEM_PATH,
             "cuda_home": kept_toolchain_home or "", "min_driver": resolution.driver.min_driver,
             "driver_source": resolution.driver.source, "cuda": resolution.stack.cuda,
             "arch_list": resolution.arch_list, "gpu": resolution.gpu.name, "sm": resolution.gpu.sm}
    user = {e.name for e in resolution.env if e.source == "user"}
    toolchain = "kept" if kept_toolchain_home else "lean"
    env = []
    for entry in resolution.facts.image_env:
        if entry.name in user or entry.toolchain not in (None, toolchain):
            continue
        value, reason, source = entry.filled(facts)
        env.append(EnvVar(entry.name, value, reason, source, entry.layer, entry.cost))
    return tuple(env) + tuple(resolution.env)


def node_conditions(resolution: Resolution) -> dict[str, dict]:
    """The device conditions the node_env entries name, as fabrics.yaml declares them: the image
    decides each at start-up from this definition (image/node.py), not from code of its own."""
    return {name: resolution.node_conditions[name].record() for name in sorted(resolution.node_conditions)}


def labels(resolution: Resolution, manifest: dict) -> list[tuple[str, str]]:
    """The image's labels: the OCI ones, then the manifest's keys that a registry should show
    without a pull (schema.py declares which)."""
    stack = resolution.stack
    return [
        ("org.opencontainers.image.title", f"envbuild {resolution.tag}"),
        ("org.opencontainers.image.description",
         f"torch {stack.torch} (CUDA {stack.cuda}, Python {stack.python}) + DeepSpeed {stack.deepspeed} with pre-built "
         f"ops for {resolution.gpu.name} ({resolution.gpu.sm})"
         + "".join(f" + {e.name} {e.version}" for e in resolution.extensions)),
        ("org.opencontainers.image.version", resolution.tag),
        ("org.opencontainers.image.base.name", resolution.base_images["runtime"]),
        *schema.labels(manifest),
    ]


def manifest(ctx: Context, image_env: tuple[EnvVar, ...]) -> dict:
    """The resolved build; also copied into the image as /opt/envbuild/manifest.json."""
    resolution = ctx.resolution
    stack = resolution.stack
    return schema.ordered({
        "schema": 1,
        "envbuild": __version__,
        "tag": resolution.tag,
        "image": resolution.image_ref,
        "stack": stack.id,
        "python": stack.python,
        "cuda": stack.cuda,
        "torch": stack.torch,
        "torchvision": resolution.torchvision,
        "deepspeed": stack.deepspeed,
        "nccl": resolution.nccl,
        "gpu": resolution.gpu.name,
        "gpu_cc": resolution.gpu.cc,
        "torch_cuda_arch_list": resolution.arch_list,
        "ds_ops": resolution.ops,
        "ds_ops_dropped": [{"op": o, "reason": why} for o, why in resolution.dropped_ops],
        "arch": resolution.arch,
        "platform": resolution.platform,
        "cpu_target": resolution.cpu_target,
        "toolchain": stack.toolchain,
        "toolchain_kept": resolution.request.keep_toolchain,
        "runtime_compiler": resolution.request.keep_toolchain or not resolution.request.no_compiler,
        "constraints": paths.CONSTRAINTS,
        "lock": _lock_record(ctx),
        "dropped_requirements": [{"package": name, "required_by": "deepspeed",
                                  "reason": resolution.facts.ds_build_only[name]}
                                 for name in ctx.ds_build_only],
        "torch_index": resolution.torch_index,
        "env": {e.name: e.value for e in image_env},
        "env_reasons": [{"name": e.name, "value": e.value, "reason": e.reason, "source": e.source,
                         **({"cost": e.cost} if e.cost else {})} for e in image_env],
        "node_env": [{"name": d.name, "value": d.value, "when": d.node.model_dump(exclude_none=True),
                      "reason": d.reason, "source": d.source, "cost": d.cost} for d in resolution.node_env],
        "node_conditions": node_conditions(resolution),
        "driver": {"cuda": stack.cuda, "min_driver": resolution.driver.min_driver, "branch": resolution.driver.branch,
                   "forward_compat": resolution.facts.forward_compat, "source": resolution.driver.source},
        "base_images": dict(resolution.base_images),
        "base_pinning": base_pinning(resolution.base_images),
        "os_lock": _os_lock_record(resolution),
        "fabric": _fabric_manifest(resolution),
        "sass_audit": (None if ctx.toolchain_home is None else
                       resolution.facts.toolchain.audit_missing(stack.cuda_toolkit) or "cuobjdump"),
        # What `envbuild rebuild` re-renders from: the request as given, and the matrix it met.
        "request": request_record(resolution),
        "matrix": {"sha256": resolution.matrix_sha256},
        "extensions": [_extension_record(e, resolution) for e in resolution.extensions],
        **_nccl_override_record(resolution),
    })


def _extension_record(e, resolution: Resolution) -> dict:
    """One extension of the manifest: what it was compiled from (PyPI's sdist, or GitHub archives
    by their tar streams' sha256), its import names and where its build record and lock are."""
    return {"name": e.name, "version": e.version, "sdist_sha256": e.sdist.sha256 if e.sdist else None,
            **({"archives": [{"url": a.url, "tar_sha256": a.tar_sha256, "path": a.path} for a in e.archives]}
               if e.archives else {}),
            "packages": e.packages, "modules": e.modules, "op_libraries": e.op_libraries,
            "arch_list": resolution.arch_list,
            "gpu_check": e.gpu_check, "build_record": paths.EXTENSIONS_RECORD,
            **({"run_time_compile": {"enable_env": e.run_time_compile.enable_env,
                                     "cache_env": e.run_time_compile.cache_env}}
               if e.run_time_compile else {}),
            "lock": paths.EXTENSIONS_LOCK}


def _nccl_override_record(resolution: Resolution) -> dict:
    """--nccl: what replaced torch's pin, and where it is locked (a key only such images have)."""
    o = resolution.nccl_override
    if o is None:
        return {}
    return {"nccl_override": {"package": o.package, "version": o.version, "replaced": o.replaced,
                              "torch_requires": f"torch {resolution.stack.torch}'s Requires-Dist moved from "
                                                f"{o.package}=={o.replaced} to =={o.version} (steps/nccl.sh)",
                              "lock_section": "nccl", "wheels": [{"file": f, "sha256": h} for f, h in o.wheels],
                              "source": o.source}}


def _lock_record(ctx: Context) -> Optional[dict]:
    lock = ctx.lock
    if lock is None:
        return None
    sections = list(ctx.venv_sections)
    packages = {p.key for s in sections for p in lock.sections[s]}
    return {"path": paths.LOCK, "sha256": lock.sha256, "packages": len(packages),
            "sections": sections, "exclude_newer": lock.header.get("exclude-newer"),
            "index": lock.header.get("index"), "dropped": list(ctx.ds_build_only)}


def _os_lock_record(resolution: Resolution) -> dict:
    lock = resolution.os_lock
    if lock is None:
        return {"unlocked": resolution.os_unlocked}
    return {"path": paths.OS_LOCK, "sha256": lock.sha256, "snapshot": lock.snapshot, "packages": lock.packages(),
            "stages": list(resolution.os_locked), "unlocked": resolution.os_unlocked}


def request_record(resolution: Resolution) -> dict:
    """The request as plain data (tuples as lists), in one spelling: what re-renders the same
    image. Two spellings of one request (--gpu H20 or nvidia-h20, --ds-ops ' cpu_adam ') are one
    build, so they record the same: the GPU's and the fabric's names, the op list trimmed."""
    request = resolution.request
    canonical = replace(request, gpu=resolution.gpu.name,
                        nccl=resolution.nccl_override.version if resolution.nccl_override else None,
                        fabric=resolution.fabric.name if request.fabric and resolution.fabric else request.fabric,
                        ds_ops=",".join(word.strip() for word in request.ds_ops.split(",")))
    return {f.name: (list(map(list, v)) if f.name == "env" else list(v)) if isinstance(v := getattr(canonical, f.name), tuple)
            else v for f in fields(canonical) if f.name not in OPTIONAL_REQUEST or getattr(canonical, f.name) is not None}


def base_pinning(base_images: dict[str, str]) -> dict[str, str]:
    """How each stage's base is pinned: by digest, or by tag only and why (a tag moves).

    >>> base_pinning({"builder": "ubuntu:24.04@sha256:ab", "runtime": "local/debian:bookworm"})["runtime"][:12]
    'tag only: no'
    """
    return {stage: "digest" if "@sha256:" in ref else
            ("tag only: no registry digest is known for it on the machine that rendered it (an imported "
             "or never-pushed image, or a registry it could not reach; `envbuild lock --bases` or an OS lock "
             "records one where the registry answers)")
            for stage, ref in base_images.items()}


def _fabric_manifest(resolution: Resolution) -> Optional[dict]:
    """What the image promises about the network between nodes: the smoke test's `fabric` and
    `transport` checks and the start-up checks read it (envbuild/image/fabric.py)."""
    f = resolution.fabric
    if f is None:
        return None
    baked = {e.name: e.value for e in resolution.env if any(d.name == e.name and not d.node for d in f.env)}
    return {"name": f.name, "description": f.description, "provided_by": f.provided_by, "transport": f.transport,
            "net_env": dict(f.net_env), "libraries": list(f.libraries), "providers": list(f.providers),
            "net_plugins": list(f.net_plugins), "tools": list(f.tools), "env": baked,
            "device_drivers": list(f.device_drivers), "host_paths": list(f.host_paths),
            "verbs_prefix": f.verbs_prefix, "packages": fabric_packages(resolution),
            "files": [{"path": x.path, "sha256": x.sha256, "url": x.url} for x in f.files],
            "sources": [{"name": s.name, "version": s.version, "url": s.url, "tar_sha256": s.tar_sha256}
                        for s in (f.build.sources if f.build else ())]}
