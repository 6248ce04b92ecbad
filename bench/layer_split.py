"""The split venv (layers.sh: the nvidia-* wheels' libraries in four layers of their own)
against a single-layer image of the same content, in the same run:

1. pull time from the local registry (127.0.0.1:5000), each image pulled with none of its
   layers present, alternating, ROUNDS times;
2. the bytes two adjacent stacks of the production matrix share: the nvidia-* / cuda-toolkit
   wheels (name == version) both install, from the wheels' METADATA and sizes on PyPI (the
   layers hold exactly those wheels' files, so equal wheels give equal layers; sizes are the
   compressed wheel sizes, close to the compressed layer sizes).

    python bench/layer_split.py            # both parts (builds the CI stack; about 10 GB of disk)
    python bench/layer_split.py --shared   # part 2 only (PyPI, no Docker)
    python bench/layer_split.py --rounds=1 # one pull of each instead of two
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from common import DOCKER, build, docker, inspect, machine, table

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REGISTRY = "127.0.0.1:5000"
ROUNDS = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--rounds=")), "2"))


def _single_layer(split_image: str) -> str:
    """The same files as `split_image`, in one layer (FROM scratch, COPY --from the image)."""
    with tempfile.TemporaryDirectory() as context:
        Path(context, "Dockerfile").write_text(f"FROM {split_image} AS content\nFROM scratch\nCOPY --from=content / /\n")
        ref = split_image.rsplit(":", 1)[0] + ":single-layer"
        import subprocess

        subprocess.run([DOCKER, "build", "-q", "-t", ref, context], check=True, capture_output=True,
                       env={"DOCKER_BUILDKIT": "1", "PATH": "/usr/bin:/bin"})
    return ref


def _pull_seconds(ref: str) -> float:
    docker("image", "rm", "-f", ref, check=False)
    start = time.monotonic()
    docker("pull", "-q", ref, timeout=3600)
    return time.monotonic() - start


def pull_times() -> None:
    split, build_seconds = build("h20", "layers-split", "--ds-ops", "cpu_adam")
    single = _single_layer(split)
    refs = {}
    for name, ref in (("split", split), ("single", single)):
        remote = f"{REGISTRY}/envbuild-bench:{name}"
        docker("tag", ref, remote)
        docker("push", "-q", remote, timeout=3600)
        refs[name] = remote
    layers = {name: inspect(ref)["RootFS"]["Layers"] for name, ref in refs.items()}
    size = inspect(refs["split"])["Size"] / 1e9
    # No local copy of any layer may be left, or a pull finds it and takes no time: remove the
    # images by ID (every tag of them: envbuild's content tag too).
    ids = {inspect(ref)["Id"] for ref in (split, single, *refs.values())}
    docker("image", "rm", "-f", *ids, check=False)
    times: dict[str, list[float]] = {"split": [], "single": []}
    for _ in range(ROUNDS):
        for name in ("split", "single"):
            for other in refs.values():
                docker("image", "rm", "-f", other, check=False)
            docker("builder", "prune", "-f", check=False)  # BuildKit's cache holds the same layers
            times[name].append(_pull_seconds(refs[name]))
    for ref in refs.values():
        docker("image", "rm", "-f", ref, check=False)
    table(f"Pull from the local registry, split venv vs one layer — {machine()}",
          ["image", "layers", "size (GB)", *[f"pull {i + 1} (s)" for i in range(ROUNDS)], "best (s)"],
          [[name, len(layers[name]), f"{size:.2f}", *[f"{t:.0f}" for t in times[name]], f"{min(times[name]):.0f}"]
           for name in ("split", "single")])
    print(f"(CI stack build for the split image: {build_seconds:.0f} s)")


# ---------------------------------------------------------------- part 2: bytes shared


def _wheel_requirements(index, project: str, version: str, machine_tag: str, python: str) -> list[Requirement]:
    """Requires-Dist of the project's Linux wheel for `machine_tag` and Python, as read from PyPI."""
    from envbuild.refresh.pypi import DistFile  # noqa: F401  (the index's file type)

    cp = "cp" + python.replace(".", "")
    wheels = [f for f in index.files(project) if f.is_wheel and str(f.version) == version
              and any(machine_tag in p for p in f.platforms) and (cp in f.filename or "py3-none" in f.filename)]
    if not wheels:
        wheels = [f for f in index.files(project) if f.is_wheel and str(f.version) == version
                  and "none-any" in f.filename]
    if not wheels:
        return []
    meta = next(m for m in index.members(wheels[0]) if m.endswith(".dist-info/METADATA"))
    text = index.member(wheels[0], meta).decode()
    return [Requirement(line.removeprefix("Requires-Dist: ")) for line in text.splitlines()
            if line.startswith("Requires-Dist: ")]


