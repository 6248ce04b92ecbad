"""FA3 compiled from its GitHub source: extensions.yaml's `archives` (the flash-attention repository
at a release tag and the cutlass commit its csrc/cutlass submodule pins), each fetched by URL and
checked by the sha256 of its uncompressed tar stream before anything in it is used, as the
source-built fabrics are (the source_mirror secret stands in for https://github.com; here the
archives are served on 127.0.0.1). Refused until every archive is pinned (rule ext-source), on
any GPU but compute capability 9.0 (ext-gpu), and rendered for an H100 as an sm_90a-only build."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, build_step, run_here
from envbuild.base.errors import EnvbuildError
from envbuild.resolve.resolver import Request, resolve

FA_COMMIT = "a8aa52b1ab3e9ca574c8a33b3f35afc017ffa2e2"
CUTLASS_COMMIT = "dc4817921edda44a549197ff3a9dcf5df0636e7b"
UNPINNED_CUTLASS = "        path: csrc/cutlass\n"  # the cutlass archive's line after where its pin goes


def tar_stream(top: str, files: dict[str, bytes], dirs=()) -> bytes:
    """A tar stream like `git archive --prefix=TOP/` (sorted, mtime 0): its sha256 is the pin."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted({top, *(f"{top}/{d}" for d in dirs)}):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


FA_TAR = tar_stream(f"flash-attention-{FA_COMMIT}", {"setup.py": b"# flash-attn\n", "hopper/setup.py": b"# FA3\n"},
                    dirs=("hopper", "csrc", "csrc/cutlass"))  # git archive leaves a submodule an empty directory
CUTLASS_TAR = tar_stream(f"cutlass-{CUTLASS_COMMIT}", {"include/cutlass/cutlass.h": b"#pragma once\n"},
                         dirs=("include", "include/cutlass"))


def pinned_text(text: str, cutlass_sha: str) -> str:
    """extensions.yaml with the cutlass archive pinned to `cutlass_sha` (the shipped entry has no pin yet)."""
    assert text.count(UNPINNED_CUTLASS) == 1
    return text.replace(UNPINNED_CUTLASS, f"        tar_sha256: {cutlass_sha}\n{UNPINNED_CUTLASS}")


def fa3_entry(fa_sha: str, cutlass_sha: str) -> dict:
    """FA3's entry of extensions.json as the plan writes it, with these pins."""
    return {"name": "flash-attn-3", "version": "3.0.0b1", "cache_key": "0123456789abcdef", "subdirectory": "hopper",
            "patches": [], "sdist": None,
            "archives": [{"name": "flash-attention", "version": "v2.8.3.post1", "commit": FA_COMMIT, "path": ".",
                          "url": f"https://github.com/Dao-AILab/flash-attention/archive/{FA_COMMIT}.tar.gz",
                          "tar_sha256": fa_sha},
                         {"name": "cutlass", "version": "v3.9.2-18-gdc48179", "commit": CUTLASS_COMMIT,
                          "path": "csrc/cutlass", "url": f"https://github.com/NVIDIA/cutlass/archive/{CUTLASS_COMMIT}.tar.gz",
                          "tar_sha256": cutlass_sha}]}


@pytest.fixture
def mirror(tmp_path):
    """GitHub's archive paths served on 127.0.0.1 (as scripts/fabric-sources.sh serves a copy);
    yields (root, base URL, the paths requested)."""
    root = tmp_path / "mirror"
    for slug, commit, data in (("Dao-AILab/flash-attention", FA_COMMIT, FA_TAR), ("NVIDIA/cutlass", CUTLASS_COMMIT, CUTLASS_TAR)):
        path = root / slug / "archive" / f"{commit}.tar.gz"
        path.parent.mkdir(parents=True)
        path.write_bytes(gzip.compress(data, mtime=0))
    requested = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requested.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}", requested
    server.shutdown()


# ---------------------------------------------------------------- the data and the rules


