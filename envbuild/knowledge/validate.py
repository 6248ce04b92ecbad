"""Refuse bad input before it becomes a broken build: one paragraph naming the input, what
is wrong with it and the nearest valid choice of the same kind (exit 2, nothing written).

What is checked here, and what is not:

- ``--image-repo``: the OCI distribution spec's repository grammar (path components
  ``[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*``, an optional ``host[:port]/`` in front), no tag,
  no digest (envbuild writes the tags).
- ``--base-image`` / ``--builder-image``: a valid reference (``name[:tag][@digest]``), and
  the distro release its name or tag names (``ubuntu:22.04``, ``...-ubuntu22.04``,
  ``debian:bookworm-slim``, ``python:3.11-slim-trixie``) must be the stack's; a builder
  named ``.../cuda:X.Y...`` must be a ``devel`` image of the stack's CUDA. Nothing is
  pulled: a name that carries no release (a private mirror's ``base:v3``, a digest) is
  accepted without a claim; one with no tag, or the tag ``latest``, and no digest is refused
  (it moves: the rule base-pinned).
- ``--apt-mirror`` / ``--pip-index-url`` / ``--torch-index-url``: http(s) URLs.
- ``--env``: names, characters that would break the Dockerfile or ``%environment``,
  ``PATH`` (refused: see :func:`check_env`); warnings for overrides that bring back what
  the image prevents (:func:`env_warnings`).
- Empty values, version values of the wrong kind (``--cuda cu128``, ``--torch cu130``),
  ``--ds-ops`` mixing a preset with op names, ``--stack`` with contradicting versions.
- GPU names as ``nvidia-smi`` prints them (:func:`gpu_spellings`).
"""

from __future__ import annotations

import re
from typing import Optional
from urllib.parse import unquote, urlsplit

from packaging.version import Version

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.grammar import redact
from envbuild.knowledge import rules
from envbuild.oci.registry import check_image_reference, check_image_repo

# ---------------------------------------------------------------- URLs


def check_url(flag: str, url: Optional[str]) -> None:
    """--pip-index-url / --torch-index-url / --apt-mirror / --source-mirror: an http(s) URL with a host."""
    if url is None:
        return
    shown = grammar.shown(redact(url), limit=200)[1:-1]  # control characters escaped: one paragraph
    example = {"--apt-mirror": "https://mirror.example.com",
               "--pip-index-url": "https://pypi.example.com/simple",
               "--torch-index-url": "https://mirror.example.com/whl/cu128",
               "--source-mirror": "http://127.0.0.1:8765"}[flag]
    if not url.strip():
        raise EnvbuildError(f"{flag} is empty; give an http(s) URL such as {example}, or leave the option out.")
    bad = sorted({c for c in url if c.isspace()} | set(grammar.control_characters(url)))
    if bad:
        raise EnvbuildError(f"{flag} '{shown}' contains {' '.join(repr(c) for c in bad)}; a URL has no spaces or "
                            f"control characters (write a space as %20), e.g. {example}.")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        rest = url.split("://", 1)[-1]
        hint = f"https://{rest}" if rest and not rest.startswith("/") else example
        raise EnvbuildError(f"{flag} '{shown}' is not an http(s) URL (pip and apt fetch over http or https); "
                            f"nearest valid choice: {flag} {redact(hint)}.")
    try:
        host = parts.hostname
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as e:
        raise EnvbuildError(f"{flag} '{shown}' is not a valid URL ({e}); e.g. {example}.") from None
    if not host:
        raise EnvbuildError(f"{flag} '{shown}' has no host; e.g. {flag} {example}.")
    if flag in ("--apt-mirror", "--source-mirror") and (parts.query or parts.fragment or set("&#\\|'\"") & set(url)):
        raise EnvbuildError(f"{flag} '{shown}' may not carry a query, a fragment or any of & # \\ | ' \" "
                            f"(it replaces a host in the URLs the build fetches); e.g. {flag} {example}.")


def check_mirror_options(options: dict) -> None:
    """The mirror URLs and --ca-cert, as the CLI passes them (option name -> value)."""
    for flag in ("--pip-index-url", "--torch-index-url", "--apt-mirror", "--source-mirror"):
        check_url(flag, options.get(flag[2:].replace("-", "_")))
    ca_cert = options.get("ca_cert")
    if ca_cert is not None and not ca_cert.strip():
        raise EnvbuildError("--ca-cert is empty; give a PEM file such as /etc/ssl/certs/ca-certificates.crt, or "
                            "leave the option out.")