def _cuda_wheels(index, torch: str, python: str) -> dict[str, tuple[str, int]]:
    """name -> (version, wheel bytes) of the nvidia-* and cuda-* wheels torch `torch` installs
    on Linux x86_64 for `python` (torch's pins, and the cuda-toolkit extras it names)."""
    env = {"platform_system": "Linux", "platform_machine": "x86_64", "sys_platform": "linux",
           "python_version": python, "extra": ""}
    out: dict[str, tuple[str, int]] = {}

    def add(req: Requirement, extra_env: dict) -> None:
        name = canonicalize_name(req.name)
        if not (name.startswith("nvidia-") or name.startswith("cuda-")):
            return
        if req.marker is not None and not req.marker.evaluate(extra_env):
            return
        candidates = sorted({f.version for f in index.files(name) if f.is_wheel and req.specifier.contains(f.version)})
        if not candidates:
            return
        version = str(candidates[-1])  # what pip picks for a pin like ==13.1.0.3.*
        files = [f for f in index.files(name) if f.is_wheel and f.version == Version(version)
                 and (any("x86_64" in p for p in f.platforms) or "none-any" in f.filename)]
        out[name] = (version, files[0].size if files else 0)
        if name == "cuda-toolkit":
            for sub in _wheel_requirements(index, name, version, "x86_64", python):
                for extra in req.extras:
                    add(sub, {**env, "extra": extra})

    for req in _wheel_requirements(index, "torch", torch, "x86_64", python):
        add(req, env)
    return out


def layer_of(name: str) -> str:
    """The layer layers.sh puts a wheel's files in (by the directory it installs under nvidia/)."""
    if "cudnn" in name:
        return "cudnn"
    if "nccl" in name or "nvshmem" in name:
        return "nccl"
    if "cusparselt" in name:
        return "other"
    return "venv" if name.startswith("cuda-") else "cuda"  # cuda-bindings & co. are Python packages


def shared_bytes() -> None:
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.refresh.pypi import PyPI

    m = load_matrix()
    index = PyPI(Path(tempfile.gettempdir()) / "envbuild-bench-pypi")
    rows = []
    stacks = [s for s in m.stacks if s.cuda == m.torch_release(s.torch).default_cuda]  # wheels on PyPI
    for first, second in zip(stacks, stacks[1:]):
        a, b = _cuda_wheels(index, first.torch, first.python), _cuda_wheels(index, second.torch, second.python)
        same = {n for n in a if n in b and a[n][0] == b[n][0]}
        shared, total = sum(a[n][1] for n in same), sum(b[n][1] for n in b)
        # A layer is shared only when every wheel in it is the same in both stacks.
        layers = {layer_of(n) for n in [*a, *b]} - {"venv"}
        same_layers = [layer for layer in sorted(layers)
                       if {n: a[n][0] for n in a if layer_of(n) == layer} == {n: b[n][0] for n in b if layer_of(n) == layer}]
        layer_bytes = sum(b[n][1] for n in b if layer_of(n) in same_layers)
        rows.append([f"{first.id} -> {second.id}", f"{total / 1e9:.2f}", f"{shared / 1e9:.2f}",
                     f"{100 * shared / total:.0f}%" if total else "-", " ".join(same_layers) or "none",
                     f"{layer_bytes / 1e9:.2f}"])
    table("CUDA wheels two adjacent stacks share (PyPI wheel sizes, compressed)",
          ["stacks (matrix order, PyPI default CUDA)", "CUDA wheels GB", "same wheels GB", "share",
           "identical layers", "shared layers GB"], rows)


if __name__ == "__main__":
    if "--shared" not in sys.argv:
        pull_times()
    shared_bytes()
