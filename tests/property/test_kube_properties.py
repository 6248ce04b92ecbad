"""`envbuild job --k8s` for any value of any option (hypothesis): exit 2 with one line naming the
option and nothing written, or a manifest whose YAML, read back, holds the value exactly where it
belongs and no key more (a newline, a quote, ``$(...)``, ``${{ }}`` or a very long name cannot add
one), and that envbuild's own --check accepts."""

from __future__ import annotations

import shlex

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError
from envbuild.cli import main
from envbuild.render.kube import KubeJob, manifest
from envbuild.render.kubecheck import manifest_problems
from property_settings import EXAMPLES

IMAGE = "ghcr.io/acme/envbuild@sha256:" + "c" * 64
OPTIONS = {"name": "llm", "namespace": "team-a", "queue": "q", "cluster_domain": "cluster.local", "socket_ifname": "eth0",
           "shm_size": "64Gi", "train": "train.py", "image": IMAGE, "node_selector": "a/b=c",
           "toleration": "nvidia.com/gpu:NoSchedule", "fabric_resource": "rdma/shared_ib=1", "fabric": "ib"}
PIECES = ["\n", "\r", "\t", "\x1b", "\u2028", '"', "'", "`", "\\", "$", "$(touch PWNED)", "${{ secrets.X }}", "${HOME}",
          ": x", "\n  evil: 1", "- a", "{a: b}", "[1]", "#", "&a", "*a", "!!python/object", "---", " ", "-", "/", ".",
          "=", ":", "x" * 300, "A", "0", "NoSchedule", "@sha256:"]


@st.composite
def option_values(draw):
    option = draw(st.sampled_from(sorted(OPTIONS)))
    hostile = draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=5).map("".join)
                   | st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
    benign = OPTIONS[option]
    return option, draw(st.sampled_from([hostile, benign + hostile, hostile + benign]))


def _job(values: dict) -> KubeJob:
    many = {k: (values[k],) for k in ("node_selector", "toleration", "fabric_resource")}
    return KubeJob("indexed", values["image"], 2, 8, values["train"], values["fabric"], values["name"],
                   values["namespace"], values["cluster_domain"], values["queue"], many["node_selector"],
                   many["toleration"], many["fabric_resource"], values["shm_size"], values["socket_ifname"])


def _cli(values: dict, output) -> int:
    """`envbuild job --k8s indexed` with `values` as options and -o `output`: its exit code."""
    args = [w for k, v in values.items() for w in ("--" + k.replace("_", "-"), v)]
    result = CliRunner().invoke(main, ["job", "--k8s", "indexed", *args, "-o", str(output)])
    return result.exception.exit_code if isinstance(result.exception, EnvbuildError) else result.exit_code


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option_value=option_values())
def test_any_value_is_refused_naming_its_option_or_lands_where_it_belongs(option_value, tmp_path):
    option, value = option_value
    values = {**OPTIONS, option: value}
    try:
        text = manifest(_job(values))
    except EnvbuildError as e:
        event(f"{option} refused")
        flag = "--" + option.replace("_", "-")
        assert e.exit_code == 2 and flag in e.message, (option, value, e.message)
        assert "\n" not in e.message and not set(grammar.control_characters(value)) & set(e.message), e.message
        assert _cli(values, tmp_path / "job.yaml") == 2 and list(tmp_path.iterdir()) == []  # nothing written
        return
    event(f"{option} written")
    service, job = yaml.safe_load_all(text)
    assert manifest_problems([service, job]) == []
    pod = job["spec"]["template"]["spec"]
    node = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in node["env"]}
    # every key is envbuild's: the value added none
    assert set(job) == {"apiVersion", "kind", "metadata", "spec"} and set(service["metadata"]) == {"name", "namespace",
                                                                                                 "labels"}
    assert set(node) == {"name", "image", "args", "env", "securityContext", "volumeMounts", "resources"}
    assert set(env) == {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_NET", "NODE_RANK"}
    name, ns = values["name"], values["namespace"]
    assert job["metadata"]["name"] == service["metadata"]["name"] == pod["subdomain"] == name
    assert job["metadata"]["namespace"] == ns and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == values["queue"]
    assert node["image"] == values["image"] and env["NCCL_SOCKET_IFNAME"] == values["socket_ifname"]
    assert node["args"][node["args"].index("--master-addr") + 1] == f"{name}-0.{name}.{ns}.svc.{values['cluster_domain']}"
    assert [w.replace("$$", "$") for w in node["args"][11:]] == shlex.split(values["train"])
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == values["shm_size"]
    key, _, label = values["node_selector"].partition("=")
    assert pod["nodeSelector"] == {key: label}
    resource, _, count = values["fabric_resource"].partition("=")
    assert node["resources"]["limits"] == {"nvidia.com/gpu": 8, resource: int(count)}