# ---------------------------------------------------------------- --compile-cache

COMPILE_CACHE_EXAMPLES = ("redis://127.0.0.1:6379, rediss://cache.example.com:6380/0 (a password in the URL's user part), "
                          "s3://BUCKET/PREFIX or gha")
# What each storage needs from envbuild's own environment (where CI keeps its credentials);
# the compile_cache secret hands them to sccache inside the build step (lib.sh).
_FROM_ENV = {"s3": (("AWS_REGION", "SCCACHE_REGION", False), ("AWS_ENDPOINT_URL", "SCCACHE_ENDPOINT", False),
                    ("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY", False),
                    ("AWS_SESSION_TOKEN", "AWS_SESSION_TOKEN", False)),
             "gha": (("ACTIONS_RESULTS_URL", "ACTIONS_RESULTS_URL", True), ("ACTIONS_RUNTIME_TOKEN", "ACTIONS_RUNTIME_TOKEN", True))}


def compile_cache_secret(url: Optional[str], environ: dict) -> Optional[str]:
    """--compile-cache: where sccache keeps compiled units, as the compile_cache secret's lines
    (sccache's own storage variables). redis:// or rediss:// (host, port, optional password and
    database), s3://BUCKET[/PREFIX] (credentials and region from the AWS_* variables), gha (the
    GitHub Actions cache: ACTIONS_RESULTS_URL and ACTIONS_RUNTIME_TOKEN, which a workflow step
    exposes). Each value is one line: nothing in it can set another variable."""
    if url is None:
        return None
    shown = grammar.shown(redact(url), limit=200)[1:-1]
    bad = sorted({c for c in url if c.isspace()} | set(grammar.control_characters(url)))
    if not url.strip() or bad:
        raise EnvbuildError(f"--compile-cache '{shown}' is {'empty' if not url.strip() else 'not one word'}; give where "
                            f"the compile cache is, one of {COMPILE_CACHE_EXAMPLES}, or leave the option out (every unit "
                            f"is then compiled).")
    if url == "gha":
        return _cache_lines({"SCCACHE_GHA_ENABLED": "on"}, "gha", environ)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise EnvbuildError(f"--compile-cache '{shown}' is not a valid URL ({e}); e.g. {COMPILE_CACHE_EXAMPLES}.") from None
    db = re.fullmatch(r"/?(\d{1,2})?", parts.path)
    if scheme in ("redis", "rediss") and host and db and not parts.query and not parts.fragment:
        # sccache takes the endpoint without credentials; they and the database are variables of their own
        netloc = f"[{host}]" if ":" in host else host
        values = {"SCCACHE_REDIS_ENDPOINT": f"{scheme}://{netloc}:{port or 6379}"}
        if parts.username:
            values["SCCACHE_REDIS_USERNAME"] = unquote(parts.username)
        if parts.password:
            values["SCCACHE_REDIS_PASSWORD"] = unquote(parts.password)
        if db.group(1):
            values["SCCACHE_REDIS_DB"] = db.group(1)
        return _cache_lines(values, "redis", environ)
    if scheme == "s3" and host and re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", host) and not (port or parts.query):
        return _cache_lines({"SCCACHE_BUCKET": host, **({"SCCACHE_S3_KEY_PREFIX": parts.path.strip("/")}
                                                          if parts.path.strip("/") else {})}, "s3", environ)
    nearest_one = f"redis://{url.split('://', 1)[-1]}" if "://" in url and scheme not in ("redis", "rediss", "s3") else None
    raise EnvbuildError(f"--compile-cache '{shown}' is not a compile cache envbuild can hand sccache: one of "
                        f"{COMPILE_CACHE_EXAMPLES} (a Redis URL takes a host, an optional port and database number, "
                        f"no query)" + (f"; nearest valid choice: --compile-cache {redact(nearest_one)}" if nearest_one else "")
                        + ".")


