"""Build, cache, install and verify the CUDA extensions of one image (extensions.sh runs this).

SPEC (extensions.json, written by the build plan) names each extension with its sdist (URL and
sha256) or, where PyPI has no source that builds (FA3), the GitHub archives it compiles from
(each URL with the sha256 of its tar stream, checked here before anything in it is used, as the
source-built fabrics' are), its import names and the cache key of its wheel: a hash of everything that determines
the compiled file (the sdist, torch's exact build, nvcc, Python, CPU architecture, the arch
list, the build variables). A wheel already in the cache under that key is reused; otherwise it
is compiled here with `pip wheel --no-build-isolation` against the venv's torch, for the GPU's
arches only, with MAX_JOBS from this builder's memory. The wheel is installed by hash, its
build-only requirements dropped (ninja: nothing may JIT at run time), and the build fails
unless every compiled module imports against this torch (no `undefined symbol`) and every
shared library carries SASS for each arch (sass_audit.py, NVIDIA's cuobjdump). What was
built, with the wheel's sha256, goes to the record and lock files the final image keeps.
"""

import gzip
import hashlib
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
import urllib.request
import zlib
from importlib import metadata
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_audit  # noqa: E402  (beside this script in the setup directory)

GIB = 1024 ** 3
PARTIAL = "partial"  # <cache>/<name>/<key>/partial: the tree of a compile not finished yet
HEARTBEAT_SECONDS = 15
STALE_DAYS = 14  # a compile not resumed for this long is given up: its tree is removed


def log(msg: str) -> None:
    print(f"envbuild: {msg}", file=sys.stderr, flush=True)


