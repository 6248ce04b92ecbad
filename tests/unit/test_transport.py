"""The smoke test's `transport` check: NCCL's INFO log read on real output from public threads
(tests/fixtures/nccl, each with its source in INDEX.yaml), the verdict on each kind of node, and
the child process run under a hard timeout (a child that hangs: tests/process/test_transport_hang.py).

No GPU exists here, so check_transport's child is a stand-in (a small Python script that writes
a real fixture where NCCL would write its debug file); each test that uses it says so. The
lines written in this file are NCCL's own format strings rendered, for wordings no public
thread shows (each names the NCCL source file and release it comes from).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import yaml

from conftest import ROOT
from envbuild.image import netverdict, transport
from envbuild.image.nccllog import net_family, parse_nccl_info
from envbuild.image.netverdict import transport_verdict
from envbuild.image.report import Skipped, run_check
from envbuild.image.transport import check_transport

FIXTURES = ROOT / "tests" / "fixtures" / "nccl"
INDEX = yaml.safe_load((FIXTURES / "INDEX.yaml").read_text())["logs"]
FABRICS = {f["name"]: f for f in yaml.safe_load((ROOT / "matrices" / "fabrics.yaml").read_text())["fabrics"]}
IB = FABRICS["ib"]
NONE = FABRICS["none"]
# The aws-efa profile as /tmp/research/FABRIC_SCHEMA.md describes it (matrices/ has none yet).
EFA = {"name": "aws-efa", "transport": "Libfabric", "net_env": {"NCCL_NET": "Libfabric"}, "providers": ["efa"],
       "net_plugins": ["/opt/amazon/ofi-nccl/lib/libnccl-net.so"], "env": {"FI_PROVIDER": "efa"},
       "device_drivers": ["efa"]}
UNLIMITED = {"memlock": -1, "dev_infiniband": True}


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def parsed(name: str) -> dict:
    return parse_nccl_info(fixture(name))


# --- the parser on every real log ------------------------------------------------------------


def test_index_and_folder_agree_and_every_log_has_a_public_source():
    listed = {e["file"] for e in INDEX}
    assert listed == {p.name for p in FIXTURES.glob("*.log")}
    for entry in INDEX:
        assert entry["source"].startswith("https://github.com/"), entry["file"]
        assert entry["cause"] and entry["expect"]
    cases = {e["expect"]["net"] for e in INDEX}
    assert {"IB", "Socket", "Libfabric", "AWS Libfabric", "IBext"} <= cases  # IB, RoCE, EFA and Socket
    assert any("RoCE" in e["expect"]["links"] for e in INDEX)


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_parser_reads_what_the_thread_shows(entry):
    p = parsed(entry["file"])
    want = entry["expect"]
    assert p["net"] == want["net"]
    assert p["version"] == entry["nccl"]
    assert [d["name"] for d in p["ib_devices"]] == want["devices"]
    assert p["link_layers"] == want["links"]
    assert p["socket_interfaces"] == want["interfaces"]
    assert p["ofi_provider"] == want["ofi_provider"]
    for key in ("ofi_nics", "ofi_version"):
        if key in want:
            assert p[key] == want[key]
    assert {kind for kind, _ in p["reasons"]} == set(want["reasons"])
    assert p["init_error"] is None  # no public log here shows a pinned init failure (see below)


def test_the_reasons_are_nccls_own_words():
    assert parsed("nccl-451-socket-device-open.log")["reasons"] == [
        ("device-open", "Call to ibv_open_device failed"),
        ("device-open", "NET/IB : Unable to open device mlx5_bond_0"),
        ("no-device", "NET/IB : No device found.")]
    ofi = [w for k, w in parsed("aws-ofi-nccl-889-efa-socket.log")["reasons"] if k == "ofi-failed"]
    assert "NET/OFI Creating new endpoint for domain 0x7f7dc3a992c0 failed: Invalid argument" in ofi
    assert "NET/OFI aws-ofi-nccl initialization failed" in ofi


def test_plugin_messages_are_the_net_plugins_only():
    hpcx = parsed("nccl-941-ibext-socket-container.log")["plugins"]
    assert "NET/Plugin: Loaded net plugin NCCL RDMA Plugin (v5)" in hpcx and "P2P plugin IBext" in hpcx
    assert "Plugin Path : /opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so" in hpcx
    new_api = parsed("nccl-1925-ib-plugin-api.log")["plugins"]
    assert {"Initialized NET plugin IB", "Assigned NET plugin IB to comm", "NET/Plugin: Could not find: libnccl-net.so"} \
        <= set(new_api)
    assert not any("PROFILER" in m for m in parsed("nccl-1597-efa.log")["plugins"])
    # collnet symbols missing are no reason for a fallback
    assert parsed("nccl-527-efa.log")["reasons"] == []


def test_a_log_of_many_processes_that_disagree_has_no_single_net():
    p = parse_nccl_info(fixture("nccl-tests-182-ib.log") + fixture("nccl-1410-socket-no-verbs.log"))
    assert p["net"] is None and p["nets"] == ["IB", "Socket"]


def test_wordings_from_nccls_source_that_no_public_log_shows():
    """Rendered from NCCL's format strings: v2.30 src/misc/ibvsymbols.cc ("Count not open %s", sic),
    v2.24+ src/transport/net_ib ("NET/IB : Using%s %s; OOB %s:%s" printed with no device after
    "No device found."), v2.27+ src/plugin/net.cc and v2.18-2.26 src/net.cc (a pinned NCCL_NET
    that no net satisfies), v2.29+ src/plugin/plugin_open.cc (a plugin whose dependency is missing)."""
    v230 = parse_nccl_info("""h:7:8 [0] NCCL INFO Count not open libibverbs.so