def _cache_lines(values: dict, kind: str, environ: dict) -> str:
    for name, variable, needed in _FROM_ENV.get(kind, ()):
        value = environ.get(name, "")
        if needed and not value:
            raise EnvbuildError(f"--compile-cache gha needs {name} in envbuild's environment (GitHub Actions gives it "
                                f"to actions, not to run steps: an actions/github-script step exports it, as the generated workflow does); "
                                f"it is not set. Outside GitHub Actions use a Redis or S3 cache, e.g. --compile-cache "
                                f"redis://127.0.0.1:6379.")
        if value:
            values[variable] = value
    for name, value in values.items():
        if "\n" in value or "\r" in value or "\0" in value:
            raise EnvbuildError(f"--compile-cache: {name} holds a line break or NUL, which would end the value it "
                                f"hands sccache; set it to one line.")
    return "".join(f"{name}={value}\n" for name, value in values.items()).rstrip("\n")


# ---------------------------------------------------------------- --env

def check_env(env: tuple[tuple[str, str], ...], runtime_path: str, variables=None) -> None:
    """--env NAME=VALUE: a name, a value in the grammar of values a Dockerfile ENV line and
    Apptainer's %environment hold as text (grammar.env_value), and, for a variable the matrix
    knows (gpus.yaml `variables`), a value its reader accepts."""
    for name, value in env:
        try:
            grammar.env_name(name)
        except grammar.GrammarError:
            fixed = re.sub(r"[^A-Za-z0-9_]", "_", name.strip()).lstrip("0123456789") or "NAME"
            raise EnvbuildError(f"--env {grammar.shown(name)} is not a valid environment variable name (letters, "
                                f"digits and '_', not starting with a digit); use NAME=VALUE, e.g. --env "
                                f"{fixed}={grammar.shown(value)[1:-1]}.") from None
        if name == "PATH":
            raise EnvbuildError(
                f"--env PATH=... is not supported: envbuild sets PATH itself ({runtime_path}: the venv first) and "
                f"a baked PATH would drop the venv in Docker while Apptainer kept the host's. To add a directory, "
                f"put the tools in /usr/local/bin (already on PATH) in a derived image, or per job: "
                f"`apptainer exec --env PREPEND_PATH=/your/bin ...` or `docker run -e PATH=/your/bin:{runtime_path} "
                f"...`.")
        try:
            grammar.env_value(value, name)
        except grammar.GrammarError as e:
            raise EnvbuildError(f"--env {name}={grammar.shown(value)}: {e}.") from None
        known = (variables or {}).get(name)
        why = known.problem(name, value) if known else None
        if why:
            raise EnvbuildError(f"--env {name}={grammar.shown(value)[1:-1]}: {why}. "
                                + ("Leave it out." if known.refused else "Give one of those values, or leave it out."))


_SHARED = ("~", "/home/", "/root/", "/gpfs/", "/lustre/", "/nfs/", "/shared/")


