"""Merge derived facts into matrices/torch.yaml and deepspeed.yaml: derived fields are
replaced, curated fields kept, new torch minors appended; stacks that pinned a torch release
the refresh replaced by another patch of its minor follow it in stacks.yaml; then diff and
write atomically."""

from __future__ import annotations

import difflib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from packaging.version import InvalidVersion, Version

from envbuild.base.errors import EnvbuildError
from envbuild.refresh import layout
from envbuild.refresh.ds_history import DeepSpeedHistory
from envbuild.refresh.torch_facts import TRACK_FROM, TorchFacts

TORCH_DERIVED = ("torch", "python", "torchvision", "triton", "nccl", "manylinux", "default_cuda", "cuda_toolkit",
                 "default_arches", "cuda_platforms", "aarch64_arches", "cpp_extension_arches", "extension_lock")
TORCH_ROW_ORDER = TORCH_DERIVED + ("variants", "note", "source")
TORCH_TOP_ORDER = ("sources", "variant_index", "arch_lists", "releases")
NEW_ROW_NOTE = "new on PyPI: its other CUDA variants are not curated yet [U]"

DS_DERIVED = ("deepspeed", "torch", "gpu_free_install", "nvcc_free_install")
DS_TOP_ORDER = ("sources", "releases", "build_requires", "build_only", "ops", "presets", "aarch64")
OP_DERIVED = ("env", "kind", "since", "until", "cuda_extension_until")
OP_ORDER = OP_DERIVED + ("needs", "min_cc", "torch", "triton", "reason", "cuda", "cuda_reason", "note")
DERIVABLE_NEEDS = {"libaio", "cufile", "curand", "libcuda"}

TORCH_SOURCES = {
    "releases": "newest patch of every torch minor >= 2.4 that has a manylinux x86_64 wheel on PyPI [V]",
    "python": "cpXY tags of the manylinux x86_64 wheels, within Requires-Python, within the paired torchvision's "
              "tags and Requires-Python, and within the pinned triton's tags where the pin's marker applies [V]",
    "torchvision": "newest torchvision whose METADATA requires a torch (== or >=) that admits the release [V]",
    "triton": "Requires-Dist triton of the Linux x86_64 wheel's METADATA, as written [V]",
    "nccl": "Requires-Dist nvidia-nccl-cu1X pin of the Linux x86_64 wheel [V]",
    "manylinux": "platform tag of the x86_64 wheel [V]",
    "default_cuda": "`cuda` in torch/version.py of the x86_64 wheel [V]",
    "cuda_toolkit": "Requires-Dist cuda-toolkit[...] pin, when the wheel has one (from 2.11) [V]",
    "default_arches": "arch-flags string in torch/lib/libtorch_python.so of the x86_64 wheel, read by range "
                      "requests until found (sm_XY -> X.Y, compute_XY -> X.Y+PTX) [V]",
    "cuda_platforms": "machines whose PyPI wheel's torch/version.py names a CUDA version [V]",
    "aarch64_arches": "arch-flags string in the aarch64 wheel's torch/lib/libtorch_python.so [V]",
    "cpp_extension_arches": "`supported_arches` of _get_cuda_arch_flags in torch/utils/cpp_extension.py [V]",
    "extension_lock": "what _jit_compile in torch/utils/cpp_extension.py locks with: FileBaton, a lock file whose "
                      "existence blocks (filebaton), or FileLock, an flock (flock) [V]",
    "source": "per release: the wheels and members its derived fields were read from",
}
# keys of older hand-written `sources` that the per-field entries above replace
TORCH_SUPERSEDED = {"derived", "pins", "arches_default", "patch_versions"}