h:7:8 [0] NCCL INFO Count not open libibverbs.so.1
h:7:8 [0] NCCL INFO Failed to initialize NET plugin IB
h:7:8 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
h:7:8 [0] NCCL INFO Initialized NET plugin Socket
h:7:8 [0] NCCL INFO Using network Socket""")
    assert v230["net"] == "Socket"
    assert [k for k, _ in v230["reasons"]] == ["verbs-missing", "verbs-missing", "plugin-failed"]
    empty_ib = parse_nccl_info("h:7:8 [0] NCCL INFO NET/IB : No device found.\n"
                               "h:7:8 [0] NCCL INFO NET/IB : Using [RO]; OOB eth0:10.0.0.5<0>")
    assert empty_ib["ib_devices"] == [] and empty_ib["link_layers"] == []
    for warn in ("Failed to initialize any NET plugin", "Error: network IB not found."):
        pinned = parse_nccl_info("h:7:8 [0] transport/net_ib/init.cc:334 NCCL WARN NET/IB : Unable to open device mlx5_0\n"
                                 "h:7:8 [0] NCCL INFO NET/IB : No device found.\n"
                                 f"h:7:8 [0] plugin/net.cc:349 NCCL WARN {warn}")
        assert pinned["init_error"] == warn and pinned["nets"] == []
    dep = parse_nccl_info("h:7:8 [0] NCCL INFO NET/Plugin: libnccl-net.so: libfabric.so.1: cannot open shared "
                          "object file: No such file or directory")
    assert dep["reasons"][0][0] == "plugin-failed"  # the plugin is there, a library it needs is not


def test_net_families():
    assert [net_family(n) for n in ("IB", "IBext", "IBext_v8", "Libfabric", "AWS Libfabric", "OFI", "Socket", "gIB")] \
        == ["IB", "IB", "IB", "OFI", "OFI", "OFI", "Socket", "gIB"]


# --- the verdict -----------------------------------------------------------------------------

MLX = {"mlx5_0": "mlx5_core"}
EFA_NICS = {"rdmap16s27": "efa", "rdmap32s27": "efa"}

VERDICTS = [
    # (fixture, fabric, node's RDMA devices, node facts, ok, words the detail must contain)
    ("nccl-tests-182-ib.log", IB, MLX, UNLIMITED, True, ["NCCL 2.19.3 chose IB (mlx5_0:1/IB)"]),
    ("nccl-tests-185-roce.log", IB, {"mlx5_10": "mlx5_core", "mlx5_11": "mlx5_core"}, UNLIMITED, True,
     ["mlx5_10:1/RoCE, mlx5_11:1/RoCE"]),
    ("nccl-1357-ibext-sharp.log", IB, MLX, UNLIMITED, True, ["IBext (mlx5_0:1/IB"]),
    ("dstack-2712-ib-fixed.log", IB, MLX, UNLIMITED, True, ["NCCL 2.26.2 chose IB"]),
    ("nccl-1267-socket-no-rdma.log", IB, {}, UNLIMITED, True, ["Socket (ens7:10.128.0.31)", "no RDMA device"]),
    ("nccl-1410-socket-no-verbs.log", IB, {}, UNLIMITED, True, ["expected"]),
    ("nccl-1410-socket-no-verbs.log", IB, MLX, UNLIMITED, False,
     ["although this node has RDMA devices mlx5_0", "'Failed to open libibverbs.so[.1]'", "--fabric ib"]),
    ("nccl-tests-166-socket-no-verbs.log", IB, MLX, UNLIMITED, False, ["libibverbs"]),
    ("nccl-451-socket-device-open.log", IB, {"mlx5_bond_0": "mlx5_core"}, {"dev_infiniband": False}, False,
     ["'NET/IB : Unable to open device mlx5_bond_0'", "/dev/infiniband is missing in this container",
      "--device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1"]),
    ("nccl-941-ibext-socket-container.log", IB, MLX, UNLIMITED, False, ["'NET/IB : No device found.'", "PORT_ACTIVE"]),
    ("imagereward-65-ib-partial-open.log", IB, {"mlx5_1": "", "mlx5_18": "", "mlx5_58": "", "mlx5_59": ""},
     UNLIMITED, True, ["could not open some devices", "mlx5_59"]),
    ("nccl-1925-ib-plugin-api.log", IB, MLX, UNLIMITED, True, ["chose IB (mlx5_0:1/IB)"]),
    ("nccl-1925-ib-plugin-api.log", IB, MLX, {"memlock": 64 << 10}, False, ["64 KiB", "--ulimit memlock=-1"]),
    ("nccl-527-efa.log", EFA, EFA_NICS, UNLIMITED, True, ["AWS Libfabric (provider efa)"]),
    ("nccl-1597-efa.log", EFA, EFA_NICS, UNLIMITED, True, ["Libfabric (provider efa, 16 NICs)"]),
    ("aws-ofi-nccl-715-efa-socket.log", EFA, EFA_NICS, UNLIMITED, False,
     ["'NET/OFI aws-ofi-nccl initialization failed'", "unset NCCL_IB_DISABLE", "--device /dev/infiniband"]),
    ("aws-ofi-nccl-889-efa-socket.log", EFA, EFA_NICS, UNLIMITED, False, ["Creating new endpoint", "rdmap16s27"]),
    ("aws-ofi-nccl-803-efa-tcp-provider.log", EFA, EFA_NICS, UNLIMITED, False,
     ["libfabric's tcp provider, not efa", "NCCL 2.23.4 could not initialise"]),
    # an ib image on an EFA node: NCCL's IB transport cannot drive EFA, sockets it is
    ("aws-ofi-nccl-889-efa-socket.log", IB, EFA_NICS, UNLIMITED, False, ["not the kind fabric ib drives", "aws-efa"]),
    # the none fabric promises sockets: its Socket is no fallback, even on an RDMA node
    ("nccl-1410-socket-no-verbs.log", NONE, MLX, UNLIMITED, True, ["fabric none provides TCP sockets"]),
]


@pytest.mark.parametrize("name,fabric,rdma,node,ok,words", VERDICTS,
                         ids=[f"{v[0]}-{v[1]['name']}-{'rdma' if v[2] else 'nordma'}-{v[4]}" for v in VERDICTS])
def test_verdict(name, fabric, rdma, node, ok, words):
    got, detail = transport_verdict(parsed(name), fabric, rdma, node=node)
    assert got is ok, detail
    for word in words:
        assert word in detail, (word, detail)


def test_socket_chosen_by_the_environment_is_no_fallback():
    ok, detail = transport_verdict(parsed("nccl-1410-socket-no-verbs.log"), IB, MLX, node={"user_net": "Socket"})
    assert ok and "NCCL_NET=Socket is set" in detail


def test_a_pinned_transport_that_cannot_initialise_is_reported_in_nccls_words():
    """NCCL 2.27+ (src/plugin/net.cc) with NCCL_NET=IB and a container without the devices;
    the lines are NCCL's format strings rendered, as no public log shows this case."""
    log = ("h:7:8 [0] misc/ibvwrap.cc:120 NCCL WARN Call to ibv_open_device failed\n"
           "h:7:8 [0] transport/net_ib/init.cc:334 NCCL WARN NET/IB : Unable to open device mlx5_0\n"
           "h:7:8 [0] NCCL INFO NET/IB : No device found.\n"
           "h:7:8 [0] NCCL INFO Failed to initialize NET plugin IB\n"
           "h:7:8 [0] plugin/net.cc:349 NCCL WARN Failed to initialize any NET plugin\n")
    ok, detail = transport_verdict(parse_nccl_info(log), IB, MLX, pinned={"NCCL_NET": "IB"},
                                   node={"dev_infiniband": False})
    assert not ok
    assert "could not initialise with NCCL_NET=IB pinned: 'Failed to initialize any NET plugin'" in detail
    assert "'NET/IB : Unable to open device mlx5_0'" in detail and "--cap-add IPC_LOCK" in detail