def env_warnings(resolution) -> list[str]:
    """Warnings (not errors) for --env overrides that bring back what the image prevents."""
    out = []
    for name, value in resolution.request.env:
        if name in ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR") and (value == "~" or value.startswith(_SHARED)):
            tilde = " ('~' is not expanded in an ENV line: it is a directory named '~')" if value[:1] == "~" else ""
            out.append(f"--env {name}={value} puts the compile cache on a shared home/network filesystem{tilde}: "
                       f"jobs on several nodes then share its lock files, the torch_extensions hang of field reports "
                       f"1 and 2. Left unset, the image picks a per-job, node-local directory.")
        elif name == "DS_ACCELERATOR" and value != "cuda":
            out.append(f"--env DS_ACCELERATOR={value}: the DeepSpeed ops were pre-built for cuda; with another "
                       f"accelerator DeepSpeed treats them as missing and JIT-compiles (or fails) at run time.")
        elif name.startswith("DS_BUILD_"):
            out.append(f"--env {name}={value} is a DeepSpeed build switch: the ops are already pre-built (--ds-ops "
                       f"chooses them); baked in, it only changes what a later `pip install deepspeed` compiles.")
        elif name == "TORCH_CUDA_ARCH_LIST" and value != resolution.arch_list:
            out.append(f"--env TORCH_CUDA_ARCH_LIST={value}: the ops were pre-built for {resolution.arch_list} "
                       f"({resolution.gpu.name}); another list only matters to run-time JIT compiles.")
        elif name in ("PIP_CONSTRAINT", "UV_CONSTRAINT"):
            tool = "pip install" if name == "PIP_CONSTRAINT" else "uv pip install"
            out.append(f"--env {name}={value} replaces the guard (the constraints file that pins torch, the CUDA "
                       f"wheels and DeepSpeed as built): a later `{tool}` can then replace torch under the "
                       f"pre-built ops and extensions (undefined symbols at import). Bypass it per command "
                       f"instead: {name}= {tool} ...")
        elif name == "ENVBUILD_MIN_DRIVER":
            out.append(f"--env ENVBUILD_MIN_DRIVER={value} changes the driver floor the entrypoint and the smoke test "
                       f"check (the stack's CUDA needs its own); {'empty, it silences the check' if not value.strip() else 'a wrong floor lets an old driver through to CUDA error 803 at the first kernel'}.")
        elif name == "NVIDIA_VISIBLE_DEVICES":
            out.append(f"--env NVIDIA_VISIBLE_DEVICES={value} bakes which GPUs the NVIDIA runtime and enroot's hook "
                       f"hand in ('all' by default); "
                       + ("with none/void/empty every container of the image starts without GPUs or driver "
                          "libraries." if value.strip().lower() in ("", "none", "void") else
                          "a fixed list is wrong on every node whose GPUs differ; choose GPUs per job "
                          "(--gpus, CUDA_VISIBLE_DEVICES) instead."))
        elif name == "NVIDIA_DRIVER_CAPABILITIES" and not {"compute", "all"} & set(value.replace(" ", "").split(",")):
            out.append(f"--env NVIDIA_DRIVER_CAPABILITIES={value} leaves out 'compute': the container gets no "
                       f"libcuda.so, and CUDA cannot start.")
        elif name == "LD_LIBRARY_PATH":
            out.append("--env LD_LIBRARY_PATH replaces the base image's value in Docker (nvidia/cuda sets "
                       "/usr/local/nvidia/lib:/usr/local/nvidia/lib64 for the driver libraries), while in Apptainer "
                       "a value set on the host wins.")
    return out


# ---------------------------------------------------------------- versions and ops

KIND = {"python": "Python", "cuda": "CUDA", "torch": "torch", "deepspeed": "DeepSpeed"}
VERSION_FLAGS = {  # attribute: (flag, example version, example specifier)
    "python": ("--python", "3.12", ">=3.10"),
    "cuda": ("--cuda", "12.8", ">=12.6"),
    "torch": ("--torch", "2.11", ">=2.5,<2.8"),
    "deepspeed": ("--deepspeed", "0.19.8", ">=0.16"),
}
_PREFIXES = [  # a name glued to a version: which kind it is
    (re.compile(r"^(?:cu|cuda)[-=]*(\d+)$", re.I), "cuda", lambda d: f"{d[:-1]}.{d[-1]}" if len(d) >= 3 else None),
    (re.compile(r"^(?:cuda|cu)[-=]*(\d+\.\d+(?:\.\d+)?)$", re.I), "cuda", lambda d: d),
    (re.compile(r"^(?:cp|py)(3)(\d+)$", re.I), "python", None),
    (re.compile(r"^(?:py|python|cpython)[-=]*(\d+\.\d+)$", re.I), "python", lambda d: d),
    (re.compile(r"^(?:torch|pytorch)[-=]*(\d+(?:\.\d+)*)$", re.I), "torch", lambda d: d),
    (re.compile(r"^(?:ds|deepspeed)[-=]*(\d+(?:\.\d+)*)$", re.I), "deepspeed", lambda d: d),
]


def _tagged_version(text: str) -> Optional[tuple[str, str]]:
    """'cu128' -> ('cuda', '12.8'); 'cp312' -> ('python', '3.12'); 'torch2.11' -> ('torch', '2.11')."""
    for pattern, kind, convert in _PREFIXES:
        found = pattern.match(text.strip())
        if found:
            if kind == "python" and convert is None:
                return kind, f"{found.group(1)}.{found.group(2)}"
            version = convert(found.group(1))
            if version:
                return kind, version
    return None


