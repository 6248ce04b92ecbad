"""The smoke test's ``transport`` check: which network NCCL really chose on this node.

A missing verbs library, an RDMA device the container cannot open or a net plugin that fails
to initialise is no error to NCCL: it says why at INFO level and falls back to TCP sockets, and
a multi-node job runs at a fraction of its bandwidth. So on a GPU node this check initialises
NCCL in a child process (world size 1, one all_reduce on cuda:0) with ``NCCL_DEBUG=INFO``
written to a file and the fabric's transport pinned (``net_env``, e.g. ``NCCL_NET=IB``) where
the node has that fabric's devices, then reads the file: the net NCCL chose, the devices and
their link layer, NCCL's version, the plugin messages and NCCL's own words for any fallback.

The parser follows NCCL's sources (NVIDIA/nccl v2.18 to v2.30: ``src/init.cc``,
``src/transport/net_ib*``, ``src/transport/net_socket.cc``, ``src/net.cc`` then
``src/plugin/net.cc`` and ``src/plugin/plugin_open.cc``, ``src/misc/ibvsymbols.cc``) and the
AWS OFI plugin's (aws/aws-ofi-nccl ``src/nccl_ofi_net.cpp``); tests/fixtures/nccl holds real
logs from public threads, with their sources.
"""

from __future__ import annotations

import glob
import os
import re

from . import sandbox
from .node import MEMLOCK_FLOOR, ROOT_ENV, rdma_devices
from .report import Skipped

# Net names NCCL reports ("Using network X") grouped by what carries the traffic. IBext* is the
# HPC-X nccl-rdma-sharp plugin over the same verbs devices; the AWS OFI plugin is named
# "Libfabric", or "AWS Libfabric" / "OFI" when NCCL_NET asks for those (aws-ofi-nccl
# src/nccl_ofi_interface_nvidia.cpp; "AWS Libfabric" up to 1.11).
OFI_NAMES = ("libfabric", "aws libfabric", "ofi")
RDMA_TRANSPORTS = ("IB", "OFI", "gIB")
CHILD_DIR = "transport"
DEBUG_FILE = "nccl.%h.%p.log"  # NCCL expands %h (host) and %p (pid): one file per process
DEBUG_SUBSYS = "INIT,NET,ENV"  # ENV: NCCL then also names variables such as NCCL_IB_DISABLE it read
CONTAINER_FLAGS = ("docker run --device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1 (Kubernetes: "
                   "mount /dev/infiniband or use an RDMA device plugin, with capability IPC_LOCK; Slurm+pyxis/"
                   "enroot: MELLANOX_VISIBLE_DEVICES=all)")

_LINE = re.compile(r"NCCL (INFO|WARN) (.*)$")
_VERSION = re.compile(r"^NCCL version (\d+\.\d+\.\d+)(\S*)")
_USING_NET = re.compile(r"^Using (?:network|internal Network) (.+?)\s*$")
_IB_USING = re.compile(r"^NET/IB ?: Using(.*?)(?:; OOB (\S+))?\s*$")
_IB_DEVICE = re.compile(r"([A-Za-z0-9_.-]+):(\d+)(?::[^/\s,{}\]]*)*/(IB|RoCE|UNSPECIFIED)\b")
_SOCKET_USING = re.compile(r"^NET/Socket ?: Using(.*)$")
_SOCKET_IF = re.compile(r"\[\d+\]([^:\s\[\]]+):(\S+?)(?:<\d+>|\s|$)")
_OFI_PROVIDER = re.compile(r"^NET/OFI Selected [Pp]rovider is ([^\s,(]+)(?:, fabric is ([^\s,(]+))?"
                           r"(?: \(found (\d+) nics\))?")
_OFI_VERSION = re.compile(r"^NET/OFI (?:Initializing|Using) aws-ofi-nccl (\S+)")
_PLUGIN = re.compile(r"^(NET/Plugin|Plugin Path|P2P plugin|Initialized NET plugin|Failed to initialize NET plugin|"
                     r"Assigned NET plugin|Disabling external plugins|NCCL_NET_PLUGIN set)")
