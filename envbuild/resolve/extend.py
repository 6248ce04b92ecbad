"""`envbuild extend`: a researcher's own packages as one layer on top of a stack image.

The user's requirements are resolved by uv *before anything is built*, with the stack's lock
as constraints, so nothing the stack installed can move (torch, the pre-built DeepSpeed, numpy,
...). A conflict is one paragraph: uv's derivation, what the stack pins, and the stacks of the
matrix where the requirements would fit. Success is a layer lock (the new packages only,
each == with its hashes) and a build directory whose Dockerfile / Singularity.def start FROM
the stack image (by digest when this machine knows it), install the lock with hash checking,
run `pip check`, and import each top-level package, recording what it imported in
manifest.json. Every heavy layer is the stack image's. This module resolves; the image is a
build plan like any other (:func:`envbuild.plan.layer_plan`).

>>> read_requirements("einops\\n# a comment\\nsafetensors>=0.4  # inline\\n", "req.txt")
['einops', 'safetensors>=0.4']
>>> read_requirements("git+https://github.com/x/y", "req.txt")
Traceback (most recent call last):
envbuild.base.errors.EnvbuildError: req.txt:1: 'git+https://github.com/x/y' is a VCS URL or a path. envbuild extend installs from an index with hashes only, so a source it cannot hash is refused: publish the package to an index (or a wheel on a file server you list with --pip-index-url), then name it as 'name==version'.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from pydantic import ConfigDict, ValidationError, create_model

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError
from envbuild.base.files import parse_yaml, read_text
from envbuild.knowledge import rules
from envbuild.knowledge.lock import Lock, parse_lock
from envbuild.knowledge.matrix import Matrix
from envbuild.knowledge.request import flags
from envbuild.oci.registry import CONTENT_TAG_DIGITS, split_reference
from envbuild.resolve.locking import LockInputs, ResolveFailed, compile_requirements, today
from envbuild.resolve.resolver import Resolution, resolve

EXTEND_LOCK_SOURCE = "envbuild/extend-lock.txt"  # the name parse errors of a layer lock give


# envbuild.yaml: what a lab commits to get its environment (the CLI's options win). Its request
# keys are the options' names (ds_ops, ext), each a string as the command line gives it; then its
# own: the layer's name, its requirements (strings, or a requirements file beside envbuild.yaml)
# and the stack image to start from (default: the stack's own reference).
Project = create_model("Project", __config__=ConfigDict(extra="forbid"),
                       **{flag.key: (Optional[str], None) for flag in flags().values() if flag.project},
                       name=(Optional[str], None), requirements=(Union[list[str], str], []),
                       image=(Optional[str], None))


def load_project(path: Path) -> tuple[Project, list[str], str]:
    """(project, its requirements, where they came from)."""
    text = read_text(path, "-f", "project")
    try:
        data = parse_yaml(text, f"-f {path}") or {}
    except EnvbuildError as e:
        raise EnvbuildError(f"{e.message} A project file looks like: `gpu: h100` and `requirements: [accelerate, "
                            f"einops]` on lines of their own.") from None
    try:
        project = Project.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise EnvbuildError(f"-f {path}: {where}: {first['msg']}. Known keys: "
                            f"{', '.join(Project.model_fields)}.") from None
    if isinstance(project.requirements, str):
        req_path = _beside(path, project.requirements)
        return project, read_requirements_file(req_path), str(req_path)
    return project, read_requirements("\n".join(project.requirements), str(path)), str(path)


def _beside(project_file: Path, name: str) -> Path:
    """The requirements file a project file names: a path inside the project file's directory
    (symlinks followed), never `/etc/...` or `../../` out of it: a project file comes from a
    repository someone else may have written, and what it names is read and shown in messages."""
    home = project_file.parent.resolve()
    if "\0" in name:  # no file has one; os.stat's ValueError would be exit 70
        raise EnvbuildError(f"-f {grammar.escaped(str(project_file))}: requirements {grammar.shown(name)} holds a NUL "
                            f"byte, which no file name can; name a file beside envbuild.yaml, such as requirements.txt.")
    target = (home / name).resolve()
    if Path(name).is_absolute() or not target.is_relative_to(home):
        raise EnvbuildError(f"-f {grammar.escaped(str(project_file))}: requirements {grammar.shown(name)} is outside "
                            f"the project file's directory ({grammar.escaped(str(home))}); name a file beside "
                            f"envbuild.yaml or below it, such as requirements: requirements.txt.")
    return home / name


def read_requirements_file(path: Path) -> "Requirements":
    return read_requirements(read_text(path, "-r", "requirements"), str(path))


class Requirements(list):
    """Requirement strings, and the ``--hash`` values a hash-pinned file gave for each
    package (canonical name -> sha256s): the resolved files must be among them."""

    def __init__(self, items=(), hashes=None):
        super().__init__(items)
        self.hashes: dict[str, set[str]] = dict(hashes or {})


_HASH = re.compile(r"\s+--hash[=\s]\s*sha256:([0-9a-f]{64})\b", re.I)


def _logical_lines(text: str):
    """(first line number, text) with comments dropped and ``\\`` continuations joined, as pip
    reads a requirements file (the format pip-compile and uv pip compile write)."""
    start, parts = None, []
    for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        line = "" if raw.lstrip().startswith("#") else raw.split(" #", 1)[0]
        start = start or number
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(p.strip() for p in parts).strip()
        start, parts = None, []
    if parts:
        yield start, " ".join(p.strip() for p in parts).strip()


_UNHASHABLE = re.compile(r"^(-e\b|--editable\b|\.{0,2}/|~|file:|[a-z+]+://|git\+|hg\+|svn\+|bzr\+)", re.I)


def read_requirements(text: str, where: str) -> Requirements:
    """The requirement strings of a requirements file; what cannot be hash-locked is refused.
    pip's format as pip-compile writes it is read: continuations, ``--hash`` per requirement
    (kept, and checked against what uv resolves), a byte-order mark."""
    out = Requirements()
    for number, line in _logical_lines(text):
        if not line:
            continue
        hashes = {h.lower() for h in _HASH.findall(" " + line)}
        if hashes:
            line = _HASH.sub("", " " + line).strip()
        if _UNHASHABLE.match(line) or " @ " in line or line.startswith("@"):
            raise EnvbuildError(f"{where}:{number}: {line!r} is a VCS URL or a path. envbuild extend installs from "
                                f"an index with hashes only, so a source it cannot hash is refused: publish the "
                                f"package to an index (or a wheel on a file server you list with --pip-index-url), "
                                f"then name it as 'name==version'.")
        if line.startswith("-"):
            raise EnvbuildError(f"{where}:{number}: {line!r}: pip options are not taken here; index mirrors are "
                                f"--pip-index-url (a build secret), constraints come from the stack's lock.")
        if " --" in line or " -" in line.split(";")[0]:
            raise EnvbuildError(f"{where}:{number}: {line!r}: the only per-requirement option taken is "
                                f"--hash=sha256:...; drop the others (index mirrors are --pip-index-url).")
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            raise EnvbuildError(f"{where}:{number}: {line!r} is not a requirement ({e}). Write one per line, e.g. "
                                f"'accelerate>=1.0' or 'einops'.") from None
        if hashes:
            out.hashes.setdefault(canonicalize_name(req.name), set()).update(hashes)
        out.append(line)
    if not out:
        raise EnvbuildError(f"{where}: no requirements in it; list the packages to add, one per line.")
    return out


def split_cuda_extensions(matrix: Matrix, requirements: list[str], source: str) -> tuple[list[str], list[str]]:
    """(CUDA extensions envbuild compiles into the stack image, the requirements uv resolves).

    flash-attn from PyPI is an sdist that compiles with nvcc against the installed torch, and the
    final image has no nvcc: such a requirement is built in the stack image's builder instead
    (`--ext`), where it is cached, hash-locked and verified. A version it does not build is refused.
    """
    compiled, rest = [], []
    for line in requirements:
        req = Requirement(line)
        key = canonicalize_name(req.name)
        refused = rules.extension_not_prebuilt(matrix, key)
        if refused:
            raise EnvbuildError(f"{source}: {line!r}: {refused.message} (rule {refused.rule}). Remove it from "
                                f"{source}; envbuild pre-builds {', '.join(matrix.extensions)} (`envbuild "
                                f"extensions`).")
        if key not in matrix.extensions:
            rest.append(line)
            continue
        ext = matrix.extensions[key]
        if req.specifier and not req.specifier.contains(ext.version, prereleases=True):
            raise EnvbuildError(f"{source}: {line!r}: {ext.name} is a CUDA extension envbuild compiles into the stack "
                                f"image, and it builds {ext.name} {ext.version} only (extensions.yaml); nearest valid "
                                f"choice: '{ext.name}=={ext.version}' or plain '{ext.name}'.")
        if req.extras or req.url:
            raise EnvbuildError(f"{source}: {line!r}: write plain '{ext.name}' (envbuild compiles {ext.name} "
                                f"{ext.version} from its PyPI sdist, without extras).")
        compiled.append(ext.name)
    return sorted(set(compiled)), rest


def with_cuda_extensions(matrix: Matrix, request, requirements: list[str], source: str):
    """(the request with the requirements' CUDA extensions added to --ext, the rest for uv)."""
    compiled, rest = split_cuda_extensions(matrix, requirements, source)
    rest = Requirements(rest, {k: v for k, v in getattr(requirements, "hashes", {}).items()
                               if k not in matrix.extensions})
    if compiled:
        request = replace(request, extensions=tuple(sorted({*request.extensions, *compiled})))
    return request, rest


@dataclass(frozen=True)
class Layer:
    """A resolved layer: the new packages' lock and what it was made from."""

    requirements: tuple[str, ...]
    source: str
    lock: Lock
    exclude_newer: str
    name: str

    @property
    def top_level(self) -> tuple[str, ...]:
        """The distributions the user asked for by name (what the import check covers)."""
        return tuple(sorted({canonicalize_name(Requirement(r).name) for r in self.requirements}))


def _constraints(stack_lock: Lock, directory: Path) -> Path:
    """The stack's venv, == per package: nothing the stack installed may move."""
    path = directory / "stack-constraints.txt"
    path.write_text("".join(f"{p.name}=={p.version}\n" for p in stack_lock.sections["venv"]))
    return path


def _inputs(resolution: Resolution) -> LockInputs:
    """The uv settings of the stack's own lock (Python, platform, indexes, DeepSpeed's metadata)."""
    lock = resolution.lock
    requires = lock.header.get("deepspeed-requires", "").split(" (")[0].split()
    return LockInputs(stack=resolution.stack.id, arch=lock.header["arch"], python=lock.header["python"],
                      platform=lock.header["platform"], venv=(), indexes=tuple(lock.header["index"].split()),
                      deepspeed=resolution.stack.deepspeed, deepspeed_requires=tuple(requires))


def _compile_layer(resolution: Resolution, requirements: tuple[str, ...], exclude_newer: str) -> str:
    with tempfile.TemporaryDirectory(prefix="envbuild-extend-") as tmp:
        directory = Path(tmp)
        return compile_requirements(requirements, _inputs(resolution), exclude_newer, directory,
                        constraints=_constraints(resolution.lock, directory))


def _fits(matrix: Matrix, resolution: Resolution, requirements: tuple[str, ...], exclude_newer: str) -> list[str]:
    """The other locked stacks this GPU allows where the requirements resolve."""
    fits = []
    for stack in matrix.stacks:
        if stack.id == resolution.stack.id:
            continue
        try:
            other = resolve(matrix, replace(resolution.request, stack=stack.id, python=None, cuda=None,
                                                       torch=None, deepspeed=None))
        except EnvbuildError:
            continue
        if other.lock is None:
            continue
        try:
            _compile_layer(other, requirements, exclude_newer)
        except EnvbuildError:
            continue
        fits.append(stack.id)
    return fits


def _explain(matrix: Matrix, resolution: Resolution, requirements: tuple[str, ...], source: str, failure: ResolveFailed,
             exclude_newer: str) -> EnvbuildError:
    stack = resolution.stack
    lines = [line.strip() for line in failure.detail.splitlines()
             if line.strip() and not line.strip().startswith(("error:", "warning:"))]
    why = " ".join(re.sub(r"^(cause|hint):\s*", "", line) for line in lines)
    if "was not found in the package registry" in why:
        kind = "names a package no index has"
    elif "we only found wheels" in why or "Wheels are available" in why or "no usable wheels" in why:
        kind = f"has no wheel or sdist that installs on Python {stack.python} ({resolution.lock.header['platform']})"
    else:
        kind = "conflicts with what the stack pins"
    fits = _fits(matrix, resolution, requirements, exclude_newer)
    pins = resolution.lock.pins()
    needs = ""
    try:  # what the requirements pull in on their own, where it differs from the stack
        with tempfile.TemporaryDirectory(prefix="envbuild-extend-") as tmp:
            text = compile_requirements(requirements, _inputs(resolution), exclude_newer, Path(tmp))
            alone = parse_lock("# [venv]\n" + text, "uv output").pins()
        differ = [f"{name}=={version} (the stack: {pins[name]})" for name, version in sorted(alone.items())
                  if name in pins and pins[name] != version]
        if differ:
            needs = f" On their own they resolve to {', '.join(differ[:6])}{', ...' if len(differ) > 6 else ''}."
    except EnvbuildError:
        pass
    pinned = ", ".join(f"{name}=={pins[name]}" for name in ("torch", "torchvision", "deepspeed", "numpy") if name in pins)
    where = (f"It would fit on: {', '.join(fits)} (envbuild extend --stack ID)." if fits
             else "No other locked stack this GPU allows fits it either.")
    return EnvbuildError(f"envbuild extend: {source}: the requirements ({', '.join(requirements)}) cannot be added "
                         f"to stack {stack.id}: it {kind}. uv says: {why}{needs} The stack pins {pinned} (and every "
                         f"other package of its lock). {where} Nothing was written.")


def resolve_layer(matrix: Matrix, resolution: Resolution, requirements: list[str], source: str,
                      name: Optional[str] = None, exclude_newer: Optional[str] = None) -> Layer:
    """Resolve the user's requirements against the stack's lock, before anything is built."""
    stack = resolution.stack
    if resolution.lock is None:
        raise EnvbuildError(f"envbuild extend: stack {stack.id} has no lock (in {matrix.directory / 'locks'}), so there is nothing "
                            f"to hold its packages in place while yours resolve. Lock it first with `envbuild lock "
                            f"--stack {stack.id}`, or pick a locked stack (`envbuild matrix`).")
    date = exclude_newer or today()
    hashes = getattr(requirements, "hashes", {})
    _check_markers(resolution, requirements, source)
    _check_hashes(hashes, resolution.lock.sections["venv"], "the stack pins", source)
    requirements = tuple(requirements)
    try:
        text = _compile_layer(resolution, requirements, date)
    except ResolveFailed as failure:
        raise _explain(matrix, resolution, requirements, source, failure, date) from None
    resolved = parse_lock("# [venv]\n" + text, "uv output")
    stack_pins = resolution.lock.pins()
    moved = [f"{p.name}=={p.version} (stack: {stack_pins[p.key]})" for p in resolved.sections["venv"]
             if p.key in stack_pins and stack_pins[p.key] != p.version]
    if moved:  # the constraints make this impossible; refuse rather than trust it
        raise EnvbuildError(f"envbuild extend: uv moved stack packages: {', '.join(moved)}.")
    new = [p for p in resolved.sections["venv"] if p.key not in stack_pins]
    for pin in new:  # one pulled in by another requirement (named ones were refused before uv ran)
        refused = rules.extension_not_prebuilt(matrix, pin.key)
        if refused:
            via = " ".join(line.strip().lstrip("#").strip() for line in pin.block.splitlines() if "via" in line or
                           line.strip().startswith("#   "))
            raise EnvbuildError(f"{source}: the requirements pull in {pin.name}=={pin.version} ({via or 'a dependency'}): "
                                f"{refused.message} (rule {refused.rule}). Remove what needs it from {source}.")
    _check_hashes(hashes, new, "uv resolved", source)
    label = _name(name or Path(source).stem)
    header = [
        f"# envbuild layer lock: the packages {source} adds to stack {stack.id}, each == with its sha256",
        "# hashes, resolved by uv with the stack's lock as constraints; installed with pip --require-hashes.",
        f"# stack: {stack.id}",
        f"# stack-lock: sha256:{resolution.lock.sha256}",
        f"# python: {resolution.lock.header['python']}",
        f"# platform: {resolution.lock.header['platform']}",
        f"# index: {resolution.lock.header['index']}",
        f"# exclude-newer: {date}",
        f"# requirements: {' '.join(requirements)}",
    ]
    lock_text = "\n".join(header) + "\n\n# [venv]\n" + "".join(p.block for p in new)
    return Layer(requirements=requirements, source=source, lock=parse_lock(lock_text, EXTEND_LOCK_SOURCE),
                     exclude_newer=date, name=label)


def _check_markers(resolution: Resolution, requirements, source: str) -> None:
    """A requirement whose environment marker excludes the image would add nothing, and its
    import check would then fail in the image: refuse it here, saying why."""
    python = resolution.lock.header.get("python", resolution.stack.python)
    env = {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python,
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "platform_machine": getattr(resolution, "arch", "x86_64"), "implementation_name": "cpython",
           "platform_python_implementation": "CPython"}
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            raise EnvbuildError(f"{source}: {line!r}: its marker '{req.marker}' is false in this image (Python "
                                f"{env['python_version']}, Linux {env['platform_machine']}), so it would add "
                                f"nothing; drop the marker, or the line.")


def _check_hashes(hashes: dict[str, set[str]], packages, whose: str, source: str) -> None:
    """The files uv resolved (or the stack pins) must be among the --hash values the user gave."""
    for p in packages:
        wanted = hashes.get(p.key)
        if wanted and not wanted & set(re.findall(r"sha256:([0-9a-f]{64})", p.block)):
            raise EnvbuildError(f"{source}: {p.name}: none of its --hash values matches a file of {p.name}=={p.version}, "
                                f"the version {whose}; pin "
                                f"'{p.name}=={p.version}' with that version's hashes, or drop the --hash lines.")


def check_stack_image(ref: str, labels: dict[str, str], resolution: Resolution) -> None:
    """--from must be the resolved stack's own image (its io.envbuild labels say what it was built
    as): another image, or one of another torch, would take a lock made for this stack."""
    stack = resolution.stack
    if "io.envbuild.stack" not in labels:
        raise EnvbuildError(f"--from {ref} is not an envbuild stack image (it has no io.envbuild.stack label); an "
                            f"`envbuild extend` layer goes on the stack image it was resolved for. Build that first "
                            f"(`envbuild build {resolution.request.describe()}`) or leave --from out.")
    want = {"io.envbuild.stack": stack.id, "io.envbuild.torch": stack.torch, "io.envbuild.cuda": stack.cuda,
            "io.envbuild.python": stack.python}
    wrong = [f"{k.split('.')[-1]} {labels.get(k)} (expected {v})" for k, v in want.items()
             if k in labels and labels[k] != v]
    if wrong:
        raise EnvbuildError(f"--from {ref} was built as {', '.join(wrong)}, not as stack {stack.id}, which these "
                            f"requirements were resolved against; give that stack's image, or --stack "
                            f"{labels['io.envbuild.stack']} to extend the image you named.")


def check_stack_image_name(ref: str, resolution: Resolution) -> None:
    """--from, where this machine's engine does not hold it (nothing to read labels from): its tag
    must be the resolved stack image's readable or content tag; a digest alone is checked by the
    build (extend.sh compares the image's manifest). `ubuntu:24.04` or another stack's image
    would otherwise reach the build, which pulls it and fails late, or installs a lock made for
    another torch."""
    _, tag, digest = split_reference(ref)
    want = resolution.tag
    if tag is None and digest is not None:
        return
    if tag is not None and re.fullmatch(rf"{re.escape(want)}(-[0-9a-f]{{{CONTENT_TAG_DIGITS}}})?", tag):
        return
    other = (f"its tag {tag} is another stack's or GPU's image" if tag and tag.startswith("torch") else
             f"its tag ({tag or 'none: latest'}) is not stack {resolution.stack.id}'s")
    raise EnvbuildError(f"--from {ref} is not on this machine (the engine does not hold it, so its labels cannot be "
                        f"read) and {other}: an `envbuild extend` layer goes on the stack image its requirements were "
                        f"resolved against, tagged {want} (or {want}-<content tag>). Nearest valid choice: --from "
                        f"{resolution.image_ref} (build it first: `envbuild build {resolution.request.describe()}`), "
                        f"or leave --from out.")


def _name(text: str) -> str:
    """A tag-safe name: 'My Lab/reqs' -> 'my-lab-reqs' (at most 32 characters)."""
    cleaned = re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")
    return cleaned[:32] or "ext"