DS_SOURCES = {
    "releases": "the releases listed are curated; their fields are read from each PyPI sdist [V]",
    "torch": "the torch requirement in requirements/requirements.txt ('' = unversioned) [V]",
    "gpu_free_install": "static analysis of the sdist: no module that setup.py imports calls, at import time, a "
                        "CUDA_Accelerator method reaching torch.cuda.get_device_capability() & co. without an "
                        "is_available() early return (DS_ACCELERATOR=cuda, no GPU) [V]",
    "nvcc_free_install": "static analysis of the sdist: setup.py, run with DS_ACCELERATOR=cuda, calls no op_builder "
                         "function that runs nvcc outside a try that catches MissingCUDAException [V]",
    "ops": "op_builder/*.py builder classes DeepSpeed's CUDA accelerator collects (NAME, BUILD_VAR -> env) [V]",
    "kind": "the sdist's op_builder/*.py: cpu: an OpBuilder, TorchCPUOpBuilder or CPUOpBuilder (host compiler); "
            "cuda: any other CUDAOpBuilder; as of the newest release that has the op [V]",
    "since_until": "first PyPI release (final, with an sdist) that has / no longer has the op, bisected from the "
                   "tracked releases [V]",
    "cuda_extension_until": "first release whose sdist's builder of a cpu op is no longer a CUDAOpBuilder; before "
                            "it, a CUDA toolkit present at build time makes it a CUDA extension linking cudart [V]",
    "needs": "libaio and cufile from the has_function() link tests of the sdist's builder and its op_builder "
             "bases, curand and libcuda from '-lcurand' and '-lcuda' in their extra_ldflags() [V]; other needs curated "
             "(each op's reason names its source)",
    "curated": "min_cc, triton, torch, reason, cuda, cuda_reason, note and the needs above are kept as written; each names its "
               "source in the sdist (op_builder/*.py) or a public thread",
}
DS_SUPERSEDED = {"torch_floor", "no_gpu_build"}

TORCH_HEADER = """\
# PyTorch releases: what each release supports. The resolver's torch<->CUDA,
# torch<->Python and GPU<->torch rules read this file and nothing else.
# Every field except `variants` and `note` is derived from the PyPI artifacts by
# `envbuild matrix refresh` (see `sources`); `variants` is curated (PyTorch's own index is
# not reachable from the builders that derive the rest). This layout is generated.
"""
TORCH_COMMENTS = {
    "arch_lists": 'Named arch lists of the non-default CUDA variants (curated); "default" in `variants`\n'
                  "means the PyPI wheel's own `default_arches`.",
}
DS_HEADER = """\
# DeepSpeed releases and op build rules. The op rules (envbuild/knowledge/rules/deepspeed_ops.py)
# read this file only. `envbuild matrix refresh` derives every release field and the ops'
# env/kind/since/until/cuda_extension_until (and libaio/cufile needs) from the PyPI sdists
# (see `sources`); the list of releases, build_requires, min_cc, triton rules, torch,
# reasons, notes and other needs are curated. This layout is generated.
"""
DS_COMMENTS = {
    "releases": "gpu_free_install: setup.py (which imports the package) and `import deepspeed` work with\n"
                "DS_ACCELERATOR=cuda on a builder without a GPU (0.16.4-0.17.4 call\n"
                "torch.cuda.get_device_capability() at import, so `pip install` fails in egg_info).\n"
                "nvcc_free_install: setup.py needs no nvcc when only CPU ops are pre-built (before 0.19.8\n"
                "it runs `nvcc -V` under DS_ACCELERATOR=cuda).",
    "build_requires": "setup.py imports these before pip resolves anything when it runs with\n"
                      "--no-build-isolation (how ops are pre-built), so the build installs them first; ninja\n"
                      "compiles the ops in parallel; setuptools builds the sdist; pip is the installer. The\n"
                      "lock (envbuild lock) resolves them with the stack, so their versions are locked too.",
    "build_only": "what the build needs and the final image drops, and why: DeepSpeed declares ninja only\n"
                  "to JIT-compile ops; the image drops ninja and DeepSpeed's Requires-Dist of it (recorded in\n"
                  "manifest.json), so nothing can JIT and `pip check` stays true.",
    "ops": "kind: cpu ops compile with the host compiler only; cuda ops need nvcc.\n"
           "needs: a capability the build must provide (see bases.yaml `provides`).",
    "presets": "`all` is not listed: it is computed (every op the stack and GPU allow).",
    "aarch64": "aarch64 (Grace, GB10): read from the sdists of every release above. No source file of an op\n"
               "that DeepSpeed's CUDA accelerator collects includes an x86-only header outside an x86/AVX\n"
               "guard; the one that does (csrc/cpu/comm's shm, DS#5640) is the CPU accelerator's comm op,\n"
               "which no preset builds. The x86 parts are compile flags: op_builder/builder.py cpu_arch()\n"
               "(-march=native) and simd_width() (-D__AVX512__/-D__AVX256__ on x86; -D__NEON__ or -D__SVE__ on\n"
               "ARM from 0.19.7, -D__SCALAR__ before), which cc-wrapper.sh rewrites to the declared CPU target.",
}