def _matrix_values(m, attr: str) -> list[str]:
    return sorted({getattr(s, attr) for s in m.stacks}, key=Version)


def check_versions(m, req) -> None:
    for attr, (flag, example, spec_example) in VERSION_FLAGS.items():
        value = getattr(req, attr)
        if value is None:
            continue
        have = ", ".join(_matrix_values(m, attr))
        if not value.strip():
            raise EnvbuildError(f"{flag} is empty; give a version such as {flag} {example} or a specifier such as "
                                f"{flag} '{spec_example}' (the matrix has {KIND[attr]} {have}), or leave the option out.")
        tagged = _tagged_version(value)
        if tagged:
            kind, version = tagged
            right = VERSION_FLAGS[kind][0]
            if kind == attr:
                raise EnvbuildError(f"{flag} '{value}' is a wheel/tag spelling; write the {KIND[attr]} version: "
                                    f"{flag} {version}.")
            raise EnvbuildError(f"{flag} '{value}' is a {KIND[kind]} version, not a {KIND[attr]} version; did you mean "
                                f"{right} {version}? ({KIND[attr]} versions in the matrix: {have}.)")
        try:
            spec = rules.user_specifier(flag, value)
        except EnvbuildError:
            raise EnvbuildError(f"{flag} '{value}' is neither a version nor a PEP 440 specifier; examples: "
                                f"{flag} {example}, {flag} '{spec_example}' (the matrix has {KIND[attr]} {have}).") from None
        if not any(spec.contains(Version(v), prereleases=True) for v in _matrix_values(m, attr)):
            bare = re.fullmatch(r"\d+(\.\d+)*", value.strip())
            for other in VERSION_FLAGS:
                if bare and other != attr and any(spec.contains(Version(v)) for v in _matrix_values(m, other)):
                    raise EnvbuildError(
                        f"{flag} {value} matches no {KIND[attr]} version in the matrix ({have}); {value} is a {KIND[other]} version: "
                        f"did you mean {VERSION_FLAGS[other][0]} {value}?")


def check_stack_versions(m, req) -> None:
    """--stack with --torch/--cuda/--python/--deepspeed that contradict the stack's own."""
    if not req.stack:
        return
    stack = m.stack(req.stack)
    for attr, (flag, _, _) in VERSION_FLAGS.items():
        value = getattr(req, attr)
        if value and not rules.user_specifier(flag, value).contains(Version(getattr(stack, attr)), prereleases=True):
            fits = [s.id for s in m.stacks if rules.user_specifier(flag, value).contains(Version(getattr(s, attr)))]
            alt = (f", or drop --stack and keep {flag} {value} (stacks with it: {', '.join(fits)})" if fits else "")
            raise EnvbuildError(f"--stack {stack.id} has {KIND[attr]} {getattr(stack, attr)}, which contradicts {flag} "
                                f"{value}. Drop {flag} (the stack pins it){alt}.")


def check_ds_ops(m, choice: Optional[str]) -> None:
    """Presets stand alone; a list is op names. Spaces around names are trimmed."""
    if choice is None:
        return
    presets = {"all": sorted(m.ops), **m.deepspeed_file.presets}
    if not choice.strip():
        raise EnvbuildError(f"--ds-ops is empty; give a preset ({', '.join(presets)}) or a comma list of ops such "
                            f"as --ds-ops cpu_adam,fused_adam.")
    names = [n.strip() for n in choice.split(",")]
    if "" in names:
        fixed = ",".join(n for n in names if n)
        raise EnvbuildError(f"--ds-ops '{choice}' has an empty item; nearest valid choice: --ds-ops {fixed}.")
    mixed = [n for n in names if n in presets]
    if mixed and len(names) > 1:
        ops = [n for n in names if n not in presets]
        expanded = sorted({o for p in mixed for o in presets[p]} | set(ops))
        raise EnvbuildError(f"--ds-ops '{choice}' mixes the preset {', '.join(mixed)} with op names; a preset stands "
                            f"alone. To add ops to a preset, list them all: --ds-ops {','.join(expanded) or 'none'}.")
    for n in names:
        if n not in presets and n not in m.ops:
            hint = nearest(n, m.ops)
            did = f" did you mean {', '.join(hint)}?" if hint else ""
            raise EnvbuildError(
                f"--ds-ops names unknown DeepSpeed op '{n}';{did} Presets: "
                f"{', '.join(presets)}; ops: {', '.join(m.ops)}.")