def fail(msg: str) -> "NoReturn":  # noqa: F821
    print(f"envbuild: CUDA extension build FAILED: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def memory_bytes() -> int:
    """What this build may use: the smaller of the available memory and the cgroup's limit."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    limit = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = int(text)
            break
    known = [v for v in (avail, limit) if v]
    return min(known) if known else 8 * GIB


def max_jobs(per_job_gib: float) -> int:
    """Compile jobs that fit in memory (an OOM kill is the usual end of a flash-attn build) and
    cores: at least one."""
    by_memory = int(memory_bytes() // (per_job_gib * GIB))
    return max(1, min(os.cpu_count() or 1, by_memory))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip(*args: str, env=None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    if subprocess.run(cmd, env=env).returncode != 0:
        fail(f"`pip {' '.join(args[:2])} ...` failed (its output is above)")


def cached_wheel(entry: dict, cache: Path):
    """The wheel built before under this key, if its recorded hash still matches."""
    where = cache / entry["name"] / entry["cache_key"]
    for wheel in sorted(where.glob("*.whl")):
        stamp = wheel.with_suffix(".sha256")
        if stamp.is_file() and stamp.read_text().strip() == sha256(wheel):
            return wheel
    return None


def unpack(archive: Path, into: Path, marker: str = "setup.py") -> Path:
    """The archive's top directory, unpacked with tarfile's `data` filter where this Python has it
    (no absolute paths, no `..`, no links out), else with the same checks by hand; it must hold
    `marker` (an sdist's setup.py)."""
    into.mkdir()
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, filter="data")
            else:  # Python < 3.10.12 / 3.11.4
                for member in tar.getmembers():
                    parts = Path(member.name).parts
                    if member.name.startswith("/") or ".." in parts or member.issym() or member.islnk():
                        fail(f"{archive.name}: refusing the archive member {member.name!r}")
                tar.extractall(into)
    except (tarfile.TarError, OSError) as e:
        fail(f"{archive.name}: cannot unpack it: {e}")
    tops = [d for d in into.iterdir() if d.is_dir()]
    if len(tops) != 1 or (marker and not (tops[0] / marker).exists()):
        fail(f"{archive.name}: expected one top directory with a {marker or 'file'}, found {[d.name for d in tops]}")
    return tops[0]


def apply_patches(tree: Path, patches: list, name: str) -> None:
    """Each patch replaces text that occurs exactly once: a patch that matches nothing (or twice)
    fails the build, naming it, rather than compiling an unpatched source."""
    for patch in patches:
        path = tree / patch["file"]
        text = path.read_text()
        found = text.count(patch["old"])
        if found != 1:
            fail(f"{name}: the patch for {patch['file']} ({patch['source']}) expects {patch['old']!r} once, "
                 f"found it {found} times: the sdist is not the one the patch was written for")
        path.write_text(text.replace(patch["old"], patch["new"]))
        log(f"{name}: patched {patch['file']}: {patch['old'].strip()} -> {patch['new'].strip()} ({patch['source']})")


def sdist_project(filename: str) -> tuple[str, str]:
    """The distribution and version an sdist file is of ('flash_attn-2.8.3.post2.tar.gz' ->
    ('flash_attn', '2.8.3.post2')): FA3 is built from flash-attn's sdist, so pip downloads that
    one by its own name and hash."""
    stem = filename[:-len(".tar.gz")] if filename.endswith(".tar.gz") else filename.rsplit(".", 1)[0]
    project, _, version = stem.rpartition("-")
    return project, version


def fetch_wheel(entry: dict, work: Path) -> Path:
    """The PyPI wheel the plan chose for this stack (rules.extension_wheel), downloaded by pip with
    its sha256 required: a wheel is installed only as the matrix recorded it."""
    wheel = entry["wheel"]
    req = work / "wheel.txt"
    req.write_text(f"{entry['name']}=={entry['version']} --hash=sha256:{wheel['sha256']}\n")
    out = work / "download"
    pip("download", "--no-deps", "--only-binary", ":all:", "--require-hashes", "-r", str(req), "-d", str(out))
    found = out / wheel["filename"]
    if not found.is_file() or sha256(found) != wheel["sha256"]:
        fail(f"{entry['name']}: pip did not download {wheel['filename']} with sha256 {wheel['sha256']}")
    return found


def archive_url(url: str, mirror: str) -> str:
    """Where to download an archive from: the source_mirror secret (a local copy served by
    scripts/fabric-sources.sh) stands in for https://github.com, as in fabric.sh."""
    if mirror and url.startswith("https://github.com/"):
        return mirror.rstrip("/") + "/" + url[len("https://github.com/"):]
    return url


def fetch_archive(archive: dict, into: Path, mirror: str, marker=None) -> Path:
    """Download one GitHub archive, check the sha256 of its uncompressed tar stream (`git archive`
    of the commit, which any copy reproduces: fabric.sh's check) before anything in it is used,
    and unpack it into `into`: its top directory."""
    url = archive_url(archive["url"], mirror)
    name, version = archive["name"], archive["version"]
    log(f"{name} {version} from {url}")
    into.mkdir(parents=True, exist_ok=True)
    download = into / f"{name}.tar.gz"
    try:
        with urllib.request.urlopen(url, timeout=300) as response, open(download, "wb") as out:
            shutil.copyfileobj(response, out)
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        fail(f"could not download {name} {version} from {url}: {e}")
    digest = hashlib.sha256()
    try:
        with gzip.open(download) as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
    except (OSError, EOFError, zlib.error) as e:
        fail(f"{name} {version} from {url} is not a gzip-compressed tar: {e}")
    if digest.hexdigest() != archive["tar_sha256"]:
        fail(f"{name} {version} from {url}: the tar's sha256 is {digest.hexdigest()}, the pin is "
             f"{archive['tar_sha256']}: not the pinned source (a changed or wrong archive); the build stops")
    top = unpack(download, into / "tree", marker=marker)
    download.unlink()
    return top


def archives_tree(entry: dict, partial: Path, mirror: str) -> Path:
    """The repository's archive unpacked into partial/src, each submodule's archive at its path
    (where `git archive` left the gitlink an empty directory)."""
    first, *subs = entry["archives"]
    top = fetch_archive(first, partial / "fetch" / first["name"], mirror, marker=".")
    (partial / "src").mkdir()
    top = Path(shutil.move(str(top), str(partial / "src" / top.name)))
    for sub in subs:
        dest = top / sub["path"]
        if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
            fail(f"{entry['name']}: {sub['path']} in {first['name']}'s archive is not the empty directory of a "
                 f"submodule: {sub['name']} cannot go there")
        if dest.exists():
            dest.rmdir()
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(fetch_archive(sub, partial / "fetch" / sub["name"], mirror, marker="")), str(dest))
        log(f"{entry['name']}: {sub['name']} {sub['version']} at {sub['path']}")
    shutil.rmtree(partial / "fetch")
    return top