@dataclass
class FileChange:
    path: Path
    old: str
    new: str

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def diff(self, label: str) -> str:
        return unified_diff(self.old, self.new, label)


def unified_diff(old: str, new: str, label: str, context: int = 3) -> str:
    """difflib's unified format without its "popular line" heuristic (autojunk), which in a
    matrix file of repeated lines reports unchanged lines as changed."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    out = [f"--- a/{label}\n", f"+++ b/{label}\n"]
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        out.append(f"@@ -{_span(i1, i2)} +{_span(j1, j2)} @@\n")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + line for line in a[a1:a2]]
                continue
            out += ["-" + line for line in a[a1:a2]]
            out += ["+" + line for line in b[b1:b2]]
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in out)


def _span(start: int, stop: int) -> str:
    length = stop - start
    first = start + 1 if length else start
    return f"{first}" if length == 1 else f"{first},{length}"


def read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise EnvbuildError(f"matrix file {path} cannot be read: {e.strerror}.") from None


def load(path: Path) -> tuple[str, dict]:
    text = read(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EnvbuildError(f"matrix file {path} is not valid YAML ({e}); fix it before refreshing.") from None
    if not isinstance(data, dict) or not isinstance(data.get("releases"), list):
        raise EnvbuildError(f"matrix file {path} has no `releases` list; it is not a matrix file.")
    return text, data


def _ordered(row: dict, order: tuple[str, ...]) -> dict:
    return {**{k: row[k] for k in order if k in row}, **{k: v for k, v in row.items() if k not in order}}


def _top(data: dict, order: tuple[str, ...]) -> dict:
    return _ordered(data, order)


def _minor(version: str) -> tuple[int, int]:
    try:
        v = Version(str(version))
    except InvalidVersion:
        raise EnvbuildError(f"torch.yaml: release {version!r} is not a version.") from None
    return v.major, v.minor


def merge_torch(data: dict, derived: list[TorchFacts], path: Path) -> dict:
    """Derived fields replaced, curated kept, new minors appended (with their PyPI wheel's own
    CUDA as the one variant known), rows ordered by version."""
    by_minor = {_minor(f.fields["torch"]): f for f in derived}
    rows = []
    seen = set()
    for row in data["releases"]:
        if not isinstance(row, dict) or "torch" not in row:
            raise EnvbuildError(f"{path}: a release row has no `torch` field: {row!r}.")
        minor = _minor(row["torch"])
        if minor in seen:
            raise EnvbuildError(f"{path}: two rows for torch {minor[0]}.{minor[1]}; keep one per minor.")
        seen.add(minor)
        if minor not in by_minor:
            if Version(str(row["torch"])) >= TRACK_FROM:
                raise EnvbuildError(
                    f"{path}: torch {row['torch']} is in the matrix but PyPI lists no {minor[0]}.{minor[1]}.x release "
                    f"with a manylinux x86_64 wheel; the release list lost a minor (nearest on PyPI: "
                    f"{', '.join(f.fields['torch'] for f in derived[-3:])}).")
            rows.append(row)
            continue
        facts = by_minor[minor]
        curated = {k: v for k, v in row.items() if k not in TORCH_DERIVED and k != "source"}
        rows.append(_ordered({**curated, **facts.fields, "source": "; ".join(facts.sources)}, TORCH_ROW_ORDER))
    for minor, facts in sorted(by_minor.items()):
        if minor not in seen:
            # the PyPI wheel's own CUDA is a variant (the loader needs `variants` and requires it)
            own_variant = {facts.fields["default_cuda"]: "default"}
            rows.append(_ordered({**facts.fields, "variants": own_variant, "note": NEW_ROW_NOTE,
                                  "source": "; ".join(facts.sources)}, TORCH_ROW_ORDER))
    rows.sort(key=lambda r: Version(str(r["torch"])))
    sources = {k: v for k, v in (data.get("sources") or {}).items() if k not in TORCH_SUPERSEDED | set(TORCH_SOURCES)}
    return _top({**data, "sources": {**TORCH_SOURCES, **sources}, "releases": rows}, TORCH_TOP_ORDER)


def merge_deepspeed(data: dict, history: DeepSpeedHistory, path: Path) -> dict:
    """Release rows and the ops table refreshed; the release list and curated op fields kept."""
    rows = []
    for row in data["releases"]:
        version = str(row.get("deepspeed"))
        facts = history.releases[version]
        curated = {k: v for k, v in row.items() if k not in DS_DERIVED and k != "source"}
        source = f"{history.sdists[version]} (requirements/requirements.txt, setup.py, op_builder/, accelerator/)"
        if facts.gpu_hazard:
            source += f"; not GPU-free: {facts.gpu_hazard}"
        if facts.nvcc_call:
            source += f"; needs nvcc: {facts.nvcc_call}"
        rows.append(_ordered({**curated, "deepspeed": version, "torch": facts.torch,
                              "gpu_free_install": facts.gpu_free_install,
                              "nvcc_free_install": facts.nvcc_free_install, "source": source},
                             DS_DERIVED + ("source",)))
    old_ops = data.get("ops") or {}
    missing = sorted(set(old_ops) - set(history.ops))
    if missing:
        raise EnvbuildError(f"{path}: ops {', '.join(missing)} are in the matrix but in none of the releases read "
                            f"({', '.join(history.releases)}); the op_builder layout changed or the op was renamed.")
    ops = {}
    for name in [*old_ops, *sorted(set(history.ops) - set(old_ops))]:
        op = history.ops[name]
        curated = {k: v for k, v in (old_ops.get(name) or {}).items() if k not in OP_DERIVED}
        old_needs = list(curated.pop("needs", []))
        needs = sorted(set(op.facts.needs) | {n for n in old_needs if n not in DERIVABLE_NEEDS})
        if set(needs) == set(old_needs):
            needs = old_needs  # same set: keep the curated order
        entry = {**curated, "env": op.facts.env, "kind": op.facts.kind, "since": op.since}
        if op.until:
            entry["until"] = op.until
        if op.cuda_extension_until:
            entry["cuda_extension_until"] = op.cuda_extension_until
        if needs:
            entry["needs"] = needs
        ops[name] = _ordered(entry, OP_ORDER)
    sources = {k: v for k, v in (data.get("sources") or {}).items() if k not in DS_SUPERSEDED | set(DS_SOURCES)}
    return _top({**data, "sources": {**DS_SOURCES, **sources}, "releases": rows, "ops": ops}, DS_TOP_ORDER)


@dataclass(frozen=True)
class PinMove:
    """One stack's pin moved because the torch release it named was replaced."""

    stack: str
    field: str
    old: str
    new: str

    def __str__(self) -> str:
        return f"stack {self.stack}: {self.field} {self.old} -> {self.new}"


