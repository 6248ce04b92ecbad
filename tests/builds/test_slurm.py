"""The Slurm path for real: a one-node Slurm 22.05 cluster with pyxis and enroot built from their
pinned sources (scripts/slurm-setup.sh, about 40 s), the CI stack's image exported as a .sqsh,
staged, started by `srun --container-image` with the smoke test inside, and `envbuild job`'s
script (one node, CPU, gloo) submitted with sbatch and run to completion.

Opt-in (ENVBUILD_SLURM=1), after `bash scripts/host-setup.sh && bash scripts/slurm-setup.sh`:
about 20 minutes on 2 cores, most of it mksquashfs of the multi-GB image and enroot's start.
With ENVBUILD_SLURM_IMAGE=REGISTRY/NAME:TAG (or @DIGEST) of an image `envbuild publish`
published, nothing is built or exported: `envbuild stage` fetches the .sqsh published beside it
(the registry's credentials and CA come from the environment, as for `envbuild stage`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import remove_images, run_build, run_cli, unique
from envbuild.supply.ci import real_build_stack
from envbuild.knowledge.matrix import load_matrix

pytestmark = [pytest.mark.skipif(os.environ.get("ENVBUILD_SLURM") != "1",
                                 reason="opt-in: set ENVBUILD_SLURM=1 after scripts/slurm-setup.sh")]
REPO = unique("envbuild-slurm")
# A CPU node: no libnvidia-container, so the job says it wants no GPU (the image asks for all,
# and under pyxis the image's value wins unless the job names it), as `envbuild job` does.
CPU = ("--container-env=NVIDIA_VISIBLE_DEVICES",)
CPU_ENV = {**os.environ, "NVIDIA_VISIBLE_DEVICES": "void"}


def _sh(*args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def cluster():
    if not shutil.which("srun") or "idle" not in _sh("sinfo", "-h", "-o", "%T").stdout:
        pytest.fail("no idle Slurm node: run `bash scripts/slurm-setup.sh` first")
    version = _sh("srun", "--help").stdout
    assert "--container-image" in version, "pyxis is not loaded (plugstack.conf.d/pyxis.conf)"


@pytest.fixture(scope="module")
def staged(cluster, docker_engine, tmp_path_factory):
    """The CI stack's image (CPU ops only; from BuildKit's cache where an earlier build left it,
    else built whole), exported and staged on a 'shared' directory; or, with ENVBUILD_SLURM_IMAGE,
    the .sqsh published beside that image, fetched from its registry."""
    work = tmp_path_factory.mktemp("slurm")
    shared = work / "shared"
    shared.mkdir()
    published = os.environ.get("ENVBUILD_SLURM_IMAGE")
    if published:
        started = time.monotonic()
        r = run_cli("stage", published, "--to", str(shared), "--unverified", timeout=3600)  # the test's own image
        assert r.returncode == 0 and "fetching the published .sqsh" in r.stderr, r.stderr
        yield {"image": published, "sqsh": next(shared.glob("*.sqsh")), "work": work,
               "export_s": time.monotonic() - started}
        return
    stack = real_build_stack(load_matrix()).id
    r = run_build("--gpu", "h20", "--stack", stack, "--ds-ops", "cpu_adam", "--image-repo", REPO, "-o", str(work / "b"),
                  env={"ENVBUILD_STATE_DIR": str(work / "state")}, timeout=5400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    image = f"{REPO}:{json.loads((work / 'b' / 'manifest.json').read_text())['tag']}"
    started = time.monotonic()
    r = run_cli("stage", image, "--to", str(shared), timeout=3600)
    assert r.returncode == 0, r.stderr
    sqsh = next(shared.glob("*.sqsh"))
    # pyxis starts the container read-only and mounts the home only of non-root users: the dumps go
    # to a directory the job mounts, named by ENVBUILD_DUMP_DIR (the image does not bake it). This
    # run's own: Slurm job ids start again at 1 on a new cluster, and an earlier run's dump
    # directory of the same job id would pass for this run's.
    dumps = work / "dumps"
    dumps.mkdir()
    yield {"image": image, "sqsh": sqsh, "work": work, "dumps": dumps, "export_s": time.monotonic() - started}
    remove_images(REPO)  # every tag the build gave it (readable and content), no one else's


def _dumps(staged):
    """srun's flag that mounts the dump directory, and the variable that names it."""
    dumps = staged["dumps"]
    return (f"--container-mounts={dumps}:{dumps}",), {**CPU_ENV, "ENVBUILD_DUMP_DIR": str(dumps)}


def test_srun_container_image_runs_the_smoke_test_inside(staged):
    mount, env = _dumps(staged)
    r = _sh("srun", f"--container-image={staged['sqsh']}", *CPU, *mount, "bash", "-c",
            ". /opt/envbuild/env.sh && exec python /opt/envbuild/smoke.py --json", timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout[r.stdout.index("{"):])
    assert result["ok"], [c for c in result["checks"] if not c.get("ok")]


def test_the_job_sees_the_images_environment_without_the_entrypoint(staged):
    """pyxis runs the command, not the image's entrypoint: the baked environment (the guard) comes
    through enroot's /etc/environment, the per-job caches and the dump directory from env.sh."""
    mount, environ = _dumps(staged)
    r = _sh("srun", f"--container-image={staged['sqsh']}", *CPU, *mount, "bash", "-c",
            ". /opt/envbuild/env.sh && env", timeout=600, env=environ)
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    job = env["SLURM_JOB_ID"]
    assert env["PIP_CONSTRAINT"] == "/etc/pip/constraint.txt"  # the guard (envbuild/image/paths.py)
    assert env["TORCH_EXTENSIONS_DIR"].endswith(f"torch_extensions-{job}")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{staged['dumps']}/flight_recorder-{job}/rank_"
    assert (staged["dumps"] / f"flight_recorder-{job}").is_dir()  # on the host, after the step: the user keeps it
    assert env["PATH"].startswith("/opt/venv/bin:")


def test_sbatch_of_the_generated_job_script_runs_to_completion(staged):
    work = staged["work"]
    (work / "train.py").write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "import torch\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "print('trained', dist.get_rank(), int(t.item()), flush=True)\n")
    script = run_cli("job", "--image", str(staged["sqsh"]), "--nodes", "1", "--gpus-per-node", "0",
                     "--time", "00:30:00").stdout
    (work / "job.sbatch").write_text(script)
    r = _sh("sbatch", "--parsable", "-o", str(work / "job-%j.out"), str(work / "job.sbatch"), cwd=work)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 1800
    while _sh("squeue", "-h", "-j", job_id).stdout.strip() and time.monotonic() < deadline:
        time.sleep(5)
    state = _sh("scontrol", "show", "job", job_id).stdout
    log = (work / f"job-{job_id}.out").read_text()
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + log[-3000:]
    assert "trained 0 2" in log and "trained 1 2" in log, log[-3000:]
