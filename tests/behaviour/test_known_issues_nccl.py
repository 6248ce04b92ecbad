"""known_issues.yaml's NCCL quotes in the wording NCCL 2.27-2.30 print (the torch >= 2.8 stacks
pin NCCL 2.27.3 to 2.30.7): each line below is built from the format string at the named tag of
https://github.com/NVIDIA/nccl, as NCCL fills it in, with NCCL's usual line prefix."""

from __future__ import annotations

import pytest

from envbuild.doctor import diagnose_text, load_issues

from conftest import ROOT

ISSUES = load_issues(ROOT / "matrices")
PREFIX = "node1:4242:4300 [0] NCCL INFO "


def found(log: str, issue_id: str):
    return [f for f in diagnose_text(log, ISSUES) if f.issue.id == issue_id]


@pytest.mark.parametrize("line", [
    # src/plugin/net.cc ncclNetInit, v2.27.3-1 to v2.30.7-1: WARN("Failed to initialize any NET plugin")
    "node1:4242:4300 [0] net.cc:349 NCCL WARN Failed to initialize any NET plugin",
    # v2.20.5-1 to v2.26.6-1: WARN("Error: network %s not found.", netName)
    "node1:4242:4300 [0] net.cc:232 NCCL WARN Error: network IB not found.",
])
def test_an_unknown_nccl_net_is_found_in_old_and_new_wording(line):
    (finding,) = found(line + "\n", "nccl-net-not-found")
    assert "?" not in finding.title and "NCCL_NET" in finding.text("cause")


@pytest.mark.parametrize("missing", [
    "NET/Plugin: Could not find: libnccl-net.so. Using internal net plugin.",  # v2.26: ... Could not find:%s. %s
    "NET/Plugin: Could not find: libnccl-net.so. ",  # v2.27: the net fallback text is ""
    "NET/Plugin: Could not find: libnccl-net.so",  # v2.28-v2.30: Could not find:%s%s%s, fallback ""
    "NET/Plugin: Could not find: ofi libnccl-net-ofi.so",  # NCCL_NET_PLUGIN=ofi: each name tried
])
def test_a_net_plugin_loaded_on_one_node_only_is_found_in_every_wording(missing):
    log = (f"{PREFIX}NET/Plugin: Loaded net plugin NCCL RDMA Plugin v10 (v10)\n"  # net_v10.cc, all tags
           f"node2:4243:4301 [8] NCCL INFO {missing}\n")
    (finding,) = found(log, "net-plugin-partial")
    assert "libnccl-net" in finding.detail


@pytest.mark.parametrize("line, devices, topology", [
    # src/graph/topo.cc, v2.26.2-1 to v2.30.7-1 (INFO): NET/%s : GPU Direct RDMA %s for HCA %d '%s'
    ("NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'", "mlx5_0", False),
    # src/graph/paths.cc to v2.28.9-1: GPU Direct RDMA Disabled for GPU %d / HCA %lx (distance %d > %d)
    ("GPU Direct RDMA Disabled for GPU 0 / HCA 1a (distance 5 > 4)", "1a", True),
    # src/graph/paths.cc v2.29.2-1 to v2.29.7-1: "GPU Direct RDMA Disabled for %s", gpuNetMsg
    ("GPU Direct RDMA Disabled for GPU/0-1b000 (rank 0) - NET/0-1 (distance 7 > 5)", "0-1", True),
    ("GPU Direct RDMA Disabled for GPU/0-1b000 (rank 3) - NET/0-2 ( using PXN via GPU/0-3d000, distance 7 > 5)",
     "0-2", True),
])
def test_gpudirect_rdma_off_is_found_in_each_release_s_wording(line, devices, topology):
    (finding,) = found(PREFIX + line + "\n", "gpudirect-rdma-off")
    assert devices in finding.detail
    assert ("PCIe topology" in finding.text("cause")) == topology