_DLERROR_OBJECT = re.compile(r"([^\s:=]+): cannot open shared object file")


def net_family(name: str | None) -> str | None:
    """What carries a net's traffic: IB (verbs, incl. RoCE and HPC-X's IBext), OFI, Socket or the name.

    >>> [net_family(n) for n in ("IB", "IBext_v8", "AWS Libfabric", "Libfabric", "socket", "gIB", None)]
    ['IB', 'IB', 'OFI', 'OFI', 'Socket', 'gIB', None]
    """
    if not name:
        return None
    low = name.strip().lower()
    if low == "ib" or low.startswith("ibext"):
        return "IB"
    if low in OFI_NAMES:
        return "OFI"
    if low == "socket":
        return "Socket"
    return name.strip()


def _message(line: str) -> tuple[str, str] | None:
    """('INFO'|'WARN'|'', message) of one line whatever its prefix (host:pid:tid [dev], mpirun's
    [1,0]<stdout>:, a log shipper's timestamp); '' for NCCL's bare version line."""
    found = _LINE.search(line)
    if found:
        return found.group(1), found.group(2).strip()
    stripped = line.strip()
    return ("", stripped) if stripped.startswith("NCCL version ") else None


def _add(items: list, item) -> None:
    if item not in items:
        items.append(item)


def _plugin_reason(message: str) -> tuple[str, str] | None:
    """A net plugin message that explains a fallback: the plugin missing or failing to load."""
    if not message.startswith("NET/Plugin"):
        if message.startswith("Failed to initialize NET plugin"):
            return "plugin-failed", message
        return None
    dlerror = _DLERROR_OBJECT.search(message)
    if dlerror:  # the plugin itself absent (ENOENT on libnccl-net*.so), or a library it needs
        missing = os.path.basename(dlerror.group(1))
        return ("plugin-missing" if missing.startswith("libnccl-net") else "plugin-failed"), message
    if "Could not find:" in message or "No plugin found" in message:
        return "plugin-missing", message
    if re.match(r"NET/Plugin ?: [^\s:]+\.so: ", message):  # 2.29+: "NET/Plugin: <lib>: <dlerror>"
        return "plugin-failed", message
    return None


def _reason(level: str, message: str) -> tuple[str, str] | None:
    """(kind, NCCL's words) when a message says why a transport was not used, else None."""
    if re.match(r"(Failed to open libibverbs|Count not open libibverbs|dlvsym failed on )", message):
        return "verbs-missing", message
    if re.match(r"(Call to ibv_open_device failed|NET/IB ?: Unable to (open|query) device|"
                r"NET/IB ?: Unable to query port)", message):
        return "device-open", message
    if re.match(r"NET/IB ?: No device found", message):
        return "no-device", message
    if re.match(r"NET/IB ?: No IP interface found", message):
        return "no-ip", message
    if re.match(r"NCCL_IB_DISABLE set by environment to 1\b", message):
        return "ib-disabled", message
    if message.startswith("NET/OFI ") and (level == "WARN" or "No eligible providers" in message):
        return "ofi-failed", message
    return _plugin_reason(message)


def parse_nccl_info(text: str) -> dict:
    """What an ``NCCL_DEBUG=INFO`` log says about the network: the net NCCL chose and why.

    Keys: ``net`` (the one net every process chose, else None), ``nets`` (each distinct one),
    ``version``, ``ib_devices`` ([{name, port, link}]), ``link_layers``, ``socket_interfaces``,
    ``ofi_provider``/``ofi_fabric``/``ofi_nics``/``ofi_version``, ``plugins`` (net plugin
    messages), ``reasons`` ([(kind, NCCL's words)]), ``init_error`` (NCCL's WARN when no net
    could be initialised, as with a pinned NCCL_NET) and ``warnings`` (every WARN message).

    >>> p = parse_nccl_info('''h:1:2 [0] NCCL INFO Failed to open libibverbs.so[.1]
    ... h:1:2 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
    ... h:1:2 [0] NCCL INFO Using network Socket''')
    >>> p["net"], p["socket_interfaces"], p["reasons"]
    ('Socket', ['eth0:10.0.0.1'], [('verbs-missing', 'Failed to open libibverbs.so[.1]')])
    """
    out: dict = {"net": None, "nets": [], "version": None, "version_line": None, "ib_devices": [],
                 "link_layers": [], "socket_interfaces": [], "ofi_provider": None, "ofi_fabric": None,
                 "ofi_nics": None, "ofi_version": None, "plugins": [], "reasons": [], "init_error": None,
                 "warnings": [], "nccl_lines": 0}
    for line in text.splitlines():
        parsed = _message(line)
        if parsed:
            _note(out, *parsed)
    out["net"] = out["nets"][0] if len(out["nets"]) == 1 else None
    return out


