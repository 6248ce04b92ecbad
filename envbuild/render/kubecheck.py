"""`envbuild job --k8s --check FILE`: envbuild's own check of a Kubernetes training manifest, so
a lab can check one someone else wrote (and envbuild checks each it writes). Each rule is a
mistake that leaves a multi-node job slow or hung without an error:

- **split**: the GPUs and the fabric's device-plugin resources (``rdma/*``, ``vpc.amazonaws.com/efa``
  and each fabrics.yaml profile's) not in the same container: the devices land in a container
  that runs no NCCL, and NCCL falls back to TCP;
- **no IPC_LOCK** in a container holding a fabric resource: verbs pin memory (ibv_reg_mr), which
  the default 64 KiB memlock refuses;
- **no memory-backed /dev/shm** in a container with GPUs: the runtime's 64 MiB default makes
  NCCL's shared-memory transport fail (posix_fallocate) and UCX crash with 8 local ranks;
- **a short-name rendezvous address** (``MASTER_ADDR``, ``PET_MASTER_ADDR``, ``--master-addr``,
  ``--rdzv-endpoint``): one label, or ``pod.service``, resolves only through the pod's search
  path; the full name (``pod.service.ns.svc.cluster.local``) or an IP resolves anywhere.

The file is a user's: a regular file, size-bounded, parsed by :mod:`envbuild.base.untrusted`
(a stream of documents); its strings are only compared, never written anywhere. A name or image
the API server would refuse (a newline in a reference, a name that is no DNS-1123 name) is
named by its field before any rule is judged.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_bytes
from envbuild.base import grammar
from envbuild.base.grammar import escaped, shown
from envbuild.base.untrusted import loads_yaml
from envbuild.knowledge.matrix.loader import load_matrix
from envbuild.oci.registry import reference_problems

GPU = "nvidia.com/gpu"
FABRIC_PREFIXES = ("rdma/",)  # the RDMA shared device plugin's and the SR-IOV plugin's usual pools
RENDEZVOUS_ENV = ("MASTER_ADDR", "PET_MASTER_ADDR")
RENDEZVOUS_FLAGS = ("--master-addr", "--master_addr", "--rdzv-endpoint", "--rdzv_endpoint")
SHM_PATH = "/dev/shm"


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def fabric_resources() -> set[str]:
    """The device-plugin resources fabrics.yaml knows (beside any ``rdma/*``)."""
    return {r.name for f in load_matrix().fabrics for r in f.kubernetes.resources}


def _pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of each pod template a document holds, by its kind."""
    kind, spec = doc.get("kind"), _dict(doc.get("spec"))
    if kind == "Pod":
        return [("", spec)]
    if kind in ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
        return [("", _dict(_dict(spec.get("template")).get("spec")))]
    if kind in ("TrainingRuntime", "ClusterTrainingRuntime"):
        spec = _dict(_dict(spec.get("template")).get("spec"))
    elif kind != "JobSet":
        return []
    return [(f"replicatedJobs[{i}] ", _dict(_dict(_dict(_dict(r).get("template")).get("spec")).get("template")).get("spec"))
            for i, r in enumerate(_list(spec.get("replicatedJobs")))]


def _resources(container: dict) -> set[str]:
    res = _dict(container.get("resources"))
    names = set(_dict(res.get("limits"))) | set(_dict(res.get("requests")))
    return {n for n in names if isinstance(n, str)}


def _is_fabric(name: str, known: set[str]) -> bool:
    return name in known or name.startswith(FABRIC_PREFIXES)


def _has_ipc_lock(container: dict) -> bool:
    sc = _dict(container.get("securityContext"))
    added = _list(_dict(sc.get("capabilities")).get("add"))
    return sc.get("privileged") is True or any(c in ("IPC_LOCK", "CAP_IPC_LOCK", "ALL") for c in added)


def _memory_shm(container: dict, spec: dict) -> bool:
    if spec.get("hostIPC") is True:
        return True
    memory = {v.get("name") for v in map(_dict, _list(spec.get("volumes")))
              if _dict(v.get("emptyDir")).get("medium") == "Memory"}
    return any(m.get("mountPath") == SHM_PATH and m.get("name") in memory
               for m in map(_dict, _list(container.get("volumeMounts"))))


def short_name(address: str) -> bool:
    """Whether a rendezvous address (HOST or HOST:PORT) resolves only through a search path.

    >>> short_name("job-0"), short_name("job-0.job:29500"), short_name("job-0.job.ns.svc.cluster.local:29500")
    (True, True, False)
    >>> short_name("10.0.0.2"), short_name("[fd00::2]:29500"), short_name("$(MASTER_ADDR)")
    (False, False, False)
    """
    if address.startswith("[") and "]" in address:  # [IPv6]:PORT
        address = address[1:address.index("]")]
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    if not host or host.startswith("$(") or "$(" in host:
        return False  # another variable's value: judged where that variable is set
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        pass
    return len(host.rstrip(".").split(".")) < 3 and host != "localhost"


def _addresses(container: dict) -> list[tuple[str, str]]:
    """(where it is set, the address) of each rendezvous address in a container."""
    found = [(e["name"], str(e["value"])) for e in map(_dict, _list(container.get("env")))
             if e.get("name") in RENDEZVOUS_ENV and isinstance(e.get("value"), (str, int))]
    words = [str(w) for w in _list(container.get("command")) + _list(container.get("args"))]
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag in RENDEZVOUS_FLAGS:
            if eq:
                found.append((flag, value))
            elif i + 1 < len(words):
                found.append((flag, words[i + 1]))
    return found


def _container_problems(c: dict, spec: dict, pod_fabric: set[str], known: set[str]) -> list[str]:
    name = shown(str(c.get("name", "?")))
    names = _resources(c)
    gpus, fabric = GPU in names, {n for n in names if _is_fabric(n, known)}
    problems = []
    if gpus and pod_fabric - fabric:
        problems.append(f"container {name} has the GPUs but not {', '.join(sorted(pod_fabric - fabric))}, which another "
                        f"container of the pod asks for (resources split): NCCL in this container gets no fabric "
                        f"device and falls back to TCP; put every GPU and fabric resource in one container's limits")
    pinned = {str(e.get("value")) for e in map(_dict, _list(c.get("env"))) if e.get("name") == "NCCL_NET"}
    if gpus and not fabric and not pod_fabric and pinned - {"Socket", "socket"}:
        problems.append(f"container {name} pins NCCL_NET={'/'.join(sorted(pinned))} but asks for no fabric resource "
                        f"beside its GPUs (dropped, or never asked for): the pod gets no fabric device; add the device "
                        f"plugin's resource (rdma/POOL, vpc.amazonaws.com/efa) to its limits")
    if fabric and not _has_ipc_lock(c):
        problems.append(f"container {name} asks for {', '.join(sorted(fabric))} without the IPC_LOCK capability: verbs "
                        f"cannot pin memory under the default memlock limit; add securityContext.capabilities.add: "
                        f"[IPC_LOCK]")
    if gpus and not _memory_shm(c, spec):
        problems.append(f"container {name} has GPUs and no memory-backed {SHM_PATH} (the runtime's default is 64 MiB: "
                        f"NCCL's shared-memory transport fails with posix_fallocate errors); mount an emptyDir with "
                        f"medium: Memory and a sizeLimit at {SHM_PATH}")
    for where, address in _addresses(c):
        if short_name(address):
            problems.append(f"container {name} sets {where} to {shown(address)}, a short name that resolves only "
                            f"through the pod's DNS search path; give rank 0's full name "
                            f"(POD.SERVICE.NAMESPACE.svc.CLUSTER-DOMAIN) or its IP")
    return problems


def _containers(spec: dict) -> list[dict]:
    return [_dict(c) for c in _list(spec.get("initContainers")) + _list(spec.get("containers"))]


def _name_problems(doc: dict) -> list[str]:
    """The document's metadata.name, where the API server would refuse it."""
    name = _dict(doc.get("metadata")).get("name")
    if isinstance(name, str):
        try:
            grammar.dns_subdomain(name)
        except grammar.GrammarError as e:
            return [f"metadata.name {shown(name)}: {e}"]
    return []


def _container_fields(spec: dict, where: str) -> list[str]:
    """A pod template's container names and images the API server would refuse, each by its field."""
    problems = []
    for c in _containers(spec):
        if isinstance(c.get("name"), str):
            try:
                grammar.dns_label(c["name"])
            except grammar.GrammarError as e:
                problems.append(f"{where}container name {shown(c['name'])}: {e}")
        if isinstance(c.get("image"), str) and reference_problems(c["image"]):
            problems.append(f"{where}container {shown(str(c.get('name', '?')))} image {shown(c['image'])}: "
                            f"{'; '.join(reference_problems(c['image']))}")
    return problems


def manifest_problems(docs: list) -> list[str]:
    """Each mistake in `docs` (the documents of a manifest), named by document and container."""
    known, problems, pods = fabric_resources(), [], 0
    for index, doc in enumerate(docs):
        doc = _dict(doc)
        head = f"document {index + 1} ({escaped(str(doc.get('kind')))} {shown(str(_dict(doc.get('metadata')).get('name')))}) "
        specs = _pod_specs(doc)
        pods += len(specs)
        fields = (_name_problems(doc) if specs else []) + [p for where, spec in specs for p in _container_fields(spec, where)]
        if fields:  # a manifest the API server would refuse: its rules are not judged
            problems += [f"{head}{p}" for p in fields]
            continue
        for where, spec in specs:
            containers = _containers(spec)
            pod_fabric = {n for c in containers for n in _resources(c) if _is_fabric(n, known)}
            problems += [f"{head}{where}{p}" for c in containers for p in _container_problems(c, spec, pod_fabric, known)]
    if not pods:
        problems.append("it holds no pod template (no Job, JobSet, TrainingRuntime or Pod)")
    return problems


def check_documents(docs: list, named: str) -> None:
    """Refuse (exit 2) `docs` when :func:`manifest_problems` finds any, each named."""
    problems = manifest_problems(docs)
    if problems:
        raise EnvbuildError(f"{named}: {'; '.join(problems)}.")


def check_file(path: Path | str) -> int:
    """Check the manifest at `path` (a stream of YAML documents); the number of pod templates
    checked, or EnvbuildError naming each mistake."""
    named = f"--check {escaped(str(path))}"
    docs = loads_yaml(read_bytes(path, "--check", "manifest"), named, 4 << 20, documents=True)
    docs = [d for d in docs if d is not None]
    if not all(isinstance(d, dict) for d in docs):
        raise EnvbuildError(f"{named}: a document is not a mapping (apiVersion, kind, metadata, spec); give the "
                            f"manifest's YAML file.")
    check_documents(docs, named)
    return sum(len(_pod_specs(d)) for d in docs)
