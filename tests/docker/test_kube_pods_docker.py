"""The pods of `envbuild job --k8s indexed` run, as containers: the generated manifest's pod
template turned into `docker run`s the way the kubelet would start it (its image's entrypoint
with its args, its env with the completion-index annotation filled in, the kubelet's $(VAR)
expansion, IPC_LOCK, the memory-backed /dev/shm's size), one container per index on a
user-defined bridge network where the headless Service's names resolve (network aliases:
POD.SERVICE and POD.SERVICE.NS.svc.cluster.local). Two pods, gloo on the CPU CI image:

- each pod's init container (the image's smoke test, its transport check among them) passes;
- the training containers meet at rank 0's full DNS name, the rendezvous forms over 2 x 2 ranks,
  and each rank runs on the pod of its index (global ranks 2i and 2i+1 on pod i).

No cluster is involved: the scheduler, the device plugins and the kubelet itself are not; the
image is the local CI image where the manifest names it by digest. Time: the CI image's build
(as tests/docker/test_multinode_docker.py: seconds with BuildKit's cache, minutes without), then
230 s on this 2-core machine beside another build, 2026-11-29, with the pods' init containers (each
the whole smoke test, about 100 s) one after the other; they now run at once, as on a cluster.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from envbuild.render.kube import KubeJob, manifest_documents
from test_multinode_docker import Cluster, ci_image  # noqa: F401  (the multi-node test's CI image fixture)

DIGEST_IMAGE = "127.0.0.1:5000/envbuild-kube@sha256:" + "d" * 64  # what the manifest names; the local image runs
RUN_LIMIT = 180
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def expand(word: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a command or args word: $(NAME) of a defined variable is its
    value, $$ is $, anything else stays (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), word)


def docker_run_args(container: dict, pod: dict, index: int, name: str, aliases: list[str], network: str,
                    image: str) -> list[str]:
    """`docker run` arguments for one container of pod `index`, from the pod template (its
    hostname as the Indexed Job's pods have it: JOB-INDEX, the Job named as its subdomain here)."""
    env = {"JOB_COMPLETION_INDEX": str(index)}  # the Job controller injects it into each container
    for e in container["env"]:
        if "valueFrom" in e:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_FIELD, e
            env[e["name"]] = str(index)
        else:
            env[e["name"]] = e["value"]
    caps = container["securityContext"]["capabilities"]["add"]
    [shm] = [v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["emptyDir"].get("medium") == "Memory"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/dev/shm"]
    flags = ["--name", name, "--hostname", f"{pod['subdomain']}-{index}", "--network", network,
             *[f for a in aliases for f in ("--network-alias", a)], *[f for c in caps for f in ("--cap-add", c)],
             "--shm-size", shm.replace("Gi", "g"), *[f for k, v in env.items() for f in ("-e", f"{k}={v}")]]
    assert "command" not in container  # the image's entrypoint runs, as under Docker
    return ["run", "-d", *flags, image, *(expand(w, env) for w in container["args"])]


@pytest.fixture
def pods():
    """The pods' containers on one bridge network (the multi-node test's Cluster)."""
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def test_two_pods_of_an_indexed_job_meet_at_rank_0s_full_name(ci_image, pods):  # noqa: F811
    job = KubeJob("indexed", DIGEST_IMAGE, nodes=2, gpus_per_node=0, fabric="none", name="kt", namespace="ns",
                  train="/opt/envbuild/smoke.py --multinode --json --timeout 60 --size-mb 1")
    service, manifest = manifest_documents(job)
    pod = manifest["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "kt"
    [init], [node] = pod["initContainers"], pod["containers"]
    start = time.monotonic()
    tag = pods.network[-6:]
    # each pod's first step, before its other containers; the pods' init containers run at once,
    # as each node's kubelet starts its own
    inits = [pods.run(docker_run_args(init, pod, i, f"kt-init-{i}-{tag}", [], pods.network, ci_image))
             for i in range(2)]
    for run in pods.wait(inits, RUN_LIMIT).values():
        assert run["rc"] == 0 and "transport" in run["out"] + run["err"], (run["out"] + run["err"])[-3000:]
    names = []
    for i in range(2):
        aliases = [f"kt-{i}.kt", f"kt-{i}.kt.ns.svc.cluster.local"]  # the headless Service's records
        names.append(pods.run(docker_run_args(node, pod, i, f"kt-{i}-{tag}", aliases, pods.network, ci_image)))
    done = [(run["rc"], run["out"] + run["err"]) for run in pods.wait(names, RUN_LIMIT).values()]
    assert [c for c, _ in done] == [0, 0], [logs[-3000:] for _, logs in done]
    [report] = [json.loads(line) for line in done[0][1].splitlines() if line.startswith("{") and '"checks"' in line]
    assert report["ok"] and report["world"]["world_size"] == 4 and report["world"]["backend"] == "gloo"
    assert report["world"]["master"].startswith("kt-0.kt.ns.svc.cluster.local:")
    assert {r["rank"]: r["host"] for r in report["ranks"]} == {0: "kt-0", 1: "kt-0", 2: "kt-1", 3: "kt-1"}
    print(f"\ntwo pods x 2 ranks, init containers first: {time.monotonic() - start:.1f}s")
