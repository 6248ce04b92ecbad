"""The transport check's verdict: is the net NCCL chose (nccllog.py) the one a multi-node job
on this node needs, given the image's fabric and the node's RDMA devices? If not, NCCL's
reasons and the fix, most specific first. Kept apart from the check's child process
(transport.py) so it can be judged from any parsed log.
"""

from __future__ import annotations

from .container import MEMLOCK_FLOOR
from .nccllog import net_family

RDMA_TRANSPORTS = ("IB", "OFI", "gIB")
CONTAINER_FLAGS = ("docker run --device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1 (Kubernetes: "
                   "mount /dev/infiniband or use an RDMA device plugin, with capability IPC_LOCK; Slurm+pyxis/"
                   "enroot: MELLANOX_VISIBLE_DEVICES=all)")


# ----------------------------------------------------------------------------- the fabric's devices
def fabric_devices(fabric: dict, rdma: dict[str, str]) -> list[str]:
    """The node's RDMA devices this fabric drives: by the profile's kernel drivers when known,
    else EFA devices for an OFI fabric and every other RDMA device for the rest.

    >>> fabric_devices({"transport": "IB"}, {"mlx5_0": "mlx5_core", "rdmap0": "efa"})
    ['mlx5_0']
    >>> fabric_devices({"transport": "Libfabric"}, {"mlx5_0": "mlx5_core", "rdmap0": "efa"})
    ['rdmap0']
    """
    drivers = fabric.get("device_drivers") or fabric.get("device_driver") or []
    efa = net_family(fabric.get("transport")) == "OFI"
    out = []
    for name, driver in sorted(rdma.items()):
        if drivers and driver:
            if driver in drivers:
                out.append(name)
        elif driver.endswith("efa") == efa:
            out.append(name)
    return out


# ----------------------------------------------------------------------------- the verdict
def _fix(kinds: set[str], fabric: dict, node: dict) -> str:
    """The remedy for the reasons NCCL gave, most specific first."""
    fixes = []
    if "verbs-missing" in kinds:
        fixes.append("the image cannot load libibverbs (rdma-core's verbs library, which NCCL dlopens): use an image "
                     "built with the ib fabric (`envbuild build ... --fabric ib`); the smoke `fabric` check names "
                     "what is missing")
    if "ib-disabled" in kinds:
        fixes.append("unset NCCL_IB_DISABLE (it is 1 here)")
    if "no-ip" in kinds:
        fixes.append("NCCL's IB transport needs an IP interface for its out-of-band exchange: set NCCL_SOCKET_IFNAME "
                     "to an interface with an address")
    if "plugin-missing" in kinds and net_family(fabric.get("transport")) not in ("IB", "Socket"):
        plugins = ", ".join(fabric.get("net_plugins") or []) or "libnccl-net.so"
        fixes.append(f"NCCL did not find the net plugin: set NCCL_NET_PLUGIN to its path or put its directory on "
                     f"LD_LIBRARY_PATH (this fabric's plugin: {plugins})")
    if kinds & {"device-open", "no-device", "plugin-failed", "ofi-failed", "ofi-provider", "unknown"}:
        missing = "" if node.get("dev_infiniband", True) else "/dev/infiniband is missing in this container: "
        fixes.append(f"{missing}give the container the RDMA devices: {CONTAINER_FLAGS}")
        if "no-device" in kinds:
            fixes.append("and check that `ibv_devinfo` shows a port in state PORT_ACTIVE")
    return "; ".join(fixes)


def reason_words(reasons: list, limit: int = 4) -> str:
    """NCCL's reasons in its own words, quoted, at most `limit` (a hung check quotes them too)."""
    shown = [f"'{words}'" for _, words in reasons[:limit]]
    more = f" (+{len(reasons) - limit} more)" if len(reasons) > limit else ""
    return ", ".join(shown) + more if shown else "none at INFO level"


