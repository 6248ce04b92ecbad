"""The manifest's schema: every key of /opt/envbuild/manifest.json in its order, what it holds,
and the image label that carries it where a registry should show it without a pull. The
manifest is made to this list (record.py refuses a key it does not declare), the labels are
derived from it, and docs/manifest.md is generated from it (`python -m envbuild.reference
docs/manifest.md`): one declaration, three uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

LABEL_PREFIX = "io.envbuild."


def _digest(record: Optional[dict]) -> str:
    return f"sha256:{record['sha256']}" if record and record.get("sha256") else "none"


@dataclass(frozen=True)
class Key:
    """One manifest key: its meaning, and (label) the io.envbuild.<label> that shows it."""

    name: str
    doc: str
    label: str = ""
    show: Optional[Callable[[Any], Optional[str]]] = None  # the label's text (None: no label for this value)
    optional: bool = False  # only in the manifests of images that have it (the golden renders stay as they were)

    def label_value(self, value: Any) -> Optional[str]:
        return self.show(value) if self.show else (None if value is None else str(value))


MANIFEST = (
    Key("schema", "the manifest format's version: 1"),
    Key("envbuild", "the envbuild version that rendered the image", "version"),
    Key("tag", "the image's tag: the stack, GPU and every non-default choice, readable"),
    Key("image", "the image reference the build tagged (repository:tag)"),
    Key("stack", "the stack's id in matrices/stacks.yaml", "stack"),
    Key("python", "the Python version (major.minor)", "python"),
    Key("cuda", "the CUDA version torch was built for", "cuda"),
    Key("torch", "the torch version", "torch"),
    Key("torchvision", "the torchvision version that goes with it", "torchvision"),
    Key("deepspeed", "the DeepSpeed version", "deepspeed"),
    Key("nccl", "the NCCL version the image installs: torch's wheel's pin, or the --nccl release (the smoke test "
                "checks the one loaded)"),
    Key("nccl_override", "only with --nccl: the NCCL wheel installed in place of torch's pin (package, version, the "
                         "pin it replaced, the lock section and its source)", "nccl-override",
        lambda o: f"{o['package']}=={o['version']} (torch pins {o['replaced']})", optional=True),
    Key("gpu", "the GPU profile the image is for (matrices/gpus.yaml)", "gpu"),
    Key("gpu_cc", "the GPU's compute capability"),
    Key("torch_cuda_arch_list", "the arches the ops and extensions were compiled for (TORCH_CUDA_ARCH_LIST)",
        "torch-cuda-arch-list"),
    Key("ds_ops", "the DeepSpeed ops pre-built (nothing JIT-compiles at run time)", "ds-ops", ",".join),
    Key("ds_ops_dropped", "ops the request named that this stack or GPU cannot build, each with the reason"),
    Key("arch", "the CPU architecture (x86_64, aarch64)"),
    Key("platform", "the OCI platform (linux/amd64, linux/arm64)"),
    Key("cpu_target", "what the host-compiled ops were built for (-march)", "cpu-target"),
    Key("toolchain", "where nvcc came from: the builder base image or PyPI's CUDA wheels"),
    Key("toolchain_kept", "true when the final image keeps the compilers (--keep-toolchain)"),
    Key("runtime_compiler", "true when the image has a C compiler for torch.compile"),
    Key("constraints", "the guard file pip and uv read (PIP_CONSTRAINT): what the ops were compiled against"),
    Key("lock", "the stack's Python lock in the image: path, sha256, packages, the sections the venv installed ([venv], and [curand] for the ops that link it), as-of date, index", "lock", _digest),
    Key("dropped_requirements", "build-only requirements the final image drops (ninja), each with the reason"),
    Key("torch_index", "the index torch came from, where not PyPI"),
    Key("env", "the image's environment: every baked variable and its value"),
    Key("env_reasons", "each baked variable with what makes it right, what it costs and its source"),
    Key("node_env", "the defaults decided on the node at start-up, each with its condition and reason"),
    Key("node_conditions", "the node conditions node_env names, as matrices/fabrics.yaml declares them: which RDMA "
                           "devices each counts (any, or by kernel driver and link layer), its label and meaning"),
    Key("driver", "the oldest NVIDIA driver the image runs on, its branch and source", "min-driver",
        lambda d: d["min_driver"]),
    Key("base_images", "the builder and runtime base images (by digest where known)"),
    Key("base_pinning", "how each base is pinned: by digest, or by tag only and why"),
    Key("os_lock", "the OS lock in the image (every Debian/Ubuntu package, by version and sha256), or why none",
        "os-lock", _digest),
    Key("fabric", "the network between nodes: what the image carries and what NCCL must pick", "fabric",
        lambda f: f["name"] if f else "none"),
    Key("sass_audit", "how the compiled code was checked for SASS of every arch (cuobjdump), or why not"),
    Key("request", "the request as given, in one spelling: what `envbuild rebuild` re-renders from"),
    Key("matrix", "the sha256 of the matrix the request met"),
    Key("extensions", "the CUDA extensions compiled in (--ext), each with its sdist's sha256 and GPU check",
        "extensions", lambda exts: ",".join(f"{e['name']}=={e['version']}" for e in exts) or None),
)


def ordered(values: dict) -> dict:
    """`values` in the schema's order; a key the schema does not declare (or one it misses) is a bug here."""
    names = [k.name for k in MANIFEST]
    required = {k.name for k in MANIFEST if not k.optional}
    if not required <= set(values) <= set(names):
        raise AssertionError(f"manifest keys differ from the schema: {sorted((set(values) ^ required) - (set(names) - required))}")
    return {name: values[name] for name in names if name in values}


def labels(manifest: dict) -> list[tuple[str, str]]:
    """The io.envbuild.* labels of a manifest, in the schema's order (a label with no value is left out)."""
    out = []
    for key in MANIFEST:
        if key.label and key.name in manifest and (text := key.label_value(manifest[key.name])) is not None:
            out.append((LABEL_PREFIX + key.label, text))
    return out


def reference() -> str:
    """docs/manifest.md."""
    lines = ["# The image's manifest", "",
             "<!-- Generated by `python -m envbuild.reference docs/manifest.md` from envbuild/plan/schema.py. -->", "",
             "Every image carries `/opt/envbuild/manifest.json` (also in the build directory as `manifest.json`):",
             "what it was built from and promises. The smoke test checks the image against it, `envbuild rebuild`",
             "re-renders from it, `envbuild verify` and the SBOM read it. The keys, in their order (a render adds",
             "`render`, the sha256 of every other file of the build directory; an image made by `envbuild extend`",
             "adds `extend`, what it added to the stack image); a key with a label is also shown as that image",
             "label, readable in a registry without a pull:", "",
             "| key | what it holds | label |", "| --- | --- | --- |"]
    lines += [f"| `{k.name}` | {k.doc} | {f'`{LABEL_PREFIX}{k.label}`' if k.label else ''} |" for k in MANIFEST]
    return "\n".join(lines) + "\n"