def _note(out: dict, level: str, message: str) -> None:
    """One NCCL message into `out`: a version, net, IB or socket line says only that; any other
    may name the OFI provider, a net plugin or why a transport was not used (a WARN is kept too)."""
    out["nccl_lines"] += 1
    if level == "WARN":
        _add(out["warnings"], message)
        if re.match(r"(Failed to initialize any NET plugin|Error: network .* not found)", message):
            out["init_error"] = message
    version = _VERSION.match(message)
    if version:
        out["version"], out["version_line"] = version.group(1), version.group(0)
        return
    using = _USING_NET.match(message)
    if using:
        _add(out["nets"], using.group(1))
        return
    ib = _IB_USING.match(message)
    if ib:
        for name, port, link in _IB_DEVICE.findall(ib.group(1)):
            _add(out["ib_devices"], {"name": name, "port": int(port), "link": link})
            _add(out["link_layers"], link)
        return
    sock = _SOCKET_USING.match(message)
    if sock:
        for name, address in _SOCKET_IF.findall(sock.group(1)):
            _add(out["socket_interfaces"], f"{name}:{address}")
        return
    ofi = _OFI_PROVIDER.match(message)
    if ofi:
        out["ofi_provider"], out["ofi_fabric"] = ofi.group(1), ofi.group(2)
        out["ofi_nics"] = int(ofi.group(3)) if ofi.group(3) else out["ofi_nics"]
    ofi_version = _OFI_VERSION.match(message)
    if ofi_version:
        out["ofi_version"] = ofi_version.group(1)
    if _PLUGIN.match(message):
        _add(out["plugins"], message)
    reason = _reason(level, message)
    if reason:
        _add(out["reasons"], reason)


# ----------------------------------------------------------------------------- the node
def node_rdma(root: str = "") -> dict[str, str]:
    """{RDMA device: kernel driver} from /sys/class/infiniband (driver '' when sysfs hides it).

    >>> import tempfile, pathlib
    >>> d = tempfile.mkdtemp(); dev = pathlib.Path(d, "sys/class/infiniband/rdmap0/device")
    >>> dev.mkdir(parents=True); (dev / "driver").symlink_to("/sys/bus/pci/drivers/efa")
    >>> node_rdma(d)
    {'rdmap0': 'efa'}
    """
    return {name: device["driver"] for name, device in rdma_devices(root).items()}


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes (-1: unlimited); None where it cannot be read."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return None
    return -1 if soft == resource.RLIM_INFINITY else soft


def probe_node(root: str = "") -> dict:
    """What the verdict needs to know about this node and container."""
    return {"rdma": node_rdma(root), "memlock": memlock_limit(),
            "dev_infiniband": os.path.isdir(root + "/dev/infiniband")}


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