def test_processes_that_chose_different_nets_fail():
    mixed = parse_nccl_info(fixture("nccl-tests-182-ib.log") + fixture("nccl-1410-socket-no-verbs.log"))
    ok, detail = transport_verdict(mixed, IB, MLX, node=UNLIMITED)
    assert not ok and "different nets (IB, Socket)" in detail


def test_rdma_devices_are_told_apart_by_their_kernel_driver(tmp_path):
    for name, driver in (("mlx5_0", "mlx5_core"), ("rdmap16s27", "efa")):
        device = tmp_path / "sys/class/infiniband" / name / "device"
        device.mkdir(parents=True)
        (device / "driver").symlink_to(f"/sys/bus/pci/drivers/{driver}")
    rdma = transport.node_rdma(str(tmp_path))
    assert rdma == {"mlx5_0": "mlx5_core", "rdmap16s27": "efa"}
    assert netverdict.fabric_devices(IB, rdma) == ["mlx5_0"] and netverdict.fabric_devices(EFA, rdma) == ["rdmap16s27"]
    assert transport.node_rdma(str(tmp_path / "absent")) == {}


# --- check_transport: the child under a hard timeout -----------------------------------------

STUB = r'''
import json, os, shutil, socket, subprocess, sys, time
fixture, mode, result, seen = sys.argv[1:5]
json.dump({k: os.environ.get(k) for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_NET")},
          open(seen, "w"))
if mode == "crash":
    sys.exit(3)
path = os.environ["NCCL_DEBUG_FILE"].replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
shutil.copy(fixture, path)
if mode == "hang":
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(seen + ".pid", "w").write(str(grandchild.pid))
    time.sleep(300)
json.dump({"ok": mode == "ok", "stage": "all_reduce", "nccl": "2.19.3",
           "detail": "" if mode == "ok" else "DistBackendError: NCCL error: unhandled system error"}, open(result, "w"))
sys.exit(0 if mode == "ok" else 1)
'''


