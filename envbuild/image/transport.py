"""The smoke test's ``transport`` check: which network NCCL really chose on this node.

A missing verbs library, an RDMA device the container cannot open or a net plugin that fails
to initialise is no error to NCCL: it says why at INFO level and falls back to TCP sockets, and
a multi-node job runs at a fraction of its bandwidth. So on a GPU node this check initialises
NCCL in a child process (world size 1, one all_reduce on cuda:0) with ``NCCL_DEBUG=INFO``
written to a file and the fabric's transport pinned (``net_env``, e.g. ``NCCL_NET=IB``) where
the node has that fabric's devices, then reads the file: the net NCCL chose, the devices and
their link layer, NCCL's version, the plugin messages and NCCL's own words for any fallback.

The log is read by nccllog.py and judged by netverdict.py; this module runs the child and
puts the check together.
"""

from __future__ import annotations

import glob
import os

from . import sandbox
from .nccllog import parse_nccl_info
from .netverdict import fabric_devices, reason_words, transport_verdict
from .nodefacts import ROOT_ENV, rdma_devices
from .report import Skipped

CHILD_DIR = "transport"
DEBUG_FILE = "nccl.%h.%p.log"  # NCCL expands %h (host) and %p (pid): one file per process
DEBUG_SUBSYS = "INIT,NET,ENV"  # ENV: NCCL then also names variables such as NCCL_IB_DISABLE it read


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
        last = (reason_words(parsed["reasons"]) if parsed["reasons"]
                else (parsed["warnings"][-1:] or ["no NCCL output"])[0])
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