def _words(reasons: list, limit: int = 4) -> str:
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
                       f"{_words(v.reasons)}. Fix: {v.fix()}")
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
        return False, (f"{self.version} could not initialise {how}: {words}. NCCL's reasons: {_words(self.reasons)}. "
                       f"{self.here}. Fix: {self.fix()}")

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
                       f"NCCL's reasons: {_words(self.reasons)}. Fix: {self.fix()}")

    def over(self, got: str) -> tuple[bool, str]:
        """An RDMA net (or a plugin's): the fabric's, over the right provider, with buffers it can register."""
        version, what, pinned_words = self.version, _chosen(self.parsed), self.pinned_words
        if got != self.want and self.want != "Socket":
            return False, (f"{version} chose {what}{pinned_words}, but fabric {self.name} promises "
                           f"{self.fabric.get('transport')}. NCCL's reasons: {_words(self.reasons)}. Fix: {self.fix()}")
        if got == "OFI" and self.wrong_provider:
            return False, (f"{version} chose {what}: the OFI plugin runs over libfabric's {self.provider} provider, "
                           f"not {self.expected}, i.e. TCP. Fix: {_fix({'ofi-provider'}, self.fabric, self.node)}, "
                           f"and check that `fi_info -p {self.expected}` lists the devices")
        notes = []
        partial = [w for k, w in self.reasons if k == "device-open"]
        if partial:
            notes.append(f"NCCL could not open some devices: {_words([('', w) for w in partial])}")
        memlock = self.node.get("memlock")
        if self.rdma and got in RDMA_TRANSPORTS and memlock is not None and 0 <= memlock < MEMLOCK_FLOOR:
            return False, (f"{version} chose {what}{pinned_words}, but the locked-memory limit is {memlock // 1024} "
                           f"KiB: registering NCCL's buffers with the NIC (ibv_reg_mr) fails at the first inter-node "
                           f"transfer. Fix: {CONTAINER_FLAGS}")
        tail = f"; {'; '.join(notes)}" if notes else ""
        return True, f"{version} chose {what}{pinned_words}; {self.here}{tail}"


# ----------------------------------------------------------------------------- the child
def child_main(argv: list[str]) -> int:
    """In the child: NCCL with world size 1 on cuda:0 and one all_reduce; the outcome to argv[0]."""
    from datetime import timedelta

    result, timeout = argv[0], float(argv[1])
    out: dict = {"ok": False, "stage": "import torch"}
    dist = None
    try:
        import torch
        import torch.distributed as dist

        out["torch"] = torch.__version__
        out["stage"] = "cuda"
        torch.cuda.set_device(0)
        try:  # a tuple since torch 1.10, an int before
            version = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - NCCL's own log says which it is
            pass
        out["stage"] = "init_process_group"
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))
        out["stage"] = "all_reduce"
        x = torch.ones(1024, device="cuda:0")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        out["ok"] = bool((x == 1).all())
        out["detail"] = "" if out["ok"] else f"all_reduce over one rank changed the values: {x[0].item()}"
    except Exception as error:  # noqa: BLE001 - the parent reports it with NCCL's log
        out["detail"] = f"{type(error).__name__}: {str(error)[:2000]}"
    sandbox.write_json(result, out)
    if dist is not None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return 0 if out["ok"] else 1


def child_command(result: str, timeout: float) -> list[str]:
    """argv of the child: ``python -I`` (no user site, no PYTHON* variables) importing this package."""
    return sandbox.package_command("transport", "child_main", result, str(timeout), isolated=True)


def child_env(environ: dict, fabric: dict, debug_file: str, node_has_devices: bool) -> tuple[dict, dict]:
    """(the child's environment, what was pinned): NCCL's INFO log to `debug_file`; the fabric's
    net_env where this node has its devices, each variable the user (or env.sh) set left as it is.

    >>> env, pinned = child_env({"NCCL_DEBUG": "WARN"}, {"net_env": {"NCCL_NET": "IB"}}, "/w/n.%h.%p.log", True)
    >>> env["NCCL_DEBUG"], env["NCCL_NET"], pinned
    ('INFO', 'IB', {'NCCL_NET': 'IB'})
    >>> child_env({"NCCL_NET": "Socket"}, {"net_env": {"NCCL_NET": "IB"}}, "/w/n.log", True)[1]
    {}
    """
    env = dict(environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS=DEBUG_SUBSYS, NCCL_DEBUG_FILE=debug_file)
    pinned = {}
    if node_has_devices:
        for key, value in (fabric.get("net_env") or {}).items():
            if not environ.get(key):
                env[key] = pinned[key] = str(value)
    return env, pinned