def parse_extensions(m, text: Optional[str]) -> tuple[str, ...]:
    """--ext a,b: each a known CUDA extension (any spelling pip accepts), canonical, sorted, once.

    >>> from envbuild.knowledge.matrix import load_matrix
    >>> parse_extensions(load_matrix(), "Causal_Conv1d,flash-attn,causal-conv1d")
    ('causal-conv1d', 'flash-attn')
    """
    if text is None:
        return ()
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or "" in names:
        fixed = ",".join(n for n in names if n)
        raise EnvbuildError(f"--ext '{text}' has an empty item; give CUDA extensions as a comma list"
                            + (f"; nearest valid choice: --ext {fixed}." if fixed else
                               f" such as --ext {next(iter(m.extensions), 'flash-attn')}."))
    return tuple(sorted({m.extension(n).name for n in names}))


def check_request(m, req, runtime_path: str) -> None:
    """Every check that needs only the request and the matrix (run before resolving)."""
    if req.keep_toolchain and req.no_compiler:
        raise EnvbuildError("--keep-toolchain and --no-compiler contradict each other: the first keeps every "
                            "compiler of the builder, the second leaves even the C compiler out; choose one.")
    if req.stack is not None and not req.stack.strip():
        raise EnvbuildError("--stack is empty; give a stack id such as "
                            f"{max(m.stacks, key=lambda s: Version(s.torch)).id} (`envbuild matrix` lists them), "
                            f"or leave it out for the newest stack the GPU allows.")
    names = [name for name, _ in req.env]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EnvbuildError(f"--env {twice[0]} is given {names.count(twice[0])} times; give each variable once "
                            f"(the last one would silently win).")
    check_versions(m, req)
    check_stack_versions(m, req)
    check_ds_ops(m, req.ds_ops)
    check_image_repo(req.image_repo)
    check_image_reference("--base-image", req.base_image)
    check_image_reference("--builder-image", req.builder_image)
    check_env(req.env, runtime_path, m.gpus_file.variables)


# ---------------------------------------------------------------- GPU names

_VENDOR = {"nvidia", "tesla", "geforce", "quadro"}
_DROP = re.compile(r"^(\d+gb|sxm\d*|pcie|nvl|nvlink|hbm\d*e?|gddr\d*x?|oem)$")


def gpu_spellings(name: str) -> list[str]:
    """Keys to look a GPU up by, most literal first: the name as given, then with the
    vendor, memory size and form factor dropped, as nvidia-smi prints them
    ('NVIDIA H100 80GB HBM3' -> h100, 'Tesla V100-SXM2-32GB' -> v100,
    'NVIDIA GeForce RTX 4090' -> rtx-4090)."""
    if not name or not name.strip():
        raise EnvbuildError("--gpu is empty; give a GPU profile such as h100, or the name nvidia-smi prints "
                            "('NVIDIA H100 80GB HBM3'); `envbuild gpus` lists the profiles.")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    out = [key, key.replace("-", "")]
    tokens = [t for t in re.split(r"[\s_\-]+", name.strip().lower()) if t]
    kept = [t for t in tokens if t not in _VENDOR and not _DROP.match(t)]
    if kept:
        out += ["-".join(kept), "".join(kept)]
    return list(dict.fromkeys(out))


def unknown_gpu(name: str, spellings: list[str], profiles: list[str], gpus_file: str = "matrices/gpus.yaml"
                ) -> EnvbuildError:
    read = f" (read as {grammar.shown(spellings[-1])})" if spellings[-1] != spellings[0] else ""
    hint = nearest(spellings[-1], profiles)
    did = f" did you mean {', '.join(hint)}?" if hint else ""
    return EnvbuildError(
        f"unknown GPU {grammar.shown(name)}{read};{did} Known GPUs: {', '.join(profiles)} (`envbuild gpus` lists them with "
        f"aliases; a GPU not in the matrix needs a profile in {gpus_file} (the file this run read; --matrix-dir or "
        f"ENVBUILD_MATRIX_DIR names a matrix directory of your own), see docs/matrix.md 'Adding a GPU'.")