def test_fa3_is_refused_until_each_of_its_archives_is_pinned(matrix):
    """The cutlass commit's tar stream could not be made here (the git mirror lacks one of its
    blobs): nothing is fetched without a checked hash, so FA3 stays refused, naming the archive."""
    assert matrix.extension("fa3").unpinned == ["cutlass"]
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="h100", extensions=("fa3",), stack="torch2.10-cu128-py3.12"))
    assert "cannot be built: no sha256 of the tar stream of its cutlass archive is recorded" in str(e.value), str(e.value)
    assert "`scripts/fabric-sources.sh make DIR cutlass` prints it" in str(e.value)


def test_fa3_archives_are_the_release_tag_and_the_cutlass_commit_it_pins(matrix):
    fa3 = matrix.extension("flash-attn-3")
    repo, cutlass = fa3.archives
    assert (repo.path, repo.version, repo.commit) == (".", "v2.8.3.post1", FA_COMMIT)
    assert repo.url == f"https://github.com/Dao-AILab/flash-attention/archive/{FA_COMMIT}.tar.gz"
    assert (cutlass.path, cutlass.commit) == ("csrc/cutlass", CUTLASS_COMMIT)
    assert fa3.sdist is None and fa3.subdirectory == "hopper" and fa3.stable_abi is None  # torch's C++ ABI
    assert fa3.build_env == {"FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTENTION_OFFLINE_BUILD": "TRUE",
                             "FLASH_ATTENTION_DISABLE_SM80": "TRUE"}
    assert (fa3.min_cc, fa3.max_cc, fa3.cuda, fa3.torch) == ("9.0", "9.0", "==12.8.*", ">=2.4,<2.13")


@pytest.mark.parametrize("old, new, said", [
    (f"archive/{FA_COMMIT}.tar.gz", f"archive/{CUTLASS_COMMIT}.tar.gz", "is not https://github.com/OWNER/REPO/archive/"),
    (f"https://github.com/Dao-AILab/flash-attention/archive/{FA_COMMIT}.tar.gz", "http://example.com/fa.tar.gz",
     "is not https://github.com/OWNER/REPO/archive/"),
    ("path: csrc/cutlass", "path: ../cutlass", "expected '.' or a path inside the tree"),
    ("path: csrc/cutlass", "path: .", "the first archive is the repository"),
    ("version: v2.8.3.post1", 'version: "v2.8.3 post1"', "expected letters, digits and ._+-"),  # one word in fabric-sources.sh's list
])
def test_an_archive_outside_its_grammar_is_refused_at_load_naming_it(matrix_copy, old, new, said):
    """A lab's extensions.yaml is input: an archive URL that is not GitHub's archive of the commit
    named (or a local copy), a path out of the tree or a second top is refused at load."""
    from envbuild.knowledge.matrix import load_matrix

    path = matrix_copy / "extensions.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "flash-attn-3" in e.value.message and said in e.value.message, e.value.message


