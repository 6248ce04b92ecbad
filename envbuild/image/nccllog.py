"""What an ``NCCL_DEBUG=INFO`` log says about the network: the net NCCL chose, its devices and
their link layer, NCCL's version, the plugin messages and NCCL's own words for any fallback.
The transport check (transport.py) reads its child's log with it.

The parser follows NCCL's sources (NVIDIA/nccl v2.18 to v2.30: ``src/init.cc``,
``src/transport/net_ib*``, ``src/transport/net_socket.cc``, ``src/net.cc`` then
``src/plugin/net.cc`` and ``src/plugin/plugin_open.cc``, ``src/misc/ibvsymbols.cc``) and the
AWS OFI plugin's (aws/aws-ofi-nccl ``src/nccl_ofi_net.cpp``); tests/fixtures/nccl holds real
logs from public threads, with their sources.
"""

from __future__ import annotations

import os
import re

# Net names NCCL reports ("Using network X") grouped by what carries the traffic. IBext* is the
# HPC-X nccl-rdma-sharp plugin over the same verbs devices; the AWS OFI plugin is named
# "Libfabric", or "AWS Libfabric" / "OFI" when NCCL_NET asks for those (aws-ofi-nccl
# src/nccl_ofi_interface_nvidia.cpp; "AWS Libfabric" up to 1.11).
OFI_NAMES = ("libfabric", "aws libfabric", "ofi")

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