def source_id(entry: dict) -> str:
    """What the unpacked tree is of: the sdist's sha256, or each archive's tar sha256."""
    if entry.get("archives"):
        return " ".join(a["tar_sha256"] for a in entry["archives"])
    return entry["sdist"]["sha256"]


def source_tree(entry: dict, cache: Path, env: dict) -> Path:
    """The unpacked, patched sdist to compile in, at a path that depends only on the wheel's cache
    key, kept in the cache until the wheel is stored: a build cut off (Ctrl-C, a killed CI job, a
    job time limit) resumes there. torch's BuildExtension compiles through ninja, which skips each
    object its log records as finished with the same command line and compiles again any object
    whose command did not finish. A tree without the stamp of a finished unpack is made again."""
    partial = cache / entry["name"] / entry["cache_key"] / PARTIAL
    stamp = partial / ".envbuild-unpacked"
    if stamp.is_file() and stamp.read_text().strip() == source_id(entry):
        tops = [d for d in (partial / "src").iterdir() if d.is_dir()]
        if len(tops) == 1:
            return tops[0] / (entry.get("subdirectory") or "")
    shutil.rmtree(partial, ignore_errors=True)  # a cut-off unpack: only envbuild writes here
    partial.mkdir(parents=True)
    top = (archives_tree(entry, partial, os.environ.get("ENVBUILD_SOURCE_MIRROR", "")) if entry.get("archives")
           else sdist_tree(entry, partial, env))
    tree = top / (entry.get("subdirectory") or "")
    apply_patches(tree, entry.get("patches", []), entry["name"])
    stamp.write_text(source_id(entry) + "\n")
    return tree


def sdist_tree(entry: dict, partial: Path, env: dict) -> Path:
    """PyPI's sdist, downloaded by pip with its sha256 required, unpacked into partial/src."""
    sdist = entry["sdist"]
    download = partial / "sdist"
    req = partial / "sdist.txt"
    project, version = sdist_project(sdist["filename"])
    req.write_text(f"{project}=={version} --hash=sha256:{sdist['sha256']}\n")
    pip("download", "--no-deps", "--no-build-isolation", "--no-binary", project, "--require-hashes",
        "-r", str(req), "-d", str(download), env=env)  # its metadata step runs setup.py: CUDA_HOME
    if not (download / sdist["filename"]).is_file():
        fail(f"{entry['name']}: pip did not download {sdist['filename']}")
    top = unpack(download / sdist["filename"], partial / "src")
    shutil.rmtree(download)
    return top


def finished_objects(tree: Path) -> dict[str, tuple[int, int, int]]:
    """Object file -> (start ms, end ms, mtime) of its compile, for each compile ninja's log
    records as finished in this tree (ninja keeps the newest entry of each output: an object
    compiled again gets a new one)."""
    done: dict[str, tuple[int, int, int]] = {}
    for log_file in tree.glob("build/temp.*/.ninja_log"):
        for line in log_file.read_text(errors="replace").splitlines()[1:]:
            fields = line.split("\t")
            if len(fields) == 5 and fields[3].endswith(".o") and all(f.isdigit() for f in fields[:3]):
                done[fields[3]] = (int(fields[0]), int(fields[1]), int(fields[2]))
    return done


def kept_objects(before: dict, after: dict) -> list[str]:
    """The objects a build did not compile again: their log entry is the one from before it."""
    return sorted(obj for obj, entry in before.items() if after.get(obj) == entry)


def compile_seconds(objects: dict) -> float:
    return sum(end - start for start, end, _ in objects.values()) / 1000


