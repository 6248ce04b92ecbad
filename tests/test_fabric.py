"""Fabrics: the profiles as data (fabrics.yaml), their rules, what a render puts in the image,
and the in-image `fabric` check against real shared libraries of this machine."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from envbuild.errors import EnvbuildError
from envbuild.image import fabric as image_fabric
from envbuild.matrix import load_matrix
from envbuild.plan import build_plan
from envbuild.resolve import Request, explain_rows, resolve

LIBC = "libc.so.6"  # a library every Linux machine can dlopen, standing in for a fabric's


def test_every_image_gets_the_default_fabric_in_a_layer_of_its_own(matrix):
    r = resolve(matrix, Request(gpu="h20"))
    plan = build_plan(r)
    assert r.fabric.name == "ib" and not r.tag.endswith(("-ib", "-nofabric"))
    steps = plan.runtime.steps
    assert [s.name for s in steps] == ["os", "os"]
    assert "libibverbs1" not in steps[0].args  # the OS layer is shared by every fabric variant
    assert {"libibverbs1", "ibverbs-providers", "ibverbs-utils"} <= set(steps[1].args)
    assert steps[1].comment.startswith("fabric ib:")
    manifest = plan.manifest["fabric"]
    assert manifest["transport"] == "IB" and "libibverbs.so.1" in manifest["libraries"]
    assert manifest["packages"] == list(steps[1].args)
    assert dict(plan.labels.pairs)["io.envbuild.fabric"] == "ib"
    pinned = [d for d in r.node_env if d.name == "NCCL_NET"]
    assert pinned and pinned[0].value == "IB" and pinned[0].node.infiniband == "present" and pinned[0].node.efa == "absent"


def test_fabric_none_carries_no_rdma_and_says_so_in_its_tag(matrix):
    r = resolve(matrix, Request(gpu="h20", fabric="none"))
    plan = build_plan(r)
    assert r.tag.endswith("-h20-nofabric")
    assert [s.name for s in plan.runtime.steps] == ["os"]
    assert not any("ibverbs" in a for s in plan.runtime.steps for a in s.args)
    assert plan.manifest["fabric"]["libraries"] == [] and plan.manifest["fabric"]["transport"] == "Socket"
    assert not any(d.name == "NCCL_NET" for d in r.node_env)


def test_keep_toolchain_puts_the_fabric_into_the_builder_it_keeps(matrix):
    r = resolve(matrix, Request(gpu="h20", keep_toolchain=True))
    plan = build_plan(r)
    assert "libibverbs1" in plan.builder.steps[0].args and plan.runtime.reuses_builder


def test_aliases_resolve_and_an_unknown_fabric_is_refused_with_the_choices(matrix):
    assert matrix.fabric("RoCE").name == "ib" and matrix.fabric(None).name == "ib"
    with pytest.raises(EnvbuildError) as e:
        matrix.fabric("inifiniband")
    assert "did you mean infiniband" in e.value.message and "Known fabrics: ib, none" in e.value.message


def test_render_refuses_an_unknown_fabric_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = run_cli("render", "--gpu", "h20", "--fabric", "efaa", "-o", str(out))
    assert r.returncode == 2 and "--fabric 'efaa' is not a known fabric" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_render_summary_and_json_name_the_fabric(tmp_path):
    r = run_cli("render", "--gpu", "h20", "--json", "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fabric"]["name"] == "ib" and doc["fabric"]["transport"] == "IB"
    r = run_cli("render", "--gpu", "h20", "-o", str(tmp_path / "p"))
    assert "fabric       ib: NCCL net IB (libibverbs1" in r.stdout


def _with_fabric(matrix_dir: Path, **changes) -> None:
    path = matrix_dir / "fabrics.yaml"
    data = yaml.safe_load(path.read_text())
    data["fabrics"].append({**data["fabrics"][0], "name": "test-fabric", "aliases": [], "tag": "tf", **changes})
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_a_fabric_the_os_cannot_carry_is_rejected_by_rule_fabric_os(matrix_copy):
    _with_fabric(matrix_copy, needs=["rdma", "efa-userspace"])
    bases = yaml.safe_load((matrix_copy / "bases.yaml").read_text())
    bases["families"]["ubuntu22.04"]["capabilities"]["efa-userspace"] = {"runtime": ["libfabric1"]}
    (matrix_copy / "bases.yaml").write_text(yaml.safe_dump(bases, sort_keys=False))
    m = load_matrix(matrix_copy)
    rows = explain_rows(m, Request(gpu="h20", fabric="test-fabric"))
    debian = [why for stack, verdict, why in rows if "py3.11-pypi" in stack]
    assert debian and all("[fabric-os] fabric test-fabric needs efa-userspace packages" in w for w in debian)
    r = run_cli("render", "--gpu", "h20", "--fabric", "test-fabric", "--stack", "torch2.11-cu130-py3.11-pypi",
                "--matrix-dir", str(matrix_copy), "--print-tag")
    assert r.returncode == 2 and "efa-userspace packages" in r.stderr, r.stderr


def test_a_fabric_whose_plugin_needs_another_nccl_is_rejected_by_rule_fabric_nccl(matrix_copy):
    _with_fabric(matrix_copy, requires={"nccl": ">=2.99", "source": "a test"})
    m = load_matrix(matrix_copy)
    rows = explain_rows(m, Request(gpu="h20", fabric="test-fabric"))
    assert all(verdict == "rejected" and "[fabric-nccl] fabric test-fabric needs NCCL >=2.99" in why
               for _, verdict, why in rows)
    with pytest.raises(EnvbuildError) as e:
        resolve(m, Request(gpu="h20", fabric="test-fabric"))
    assert "needs NCCL >=2.99" in e.value.message


def test_the_matrix_refuses_a_fabric_need_no_os_provides_and_duplicate_names(matrix_copy):
    _with_fabric(matrix_copy, needs=["warp-drive"], aliases=["roce"])
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "name 'roce' is used by both ib and test-fabric" in e.value.message
    assert "needs names 'warp-drive'" in e.value.message


def test_the_production_fabrics_need_only_what_every_os_release_provides(production_matrix):
    for f in production_matrix.fabrics:
        for family, spec in production_matrix.bases.families.items():
            assert all(n in spec.capabilities for n in f.needs), (f.name, family)


# ----------------------------------------------------------------------------- the in-image check


def _manifest(**fabric) -> dict:
    base = {"name": "ib", "transport": "IB", "libraries": [LIBC], "providers": [], "net_plugins": [],
            "tools": ["sh"], "env": {}}
    return {"fabric": {**base, **fabric}}


def test_check_passes_when_everything_loads_and_says_no_device_is_a_result():
    ok, detail = image_fabric.check_fabric(_manifest(), environ={})
    assert ok is True and ("no RDMA device on this node" in detail or "RDMA devices" in detail), detail


def test_check_fails_naming_each_missing_library_tool_and_plugin(tmp_path):
    ok, detail = image_fabric.check_fabric(_manifest(libraries=[LIBC, "libibverbs-gone.so.1"],
                                                     tools=["sh", "ibv_nowhere"],
                                                     net_plugins=[str(tmp_path / "libnccl-net.so")]), environ={})
    assert ok is False
    assert "libibverbs-gone.so.1: " in detail and "cannot open shared object file" in detail
    assert "tool ibv_nowhere is not on PATH" in detail and "libnccl-net.so is missing" in detail
    assert "fall back to TCP sockets" in detail


def test_providers_must_be_registered_and_load(tmp_path, monkeypatch):
    drivers = tmp_path / "etc"
    drivers.mkdir()
    (drivers / "mlx5.driver").write_text("driver mlx5\n")
    (drivers / "bad.driver").write_text("driver bad\n")
    libdir = tmp_path / "usr/lib/x86_64-linux-gnu/libibverbs"
    libdir.mkdir(parents=True)
    real = Path(sys.executable).resolve()  # any loadable ELF would do: copy a real shared library
    lib = next(p for p in (Path("/lib/x86_64-linux-gnu/libm.so.6"), Path("/lib/aarch64-linux-gnu/libm.so.6"),
                           Path("/usr/lib64/libm.so.6")) if p.exists())
    shutil.copy(lib, libdir / "libmlx5-rdmav34.so")
    (libdir / "libbad-rdmav34.so").write_bytes(real.read_bytes()[:64])  # an ELF header and nothing else
    registered = image_fabric.registered_providers(str(drivers))
    assert registered == {"mlx5", "bad"}
    assert image_fabric.provider_problem("mlx5", registered, root=str(tmp_path)) is None
    assert "not registered" in image_fabric.provider_problem("efa", registered, root=str(tmp_path))
    assert image_fabric.provider_problem("bad", registered, root=str(tmp_path)).startswith("provider bad: ")


def test_a_plugin_with_a_missing_library_is_named(tmp_path):
    """A stand-in `ldd` prints what the real one prints for an unresolved dependency (building a
    plugin with a dangling DT_NEEDED would need a compiler the CI machine may lack)."""
    plugin = tmp_path / "libnccl-net.so"
    plugin.write_bytes(b"\x7fELF")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ldd").write_text("#!/bin/sh\necho '\tlibfabric.so.1 => not found'\necho '\tlibc.so.6 => /lib/libc.so.6'\n")
    (bindir / "ldd").chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    old = os.environ["PATH"]
    os.environ["PATH"] = env["PATH"]
    try:
        why = image_fabric.plugin_problem(str(plugin), env)
    finally:
        os.environ["PATH"] = old
    assert why == f"net plugin {plugin} needs libfabric.so.1, which the image lacks"


def test_real_ldd_resolves_a_real_library():
    lib = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/lib/aarch64-linux-gnu/libm.so.6",
                           "/usr/lib64/libm.so.6") if os.path.exists(p))
    assert image_fabric.plugin_problem(lib) is None


def test_env_that_contradicts_the_fabric_fails_the_check():
    ok, detail = image_fabric.check_fabric(_manifest(name="none", transport="Socket", libraries=[], tools=[]),
                                           environ={"NCCL_NET": "IB"})
    assert ok is False and "NCCL_NET=IB asks for a net this image (fabric none) does not carry" in detail
    ok, detail = image_fabric.check_fabric(_manifest(env={"FI_PROVIDER": "efa"}), environ={})
    assert ok is False and "FI_PROVIDER (the fabric's FI_PROVIDER=efa) did not reach this process" in detail


def test_rdma_devices_never_raises_without_devices():
    names, how = image_fabric.rdma_devices()
    assert isinstance(names, list) and how


def test_older_manifests_skip():
    from envbuild.image.report import Skipped

    assert isinstance(image_fabric.check_fabric({}), Skipped)
