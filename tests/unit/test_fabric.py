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

from conftest import run_here
from envbuild.base.errors import EnvbuildError
from envbuild.image import fabric as image_fabric
from envbuild.knowledge.matrix import load_matrix
from envbuild.plan import stack_plan
from envbuild.resolve.resolver import Request, explain_rows, resolve

LIBC = "libc.so.6"  # a library every Linux machine can dlopen, standing in for a fabric's


def test_every_image_gets_the_default_fabric_in_a_layer_of_its_own(matrix):
    r = resolve(matrix, Request(gpu="h20"))
    plan = stack_plan(r)
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
    plan = stack_plan(r)
    assert r.tag.endswith("-h20-nofabric")
    assert [s.name for s in plan.runtime.steps] == ["os"]
    assert not any("ibverbs" in a for s in plan.runtime.steps for a in s.args)
    assert plan.manifest["fabric"]["libraries"] == [] and plan.manifest["fabric"]["transport"] == "Socket"
    assert not any(d.name == "NCCL_NET" for d in r.node_env)


def test_keep_toolchain_puts_the_fabric_into_the_builder_it_keeps(matrix):
    r = resolve(matrix, Request(gpu="h20", keep_toolchain=True))
    plan = stack_plan(r)
    assert "libibverbs1" in plan.builder.steps[0].args and plan.runtime.reuses_builder


def test_aws_efa_is_built_from_pinned_sources_in_the_builder_and_copied_whole(matrix):
    """aws-efa: rdma-core, libfabric and aws-ofi-nccl built before DeepSpeed (another op set keeps
    the layer), from the real URLs with each tar's sha256; the runtime takes both prefixes and
    registers them with the loader after the copy; no distro verbs (their libibverbs is too old
    for the efa provider and would shadow the built one)."""
    r = resolve(matrix, Request(gpu="h20", fabric="efa", ds_ops="cpu_adam"))
    plan = stack_plan(r)
    assert r.fabric.name == "aws-efa" and "-h20-efa-" in r.tag
    assert r.nvcc_reason.startswith("fabric aws-efa builds rdma-core, libfabric, aws-ofi-nccl")
    names = [s.name for s in plan.builder.steps]
    assert names.index("torch") < names.index("fabric") < names.index("deepspeed")
    assert names.index("cuda-toolkit") < names.index("fabric") if "cuda-toolkit" in names else plan.toolchain_home
    step = plan.builder.steps[names.index("fabric")]
    words = list(step.args)
    assert words[words.index("rdma-core") - 1:][:6] == [
        "source", "rdma-core", "version", "v64.0",
        "url", "https://github.com/linux-rdma/rdma-core/archive/f272237493ef309984036f7b85655e11104c61c8.tar.gz"]
    assert [words[i + 1] for i, w in enumerate(words) if w == "source"] == ["rdma-core", "libfabric", "aws-ofi-nccl"]
    # {prefix:rdma-core} is filled in at render time, the builder's {cuda} is left to fabric.sh
    assert "--enable-efa=/opt/amazon/efa" in words and "--with-cuda={cuda}" in words
    assert words[words.index("link") + 1] == "/opt/amazon/efa/lib/cudart/libcudart.so"
    assert "source_mirror" in step.secrets and dict(step.env)["CUDA_HOME"] == plan.toolchain_home
    assert {"cmake", "libnl-3-dev", "libhwloc-dev"} <= set(plan.builder.steps[0].args)
    assert "nvidia-nvml-dev==13.2.86 --hash=sha256:" in plan.generated_files["envbuild/fabric/headers.txt"]
    assert "/opt/amazon/efa" in plan.runtime.from_builder and "/opt/amazon/ofi-nccl" in plan.runtime.from_builder
    assert [s.name for s in plan.runtime.after_copy] == ["fabric-install"]
    packages = [a for s in plan.runtime.steps for a in s.args]
    assert "libhwloc15" in packages and not any("ibverbs" in a or "rdmacm" in a for a in packages)
    docker = plan.runtime.docker()
    assert docker.index("COPY --from=builder /opt/amazon/efa") < docker.index("fabric-install.sh")
    manifest = plan.manifest["fabric"]
    assert manifest["verbs_prefix"] == "/opt/amazon/efa" and manifest["transport"] == "Libfabric"
    assert [s["name"] for s in manifest["sources"]] == ["rdma-core", "libfabric", "aws-ofi-nccl"]
    pinned = [d for d in r.node_env if d.name == "NCCL_NET"]
    assert [(d.value, d.node.efa) for d in pinned] == [("Libfabric", "present")]


