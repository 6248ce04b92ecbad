"""The smoke test's `nccl` and `nccl_copies` checks (envbuild/image/nccl.py).

torch and a real libnccl exist only in the images (tests/docker/test_docker_e2e.py runs the checks
there). Here the ctypes path runs for real on small shared libraries built with gcc that export
ncclGetVersion as NCCL does (`ncclResult_t ncclGetVersion(int *version)`, src/nccl.h.in), and
/proc/self/maps is a text laid out as the kernel writes it (proc(5)), naming those libraries.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from envbuild.image import nccl
from envbuild.image.report import Skipped

MANIFEST = {"nccl": "2.28.9"}

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="builds a shared library with gcc")


def build_library(path, code: int, soname: str = "libnccl.so.2"):
    """A shared library at `path` whose ncclGetVersion reports `code` (NCCL's integer encoding)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.parent / f"{path.name}.c"
    source.write_text(f"int ncclGetVersion(int *version) {{ if (!version) return 4; *version = {code}; return 0; }}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(path), str(source)], check=True,
                   capture_output=True)
    source.unlink()
    return str(path)


def maps_line(path: str, start: int = 0x7F2C1A000000, perms: str = "r-xp", inode: int = 1311234) -> str:
    """One /proc/PID/maps line: address range, permissions, offset, device, inode, path (proc(5))."""
    return f"{start:012x}-{start + 0x200000:012x} {perms} 00000000 08:01 {inode}                    {path}"


def maps_of(*paths: str) -> str:
    lines = [maps_line("/usr/bin/python3.12", 0x55D0C0000000, "r--p", 42),
             "7ffd3b5fe000-7ffd3b61f000 rw-p 00000000 00:00 0                          [stack]",
             "7f2c19000000-7f2c19100000 rw-p 00000000 00:00 0 "]
    for number, path in enumerate(paths):
        lines += [maps_line(path, 0x7F2C1A000000 + number * 0x1000000, perms) for perms in ("r--p", "r-xp", "rw-p")]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the version integer


@pytest.mark.parametrize(("code", "version"), [(2708, "2.7.8"), (2804, "2.8.4"), (20906, "2.9.6"),
                                               (22105, "2.21.5"), (22809, "2.28.9"), (23007, "2.30.7")])
def test_decode_of_released_versions(code, version):
    """2.8.4 is the last release with the old encoding, 2.9.6 the first with the new (their tags' nccl.h.in)."""
    assert nccl.decode_version(code) == version


# --------------------------------------------------------------------------- /proc/self/maps
def test_mapped_finds_each_nccl_once_and_nothing_that_only_looks_like_it():
    text = maps_of("/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
                   "/opt/amazon/ofi-nccl/lib/libnccl-net.so", "/usr/lib/x86_64-linux-gnu/libnccl_static.a",
                   "/opt/my libs/libnccl.so.2.21.5 (deleted)")
    assert nccl.mapped(text) == ["/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
                                 "/opt/my libs/libnccl.so.2.21.5"]
    assert nccl.mapped(text, nccl.STATIC_HOST) == []


# --------------------------------------------------------------------------- the loaded NCCL
@needs_gcc
def test_loaded_nccl_is_asked_its_own_version_and_torch_s_report_is_only_a_note(tmp_path):
    """The pip nightly of pytorch/builder#1666: torch said 2.18.1 while the wheel's 2.19.3 ran."""
    lib = build_library(tmp_path / "site-packages" / "nvidia" / "nccl" / "lib" / "libnccl.so.2", 21903)
    ok, detail, _, data = nccl.check_loaded({"nccl": "2.19.3"}, maps_of(lib), torch_reports="2.18.1")
    assert ok, detail
    assert f"NCCL 2.19.3 loaded dynamically from {lib}" in detail
    assert "torch.cuda.nccl.version() says 2.18.1" in detail
    assert data == {"path": lib, "version": "2.19.3", "linked": "dynamic", "torch_reports": "2.18.1"}


@needs_gcc
def test_a_loaded_nccl_other_than_the_manifest_s_fails_naming_the_file(tmp_path):
    """A job that printed NCCL 2.14.3 while torch said 2.19.3 (NVIDIA/nccl#1212): the library decides."""
    lib = build_library(tmp_path / "usr" / "lib" / "libnccl.so.2", 21403)
    ok, detail, _, data = nccl.check_loaded({"nccl": "2.19.3"}, maps_of(lib), torch_reports="2.19.3")
    assert not ok
    assert f"NCCL 2.14.3 loaded dynamically from {lib}" in detail and "manifest pins NCCL 2.19.3" in detail
    assert data["version"] == "2.14.3"


@needs_gcc
def test_an_old_encoding_is_decoded(tmp_path):
    lib = build_library(tmp_path / "libnccl.so.2", 2708)
    assert nccl.check_loaded({"nccl": "2.7.8"}, maps_of(lib))[0] is True


@needs_gcc
def test_a_static_nccl_is_asked_through_libtorch_cuda(tmp_path):
    """conda's torch links NCCL into libtorch_cuda.so (pytorch/pytorch#132617): no libnccl is mapped."""
    lib = build_library(tmp_path / "torch" / "lib" / "libtorch_cuda.so", 22809, soname="libtorch_cuda.so")
    ok, detail, _, data = nccl.check_loaded(MANIFEST, maps_of(lib), torch_reports="2.28.9")
    assert ok, detail
    assert f"NCCL 2.28.9 linked statically into torch from {lib}" in detail and data["linked"] == "static"
    assert "says" not in detail


@needs_gcc
def test_two_loaded_ncc_libraries_fail_naming_both_with_their_versions(tmp_path):
    first = build_library(tmp_path / "a" / "libnccl.so.2", 22809)
    second = build_library(tmp_path / "b" / "libnccl.so.2", 22803)
    ok, detail = nccl.check_loaded(MANIFEST, maps_of(first, second))
    assert not ok
    assert f"{first} (2.28.9)" in detail and f"{second} (2.28.3)" in detail


def test_no_nccl_at_all_fails_and_no_pin_skips(tmp_path):
    ok, detail = nccl.check_loaded(MANIFEST, maps_of(str(tmp_path / "libc.so.6")))
    assert not ok and "torch loaded no libnccl.so*" in detail and "2.28.9" in detail
    assert isinstance(nccl.check_loaded({"nccl": None}), Skipped)


# --------------------------------------------------------------------------- copies on disk
LDCONFIG = """\
3 libs found in cache `/etc/ld.so.cache'
\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1
\tlibnccl.so.2 (libc6,x86-64) => {lib}/libnccl.so.2
\tlibnccl-net.so (libc6,x86-64) => /opt/amazon/ofi-nccl/lib/libnccl-net.so
"""


@needs_gcc
def test_a_second_nccl_on_the_library_paths_fails_naming_each_file_and_version(tmp_path):
    """verl-project/verl#6621's image: the nvidia-nccl wheel's libnccl.so.2 in site-packages and
    the OS package's libnccl.so.2.28.3 (libnccl.so.2 a link to it) in /usr/lib/x86_64-linux-gnu."""
    site = tmp_path / "usr" / "local" / "lib" / "python3.12" / "dist-packages"
    wheel = build_library(site / "nvidia" / "nccl" / "lib" / "libnccl.so.2", 23004)
    system = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    real = build_library(system / "libnccl.so.2.28.3", 22803)
    os.symlink("libnccl.so.2.28.3", system / "libnccl.so.2")
    ok, detail = nccl.check_copies(MANIFEST, trees=[str(site)], dirs=[str(system)], ldconfig_text=LDCONFIG.format(lib=system))
    assert not ok
    assert f"{wheel} (2.30.4)" in detail
    assert f"{real} (also {system}/libnccl.so.2) (2.28.3)" in detail
    assert detail.startswith("2 NCCL libraries")


@needs_gcc
def test_one_nccl_passes_and_links_to_it_are_the_same_file(tmp_path):
    lib_dir = tmp_path / "venv" / "nvidia" / "nccl" / "lib"
    lib = build_library(lib_dir / "libnccl.so.2", 22809)
    os.symlink("libnccl.so.2", lib_dir / "libnccl.so")
    empty = tmp_path / "lib"
    empty.mkdir()
    ok, detail = nccl.check_copies(MANIFEST, trees=[str(tmp_path / "venv")], dirs=[str(empty), str(tmp_path / "none")],
                                   ldconfig_text=LDCONFIG.format(lib=lib_dir))
    assert ok, detail
    assert f"one NCCL in 1 site-packages, 2 library directories and ldconfig's cache: {lib} (also {lib_dir}/libnccl.so) (2.28.9)" == detail


@needs_gcc
def test_the_wheel_s_nccl_moved_to_its_layer_is_found_through_the_venv_s_symlink(tmp_path):
    """layers.sh moves site-packages/nvidia/nccl to /opt/envbuild-layers/nccl/nvidia/nccl and leaves
    a symlink: the walk follows it (the real CI image failed with 'no libnccl.so*' before), once."""
    layer = tmp_path / "layers" / "nccl" / "nvidia" / "nccl"
    lib = build_library(layer / "lib" / "libnccl.so.2", 23007)
    site = tmp_path / "venv" / "site-packages"
    (site / "nvidia").mkdir(parents=True)
    os.symlink(layer, site / "nvidia" / "nccl")
    os.symlink(site, site / "nvidia" / "loop")  # a link back into the tree is walked once
    ok, detail = nccl.check_copies(MANIFEST, trees=[str(site)], dirs=[], ldconfig_text="")
    assert ok, detail
    assert str(site / "nvidia" / "nccl" / "lib" / "libnccl.so.2") in detail and "(2.30.7)" in detail
    assert os.path.realpath(lib) == str(layer / "lib" / "libnccl.so.2")


def test_an_nccl_only_ldconfig_knows_counts_and_none_fails_where_one_is_pinned(tmp_path):
    elsewhere = tmp_path / "opt" / "nccl"
    elsewhere.mkdir(parents=True)
    (elsewhere / "libnccl.so.2").write_bytes(b"not ELF")
    ok, detail = nccl.check_copies(MANIFEST, trees=[], dirs=[], ldconfig_text=LDCONFIG.format(lib=elsewhere))
    assert ok and f"{elsewhere}/libnccl.so.2 (version unreadable:" in detail
    ok, detail = nccl.check_copies(MANIFEST, trees=[], dirs=[], ldconfig_text="")
    assert not ok and detail.startswith("no libnccl.so*")
    assert nccl.check_copies({}, trees=[], dirs=[], ldconfig_text="")[0] is True


def test_search_dirs_put_ld_library_path_first_and_fill_in_the_triplet():
    dirs = nccl.search_dirs({"LD_LIBRARY_PATH": "/opt/nccl/lib::relative:/usr/lib"}, ("/usr/lib", "/usr/lib/{triplet}"))
    assert dirs[:2] == ["/opt/nccl/lib", "/usr/lib"] and dirs[2].endswith("-linux-gnu") and len(dirs) == 3


@needs_gcc
def test_the_multinode_fingerprint_names_the_loaded_nccl_not_torch_s_header(tmp_path, monkeypatch):
    """Ranks compare the NCCL they loaded: torch.cuda.nccl.version() is the header torch was
    built with, the same on every rank even where one loads another library."""
    lib = build_library(tmp_path / "libnccl.so.2", 22809)
    monkeypatch.setattr(nccl, "_read_maps", lambda: maps_of(str(lib)))
    monkeypatch.setattr(nccl, "_torch_reports", lambda: "2.21.5")
    assert nccl.loaded_version() == "2.28.9"
    monkeypatch.setattr(nccl, "_read_maps", lambda: maps_of())  # nothing mapped: a static NCCL
    assert nccl.loaded_version() == "2.21.5"