def replaced_releases(old: dict, new: dict) -> dict[str, tuple[dict, dict]]:
    """{old version: (old row, new row)} of every torch row the merge replaced by another
    patch of the same minor (a new patch on PyPI, or a yanked one gone)."""
    new_by_minor = {_minor(row["torch"]): row for row in new["releases"]}
    replaced = {}
    for row in old["releases"]:
        successor = new_by_minor.get(_minor(row["torch"]))
        if successor is not None and str(successor["torch"]) != str(row["torch"]):
            replaced[str(row["torch"])] = (row, successor)
    return replaced


def move_stack_pins(text: str, old_torch: dict, new_torch: dict, path: Path) -> tuple[str, list[PinMove]]:
    """stacks.yaml with every stack that pinned a replaced torch release moved to its
    successor, so the refreshed matrix still loads. Also its `cuda_toolkit`, where it was the
    old release's own cuda-toolkit pin (the toolchain rule wants the release's). Only those
    scalars are rewritten, in their own quoting, so comments and layout stay byte for byte.
    A pin that names no replaced release is left as is: the loader reports what is wrong."""
    replaced = replaced_releases(old_torch, new_torch)
    if not replaced:
        return text, []
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise EnvbuildError(f"matrix file {path} is not valid YAML ({e}); fix it before refreshing.") from None
    stacks = None
    if isinstance(root, yaml.MappingNode):
        stacks = next((value for key, value in root.value if key.value == "stacks"), None)
    if not isinstance(stacks, yaml.SequenceNode):
        raise EnvbuildError(f"matrix file {path} has no `stacks` list; it is not a stacks file.")
    edits: list[tuple[yaml.ScalarNode, str]] = []
    moves = []
    for number, row in enumerate(stacks.value):
        if not isinstance(row, yaml.MappingNode):
            continue
        fields = {key.value: value for key, value in row.value
                  if isinstance(key, yaml.ScalarNode) and isinstance(value, yaml.ScalarNode)}
        pin = fields.get("torch")
        if pin is None or pin.value not in replaced:
            continue
        before, after = replaced[pin.value]
        name = fields["id"].value if "id" in fields else f"stacks[{number}]"
        edits.append((pin, str(after["torch"])))
        moves.append(PinMove(name, "torch", pin.value, str(after["torch"])))
        toolkit, cuda = fields.get("cuda_toolkit"), fields.get("cuda")
        old_toolkit, new_toolkit = before.get("cuda_toolkit"), after.get("cuda_toolkit")
        if (toolkit is not None and old_toolkit and new_toolkit and toolkit.value == str(old_toolkit)
                and str(new_toolkit) != toolkit.value and cuda is not None
                and cuda.value == str(after.get("default_cuda"))):
            edits.append((toolkit, str(new_toolkit)))
            moves.append(PinMove(name, "cuda_toolkit", toolkit.value, str(new_toolkit)))
    for node, value in sorted(edits, key=lambda edit: edit[0].start_mark.index, reverse=True):
        text = text[:node.start_mark.index] + _requoted(node, value) + text[node.end_mark.index:]
    return text, moves


