"""Render a resolved build into a build directory: Dockerfile, Singularity definitions,
manifest.json and every file they copy in.

One small primitive, :class:`Step`, is rendered both as a Docker ``RUN`` and as a line of
Singularity ``%post`` (the hpccm idea), so the two image formats run the same commands;
the commands themselves live in ``templates/files/setup.sh``. Output is deterministic and
written to a temporary directory that is moved into place only when complete.

Examples
--------
>>> from envbuild.matrix import load_matrix
>>> from envbuild.resolve import Request, resolve
>>> files = render_files(resolve(load_matrix(), Request(gpu="h20")))
>>> sorted(files)[:3]
['Dockerfile', 'Singularity.def', 'Singularity.standalone.def']
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2

from . import __version__, image as image_package
from .errors import EnvbuildError
from .image import paths as image_paths
from .resolve import Resolution
from .resources import templates_dir

SETUP = image_paths.SETUP
# Files from templates/files copied into the build directory under envbuild/.
BUILDER_FILES = ("setup.sh", "cc-wrapper.sh", "verify_ops.py")
IMAGE_FILES = ("env.sh", "entrypoint.sh", "smoke.py")
# The in-image package (envbuild/image), copied as envbuild/lib/envbuild_image/ and into the image
# next to IMAGE_FILES (/opt/envbuild/lib/envbuild_image).
IMAGE_LIB = f"lib/{image_paths.PACKAGE}"
IMAGE_PACKAGE_FILES = tuple(f"{IMAGE_LIB}/{name}" for name in image_package.modules())
EXECUTABLE = {"setup.sh", "cc-wrapper.sh", "entrypoint.sh"}


@dataclass(frozen=True)
class Step:
    """One build command: ``[ENV=...] bash setup.sh ARGS``, with the secrets it may read.

    Parameters
    ----------
    args:
        Arguments to ``setup.sh`` (the step name first).
    env:
        Inline environment for this command only (never persisted as ENV).
    secrets:
        BuildKit secret ids mounted for this command (files in /run/secrets).
    comment:
        Why the step exists, rendered above it.
    """

    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    secrets: tuple[str, ...] = ()
    comment: str = ""

    @property
    def command(self) -> str:
        return f"bash {SETUP} " + shlex.join(self.args)

    @property
    def env_words(self) -> list[str]:
        return [f"{k}={shlex.quote(v)}" for k, v in self.env]

    @property
    def shell(self) -> str:
        """The whole command on one line, as Singularity %post runs it."""
        return " ".join([*self.env_words, self.command])


PIP_SECRETS = ("ca_cert", "pip_index_url")
APT_SECRETS = ("ca_cert", "apt_mirror")


def _packages(names: list[str], python: str) -> list[str]:
    return [n.replace("{python}", python) for n in names]


@dataclass
class Recipe:
    """Everything the templates need, computed once from a Resolution."""

    r: Resolution
    builder_steps: list[Step]
    runtime_steps: list[Step]
    cuda_home: str | None
    labels: list[tuple[str, str]]
    manifest: dict

    @property
    def base_env(self):
        return [e for e in self.r.env if e.layer == "base"]

    @property
    def gpu_env(self):
        return [e for e in self.r.env if e.layer == "gpu"]


def recipe(r: Resolution) -> Recipe:
    m = r.matrix
    s, req = r.stack, r.request
    family = m.bases.families[s.os]
    python_pkg = family.python[s.python]
    caps = {n for o in r.ops for n in m.ops[o].needs}
    builder_pkgs = _packages(family.builder_packages, python_pkg)
    runtime_pkgs = _packages(family.runtime_packages, python_pkg)
    for cap in sorted(caps):
        builder_pkgs += family.capabilities[cap].get("builder", [])
        runtime_pkgs += family.capabilities[cap].get("runtime", [])
    toolchain = m.bases.toolchains[s.toolchain]
    cuda_home = toolchain.cuda_home if (s.toolchain != "pypi" or r.nvcc_reason) else None

    builder = [
        Step(("os", *builder_pkgs), secrets=APT_SECRETS,
             comment=f"{python_pkg} with headers and a host compiler for the DeepSpeed ops"),
        Step(("venv", f"/usr/bin/{python_pkg}"), comment="one virtual environment holds the whole stack"),
        Step(("torch", r.torch_index or "-", f"torch=={s.torch}", f"torchvision=={r.torchvision}"),
             secrets=(*PIP_SECRETS, "torch_index_url"),
             comment=f"torch first: DeepSpeed's ops compile against it (CUDA {s.cuda}"
                     f"{', ' + r.torch_index if r.torch_index else ', the PyPI default wheel'})"),
    ]
    if s.toolchain == "pypi" and r.nvcc_reason:
        builder.append(Step(("cuda-toolkit", s.cuda_toolkit), secrets=PIP_SECRETS,
                            comment=f"nvcc {s.cuda_toolkit} from PyPI, outside the venv ({r.nvcc_reason})"))
    ds_env = [("DS_ACCELERATOR", "cuda"), ("DS_BUILD_OPS", "0")]
    ds_env += [(f"DS_BUILD_{m.ops[o].env}", "1") for o in r.ops]
    ds_env += [("TORCH_CUDA_ARCH_LIST", r.arch_list), ("ENVBUILD_CPU_TARGET", req.cpu_target)]
    if cuda_home:
        ds_env.append(("CUDA_HOME", cuda_home))
    if req.keep_toolchain:
        ds_env.append(("ENVBUILD_KEEP_TOOLCHAIN", "1"))
    builder.append(Step(("deepspeed", f"deepspeed=={s.deepspeed}", *r.ops), env=tuple(ds_env),
                        secrets=PIP_SECRETS,
                        comment="DeepSpeed with its ops pre-built for the target arches; the build "
                                "fails unless DeepSpeed recorded every op for cuda"))
    runtime = [] if req.keep_toolchain else [
        Step(("os", *runtime_pkgs), secrets=APT_SECRETS,
             comment=f"{python_pkg} runtime only: no compiler, no headers"),
    ]
    labels = _labels(r)
    return Recipe(r, builder, runtime, cuda_home, labels, manifest(r))


def _labels(r: Resolution) -> list[tuple[str, str]]:
    s = r.stack
    return [
        ("org.opencontainers.image.title", f"envbuild {r.tag}"),
        ("org.opencontainers.image.description",
         f"torch {s.torch} (CUDA {s.cuda}, Python {s.python}) + DeepSpeed {s.deepspeed} with pre-built "
         f"ops for {r.gpu.name} ({r.gpu.sm})"),
        ("org.opencontainers.image.version", r.tag),
        ("org.opencontainers.image.base.name", r.base_images["runtime"]),
        ("io.envbuild.version", __version__),
        ("io.envbuild.stack", s.id),
        ("io.envbuild.gpu", r.gpu.name),
        ("io.envbuild.python", s.python),
        ("io.envbuild.cuda", s.cuda),
        ("io.envbuild.torch", s.torch),
        ("io.envbuild.torchvision", r.torchvision),
        ("io.envbuild.deepspeed", s.deepspeed),
        ("io.envbuild.ds-ops", ",".join(r.ops)),
        ("io.envbuild.torch-cuda-arch-list", r.arch_list),
        ("io.envbuild.cpu-target", r.request.cpu_target),
    ]


def manifest(r: Resolution) -> dict:
    """The resolved build; also copied into the image as /opt/envbuild/manifest.json."""
    s = r.stack
    return {
        "schema": 1,
        "envbuild": __version__,
        "tag": r.tag,
        "image": r.image_ref,
        "stack": s.id,
        "python": s.python,
        "cuda": s.cuda,
        "torch": s.torch,
        "torchvision": r.torchvision,
        "deepspeed": s.deepspeed,
        "nccl": r.nccl,
        "gpu": r.gpu.name,
        "gpu_cc": r.gpu.cc,
        "torch_cuda_arch_list": r.arch_list,
        "ds_ops": r.ops,
        "ds_ops_dropped": [{"op": o, "reason": why} for o, why in r.dropped_ops],
        "cpu_target": r.request.cpu_target,
        "toolchain": s.toolchain,
        "toolchain_kept": r.request.keep_toolchain,
        "torch_index": r.torch_index,
        "env": {e.name: e.value for e in r.env},
        "env_reasons": [{"name": e.name, "value": e.value, "reason": e.reason, "source": e.source}
                        for e in r.env],
        "base_images": dict(r.base_images),
    }


def _environment():
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = shlex.quote
    env.filters["dq"] = lambda v: json.dumps(str(v))
    env.filters["secret_mount"] = lambda sid: f"--mount=type=secret,id={sid}"
    env.filters["env_pair"] = lambda e: f"{e.name}={json.dumps(e.value)}"
    env.filters["label_pair"] = lambda kv: f"{kv[0]}={json.dumps(kv[1])}"
    return env


def render_files(r: Resolution) -> dict[str, bytes]:
    """All files of the build directory, path -> bytes. Pure and deterministic."""
    rec = recipe(r)
    env = _environment()
    ctx = {"r": r, "rec": rec, "version": __version__, "setup": SETUP,
           "builder_files": BUILDER_FILES, "image_files": IMAGE_FILES, "image_package_files": IMAGE_PACKAGE_FILES,
           "image_lib": IMAGE_LIB}
    files: dict[str, bytes] = {}
    for name, template in (("Dockerfile", "docker/Dockerfile.j2"),
                           ("Singularity.def", "singularity/Singularity.def.j2"),
                           ("Singularity.standalone.def", "singularity/Singularity.standalone.def.j2")):
        files[name] = env.get_template(template).render(**ctx).encode()
    files[".dockerignore"] = b"build.log\n*.sif\n"
    files["manifest.json"] = (json.dumps(rec.manifest, indent=2, sort_keys=False) + "\n").encode()
    src = templates_dir() / "files"
    for name in (*BUILDER_FILES, *IMAGE_FILES):
        files[f"envbuild/{name}"] = (src / name).read_bytes()
    for name in IMAGE_PACKAGE_FILES:
        files[f"envbuild/{name}"] = image_package.module_bytes(name.rsplit("/", 1)[1])
    return files


def _is_build_dir(path: Path) -> bool:
    """Only a directory envbuild rendered may be replaced by a re-render."""
    try:
        return "envbuild" in json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def write_build_dir(files: dict[str, bytes], out: Path) -> Path:
    """Write all files to `out` atomically: a sibling temp dir, then one rename.

    An existing `out` is replaced only when the new tree is complete, so a failure never
    leaves a half-written directory behind.
    """
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if out.exists() and not out.is_dir():
            raise EnvbuildError(f"output path {out} exists and is not a directory; choose another -o/--output.")
        if out.is_dir() and any(out.iterdir()) and not _is_build_dir(out):
            raise EnvbuildError(f"output path {out} is a non-empty directory that envbuild did not write (no "
                                f"envbuild manifest.json in it); refusing to replace it. Choose an empty or new "
                                f"directory with -o/--output.")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except EnvbuildError:
        raise
    except OSError as e:
        raise EnvbuildError(f"output path {out} cannot be written: {e.strerror} ({e.filename or parent}); "
                            f"choose a writable directory with -o/--output.") from None
    try:
        for rel, data in sorted(files.items()):
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            p.chmod(0o755 if Path(rel).name in EXECUTABLE else 0o644)
        tmp.chmod(0o755)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=parent))
            os.replace(out, old / "x")
        os.replace(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EnvbuildError(f"output path {out} cannot be written: {e.strerror}; "
                            f"choose a writable directory with -o/--output.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
