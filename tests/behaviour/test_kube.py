"""`envbuild job --k8s`: the manifest of each kind for each fabric profile holds the wiring a
multi-node job needs (read back from the YAML, as kubectl would), -o writes it only over its own
file, combinations that cannot work are refused with the reason, and `--check FILE` refuses each
deliberately broken manifest of tests/fixtures/k8s-broken for its own reason."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from envbuild.base.errors import EnvbuildError
from envbuild.cli import main
from envbuild.render.kube import KubeJob, manifest_documents
from envbuild.render.kubecheck import manifest_problems

IMAGE = "ghcr.io/acme/envbuild@sha256:" + "a" * 64
BROKEN = Path(__file__).resolve().parents[1] / "fixtures" / "k8s-broken"
FABRIC_RESOURCE = {"ib": ("rdma/hca_shared_devices_a", 1), "aws-efa": ("vpc.amazonaws.com/efa", 32),
                   "azure-ndv5": ("rdma/shared_ib", 1)}
NET = {"ib": "IB", "aws-efa": "Libfabric", "azure-ndv5": "IB"}


def run(*args: str):
    """`envbuild job ARGS` in-process: (exit code, stdout, the error's message or stderr)."""
    result = CliRunner().invoke(main, ["job", *args])
    if isinstance(result.exception, EnvbuildError):
        return result.exception.exit_code, result.stdout, result.exception.message
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def pods(docs: list[dict]) -> list[dict]:
    """The pod specs of a generated manifest, as a reader finds them."""
    found = []
    for doc in docs:
        spec = doc["spec"]
        if doc["kind"] == "Job":
            found.append(spec["template"]["spec"])
        elif doc["kind"] in ("JobSet", "TrainingRuntime"):
            spec = spec["template"]["spec"] if doc["kind"] == "TrainingRuntime" else spec
            found += [r["template"]["spec"]["template"]["spec"] for r in spec["replicatedJobs"]]
    return found


@pytest.mark.parametrize("kind", ["indexed", "jobset", "trainjob"])
@pytest.mark.parametrize("fabric", ["ib", "aws-efa", "azure-ndv5"])
def test_each_kind_wires_the_fabric_in_one_container(kind, fabric):
    """GPUs and the fabric's resources in the limits of each container that runs NCCL, IPC_LOCK, a
    memory-backed /dev/shm of 8 GiB per GPU, the bootstrap interface, NCCL_NET pinned, the smoke
    test first, and rank 0's full DNS name."""
    code, out, err = run("--k8s", kind, "--image", IMAGE, "--fabric", fabric, "--nodes", "4", "--name", "llm",
                         "--namespace", "team-a", "--train", "train.py --lr 1e-4")
    assert code == 0, err
    assert out.startswith(f"# envbuild job --k8s {kind}\n")
    docs = list(yaml.safe_load_all(out))
    assert manifest_problems(docs) == []
    [pod] = pods(docs)
    resource, count = FABRIC_RESOURCE[fabric]
    assert [c["name"] for c in pod["initContainers"] + pod["containers"]] == ["transport-check", "node"]
    for c in pod["initContainers"] + pod["containers"]:
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, resource: count} == c["resources"]["requests"]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0" and env["NCCL_NET"] == NET[fabric]
        assert c["image"] == IMAGE and "command" not in c  # the image's entrypoint sources its env.sh
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
    assert pod["initContainers"][0]["args"] == ["python", "/opt/envbuild/smoke.py"]
    args = pod["containers"][0]["args"]
    host = {"indexed": "llm-0.llm", "jobset": "llm-node-0-0.llm", "trainjob": "llm-node-0-0.llm"}[kind]
    assert args[args.index("--master-addr") + 1] == f"{host}.team-a.svc.cluster.local"
    assert args[-3:] == ["train.py", "--lr", "1e-4"]
    if kind == "trainjob":  # Kubeflow Trainer's torch plugin sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE
        assert "--node-rank" not in args and args[args.index("--master-port") + 1] == "29400"
        assert docs[1]["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                                 "name": "llm"}
    else:
        assert args[:7] == ["torchrun", "--nnodes", "4", "--nproc-per-node", "8", "--node-rank", "$(NODE_RANK)"]
        rank = next(e for e in pod["containers"][0]["env"] if e["name"] == "NODE_RANK")
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def test_indexed_service_and_placement():
    """The headless Service selects the Job's pods and publishes them before they are ready; the
    node selector, tolerations and Kueue label land where Kubernetes reads them."""
    code, out, err = run("--k8s", "indexed", "--image", IMAGE, "--queue", "team-a", "--node-selector",
                         "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3", "--toleration", "nvidia.com/gpu:NoSchedule",
                         "--toleration", "dedicated=train:NoExecute")
    assert code == 0, err
    service, job = yaml.safe_load_all(out)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "envbuild-train"}
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and job["spec"]["suspend"] is True
    spec = job["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                   {"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoExecute"}]


def test_train_words_arrive_as_written():
    """Each word of --train is one element of args; a '$' is written '$$', which the kubelet's
    $(VAR) expansion reads back as '$': the program gets the text, nothing is expanded."""
    train = "train.py --name 'a b' '$(id)' '$(NODE_RANK)' ';' 'x\ny'"
    [job] = [d for d in manifest_documents(KubeJob("indexed", IMAGE, train=train)) if d["kind"] == "Job"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    words = args[args.index("29500") + 1:]
    assert [w.replace("$$", "$") for w in words] == shlex.split(train)
    assert words[3:5] == ["$$(id)", "$$(NODE_RANK)"]


def test_fabric_resource_override_and_cpu_job():
    code, out, err = run("--k8s", "jobset", "--image", IMAGE, "--fabric-resource", "rdma/ib_pool=2",
                         "--shm-size", "128Gi")
    assert code == 0, err
    [pod] = pods(list(yaml.safe_load_all(out)))
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/ib_pool": 2}
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "128Gi"
    code, out, err = run("--k8s", "indexed", "--image", IMAGE, "--fabric", "none", "--gpus-per-node", "0")
    assert code == 0, err
    [pod] = pods(list(yaml.safe_load_all(out)))
    node = pod["containers"][0]
    assert "resources" not in node and {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in node["env"]
    assert node["args"][:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "2"]


@pytest.mark.parametrize("args, said", [
    (["--fabric", "azure-ndv5", "--gpus-per-node", "16"], "its nodes hold 8 GPUs"),
    (["--fabric", "aws-efa", "--gpus-per-node", "9"], "nearest valid value: --gpus-per-node 8"),
    (["--gpus-per-node", "0"], "--fabric none for a CPU job"),
    (["--fabric", "myrinet"], "is not a known fabric"),
    (["--name", "x" * 62, "--nodes", "10"], "nearest valid choice: --name " + "x" * 54 + "."),  # x-node-0-9
    (["--name", "Train"], "not a DNS-1123 label"),
    (["--nodes", "0"], "nearest valid value: --nodes 1"),
    (["--toleration", "nvidia.com/gpu:Sometimes"], "none of NoSchedule, PreferNoSchedule, NoExecute"),
    (["--node-selector", "gpu"], "has no '='"),
    (["--fabric-resource", "kubernetes.io/x=1"], "Kubernetes' own"),
    (["--fabric-resource", "rdma/x=0"], "no whole number from 1"),
    (["--shm-size", "1.5G"], "not a quantity"),
    (["--time", "1:00"], "--time: it is for the Slurm script, not --k8s"),
])
def test_combinations_that_cannot_work_are_refused(args, said, tmp_path):
    out = tmp_path / "job.yaml"
    code, stdout, err = run("--k8s", "trainjob", "--image", IMAGE, *args, "-o", str(out))
    assert code == 2 and said in err and "\n" not in err.strip(), (code, err)
    assert not out.exists() and stdout == ""


def test_image_must_be_pinned_by_digest():
    code, _, err = run("--k8s", "indexed", "--image", "ghcr.io/acme/envbuild:latest")
    assert code == 2 and "names no sha256 digest" in err and "--image ghcr.io/acme/envbuild:latest@sha256:" in err
    code, _, err = run("--k8s", "indexed")
    assert code == 2 and "--image is missing" in err
    code, _, err = run("--fabric", "ib", "--image", "/shared/x.sqsh")
    assert code == 2 and "--fabric: it is for --k8s" in err


def test_output_written_atomically_and_only_over_its_own(tmp_path):
    """-o writes the manifest; a second run replaces envbuild's own file; a file envbuild did not
    write, a symlink or a FIFO is refused and left as it was."""
    target = tmp_path / "job.yaml"
    code, out, err = run("--k8s", "jobset", "--image", IMAGE, "-o", str(target))
    assert code == 0, err
    assert target.read_text().startswith("# envbuild job --k8s jobset\n") and f"--check {target}" in out
    code, _, err = run("--k8s", "indexed", "--image", IMAGE, "-o", str(target))
    assert code == 0 and "kind: Service" in target.read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text("apiVersion: v1\nkind: ConfigMap\n")
    code, _, err = run("--k8s", "indexed", "--image", IMAGE, "-o", str(mine))
    assert code == 2 and "did not write it" in err and mine.read_text() == "apiVersion: v1\nkind: ConfigMap\n"
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    code, _, err = run("--k8s", "indexed", "--image", IMAGE, "-o", str(link))
    assert code == 2 and link.is_symlink()
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    code, _, err = run("--k8s", "indexed", "--image", IMAGE, "-o", str(fifo))
    assert code == 2 and "FIFO" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.yaml", "job.yaml", "link.yaml", "mine.yaml"]


def test_check_accepts_what_envbuild_writes(tmp_path):
    for kind in ("indexed", "jobset", "trainjob"):
        target = tmp_path / f"{kind}.yaml"
        assert run("--k8s", kind, "--image", IMAGE, "--fabric", "aws-efa", "-o", str(target))[0] == 0
        code, out, err = run("--k8s", "--check", str(target))
        assert code == 0 and "1 pod template(s) checked" in out, err


@pytest.mark.parametrize("name", sorted(p.name for p in BROKEN.glob("*.yaml")))
def test_each_broken_manifest_is_refused_for_its_reason(name):
    """Each file's first line names the mistake; the refusal holds those words, once per
    container that has it, and names the file."""
    path = BROKEN / name
    reason = path.read_text().splitlines()[0].removeprefix("# refused: ")
    code, out, err = run("--check", str(path))
    assert code == 2 and out == "" and reason in err and str(path) in err, err
    others = {"resources split", "no memory-backed /dev/shm", "a short name", "without the IPC_LOCK capability",
              "holds no pod template", "pins NCCL_NET"} - {reason}
    assert not [o for o in others if o in err], err


def test_check_refuses_a_dropped_fabric_resource_and_what_is_no_manifest(tmp_path):
    docs = manifest_documents(KubeJob("indexed", IMAGE, fabric="ib"))
    for c in docs[1]["spec"]["template"]["spec"]["containers"]:
        del c["resources"]["limits"]["rdma/hca_shared_devices_a"], c["resources"]["requests"]["rdma/hca_shared_devices_a"]
    docs[1]["spec"]["template"]["spec"]["initContainers"] = []
    assert ["pins NCCL_NET=IB" in p for p in manifest_problems(docs)] == [True]
    for text, said in (("a: [1\n", "not valid YAML"), ("- 1\n", "not a mapping"), ("x: &a 1\ny: *a\n", "alias")):
        (tmp_path / "m.yaml").write_text(text)
        code, _, err = run("--check", str(tmp_path / "m.yaml"))
        assert code == 2 and said in err, err
    code, _, err = run("--check", "/dev/zero")
    assert code == 2 and "not a regular file" in err
    code, _, err = run("--check", str(tmp_path / "m.yaml"), "--nodes", "3")
    assert code == 2 and "--check FILE takes no other option" in err
    code, _, err = run("--k8s", "--image", IMAGE)
    assert code == 2 and "--k8s needs the kind" in err
    code, _, err = run("--k8s", "pod", "--image", IMAGE)
    assert code == 2 and "--k8s 'pod': unknown; choose one of indexed, jobset, trainjob" in err


@pytest.mark.parametrize("field, value, said", [
    ("name", "train\njob", "metadata.name 'train\\njob': it holds the control character"),
    ("image", "ghcr.io/acme/envbuild\n@sha256:" + "a" * 64, "image 'ghcr.io/acme/envbuild\\n@sha256:"),
    ("container", "Node;id", "container name 'Node;id': it is not a DNS-1123 label"),
])
def test_check_names_a_name_or_image_the_api_server_would_refuse(field, value, said, tmp_path):
    """Someone else's manifest with a newline in its name or image reference, or a container name
    that is no DNS-1123 label: exit 2 naming the field and its value as data, before any rule."""
    service, job = json.loads(json.dumps(manifest_documents(KubeJob("indexed", IMAGE, fabric="ib"))))  # no shared nodes
    pod = job["spec"]["template"]["spec"]
    if field == "name":
        job["metadata"]["name"] = value
    else:
        pod["containers"][0]["image" if field == "image" else "name"] = value
    (tmp_path / "m.yaml").write_text(yaml.safe_dump_all([service, job]))
    code, _, err = run("--check", str(tmp_path / "m.yaml"))
    assert code == 2 and said in err and "\n" not in err, err
    assert "resources split" not in err and "IPC_LOCK" not in err