@pytest.fixture
def stub(tmp_path):
    """A stand-in for the NCCL child (no GPU here): writes a real fixture where NCCL_DEBUG_FILE
    points, records the environment it got, and exits, fails, crashes or hangs."""
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    seen = tmp_path / "seen.json"

    def make(name: str, mode: str = "ok"):
        return lambda result, timeout: [sys.executable, str(script), str(FIXTURES / name), mode, result, str(seen)]

    make.seen = seen
    return make


def run(manifest, stub_command, tmp_path, facts, environ=None, timeout=60.0, gpus=1):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return check_transport(manifest, gpus, SimpleNamespace(timeout=timeout), str(work),
                           environ={"PATH": os.environ["PATH"], **(environ or {})}, command=stub_command, facts=facts)


def seen(stub) -> dict:
    import json

    return json.loads(stub.seen.read_text())


def test_cpu_mode_and_old_manifests_skip():
    assert isinstance(check_transport({"fabric": IB}, 0, SimpleNamespace(timeout=5), "/nonexistent"), Skipped)
    assert isinstance(check_transport({}, 1, SimpleNamespace(timeout=5), "/nonexistent"), Skipped)
    assert run_check("transport", check_transport, {"fabric": IB}, 0, SimpleNamespace(timeout=5), "/x")["skipped"]