def _chosen(parsed: dict) -> str:
    """'IB (mlx5_0:1/IB)', 'Socket (eth0:10.0.0.1)', 'Libfabric (provider efa, 16 NICs)'."""
    net = parsed.get("net") or "/".join(parsed.get("nets") or []) or "no net"
    family = net_family(parsed.get("net"))
    if family == "IB" and parsed.get("ib_devices"):
        what = ", ".join(f"{d['name']}:{d['port']}/{d['link']}" for d in parsed["ib_devices"])
    elif family == "Socket" and parsed.get("socket_interfaces"):
        what = ", ".join(parsed["socket_interfaces"])
    elif family == "OFI" and parsed.get("ofi_provider"):
        nics = f", {parsed['ofi_nics']} NICs" if parsed.get("ofi_nics") else ""
        what = f"provider {parsed['ofi_provider']}{nics}"
    else:
        return net
    return f"{net} ({what})"


def transport_verdict(parsed: dict, fabric: dict, rdma_devices, *, pinned: dict | None = None,
                      node: dict | None = None) -> tuple[bool, str]:
    """Is the net NCCL chose the one a multi-node job on this node needs? (ok, detail).

    `rdma_devices`: the node's RDMA devices (a list, or {name: driver}); `pinned`: the variables
    the check pinned ({} when NCCL chose freely); `node`: ``memlock`` (bytes, -1 unlimited),
    ``dev_infiniband`` (the device directory exists in this container) and ``user_net`` (an
    NCCL_NET the environment already set: NCCL_NET=Socket is a choice, not a fallback).

    >>> sock = {"net": "Socket", "nets": ["Socket"], "socket_interfaces": ["eth0:10.0.0.2"],
    ...         "reasons": [("no-device", "NET/IB : No device found.")]}
    >>> transport_verdict(sock, {"name": "ib", "transport": "IB"}, [])[0]
    True
    >>> transport_verdict(sock, {"name": "ib", "transport": "IB"}, ["mlx5_0"])[0]
    False
    """
    v = _Verdict(parsed, fabric, rdma_devices, pinned or {}, node or {})
    if parsed.get("init_error") or not parsed.get("nets"):
        return v.not_initialised()
    chosen = {net_family(n) for n in parsed["nets"]}
    if len(chosen) > 1:
        return False, (f"the processes chose different nets ({', '.join(parsed['nets'])}): NCCL's reasons: "
                       f"{reason_words(v.reasons)}. Fix: {v.fix()}")
    got = chosen.pop()
    return v.over_sockets() if got == "Socket" else v.over(got)