def _requoted(node: yaml.ScalarNode, value: str) -> str:
    """`value` in the quoting the scalar it replaces was written in."""
    if node.style == '"':
        return f'"{value}"'
    if node.style == "'":
        return f"'{value}'"
    return value if yaml.safe_load(value) == value else layout.scalar(value)


def render_torch(data: dict) -> str:
    return layout.dump(data, TORCH_HEADER, TORCH_COMMENTS)


def render_deepspeed(data: dict) -> str:
    return layout.dump(data, DS_HEADER, DS_COMMENTS)


def write_all(changes: list[FileChange]) -> None:
    """Write every changed file or none: all temporary files first, then the renames."""
    staged = []
    try:
        for change in changes:
            if not change.changed:
                continue
            fd, tmp = tempfile.mkstemp(prefix=f".{change.path.name}.", dir=change.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(change.new)
            os.chmod(tmp, 0o644)
            staged.append((tmp, change.path))
    except OSError as e:
        for tmp, _ in staged:
            os.unlink(tmp)
        raise EnvbuildError(f"cannot write the refreshed matrix: {e}.") from None
    for tmp, target in staged:
        os.replace(tmp, target)


def summary(old: dict, new: dict, key: str) -> list[str]:
    """'torch 2.5.1: python >=3.9,<3.14 -> >=3.9,<3.13' lines, field by field."""
    lines = []
    old_rows = {str(r.get(key)): r for r in old.get("releases", [])}
    for row in new.get("releases", []):
        name = str(row.get(key))
        before = old_rows.get(name)
        if before is None:
            prior = next((r for r in old.get("releases", []) if key == "torch"
                          and _minor(r["torch"]) == _minor(row["torch"])), None)
            if prior is None:
                lines.append(f"{key} {name}: new release")
                continue
            lines.append(f"{key} {prior[key]} -> {name}")
            before = prior
        for field_name, value in row.items():
            if field_name != "source" and before.get(field_name) != value:
                lines.append(f"{key} {name}: {field_name} {_short(before.get(field_name))} -> {_short(value)}")
    for name, entry in (new.get("ops") or {}).items():
        before = (old.get("ops") or {}).get(name)
        if before is None:
            lines.append(f"op {name}: new")
            continue
        for field_name, value in entry.items():
            if before.get(field_name) != value:
                lines.append(f"op {name}: {field_name} {_short(before.get(field_name))} -> {_short(value)}")
    return lines


def _short(value) -> str:
    return "(none)" if value is None else layout.flow(value)
