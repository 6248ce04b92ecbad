"""`envbuild job --k8s indexed|jobset|trainjob`: the Kubernetes manifest of a multi-node training
job, wired for the image's fabric, from one function per kind and one pod template they share.

What every pod gets, and why (each mistake is one that public threads show again and again, and
:mod:`envbuild.render.kubecheck` refuses in a manifest someone else wrote):
- the GPUs and the fabric's device-plugin resources in the limits of the same container (a
  fabric resource in another container, or dropped, leaves NCCL on TCP and nothing errors); the
  names and counts are data per fabric profile (fabrics.yaml `kubernetes:`), overridable;
- ``IPC_LOCK``: verbs pin memory (ibv_reg_mr), which the default 64 KiB memlock refuses;
- a memory-backed ``/dev/shm`` sized from the GPUs (the runtime's default is 64 MiB: NCCL's
  shared-memory transport and DataLoader workers fail with posix_fallocate errors);
- ``NCCL_SOCKET_IFNAME`` (and gloo's) on the pod's network, and the fabric's ``net_env``
  (``NCCL_NET=IB``): NCCL's bootstrap on a routable interface, and no silent socket fallback;
- torchrun's node rank from the workload's index (the Indexed Job's completion index, or the
  ``PET_*`` variables Kubeflow Trainer sets) and a rendezvous address that resolves anywhere in the
  cluster: rank 0's full DNS name through the headless Service (``pod.service.ns.svc.domain``);
- a first step (an init container) that runs the image's smoke test, whose transport check fails
  the pod when NCCL falls back to sockets on a node that has the fabric's devices.

Every value is checked by its grammar where it enters (:func:`check_kube_job`) and the manifest
is written by PyYAML from data (never joined as text), so no value can add a key. The training
command is split into words as a shell would and each word is one element of ``args``; a ``$``
in it is written ``$$``, so the kubelet's ``$(VAR)`` expansion hands it on as text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from envbuild.base import grammar
from envbuild.base.files import write_owned
from envbuild.base.errors import EnvbuildError
from envbuild.knowledge.matrix.loader import load_matrix
from envbuild.oci.registry import reference_problems
from envbuild.render.jobs import MAX_GPUS_PER_NODE
from envbuild.render.kubecheck import GPU, check_documents

KINDS = ("indexed", "jobset", "trainjob")
MARK = "# envbuild job --k8s"  # the first line of every manifest envbuild writes: the only files -o replaces
MAX_NODES = 100_000  # a Job's completions: the API server caps an Indexed Job at 100,000 (validation.go)
PORT = 29500  # torchrun's default master port
TRAINER_PORT = 29400  # Kubeflow Trainer's ContainerTrainerPort: what its PET_MASTER_PORT says
# The pod's network interface: CNI plugins name the pod's end of its veth eth0 (the CNI spec's
# CNI_IFNAME, which kubelet passes as eth0), and it routes between pods; --socket-ifname for Multus.
SOCKET_IFNAME = "eth0"
# /dev/shm per GPU: NCCL's shared-memory transport keeps a buffer per channel and peer, and
# DataLoader workers pass every batch through /dev/shm; 8 GiB per GPU holds both at 8 local ranks
# (NVIDIA's PyTorch containers ask for --ipc=host or a large --shm-size for the same reason).
SHM_GIB_PER_GPU = 8
SHM_CPU = "2Gi"
IMAGE_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}\Z")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
LABELS = {"app.kubernetes.io/managed-by": "envbuild"}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


@dataclass(frozen=True)
class KubeJob:
    kind: str  # indexed | jobset | trainjob
    image: str  # REGISTRY/REPO[:TAG]@sha256:DIGEST: every node runs the same bytes
    nodes: int = 2
    gpus_per_node: int = 8  # 0: a CPU job (gloo)
    train: str = "train.py"  # the command torchrun starts, split into words as a shell would
    fabric: Optional[str] = None  # a fabrics.yaml profile or alias; None: the matrix's default
    name: str = "envbuild-train"
    namespace: str = "default"
    cluster_domain: str = "cluster.local"
    queue: Optional[str] = None  # a Kueue LocalQueue
    node_selector: tuple[str, ...] = ()  # KEY=VALUE
    tolerations: tuple[str, ...] = ()  # KEY[=VALUE]:EFFECT
    fabric_resources: tuple[str, ...] = ()  # NAME=COUNT, replacing the profile's
    shm_size: Optional[str] = None  # a quantity; default SHM_GIB_PER_GPU per GPU
    socket_ifname: str = SOCKET_IFNAME


def _refuse(flag: str, value, error: grammar.GrammarError, choice: str) -> EnvbuildError:
    return grammar.refuse(flag, str(value), str(error), choice)


def _check(flag: str, value: str, check, choice: str) -> str:
    try:
        return check(value)
    except grammar.GrammarError as e:
        raise _refuse(flag, value, e, choice) from None


def _pair(flag: str, value: str, sep: str, example: str) -> tuple[str, str]:
    key, found, rest = value.partition(sep)
    if not found:
        raise EnvbuildError(f"{flag} {grammar.shown(value)} has no '{sep}'; give it as {example}.")
    return key, rest


def _image(job: KubeJob) -> None:
    problems = reference_problems(job.image) if job.image.strip() else ["it is empty"]
    if problems or grammar.control_characters(job.image):
        why = "; ".join(problems) or "it holds a control character"
        raise EnvbuildError(f"--image {grammar.shown(job.image)} is not an image reference: {why}; give the published "
                            f"image by digest, e.g. --image ghcr.io/acme/envbuild@sha256:<64 hex digits>.")
    if not IMAGE_DIGEST.search(job.image):
        raise EnvbuildError(f"--image {grammar.shown(job.image)} names no sha256 digest: every node pulls the tag on its "
                            f"own, and a tag moved in between runs two images in one job; give "
                            f"--image {job.image.partition('@')[0]}@sha256:<digest> (`envbuild publish` prints it).")


def check_kube_job(job: KubeJob) -> KubeJob:
    """Every value of `job` in its grammar, and the combination one that can work; EnvbuildError
    (exit 2) naming the option and the nearest valid choice otherwise."""
    if job.kind not in KINDS:
        raise EnvbuildError(f"--k8s {grammar.shown(job.kind)}: unknown; choose one of {', '.join(KINDS)}.")
    _image(job)
    for flag, value, low, high, why in (("--nodes", job.nodes, 1, MAX_NODES, "a Job's completions"),
                                        ("--gpus-per-node", job.gpus_per_node, 0, MAX_GPUS_PER_NODE,
                                         "NVIDIA's largest nodes hold 16 GPUs")):
        try:
            grammar.count(value, low, high, why)
        except grammar.GrammarError as e:
            raise _refuse(flag, value, e, f"nearest valid value: {flag} {low if value < low else high}.") from None
    _check("--train", job.train, grammar.shell_words, "e.g. --train 'train.py --lr 1e-4 --name \"run 1\"'.")
    _check("--name", job.name, grammar.dns_label, "e.g. --name llama-8b-run1.")
    _check("--namespace", job.namespace, grammar.dns_label, "e.g. --namespace training.")
    _check("--cluster-domain", job.cluster_domain, grammar.dns_subdomain, "the default is --cluster-domain cluster.local.")
    _check("--socket-ifname", job.socket_ifname, grammar.socket_ifname, "the pod's interface, e.g. --socket-ifname eth0.")
    if job.queue is not None:
        _check("--queue", job.queue, grammar.dns_label, "a Kueue LocalQueue's name, e.g. --queue team-a.")
    if job.shm_size is not None:
        _check("--shm-size", job.shm_size, grammar.quantity, "e.g. --shm-size 64Gi.")
    _check_name_length(job)
    _placement(job)
    return job


def _longest_host(job: KubeJob) -> str:
    """The longest pod hostname the job makes (a DNS label: at most 63 characters)."""
    last = str(job.nodes - 1)
    return f"{job.name}-{last}" if job.kind == "indexed" else f"{job.name}-node-0-{last}"


def _check_name_length(job: KubeJob) -> None:
    host = _longest_host(job)
    if len(host) > grammar.DNS_LABEL_MAX:
        keep = max(1, len(job.name) - (len(host) - grammar.DNS_LABEL_MAX))
        raise EnvbuildError(f"--name {grammar.shown(job.name)} makes the pod hostname {grammar.shown(host)} "
                            f"({len(host)} characters), and a hostname is a DNS label of at most "
                            f"{grammar.DNS_LABEL_MAX}: rank 0's address would not resolve; nearest valid choice: "
                            f"--name {job.name[:keep].rstrip('-') or 'train'}.")


def _placement(job: KubeJob) -> tuple[dict, list]:
    """The node selector and tolerations, each part in its grammar."""
    selector, tolerations = {}, []
    for value in job.node_selector:
        key, label = _pair("--node-selector", value, "=", "KEY=VALUE, e.g. nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3")
        selector[_check("--node-selector", key, grammar.qualified_name, "e.g. --node-selector nvidia.com/gpu.present=true.")] = \
            _check("--node-selector", label, grammar.label_value, "e.g. --node-selector nvidia.com/gpu.present=true.")
    for value in job.tolerations:
        head, effect = _pair("--toleration", value, ":", "KEY[=VALUE]:EFFECT, e.g. nvidia.com/gpu:NoSchedule")
        if effect not in EFFECTS:
            raise EnvbuildError(f"--toleration {grammar.shown(value)}: the effect {grammar.shown(effect)} is none of "
                                f"{', '.join(EFFECTS)}; e.g. --toleration nvidia.com/gpu:NoSchedule.")
        key, eq, label = head.partition("=")
        _check("--toleration", key, grammar.qualified_name, "e.g. --toleration nvidia.com/gpu:NoSchedule.")
        tol = {"key": key, "operator": "Equal", "value": _check("--toleration", label, grammar.label_value,
                                                                  "e.g. --toleration dedicated=gpu:NoSchedule.")} \
            if eq else {"key": key, "operator": "Exists"}
        tolerations.append({**tol, "effect": effect})
    return selector, tolerations


def fabric_wiring(job: KubeJob):
    """(fabric profile, its resources {name: count}) for `job`, the combination checked."""
    fabric = load_matrix().fabric(job.fabric)  # an unknown name is refused there, with the known ones
    resources = {r.name: r.count for r in fabric.kubernetes.resources}
    if job.fabric_resources:
        resources = {}
        for value in job.fabric_resources:
            name, count = _pair("--fabric-resource", value, "=", "NAME=COUNT, e.g. rdma/shared_ib=1")
            _check("--fabric-resource", name, grammar.extended_resource, "e.g. --fabric-resource rdma/shared_ib=1.")
            if not count.isdigit() or not 1 <= int(count) <= 1024:
                raise EnvbuildError(f"--fabric-resource {grammar.shown(value)}: the count is no whole number from 1 "
                                    f"to 1024; e.g. --fabric-resource {name}=1.")
            resources[name] = int(count)
    most = fabric.kubernetes.max_gpus_per_node
    if most and job.gpus_per_node > most:
        raise EnvbuildError(f"--gpus-per-node {job.gpus_per_node} with --fabric {fabric.name}: its nodes hold {most} "
                            f"GPUs, so no pod could be scheduled; nearest valid value: "
                            f"--gpus-per-node {most}.")
    if not job.gpus_per_node and resources:
        raise EnvbuildError(f"--gpus-per-node 0 is a CPU job (gloo), which does not use --fabric {fabric.name}'s "
                            f"{', '.join(resources)}; nearest valid choices: --fabric none for a CPU job, or "
                            f"--gpus-per-node 8.")
    return fabric, resources


def _literal(word: str) -> str:
    """A word the kubelet hands on as written: it expands $(VAR) in command and args, and reads $$ as $."""
    return word.replace("$", "$$")


def _dns(job: KubeJob) -> tuple[str, str]:
    """(rank 0's full DNS name, the port torchrun meets on)."""
    if job.kind == "indexed":
        return f"{job.name}-0.{job.name}.{job.namespace}.svc.{job.cluster_domain}", PORT
    port = TRAINER_PORT if job.kind == "trainjob" else PORT
    return f"{job.name}-node-0-0.{job.name}.{job.namespace}.svc.{job.cluster_domain}", port


def _container(job: KubeJob, name: str, args: list[str], env: list[dict], resources: dict) -> dict:
    limits = {GPU: job.gpus_per_node} if job.gpus_per_node else {}
    limits.update(resources)
    container = {"name": name, "image": job.image, "args": args, "env": env,
                 "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                 "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    if limits:
        container["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    return container


def pod_spec(job: KubeJob, fabric, resources: dict) -> dict:
    """The pod template's spec every kind shares: the transport check first, then torchrun."""
    host, port = _dns(job)
    env = [{"name": "NCCL_SOCKET_IFNAME", "value": job.socket_ifname},
           {"name": "GLOO_SOCKET_IFNAME", "value": job.socket_ifname},
           *({"name": k, "value": v} for k, v in fabric.net_env.items())]
    if not job.gpus_per_node:
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})  # a CPU job: no GPU hook
    rank = []
    if job.kind != "trainjob":  # Kubeflow Trainer sets PET_NODE_RANK, PET_NNODES and PET_NPROC_PER_NODE itself
        env.append({"name": "NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
        rank = ["--nnodes", str(job.nodes), "--nproc-per-node", str(job.gpus_per_node or 2),
                "--node-rank", "$(NODE_RANK)"]
    torchrun = ["torchrun", *rank, "--master-addr", host, "--master-port", str(port),
                *(_literal(w) for w in grammar.shell_words(job.train))]
    check = ["python", "/opt/envbuild/smoke.py"] + ([] if job.gpus_per_node else ["--nproc", "2"])
    shm = job.shm_size or (f"{SHM_GIB_PER_GPU * job.gpus_per_node}Gi" if job.gpus_per_node else SHM_CPU)
    selector, tolerations = _placement(job)
    spec = {"restartPolicy": "Never",
            "initContainers": [_container(job, "transport-check", check, env, resources)],
            "containers": [_container(job, "node", torchrun, env, resources)],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]}
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    return spec


def _labels(job: KubeJob, queue: bool = True) -> dict:
    return {**LABELS, **({QUEUE_LABEL: job.queue} if job.queue and queue else {})}


def indexed(job: KubeJob, spec: dict) -> list[dict]:
    """A headless Service and an Indexed Job whose pods are its subdomain: pod i is NAME-i.NAME."""
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job, queue=False)},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {"batch.kubernetes.io/job-name": job.name},
                        "ports": [{"name": "rendezvous", "port": PORT, "targetPort": PORT}]}}
    pod = {"metadata": {"labels": dict(LABELS)}, "spec": {**spec, "subdomain": job.name}}
    body = {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes, "backoffLimit": 0,
            "template": pod}
    if job.queue:
        body["suspend"] = True  # Kueue admits it: created suspended, as Kueue's docs ask
    return [service, {"apiVersion": "batch/v1", "kind": "Job",
                      "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job)}, "spec": body}]


def _replicated(job: KubeJob, spec: dict, labels: Optional[dict] = None) -> dict:
    return {"name": "node", "replicas": 1,
            "template": {**({"metadata": {"labels": labels}} if labels else {}),
                         "spec": {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes,
                                  "backoffLimit": 0, "template": {"metadata": {"labels": dict(LABELS)}, "spec": spec}}}}


def jobset(job: KubeJob, spec: dict) -> list[dict]:
    """A JobSet (v1alpha2) of one Indexed Job: pod i is NAME-node-0-i.NAME (JobSet's DNS hostnames)."""
    body = {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0}, "replicatedJobs": [_replicated(job, spec)]}
    if job.queue:
        body["suspend"] = True
    return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
             "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job)}, "spec": body}]


def trainjob(job: KubeJob, spec: dict) -> list[dict]:
    """A TrainingRuntime holding the pod template (a TrainJob cannot add capabilities or
    resources to another container) and the TrainJob (trainer.kubeflow.org/v1alpha1) that runs it."""
    runtime = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
               "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job, queue=False)},
               "spec": {"mlPolicy": {"numNodes": job.nodes, "torch": {}},  # the TrainJob says the ranks per node
                        "template": {"spec": {"network": {"publishNotReadyAddresses": True},
                                              "replicatedJobs": [_replicated(job, spec, {
                                                  "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"})]}}}}
    train = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job)},
             "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime", "name": job.name},
                      "trainer": {"numNodes": job.nodes, "numProcPerNode": job.gpus_per_node or 2}}}
    if job.queue:
        train["spec"]["suspend"] = True
    return [runtime, train]