class Attempts:
    """Each compile attempt in this tree, rewritten every few seconds while it runs: how long it
    has run and the peak anonymous memory of every compile process together (this build's cgroup,
    sampled). A build that is killed leaves its line, so the attempt that finishes can report the
    whole compile: every attempt's time and the largest peak."""

    def __init__(self, tree: Path, found: int):
        self.path = tree.parent.parent / "attempts.json"
        try:
            self.earlier = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.earlier = []
        self.now = {"objects_found": found, "objects_reused": None, "seconds": 0, "peak_memory_mib": None}
        self.start = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> "Attempts":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self._write()

    def _beat(self) -> None:
        last_write = 0.0
        while not self.stop.wait(2):
            anon = build_memory_bytes()
            if anon is not None:
                self.now["peak_memory_mib"] = max(self.now["peak_memory_mib"] or 0, anon // 2 ** 20)
            if time.monotonic() - last_write >= HEARTBEAT_SECONDS:
                self._write()
                last_write = time.monotonic()

    def _write(self) -> None:
        self.now["seconds"] = round(time.monotonic() - self.start)
        tmp = self.path.with_name(self.path.name + ".envbuild-tmp")
        tmp.write_text(json.dumps([*self.earlier, self.now]) + "\n")
        os.replace(tmp, self.path)

    def facts(self) -> dict:
        every = [*self.earlier, self.now]
        peaks = [a["peak_memory_mib"] for a in every if a.get("peak_memory_mib") is not None]
        return {"attempts": len(every), "seconds_all_attempts": sum(a["seconds"] for a in every),
                "objects_reused": self.now["objects_reused"], "peak_memory_mib": max(peaks) if peaks else None}


def build_memory_bytes():
    """Anonymous memory of this build's cgroup now (every compile process together; page cache
    left out): cgroup v2's memory.stat `anon`, v1's `total_rss`; None where neither is readable."""
    for path, key in (("/sys/fs/cgroup/memory.stat", "anon"), ("/sys/fs/cgroup/memory/memory.stat", "total_rss")):
        try:
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def header_dirs(headers: list, cuda_home: str, site_dirs=None) -> list[str]:
    """The include directory of each header a compile needs beyond the toolkit's (Transformer
    Engine's cudnn.h and nccl.h): the CUDA toolkit's own, else the one of pip's nvidia-* wheels in
    the venv that holds it (torch's requirements: nvidia/cudnn/include, nvidia/nccl/include). A
    header neither has fails the build here, naming it, instead of a compile error later."""
    roots = [Path(cuda_home) / "include"] if cuda_home else []
    sites = site_dirs if site_dirs is not None else dict.fromkeys(sysconfig.get_paths()[k] for k in ("platlib", "purelib"))
    for site in sites:
        nvidia = Path(site) / "nvidia"
        roots += sorted(nvidia.glob("*/include")) + sorted(nvidia.glob("*/*/include"))
    out = []
    for header in headers:
        found = next((r for r in roots if (r / header).is_file()), None)
        if found is None:
            fail(f"the compile includes <{header}> and neither the CUDA toolkit ({cuda_home or 'none'}/include) nor a "
                 f"pip nvidia-* wheel in the venv (nvidia/*/include) has it")
        out.append(str(found))
    return list(dict.fromkeys(out))


def no_git(env: dict, work: Path) -> None:
    """FA3's hopper/setup.py runs `git submodule update --init` of its csrc/cutlass (line 389) whether or
    not its tree is a checkout, and dies on FileNotFoundError where there is no git (the CUDA devel
    images have none). A tree made from archives has no .git and its submodule is in place (its
    own pinned archive), so where the builder lacks git a stand-in answers as git does outside a
    repository (exit 128): nothing is fetched."""
    if shutil.which("git", path=env.get("PATH")):
        return
    stand_in = work / "no-git" / "git"
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    stand_in.write_text("#!/bin/sh\necho 'envbuild: no git here: the source tree was made from pinned archives' >&2\n"
                        "exit 128\n")
    stand_in.chmod(0o755)
    env["PATH"] = os.pathsep.join([str(stand_in.parent), *filter(None, [env.get("PATH")])])


def build_wheel(entry: dict, arch_list: str, cuda_home: str, work: Path, cache: Path) -> tuple[Path, dict]:
    """Compile the extension's sdist into a wheel; (wheel, build facts). pip downloads the sdist
    from the index (a mirror, if the build names one) and checks its sha256; the source is then
    unpacked in the cache (source_tree: an interrupted compile resumes), patched where the matrix
    says so, and built by pip in that tree."""
    jobs = max_jobs(entry["memory_per_job_gib"])
    archs = " ".join(a.replace(".", "") for a in arch_list.split(";") if a)
    env = dict(os.environ, MAX_JOBS=str(jobs), TORCH_CUDA_ARCH_LIST=arch_list, ENVBUILD_CUDA_ARCHS=archs,
               **entry["build_env"])
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    if entry.get("nvcc_threads"):
        env["NVCC_THREADS"] = str(entry["nvcc_threads"])
    if entry.get("build_headers"):
        env["CPATH"] = os.pathsep.join([*header_dirs(entry["build_headers"], cuda_home),
                                        *filter(None, [env.get("CPATH")])])
    tree = source_tree(entry, cache, env)
    if entry.get("archives"):
        no_git(env, work)
    before = finished_objects(tree)
    if before:
        log(f"{entry['name']} {entry['version']}: resuming an interrupted compile: {len(before)} objects finished "
            f"before ({compile_seconds(before) / 60:.0f} min of compile jobs); ninja compiles what is missing or older "
            f"than its inputs")
    log(f"{entry['name']} {entry['version']}: compiling for {arch_list} with MAX_JOBS={jobs} "
        f"({memory_bytes() / GIB:.1f} GiB available, {entry['memory_per_job_gib']} GiB per job)")
    out = work / "wheel"
    start = time.monotonic()
    with Attempts(tree, len(before)) as attempts:
        pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(tree), env=env)
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        fail(f"{entry['name']}: pip wheel made {len(wheels)} wheels, expected one")
    compiled = finished_objects(tree)
    kept = len(kept_objects(before, compiled))
    attempts.now["objects_reused"] = kept
    if before:
        log(f"{entry['name']}: kept {kept} objects of an earlier attempt, compiled {len(compiled) - kept}")
    facts = {"seconds": round(time.monotonic() - start), "max_jobs": jobs,
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,
             "objects": len(compiled), "compile_job_seconds": round(compile_seconds(compiled)),
             "slowest_objects": dict(sorted(((Path(o).name, round((e - b) / 1000)) for o, (b, e, _) in compiled.items()),
                                            key=lambda item: -item[1])[:3]),
             **attempts.facts()}
    return wheels[0], facts