def test_rdma_node_pins_the_fabric_and_reports_the_fallback(stub, tmp_path):
    """Stand-in child (no GPU here) writing the real log of NVIDIA/nccl#451."""
    facts = {"rdma": {"mlx5_bond_0": "mlx5_core"}, "memlock": -1, "dev_infiniband": False}
    ok, detail, _, data = run({"fabric": IB}, stub("nccl-451-socket-device-open.log", "ok"), tmp_path, facts)
    env = seen(stub)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET,ENV"
    assert env["NCCL_NET"] == "IB" and data["pinned"] == {"NCCL_NET": "IB"}
    assert env["NCCL_DEBUG_FILE"].endswith("/transport/nccl.%h.%p.log")
    assert not ok and "Unable to open device mlx5_bond_0" in detail and "--device /dev/infiniband" in detail
    assert data["net"] == "Socket" and data["child"] == "done"


def test_ib_node_passes_with_the_devices_named(stub, tmp_path):
    """Stand-in child (no GPU here) writing the real log of NVIDIA/nccl-tests#182."""
    facts = {"rdma": MLX, "memlock": -1, "dev_infiniband": True}
    ok, detail, _, data = run({"fabric": IB}, stub("nccl-tests-182-ib.log"), tmp_path, facts)
    assert ok, detail
    assert "NCCL 2.19.3 chose IB (mlx5_0:1/IB) (NCCL_NET=IB pinned)" in detail
    assert data["ib_devices"] == [{"name": "mlx5_0", "port": 1, "link": "IB"}] and data["nccl"] == "2.19.3"


def test_node_without_rdma_is_not_pinned_and_passes_on_sockets(stub, tmp_path):
    """Stand-in child (no GPU here) writing the real log of NVIDIA/nccl#1267 (a GCP VM)."""
    ok, detail, _, data = run({"fabric": IB}, stub("nccl-1267-socket-no-rdma.log"), tmp_path,
                              {"rdma": {}, "memlock": 8 << 20, "dev_infiniband": False})
    assert seen(stub)["NCCL_NET"] is None and data["pinned"] == {}
    assert ok and "no RDMA device on this node" in detail


def test_the_users_nccl_net_is_never_overridden(stub, tmp_path):
    """Stand-in child (no GPU here)."""
    ok, detail, _, data = run({"fabric": IB}, stub("nccl-1410-socket-no-verbs.log"), tmp_path,
                              {"rdma": MLX, "memlock": -1, "dev_infiniband": True}, environ={"NCCL_NET": "Socket"})
    assert seen(stub)["NCCL_NET"] == "Socket" and data["pinned"] == {}
    assert ok and "by choice" in detail


def test_a_transport_that_is_right_but_an_all_reduce_that_fails_is_a_failure(stub, tmp_path):
    """Stand-in child (no GPU here): the log says IB, the child says the collective failed."""
    ok, detail, _, _ = run({"fabric": IB}, stub("nccl-tests-182-ib.log", "fail"), tmp_path,
                           {"rdma": MLX, "memlock": -1, "dev_infiniband": True})
    assert not ok and "the all_reduce failed (stage all_reduce): DistBackendError" in detail


def test_a_child_that_dies_before_nccl_speaks_is_reported(stub, tmp_path):
    """Stand-in child (no GPU here) that exits 3 before NCCL writes anything."""
    ok, detail, _, _ = run({"fabric": IB}, stub("nccl-tests-182-ib.log", "crash"), tmp_path,
                           {"rdma": MLX, "memlock": -1, "dev_infiniband": True})
    assert not ok and detail.startswith("NCCL never started") and "exit 3" in detail


def test_the_real_child_runs_isolated_and_reports_a_missing_torch(tmp_path):
    """The real child command (python -I importing this package): this machine has no torch, so
    the child stops at its first stage and the check says so instead of blaming NCCL."""
    argv = transport.child_command(str(tmp_path / "r.json"), 30)
    assert argv[0] == sys.executable and argv[1] == "-I"
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: the child would try to use a GPU")
    ok, detail, _, data = check_transport({"fabric": IB}, 1, SimpleNamespace(timeout=60), str(tmp_path),
                                          facts={"rdma": {}, "memlock": -1, "dev_infiniband": False})
    assert not ok and "NCCL never started (child stage import torch" in detail and "ModuleNotFoundError" in detail