def read_debug_logs(folder: str, limit: int = 4 << 20) -> str:
    """Every NCCL debug file the child's processes wrote, concatenated (at most `limit` bytes each)."""
    texts = []
    for path in sorted(glob.glob(os.path.join(folder, "nccl.*.log"))):
        try:
            with open(path, "rb") as handle:
                texts.append(handle.read(limit).decode("utf-8", "replace"))
        except OSError:
            continue
    return "\n".join(texts)


def check_transport(manifest: dict, gpus: int, args, work: str, environ=None, command=None, facts=None):
    """Initialise NCCL as a multi-node job would on this node and judge the net it chose.

    `command(result_path, timeout)` replaces the child's argv and `facts` the node probe
    (:func:`probe_node`): tests use a stand-in where no GPU exists.
    """
    fabric = manifest.get("fabric")
    if not gpus:
        return Skipped("CPU mode: no GPU, so NCCL cannot initialise; run the smoke test on a GPU node (--gpus all)")
    if not fabric:
        return Skipped("the manifest names no fabric (built by an older envbuild)")
    environ = dict(os.environ if environ is None else environ)
    facts = probe_node(environ.get(ROOT_ENV, "")) if facts is None else facts
    rdma = facts.get("rdma") or {}
    folder = os.path.join(work, CHILD_DIR)
    os.makedirs(folder, exist_ok=True)
    for stale in glob.glob(os.path.join(folder, "nccl.*.log")):
        os.remove(stale)
    result = os.path.join(folder, "result.json")
    env, pinned = child_env(environ, fabric, os.path.join(folder, DEBUG_FILE), bool(fabric_devices(fabric, rdma)))
    argv = command(result, args.timeout) if command is not None else child_command(result, args.timeout)
    state, code = sandbox.run_child(argv, env, args.timeout, os.path.join(folder, "child.log"))
    text = read_debug_logs(folder)
    parsed = parse_nccl_info(text + "\n" + _read(os.path.join(folder, "child.log")))
    outcome = sandbox.read_json(result) or {}
    data = {"net": parsed["net"], "nets": parsed["nets"], "nccl": parsed["version"] or outcome.get("nccl"),
            "ib_devices": parsed["ib_devices"], "link_layers": parsed["link_layers"],
            "socket_interfaces": parsed["socket_interfaces"], "ofi_provider": parsed["ofi_provider"],
            "plugins": parsed["plugins"], "reasons": [words for _, words in parsed["reasons"]],
            "pinned": pinned, "rdma_devices": rdma, "memlock": facts.get("memlock"), "child": state}
    if state == "timeout":
        last = _words(parsed["reasons"]) if parsed["reasons"] else (parsed["warnings"][-1:] or ["no NCCL output"])[0]
        return False, (f"NCCL initialisation hung: killed after {args.timeout:g}s (pinned: "
                       f"{', '.join(f'{k}={v}' for k, v in pinned.items()) or 'nothing'}); NCCL's last words: "
                       f"{last}. Re-run with NCCL_DEBUG=INFO to see where it stopped"), None, data
    if not parsed["nccl_lines"]:
        why = outcome.get("detail") or sandbox.tail(os.path.join(folder, "child.log")) or f"exit {code}"
        return False, (f"NCCL never started (child stage {outcome.get('stage', '?')}, exit {code}): {why}"), None, data
    ok, detail = transport_verdict(parsed, fabric, rdma, pinned=pinned,
                                   node=dict(facts, user_net=environ.get("NCCL_NET")))
    if ok and (code != 0 or not outcome.get("ok")):
        why = outcome.get("detail") or sandbox.tail(os.path.join(folder, "child.log"))
        ok, detail = False, f"{detail}; but the all_reduce failed (stage {outcome.get('stage', '?')}): {why}"
    elif not ok and outcome.get("detail"):
        detail = f"{detail} [torch: {outcome['detail'][:300]}]"
    return ok, detail, None, data


def _read(path: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""