def store(wheel: Path, entry: dict, cache: Path) -> None:
    """Into the cache atomically (a killed build leaves a temporary file a later build ignores)."""
    where = cache / entry["name"] / entry["cache_key"]
    where.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".envbuild-tmp-", dir=where))
    try:
        shutil.copy2(wheel, tmp / wheel.name)
        (tmp / wheel.with_suffix(".sha256").name).write_text(sha256(wheel) + "\n")
        os.replace(tmp / wheel.name, where / wheel.name)
        os.replace(tmp / wheel.with_suffix(".sha256").name, where / wheel.with_suffix(".sha256").name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def install(wheel: Path, entry: dict, work: Path) -> str:
    """pip install by hash, from the wheel's directory only; then its build-only requirements
    (ninja) leave its metadata, as DeepSpeed's do, so `pip check` stays true without them."""
    digest = sha256(wheel)
    req = work / "install.txt"
    req.write_text(f"{entry['name']}=={entry['version']} --hash=sha256:{digest}\n")
    pip("install", "--no-deps", "--require-hashes", "--no-index", "--find-links", str(wheel.parent), "-r", str(req))
    dist = metadata.distribution(entry["name"])
    meta = next(Path(f.locate()) for f in dist.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
    for name in entry["build_only"]:
        pattern = re.compile(rf"Requires-Dist: *{re.escape(name)}\b(?![-_.\w])", re.I)
        meta.write_text("".join(line for line in meta.read_text().splitlines(keepends=True) if not pattern.match(line)))
    return digest


def install_requires_lock(entry: dict, work: Path) -> list:
    """Install what the extension needs beyond the stack's lock (its own lock, matrices/locks/ext:
    FA4's CuTe DSL, quack-kernels, ...) by hash, before it; their pins join the image's extension
    lock, which the smoke test's `lock` check reads."""
    text = entry.get("requires_lock") or ""
    if not text:
        return []
    path = work / "requires-lock.txt"
    path.write_text(text)
    log(f"{entry['name']} {entry['version']}: installing what it needs beyond the stack's lock, by hash")
    pip("install", "--require-hashes", "--no-deps", "-r", str(path))
    return [text if text.endswith("\n") else text + "\n"]  # its blocks: name==version with every hash


# torch.ops.load_library wraps the loader's error (torch 2.x: OSError "Could not load this library")
# around ctypes' own (the missing library or symbol): both are said
LOAD_OP_LIBRARY = """import sys, torch
try:
    torch.ops.load_library(sys.argv[1])
except Exception as e:
    cause = e.__cause__ or e.__context__
    sys.exit(f"{type(e).__name__}: {e}" + (f" ({cause})" if cause and str(cause) not in str(e) else ""))
"""


def op_library_path(entry: dict, lib: str) -> Path:
    """Where a torch op library of the extension's distribution lies (`lib` is relative to
    site-packages, as the catalogue's op_libraries gives it), or the build fails naming it."""
    path = Path(metadata.distribution(entry["name"]).locate_file(lib))
    if not path.is_file():
        fail(f"{entry['name']}: its torch op library {lib} is not installed (no {path}): the catalogue's "
             f"op_libraries names a file its wheel does not bring")
    return path


def import_checks(entry: dict) -> list:
    """(what, python -c code, its arguments) for each check: each Python module is imported (a
    compiled one defines PyInit_<name>); each torch op library (no PyInit: it registers its ops with
    TORCH_LIBRARY, as xformers/_C.so) is loaded the way its package loads it, torch.ops.load_library,
    since importing it fails however sound it is, and its package only warns when it does not load."""
    checks = [(f"import {module}", f"import torch, importlib; importlib.import_module({module!r})", [])
              for module in [*entry["modules"], *entry["packages"]]]
    return checks + [(f"torch.ops.load_library({lib})", LOAD_OP_LIBRARY, [str(op_library_path(entry, lib))])
                     for lib in entry.get("op_libraries") or []]


def check_imports(entry: dict) -> None:
    """Each compiled module imports, and each op library loads, against the venv's torch, here,
    without a GPU: one built for another torch fails with `undefined symbol`, which this names."""
    for what, code, args in import_checks(entry):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            found = re.search(r"undefined symbol: (\S+)", r.stderr)
            if found:
                fail(f"{entry['name']}: `{what}` finds undefined symbol {found.group(1)}: it was compiled "
                     f"against another torch than this venv's ({last})")
            fail(f"{entry['name']}: `{what}` failed: {last}")
        log(f"{entry['name']}: {what} OK")


def shared_libraries(name: str) -> list[Path]:
    dist = metadata.distribution(name)
    return sorted(Path(f.locate()) for f in dist.files if f.name.endswith(".so") or ".so." in f.name)


def audit_libraries(entry: dict, arch_list: str, cuobjdump: str) -> dict:
    """One audit for a compiled wheel and a PyPI one: every shared library carries SASS for each
    arch (a host-only library, TE's torch binding, may carry none), needs no CUDA library of
    another major and no torch symbol this torch does not define; the build fails naming what
    does not fit."""
    libs = shared_libraries(entry["name"])
    if not libs and entry.get("device_code", True):
        fail(f"{entry['name']}: the wheel has no compiled library: the build compiled nothing")
    if not libs:
        return {"libraries": {}, "problems": [], "summary": "pure Python"}
    audit = (sass_audit.audit(libs, arch_list, cuobjdump, require_device_code=entry.get("device_code", True))
             if cuobjdump else {"libraries": {lib.name: [] for lib in libs}, "problems": [],
                                "summary": "host code only: no device code to list (no cuobjdump here)"})
    spec_origin = importlib.util.find_spec("torch")
    known = sass_audit.torch_symbols(Path(spec_origin.origin).parent / "lib") if spec_origin else None
    if known is not None:
        known |= {s for lib in libs for s in sass_audit.elf_dynamic(lib)[2]}  # its own libraries define some
    problems = [*audit["problems"], *(p for lib in libs for p in sass_audit.link_problems(lib, entry["cuda_major"], known))]
    if problems:
        fail(f"{entry['name']}: " + "; ".join(problems))
    log(f"{entry['name']}: SASS for {arch_list} in every library, CUDA {entry['cuda_major']} and this torch's "
        f"symbols only ({audit['summary']})")
    return audit


def remove_stale_trees(cache: Path) -> None:
    """An interrupted compile that no build has resumed for STALE_DAYS (its extension version or
    stack changed since) would hold its objects in the cache forever (flash-attn's: GBs)."""
    for partial in cache.glob(f"*/*/{PARTIAL}"):
        newest = max((p.stat().st_mtime for p in (partial, *partial.iterdir())), default=0)
        if time.time() - newest > STALE_DAYS * 86400:
            log(f"removing a compile interrupted {STALE_DAYS}+ days ago and never resumed: {partial}")
            shutil.rmtree(partial, ignore_errors=True)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    cache = Path(spec["cache"])
    cache.mkdir(parents=True, exist_ok=True)
    remove_stale_trees(cache)
    records, lock_lines = [], []
    if not spec["locked"]:  # a stack without a lock: what setup.py and the wheel need, unpinned
        needed = sorted({n for e in spec["extensions"] for n in (*e["requires"], *e["build_requires"])})
        if needed:
            pip("install", *needed)
    # only device code needs cuobjdump (render's rule ext-audit): a pure-Python wheel (FA4) or a
    # host-only library (TE's binding) is checked without it where the toolchain has none
    audited = any(e.get("device_code", True) for e in spec["extensions"])
    cuobjdump = sass_audit.find_cuobjdump(spec["cuda_home"]) if audited else sass_audit.which_cuobjdump(spec["cuda_home"])
    for entry in spec["extensions"]:
        work = Path(tempfile.mkdtemp(prefix=f"ext-{entry['name']}-", dir=os.environ.get("ENVBUILD_TMP")))
        lock_lines += install_requires_lock(entry, work)
        wheel = fetch_wheel(entry, work) if entry.get("wheel") else cached_wheel(entry, cache)
        if entry.get("wheel"):
            log(f"{entry['name']} {entry['version']}: PyPI's {wheel.name} fits this stack: audited, not compiled")
            facts = {"cache": "pypi-wheel", "url": entry["wheel"]["url"]}
        elif wheel is not None:
            log(f"{entry['name']} {entry['version']}: cached wheel {wheel.name} (key {entry['cache_key']}): not compiled again")
            # a compile cut off before this wheel came in from elsewhere (envbuild ext-cache load)
            shutil.rmtree(cache / entry["name"] / entry["cache_key"] / PARTIAL, ignore_errors=True)
            facts = {"cache": "hit"}
        else:
            built, facts = build_wheel(entry, spec["arch_list"], spec["cuda_home"], work, cache)
            store(built, entry, cache)
            shutil.rmtree(cache / entry["name"] / entry["cache_key"] / PARTIAL)  # the wheel replaces it
            wheel = cached_wheel(entry, cache) or built
            facts["cache"] = "miss"
            log(f"{entry['name']} {entry['version']}: built {wheel.name} in {facts['seconds']} s "
                f"(largest compile process {facts['peak_rss_mib']} MiB)")
        digest = install(wheel, entry, work)
        check_imports(entry)
        audit = audit_libraries(entry, spec["arch_list"], cuobjdump)
        records.append({"name": entry["name"], "version": entry["version"], "wheel": wheel.name, "sha256": digest,
                        "cache_key": entry["cache_key"], "arch_list": spec["arch_list"], "build": facts,
                        "sass": audit["libraries"], "determines": entry["determines"]})
        lock_lines.append(f"{entry['name']}=={entry['version']} --hash=sha256:{digest}\n")
        shutil.rmtree(work, ignore_errors=True)
    for path, text in ((spec["record"], json.dumps(records, indent=2, sort_keys=True) + "\n"),
                       (spec["lock"], "# [extensions] built in the builder stage; each wheel's sha256\n"
                                      + "".join(lock_lines))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


if __name__ == "__main__":
    main(sys.argv[1])