def manifest_documents(job: KubeJob) -> list[dict]:
    """The documents of `job`'s manifest (checked first: :func:`check_kube_job`)."""
    check_kube_job(job)
    fabric, resources = fabric_wiring(job)
    docs = {"indexed": indexed, "jobset": jobset, "trainjob": trainjob}[job.kind](job, pod_spec(job, fabric, resources))
    check_documents(docs, "the generated manifest")  # envbuild's own manifest check holds for what it writes
    return docs


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper without anchors: the two containers' env is one list in memory and two
    in the file (a reader, and envbuild's own --check, refuses aliases)."""

    def ignore_aliases(self, data) -> bool:
        return True


def manifest(job: KubeJob) -> str:
    """The manifest as YAML text: envbuild's first line, then each document, written by PyYAML.

    >>> text = manifest(KubeJob("indexed", "ghcr.io/acme/e@sha256:" + "0" * 64, nodes=1, gpus_per_node=0, fabric="none"))
    >>> text.splitlines()[0], "kind: Job" in text
    ('# envbuild job --k8s indexed', True)
    """
    docs = manifest_documents(job)
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1 << 16,
                         allow_unicode=False)
    return f"{MARK} {job.kind}\n{body}"


def is_generated_manifest(data: bytes) -> bool:
    """A manifest `envbuild job --k8s` wrote (its first line says so): the only kind -o replaces."""
    return data.startswith(MARK.encode() + b" ")


def write_manifest(path: Path, text: str) -> bool:
    """Write the manifest atomically, only where no file is or over one envbuild wrote."""
    return write_owned(path, text.encode(), is_generated_manifest,
                       "It is not a manifest `envbuild job --k8s` wrote; choose another file with -o.")


def job_from_options(kind: str, image: str, nodes: int, gpus_per_node: int, train: str, *, fabric, name, namespace,
                     cluster_domain, queue, node_selector, toleration, fabric_resource, shm_size, socket_ifname,
                     output) -> KubeJob:
    """The CLI's options as a KubeJob (checked when its manifest is made)."""
    return KubeJob(kind, image, nodes, gpus_per_node, train, fabric, name, namespace, cluster_domain, queue,
                   tuple(node_selector), tuple(toleration), tuple(fabric_resource), shm_size, socket_ifname)
