"""Every manifest `envbuild job --k8s` writes passes the schemas the cluster would apply: the core
kinds (Service, batch/v1 Job, and every pod template wrapped as a Job) `kubernetes-validate
--strict` for each Kubernetes minor docs/running.md names, and the JobSet, TrainingRuntime and
TrainJob documents their CRDs' openAPIV3Schema (tests/fixtures/k8s-crds, upstream's files at a
release tag, sha256 checked), made strict as the API server's field validation is: an unknown
field is refused, not pruned. Nothing here runs a cluster."""

from __future__ import annotations

import copy
import gzip
import hashlib
import re
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from envbuild.render.kube import KINDS, KubeJob, manifest_documents

CRDS = Path(__file__).resolve().parents[1] / "fixtures" / "k8s-crds"
# The minors docs/running.md names (kubernetes-validate ships their schemas).
MINORS = ("1.30.0", "1.33.0", "1.35.0")
IMAGE = "ghcr.io/acme/envbuild@sha256:" + "b" * 64
FABRICS = ("ib", "aws-efa", "azure-ndv5")
CRD_OF = {"JobSet": ("jobset.x-k8s.io_jobsets.yaml.gz", "v1alpha2"),
          "TrainingRuntime": ("trainer.kubeflow.org_trainingruntimes.yaml.gz", "v1alpha1"),
          "TrainJob": ("trainer.kubeflow.org_trainjobs.yaml.gz", "v1alpha1")}


def _readme_sha256() -> dict[str, str]:
    rows = re.findall(r"^\| (\S+\.yaml\.gz) \| .* \| ([0-9a-f]{64}) \|$", (CRDS / "README.md").read_text(), re.M)
    return dict(rows)


def test_crds_are_upstreams_files():
    """Each CRD decompresses to the bytes whose sha256 the README gives with its upstream URL."""
    listed = _readme_sha256()
    assert sorted(listed) == sorted(p.name for p in CRDS.glob("*.yaml.gz"))
    for name, digest in listed.items():
        assert hashlib.sha256(gzip.decompress((CRDS / name).read_bytes())).hexdigest() == digest, name


def _strict(schema):
    """The schema with additionalProperties: false on every object that lists its properties and
    does not keep unknown fields (x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    return [_strict(v) for v in schema] if isinstance(schema, list) else schema


@cache
def crd_schema(kind: str) -> dict:
    import yaml

    name, version = CRD_OF[kind]
    crd = yaml.safe_load(gzip.decompress((CRDS / name).read_bytes()))
    assert crd["spec"]["names"]["kind"] == kind
    [found] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _strict(found["schema"]["openAPIV3Schema"])


def _job_templates(doc: dict) -> list[dict]:
    """The batch/v1 JobSpec templates inside a JobSet or a TrainingRuntime."""
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "TrainingRuntime" else doc["spec"]
    return [r["template"] for r in spec.get("replicatedJobs", [])]


def validate(doc: dict) -> None:
    if doc["kind"] in CRD_OF:
        jsonschema.validate(doc, crd_schema(doc["kind"]))
        core = [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **t} for t in _job_templates(doc)]
    else:
        core = [doc]
    for d in core:
        for minor in MINORS:
            kubernetes_validate.validate(d, minor, strict=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fabric", FABRICS)
def test_every_manifest_passes_the_schemas(kind, fabric):
    job = KubeJob(kind, IMAGE, nodes=16, fabric=fabric, queue="team-a", node_selector=("nvidia.com/gpu.present=true",),
                  tolerations=("nvidia.com/gpu:NoSchedule", "dedicated=train:NoExecute"))
    for doc in manifest_documents(job):
        validate(doc)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cpu_manifest_passes_the_schemas(kind):
    for doc in manifest_documents(KubeJob(kind, IMAGE, nodes=2, gpus_per_node=0, fabric="none")):
        validate(doc)


@pytest.mark.parametrize("kind", KINDS)
def test_the_schemas_refuse_an_unknown_field(kind):
    """The validation can fail: a field misspelled in the pod template is refused by each schema."""
    for doc in manifest_documents(KubeJob(kind, IMAGE)):
        bad = copy.deepcopy(doc)
        if doc["kind"] == "Service":
            bad["spec"]["clusterIp"] = "None"
        elif doc["kind"] == "TrainJob":
            bad["spec"]["trainer"]["numNode"] = 2
        else:
            job = bad["spec"] if doc["kind"] == "Job" else _job_templates(bad)[0]["spec"]
            pod = job["template"]["spec"]
            pod["containers"][0]["securityContxt"] = {}
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(bad)