def test_aws_efa_apptainer_copies_the_prefixes_before_registering_them(matrix, tmp_path):
    r = run_here("render", "--gpu", "h20", "--fabric", "aws-efa", "--matrix-dir", str(_fixture_dir()),
                "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    definition = (tmp_path / "o" / "Singularity.standalone.def").read_text()
    assert "/opt/amazon/efa /opt/amazon/efa" in definition
    post = definition.split("%post", 2)[-1]
    assert "fabric-install.sh /etc/ld.so.conf.d/000-aws-efa.conf" in post
    assert (tmp_path / "o" / "envbuild" / "fabric" / "headers.txt").is_file()


@pytest.mark.parametrize("keep", [False, True])
def test_aws_efa_apptainer_takes_the_built_fabric_with_or_without_keep_toolchain(matrix, keep):
    """--keep-toolchain: Docker's runtime is the builder itself, but Apptainer's starts again
    from the builder's base, so it must copy the built prefixes and register them like the lean
    image does; before, its standalone definition had neither, and the image had no EFA."""
    plan = stack_plan(resolve(matrix, Request(gpu="h20", fabric="aws-efa", ds_ops="cpu_adam", keep_toolchain=keep)))
    sections = plan.runtime.apptainer()
    assert {"/opt/amazon/efa /opt/amazon/efa", "/opt/amazon/ofi-nccl /opt/amazon/ofi-nccl"} <= set(sections["from_builder"])
    post = "\n".join(sections["post"])
    assert "fabric-install.sh /etc/ld.so.conf.d/000-aws-efa.conf" in post
    if keep:  # the setup scripts are copied, registration runs, then they go
        assert post.index("fabric-install.sh") < post.index("rm -rf /opt/envbuild-setup")
        assert plan.runtime.docker() == "FROM builder AS runtime"


def test_the_source_mirror_is_a_secret_never_rendered(tmp_path):
    r = run_here("render", "--gpu", "h20", "--fabric", "aws-efa", "--matrix-dir", str(_fixture_dir()),
                "--source-mirror", "http://127.0.0.1:8799", "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    for f in (tmp_path / "o").rglob("*"):
        assert not f.is_file() or "127.0.0.1:8799" not in f.read_text(errors="replace"), f
    r = run_here("render", "--gpu", "h20", "--source-mirror", "ftp://mirror", "-o", str(tmp_path / "p"))
    assert r.returncode == 2 and "--source-mirror 'ftp://mirror' is not an http(s) URL" in r.stderr
    assert not (tmp_path / "p").exists()


def test_a_fabric_build_path_must_be_absolute(matrix_copy):
    text = (matrix_copy / "fabrics.yaml").read_text().replace("      prefix: /opt/amazon/efa", "      prefix: opt/amazon/efa", 1)
    (matrix_copy / "fabrics.yaml").write_text(text)
    with pytest.raises(EnvbuildError) as e:
        load_matrix(matrix_copy)
    assert "build.sources[0] (rdma-core).prefix: 'opt/amazon/efa': it is not an absolute path" in e.value.message


@pytest.fixture
def served(tmp_path):
    """A directory served over HTTP on 127.0.0.1, as scripts/fabric-sources.sh serves a mirror."""
    import functools
    import http.server
    import threading

    root = tmp_path / "mirror"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_fabric_sh_refuses_a_source_that_is_not_the_pinned_one(tmp_path, served):
    """The real step script, run here (bash, curl, gzip): the source_mirror secret replaces
    https://github.com, the tar stream's sha256 is checked against the pin, and a mismatch stops
    the build naming both hashes before anything is built or installed."""
    import hashlib
    import io
    import subprocess
    import tarfile

    from envbuild.base.resources import templates_dir

    root, mirror = served
    commit = "f272237493ef309984036f7b85655e11104c61c8"
    archive = root / "linux-rdma" / "rdma-core" / "archive" / f"{commit}.tar.gz"
    archive.parent.mkdir(parents=True)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = b"not rdma-core\n"
        info = tarfile.TarInfo(f"rdma-core-{commit}/README")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    import gzip

    archive.write_bytes(gzip.compress(raw.getvalue()))
    served_sha = hashlib.sha256(raw.getvalue()).hexdigest()
    pin = "87047eb4b0817e036fc1639fce4d3920add1200729f4a0f442e7572e128c9c15"
    cuda = tmp_path / "cuda"
    (cuda / "include").mkdir(parents=True)
    (cuda / "lib64").mkdir()
    for name in ("include/cuda.h", "include/cuda_runtime_api.h", "include/nvml.h", "lib64/libcudart_static.a"):
        (cuda / name).write_text("")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "source_mirror").write_text(mirror + "\n")
    efa = tmp_path / "efa"
    github = "https://github.com"
    args = ["ld-conf", str(tmp_path / "ld.conf"),
            "source", "rdma-core", "version", "v64.0", "url", f"{github}/linux-rdma/rdma-core/archive/{commit}.tar.gz",
            "sha256", pin, "build", "cmake", "prefix", str(efa), "option", "-GNinja",
            "source", "libfabric", "version", "v2.6.0", "url", f"{github}/ofiwg/libfabric/archive/{'0' * 40}.tar.gz",
            "sha256", "0" * 64, "build", "autotools", "prefix", str(efa), "option", "--with-cuda={cuda}"]
    env = {"PATH": os.environ["PATH"], "CUDA_HOME": str(cuda), "ENVBUILD_SECRETS_DIR": str(secrets),
           "no_proxy": "127.0.0.1"}
    r = subprocess.run(["bash", str(templates_dir() / "files" / "steps" / "fabric.sh"), *args], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert f"rdma-core v64.0 from {mirror}/linux-rdma/rdma-core/archive/{commit}.tar.gz" in r.stderr
    assert f"the tar's sha256 is {served_sha}, the pin is {pin}: not the pinned source" in r.stderr
    assert "the build stops" in r.stderr and not efa.exists()
    r = subprocess.run(["bash", str(templates_dir() / "files" / "steps" / "fabric.sh"), *args[:-2], "option"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "'option' takes a value" in r.stderr, r.stderr


def _fixture_dir() -> Path:
    from conftest import FIXTURE_MATRIX

    return Path(FIXTURE_MATRIX)


def test_azure_ndv5_bakes_the_vm_sizes_topology_file_and_azures_nccl_settings(matrix):
    r = resolve(matrix, Request(gpu="h100", fabric="ndv5"))
    plan = stack_plan(r)
    assert r.tag.endswith("-h100-ndv5")
    copied = {f.target: f.source for f in plan.image_files.files}
    assert copied["/opt/microsoft/ndv5-topo.xml"] == "envbuild/azure-ndv5-topo.xml"
    env = {e.name: e.value for e in r.env}
    assert env["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert "NCCL_IB_PCI_RELAXED_ORDERING" not in env  # Azure's 1 is NCCL's default 2: baking it changes nothing
    manifest = plan.manifest["fabric"]
    assert manifest["env"]["NCCL_IGNORE_CPU_AFFINITY"] == "1" and manifest["files"][0]["path"] == "/opt/microsoft/ndv5-topo.xml"
    assert "libibverbs1" in plan.runtime.steps[1].args


def test_a_fabric_for_other_gpus_is_rejected_by_rule_fabric_gpu_with_the_way_out(matrix):
    rows = explain_rows(matrix, Request(gpu="h20", fabric="azure-ndv5"))
    assert rows and all(v == "rejected" and "[fabric-gpu] fabric azure-ndv5 is for h100 nodes" in why
                        for _, v, why in rows)
    with pytest.raises(EnvbuildError) as e:
        resolve(matrix, Request(gpu="h20", fabric="azure-ndv5"))
    assert "Nearest valid choices: --gpu h100 with --fabric azure-ndv5, or --fabric ib" in e.value.message


def test_every_vendored_fabric_file_is_the_pinned_copy_of_its_public_source(production_matrix):
    """The topology file in templates/files is byte for byte the file at the pinned commit
    (its sha256 is in fabrics.yaml, read at the source); the URL names that commit."""
    import hashlib
    import re

    from envbuild.base.resources import templates_dir

    files = [f for fab in production_matrix.fabrics for f in fab.files]
    assert files
    for f in files:
        data = (templates_dir() / "files" / f.vendored).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256, f.vendored
        assert re.search(r"/blob/[0-9a-f]{40}/", f.url), f.url


def test_aliases_resolve_and_an_unknown_fabric_is_refused_with_the_choices(matrix):
    assert matrix.fabric("RoCE").name == "ib" and matrix.fabric(None).name == "ib"
    with pytest.raises(EnvbuildError) as e:
        matrix.fabric("inifiniband")
    assert "did you mean infiniband" in e.value.message and "Known fabrics: ib, aws-efa, azure-ndv5, none" in e.value.message


def test_render_refuses_an_unknown_fabric_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = run_here("render", "--gpu", "h20", "--fabric", "efaa", "-o", str(out))
    assert r.returncode == 2 and "--fabric 'efaa' is not a known fabric" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_render_summary_and_json_name_the_fabric(tmp_path):
    r = run_here("render", "--gpu", "h20", "--json", "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fabric"]["name"] == "ib" and doc["fabric"]["transport"] == "IB"
    r = run_here("render", "--gpu", "h20", "-o", str(tmp_path / "p"))
    assert "fabric       ib: NCCL net IB (libibverbs1" in r.stdout


class _NoAliases(yaml.SafeDumper):
    """Writes a value shared by two entries out twice: envbuild's loader refuses YAML aliases."""

    def ignore_aliases(self, data):
        return True


def _with_fabric(matrix_dir: Path, **changes) -> None:
    path = matrix_dir / "fabrics.yaml"
    data = yaml.safe_load(path.read_text())
    data["fabrics"].append({**data["fabrics"][0], "name": "test-fabric", "aliases": [], "tag": "tf", **changes})
    path.write_text(yaml.dump(data, Dumper=_NoAliases, sort_keys=False))


def test_a_fabric_the_os_cannot_carry_is_rejected_by_rule_fabric_os(matrix_copy):
    _with_fabric(matrix_copy, needs=["rdma", "efa-userspace"])
    bases = yaml.safe_load((matrix_copy / "bases.yaml").read_text())
    bases["families"]["ubuntu22.04"]["capabilities"]["efa-userspace"] = {"runtime": ["libfabric1"]}
    (matrix_copy / "bases.yaml").write_text(yaml.safe_dump(bases, sort_keys=False))
    m = load_matrix(matrix_copy)
    rows = explain_rows(m, Request(gpu="h20", fabric="test-fabric"))
    debian = [why for stack, verdict, why in rows if "py3.11-pypi" in stack]
    assert debian and all("[fabric-os] fabric test-fabric needs efa-userspace packages" in w for w in debian)
    r = run_here("render", "--gpu", "h20", "--fabric", "test-fabric", "--stack", "torch2.11-cu130-py3.11-pypi",
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


def test_a_fabric_with_its_own_rdma_core_is_checked_in_its_prefix(tmp_path):
    """aws-efa registers its providers in PREFIX/etc/libibverbs.d, not /etc: the check looks there."""
    prefix = tmp_path / "opt/amazon/efa"
    (prefix / "etc/libibverbs.d").mkdir(parents=True)
    (prefix / "etc/libibverbs.d/efa.driver").write_text("driver efa\n")
    (prefix / "lib/libibverbs").mkdir(parents=True)
    lib = next(p for p in (Path("/lib/x86_64-linux-gnu/libm.so.6"), Path("/lib/aarch64-linux-gnu/libm.so.6"),
                           Path("/usr/lib64/libm.so.6")) if p.exists())
    shutil.copy(lib, prefix / "lib/libibverbs/libefa-rdmav64.so")
    ok, detail = image_fabric.check_fabric(_manifest(providers=["efa"], verbs_prefix=str(prefix)), environ={})
    assert ok is True, detail
    ok, detail = image_fabric.check_fabric(_manifest(providers=["efa", "mlx5"], verbs_prefix=str(prefix)), environ={})
    assert ok is False and f"provider mlx5 is not registered in {prefix}/etc/libibverbs.d" in detail


def test_a_baked_file_missing_or_changed_fails_the_check(tmp_path):
    """NCCL_TOPO_FILE naming no file is ignored by NCCL without a word: the check says it."""
    import hashlib

    topo = tmp_path / "topo.xml"
    topo.write_text("<system/>\n")
    pinned = hashlib.sha256(topo.read_bytes()).hexdigest()
    fabric = dict(env={"NCCL_TOPO_FILE": str(topo)}, files=[{"path": str(topo), "sha256": pinned}])
    ok, detail = image_fabric.check_fabric(_manifest(**fabric), environ={"NCCL_TOPO_FILE": str(topo)})
    assert ok is True, detail
    topo.write_text("<system>changed</system>\n")
    ok, detail = image_fabric.check_fabric(_manifest(**fabric), environ={"NCCL_TOPO_FILE": str(topo)})
    assert ok is False and "is not the one the fabric pins" in detail
    topo.unlink()
    ok, detail = image_fabric.check_fabric(_manifest(**fabric), environ={"NCCL_TOPO_FILE": str(topo)})
    assert ok is False and f"NCCL_TOPO_FILE={topo} names no file" in detail and "No such file" in detail


def test_a_baked_file_over_one_mib_is_hashed_whole(tmp_path):
    """Only the first MiB was hashed: a pinned file larger than that never matched its pin, and a
    change after the first MiB went unseen."""
    import hashlib

    big = tmp_path / "topo.xml"
    big.write_bytes(b"<system>" + b" " * (1 << 20) + b"</system>\n")
    fabric = dict(files=[{"path": str(big), "sha256": hashlib.sha256(big.read_bytes()).hexdigest()}])
    assert image_fabric.file_problems(fabric) == []
    big.write_bytes(b"<system>" + b" " * (1 << 20) + b"</changed>\n")
    assert "is not the one the fabric pins" in image_fabric.file_problems(fabric)[0]


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