class _Verdict:
    """What every verdict's words need, decided once from the log, the fabric and the node."""

    def __init__(self, parsed: dict, fabric: dict, rdma_devices, pinned: dict, node: dict) -> None:
        self.parsed, self.fabric, self.node = parsed, fabric, node
        self.rdma = (dict(rdma_devices) if isinstance(rdma_devices, dict)
                     else {name: "" for name in rdma_devices or []})
        self.want = net_family(fabric.get("transport")) or "IB"
        self.name = fabric.get("name") or "?"
        self.version = f"NCCL {parsed['version']}" if parsed.get("version") else "NCCL"
        plugin_net = self.want not in ("IB", "Socket")  # a missing libnccl-net.so only matters where a plugin is the net
        self.reasons = [r for r in parsed.get("reasons") or [] if plugin_net or r[0] != "plugin-missing"]
        self.kinds = {kind for kind, _ in self.reasons}
        self.pin = " ".join(f"{k}={v}" for k, v in sorted(pinned.items()))
        self.pinned_words = f" ({self.pin} pinned)" if self.pin else ""
        self.mine = fabric_devices(fabric, self.rdma) if self.rdma else []
        self.here = (f"RDMA devices here: {', '.join(sorted(self.rdma))}" if self.rdma
                     else "no RDMA device on this node")
        self.provider = parsed.get("ofi_provider")
        expected = (fabric.get("env") or {}).get("FI_PROVIDER") if isinstance(fabric.get("env"), dict) else None
        self.expected = expected or ("efa" if "efa" in (fabric.get("providers") or []) or self.name == "aws-efa"
                                     else None)
        self.wrong_provider = bool(self.provider and self.expected and self.provider != self.expected)
        if self.wrong_provider:
            self.reasons.insert(0, ("ofi-provider",
                                    f"NET/OFI selected libfabric's {self.provider} provider, not {self.expected}"))
            self.kinds.add("ofi-provider")

    def fix(self) -> str:
        return _fix(self.kinds or {"unknown"}, self.fabric, self.node)

    def not_initialised(self) -> tuple[bool, str]:
        """No net at all: NCCL's init error (or no 'Using network' line) and its reasons."""
        parsed = self.parsed
        words = (f"'{parsed['init_error']}'" if parsed.get("init_error")
                 else "no 'Using network' line (NCCL did not finish choosing a net)")
        how = f"with {self.pin} pinned" if self.pin else "with the image's environment"
        return False, (f"{self.version} could not initialise {how}: {words}. NCCL's reasons: "
                       f"{reason_words(self.reasons)}. {self.here}. Fix: {self.fix()}")

    def over_sockets(self) -> tuple[bool, str]:
        """TCP: right where the fabric is TCP, the user chose it or the node has no RDMA device."""
        version, name, here, rdma = self.version, self.name, self.here, self.rdma
        what = _chosen(self.parsed)
        if self.want == "Socket":
            note = f"; the image's fabric is {name}, so a multi-node job here runs over TCP" if rdma else ""
            return True, f"{version} chose {what}: fabric {name} provides TCP sockets; {here}{note}"
        user = self.node.get("user_net")
        if user and net_family(user) == "Socket":
            return True, (f"{version} chose {what}: NCCL_NET={user} is set in this environment, so a multi-node job "
                          f"runs over TCP by choice; {here}")
        if not rdma:
            return True, (f"{version} chose {what}{self.pinned_words}: {here}, so TCP sockets are what a multi-node "
                          f"job gets here (expected); on a node with {self.fabric.get('transport')} devices this "
                          f"check pins the fabric's transport")
        if not self.mine:
            other = ", ".join(f"{d} ({rdma[d] or 'driver unknown'})" for d in sorted(rdma))
            better = "aws-efa" if any(d.endswith("efa") for d in rdma.values()) else "matching this node's devices"
            return False, (f"{version} chose {what}: this node's RDMA devices {other} are not the kind fabric {name} "
                           f"drives, so a multi-node job would run over TCP. Fix: build the image with the fabric "
                           f"{better} (`envbuild render --fabric ...`; `envbuild fabrics` lists them)")
        return False, (f"{version} chose {what}{self.pinned_words} although this node has RDMA devices "
                       f"{', '.join(self.mine)}: a multi-node job would run over TCP at a fraction of the bandwidth. "
                       f"NCCL's reasons: {reason_words(self.reasons)}. Fix: {self.fix()}")

    def over(self, got: str) -> tuple[bool, str]:
        """An RDMA net (or a plugin's): the fabric's, over the right provider, with buffers it can register."""
        version, what, pinned_words = self.version, _chosen(self.parsed), self.pinned_words
        if got != self.want and self.want != "Socket":
            return False, (f"{version} chose {what}{pinned_words}, but fabric {self.name} promises "
                           f"{self.fabric.get('transport')}. NCCL's reasons: {reason_words(self.reasons)}. "
                           f"Fix: {self.fix()}")
        if got == "OFI" and self.wrong_provider:
            return False, (f"{version} chose {what}: the OFI plugin runs over libfabric's {self.provider} provider, "
                           f"not {self.expected}, i.e. TCP. Fix: {_fix({'ofi-provider'}, self.fabric, self.node)}, "
                           f"and check that `fi_info -p {self.expected}` lists the devices")
        notes = []
        partial = [w for k, w in self.reasons if k == "device-open"]
        if partial:
            notes.append(f"NCCL could not open some devices: {reason_words([('', w) for w in partial])}")
        memlock = self.node.get("memlock")
        if self.rdma and got in RDMA_TRANSPORTS and memlock is not None and 0 <= memlock < MEMLOCK_FLOOR:
            return False, (f"{version} chose {what}{pinned_words}, but the locked-memory limit is {memlock // 1024} "
                           f"KiB: registering NCCL's buffers with the NIC (ibv_reg_mr) fails at the first inter-node "
                           f"transfer. Fix: {CONTAINER_FLAGS}")
        tail = f"; {'; '.join(notes)}" if notes else ""
        return True, f"{version} chose {what}{pinned_words}; {self.here}{tail}"