def test_fa3_pinned_renders_for_h100_compiling_sm90a_only_from_its_archives(tmp_path):
    """With every archive pinned, FA3 renders for an H100 on the newest CUDA 12.8 stack (its
    setup.py's only nvcc that needs no download): the build step fetches the archives by URL
    (the source_mirror secret mounted), builds hopper/ with the sm_80 units left out, for 9.0
    only, and nvcc-arch.sh keeps setup.py's one -gencode, sm_90a. An A100 is still refused."""
    matrix_dir = tmp_path / "m"
    shutil.copytree(FIXTURE_MATRIX, matrix_dir)
    path = matrix_dir / "extensions.yaml"
    path.write_text(pinned_text(path.read_text(), hashlib.sha256(CUTLASS_TAR).hexdigest()))
    r = run_here("render", "--gpu", "h100", "--ext", "fa3", "--matrix-dir", str(matrix_dir), "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    spec = json.loads((tmp_path / "o" / "envbuild" / "extensions.json").read_text())
    (entry,) = spec["extensions"]
    assert spec["arch_list"] == "9.0" and entry["sdist"] is None and entry["subdirectory"] == "hopper"
    assert [(a["path"], a["url"]) for a in entry["archives"]] == [
        (".", f"https://github.com/Dao-AILab/flash-attention/archive/{FA_COMMIT}.tar.gz"),
        ("csrc/cutlass", f"https://github.com/NVIDIA/cutlass/archive/{CUTLASS_COMMIT}.tar.gz")]
    assert entry["build_env"]["FLASH_ATTENTION_DISABLE_SM80"] == "TRUE"
    assert entry["determines"]["archives"]["csrc/cutlass"]["tar_sha256"] == hashlib.sha256(CUTLASS_TAR).hexdigest()
    assert entry["determines"]["cuda"] == "12.8" and "sdist_sha256" not in entry["determines"]
    dockerfile = (tmp_path / "o" / "Dockerfile").read_text()
    lines = dockerfile.splitlines()
    step = next(i for i, line in enumerate(lines) if "bash /opt/envbuild-setup/extensions.sh" in line)
    run = next(line for line in reversed(lines[:step]) if line.startswith("RUN"))
    assert "--mount=type=secret,id=source_mirror" in run
    assert "GitHub archives pinned by their tar sha256 for 9.0 only" in dockerfile
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["stack"] == "torch2.10-cu128-py3.12"
    setup_gencode = ("-gencode", "arch=compute_90a,code=sm_90a")  # hopper/setup.py lines 439-441
    kept = subprocess.run(["bash", str(ROOT / "templates/files/steps/nvcc-arch.sh"), *setup_gencode, "-c", "k.cu"],
                          env=dict(os.environ, CUDA_HOME=str(_echo_nvcc(tmp_path)), ENVBUILD_CUDA_ARCHS="90"),
                          capture_output=True, text=True)
    assert kept.returncode == 0 and re.findall(r"code=(sm_\w+)", kept.stdout) == ["sm_90a"], kept.stderr
    refused = run_here("render", "--gpu", "a100", "--ext", "fa3", "--matrix-dir", str(matrix_dir), "-o", str(tmp_path / "a"))
    assert refused.returncode == 2 and "needs compute capability >= 9.0 and a100 is sm_80" in refused.stderr
    assert not (tmp_path / "a").exists()


def _echo_nvcc(tmp_path: Path) -> Path:
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text('#!/bin/sh\necho "$@"\n')
    (home / "bin" / "nvcc").chmod(0o755)
    return home


def test_the_listing_names_each_archive_and_says_which_has_no_pin():
    r = run_here("extensions")
    assert r.returncode == 0, r.stderr
    text = re.sub(r"\s+", " ", r.stdout.split("flash-attn-3 3.0.0b1", 1)[1].split("flash-attn-4", 1)[0])
    assert "source csrc/cutlass" in text and "tar stream sha256 not recorded" in text, text
    assert "(v2.8.3.post1; tar stream sha256 bd2deb78" in text, text


def test_fabric_sources_lists_the_extension_archives_with_their_pins():
    """scripts/fabric-sources.sh (make, serve) copies every GitHub source the matrix pins, the
    fabrics' and FA3's alike; an archive with no pin yet says '-'."""
    r = subprocess.run(["bash", str(ROOT / "scripts/fabric-sources.sh"), "list"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"cutlass NVIDIA/cutlass {CUTLASS_COMMIT} v3.9.2-18-gdc48179 - extension" in lines
    assert any(line.startswith(f"flash-attention Dao-AILab/flash-attention {FA_COMMIT} v2.8.3.post1 ") for line in lines)
    assert any(line.startswith("libfabric ") and line.endswith(" fabric") for line in lines)


def test_fabric_sources_make_says_the_sha256_to_record_for_an_archive_with_no_pin(tmp_path):
    """`make DIR cutlass` from a git mirror holding the commit: no pin is recorded, so it stops and
    says the tar stream's sha256 (what extensions.yaml's tar_sha256 then records); `make DIR`
    alone copies the fabrics' sources only, as before."""
    repo = tmp_path / "mirrors" / "NVIDIA+cutlass" / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "x.h").write_text("#pragma once\n")
    subprocess.run([*git, "add", "x.h"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True, env=dict(os.environ, GIT_COMMITTER_DATE="2020-01-01T00:00:00Z",
                                                                        GIT_AUTHOR_DATE="2020-01-01T00:00:00Z"))
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    extensions = tmp_path / "extensions.yaml"
    extensions.write_text((ROOT / "matrices/extensions.yaml").read_text().replace(CUTLASS_COMMIT, commit))
    env = dict(os.environ, FABRIC_MIRRORS=str(tmp_path / "mirrors"), ENVBUILD_EXTENSIONS_FILE=str(extensions))
    r = subprocess.run(["bash", str(ROOT / "scripts/fabric-sources.sh"), "make", str(tmp_path / "out"), "cutlass"],
                       env=env, capture_output=True, text=True)
    stream = subprocess.run([*git, "archive", "--format=tar", f"--prefix=cutlass-{commit}/", commit], capture_output=True,
                            check=True).stdout
    assert r.returncode == 1 and (f"no pin is recorded; its tar stream's sha256 is {hashlib.sha256(stream).hexdigest()}"
                                  in r.stderr), r.stderr
    r = subprocess.run(["bash", str(ROOT / "scripts/fabric-sources.sh"), "make", str(tmp_path / "out"), "nothing"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "no source is named nothing" in r.stderr, r.stderr


# ---------------------------------------------------------------- the build step


def test_the_build_fetches_each_archive_by_its_pin_and_places_the_submodule(tmp_path, mirror, monkeypatch):
    """The source_mirror base replaces https://github.com; each tar stream's sha256 is checked;
    cutlass goes where the repository's archive left its submodule an empty directory; the tree
    to build is hopper/, kept for a resumed compile (a second build downloads nothing)."""
    _, base, requested = mirror
    monkeypatch.setenv("ENVBUILD_SOURCE_MIRROR", base)
    step = build_step("extensions.py")
    entry = fa3_entry(hashlib.sha256(FA_TAR).hexdigest(), hashlib.sha256(CUTLASS_TAR).hexdigest())
    tree = step.source_tree(entry, tmp_path / "cache", {})
    assert tree.name == "hopper" and (tree / "setup.py").read_bytes() == b"# FA3\n"
    assert (tree.parent / "csrc" / "cutlass" / "include" / "cutlass" / "cutlass.h").is_file()
    assert requested == [f"/Dao-AILab/flash-attention/archive/{FA_COMMIT}.tar.gz",
                         f"/NVIDIA/cutlass/archive/{CUTLASS_COMMIT}.tar.gz"]
    assert step.source_tree(entry, tmp_path / "cache", {}) == tree and len(requested) == 2


def test_a_changed_tar_stream_stops_the_build_naming_both_hashes(tmp_path, mirror, monkeypatch, capsys):
    """The same files in another tar stream (one byte of cutlass changed) are not the pinned
    source: the build stops before anything in it is used, and no tree is stamped for a resume."""
    root, base, _ = mirror
    monkeypatch.setenv("ENVBUILD_SOURCE_MIRROR", base)
    changed = CUTLASS_TAR.replace(b"#pragma once\n", b"#pragma twice")
    (root / "NVIDIA/cutlass/archive" / f"{CUTLASS_COMMIT}.tar.gz").write_bytes(gzip.compress(changed, mtime=0))
    entry = fa3_entry(hashlib.sha256(FA_TAR).hexdigest(), hashlib.sha256(CUTLASS_TAR).hexdigest())
    with pytest.raises(SystemExit):
        build_step("extensions.py").source_tree(entry, tmp_path / "cache", {})
    said = capsys.readouterr().err
    assert (f"cutlass v3.9.2-18-gdc48179 from {base}/NVIDIA/cutlass/archive/{CUTLASS_COMMIT}.tar.gz: the tar's sha256 is "
            f"{hashlib.sha256(changed).hexdigest()}, the pin is {hashlib.sha256(CUTLASS_TAR).hexdigest()}") in said, said
    assert not list((tmp_path / "cache").rglob(".envbuild-unpacked"))


def test_an_archive_that_is_not_gzip_or_not_there_stops_the_build(tmp_path, mirror, monkeypatch, capsys):
    root, base, _ = mirror
    monkeypatch.setenv("ENVBUILD_SOURCE_MIRROR", base)
    (root / "Dao-AILab/flash-attention/archive" / f"{FA_COMMIT}.tar.gz").write_bytes(FA_TAR)  # not compressed
    entry = fa3_entry(hashlib.sha256(FA_TAR).hexdigest(), hashlib.sha256(CUTLASS_TAR).hexdigest())
    with pytest.raises(SystemExit):
        build_step("extensions.py").source_tree(entry, tmp_path / "cache", {})
    assert "is not a gzip-compressed tar" in capsys.readouterr().err
    (root / "Dao-AILab/flash-attention/archive" / f"{FA_COMMIT}.tar.gz").unlink()
    with pytest.raises(SystemExit):
        build_step("extensions.py").source_tree(entry, tmp_path / "cache2", {})
    assert f"could not download flash-attention v2.8.3.post1 from {base}/Dao-AILab" in capsys.readouterr().err


def test_a_submodule_path_holding_files_is_not_overwritten(tmp_path, mirror, monkeypatch, capsys):
    """cutlass goes only into the empty directory of a gitlink: a repository archive with files at
    that path is another source than the one pinned with it."""
    root, base, _ = mirror
    monkeypatch.setenv("ENVBUILD_SOURCE_MIRROR", base)
    other = tar_stream(f"flash-attention-{FA_COMMIT}", {"hopper/setup.py": b"# FA3\n", "csrc/cutlass/README": b"x\n"},
                       dirs=("hopper", "csrc", "csrc/cutlass"))
    (root / "Dao-AILab/flash-attention/archive" / f"{FA_COMMIT}.tar.gz").write_bytes(gzip.compress(other, mtime=0))
    with pytest.raises(SystemExit):
        build_step("extensions.py").source_tree(fa3_entry(hashlib.sha256(other).hexdigest(), hashlib.sha256(CUTLASS_TAR).hexdigest()),
                            tmp_path / "cache", {})
    assert "csrc/cutlass in flash-attention's archive is not the empty directory of a submodule" in capsys.readouterr().err


def test_setup_pys_git_submodule_call_meets_a_stand_in_where_the_builder_has_no_git(tmp_path):
    """hopper/setup.py line 389 runs `git submodule update --init ../csrc/cutlass` unconditionally:
    without git it would die on FileNotFoundError; the stand-in answers as git outside a
    repository does (exit 128) and fetches nothing. Where git exists, PATH is left alone."""
    step = build_step("extensions.py")
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {"PATH": str(bare)}
    step.no_git(env, tmp_path / "work")
    r = subprocess.run(["git", "submodule", "update", "--init", "../csrc/cutlass"], env=env, capture_output=True, text=True)
    assert r.returncode == 128 and "pinned archives" in r.stderr
    (bare / "git").write_text("#!/bin/sh\n")
    (bare / "git").chmod(0o755)
    kept = {"PATH": str(bare)}
    step.no_git(kept, tmp_path / "work2")
    assert kept == {"PATH": str(bare)}


def test_the_sbom_names_each_archive_a_wheel_was_compiled_from_with_its_tar_sha256():
    """The SBOM's pedigree of a wheel compiled from archives: each commit with the sha256 of its
    tar stream (what the build checked), not an sdist with no hash."""
    from envbuild.supply import sbom

    determines = {"archives": {".": {"commit": FA_COMMIT, "tar_sha256": "ab" * 32},
                               "csrc/cutlass": {"commit": CUTLASS_COMMIT, "tar_sha256": "cd" * 32}}}
    pedigree = sbom._built_pedigree({"name": "flash_attn_3", "version": "3.0.0b1"}, "flash-attn-3", determines)
    got = [(c.name, c.version, [h.content for h in c.hashes]) for c in pedigree.ancestors]
    assert got == [("flash_attn_3", FA_COMMIT, ["ab" * 32]), ("flash_attn_3 csrc/cutlass", CUTLASS_COMMIT, ["cd" * 32])]
    assert "GitHub archives" in pedigree.notes
