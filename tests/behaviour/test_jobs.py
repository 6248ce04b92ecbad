"""`envbuild job` as a batch host meets its script: run with bash, with stand-ins for sbatch, srun,
scontrol, apptainer, torchrun and python on PATH that record their argv (no Slurm here; the real
cluster runs it in test_slurm.py, opt-in). Whatever --train holds arrives at torchrun word for word,
as a shell would split it, and nothing in it runs; values Slurm cannot take are refused."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from envbuild.cli import main
from envbuild.base.errors import EnvbuildError

STUBS = {
    # sbatch reads #SBATCH lines up to the first command (sbatch(1)), then runs the script as a job would
    "sbatch": r'''#!/bin/bash
script=${@: -1}
while IFS= read -r line; do
  case "$line" in '#!'*|'') continue ;; '#SBATCH '*) printf '%s\n' "${line#\#SBATCH }" >> "$LOG/sbatch-options" ;;
    '#'*) ;; *) break ;; esac
done < "$script"
SLURM_JOB_NODELIST='node[1-2]' SLURM_NNODES=2 SLURM_JOB_ID=42 exec bash "$script"
''',
    "scontrol": "#!/bin/bash\necho node1\necho node2\n",
    # srun: its own options, then the step (pyxis: inside the image, where /opt/envbuild/env.sh exists)
    "srun": r'''#!/bin/bash
f=$(mktemp "$LOG/srun.XXXXXX"); printf '%s\0' "$@" > "$f"
while [ "${1#--}" != "$1" ]; do shift; done
if [ "$1" = bash ] && [ "$2" = -c ]; then exec bash -c "${3//\/opt\/envbuild\/env.sh//dev/null}" "${@:4}"; fi
exec "$@"
''',
    "apptainer": r'''#!/bin/bash
f=$(mktemp "$LOG/apptainer.XXXXXX"); printf '%s\0' "$@" > "$f"
shift; while [ "${1#--}" != "$1" ]; do shift; done; shift
exec "$@"
''',
    "torchrun": '#!/bin/bash\nf=$(mktemp "$LOG/torchrun.XXXXXX"); printf \'%s\\0\' "$@" > "$f"\n',
    "python": '#!/bin/bash\nf=$(mktemp "$LOG/python.XXXXXX"); printf \'%s\\0\' "$@" > "$f"\n',
}


def job(*args: str):
    """`envbuild job ARGS` in-process: (exit code, stdout, the error's message)."""
    result = CliRunner().invoke(main, ["job", *args])
    if isinstance(result.exception, EnvbuildError):
        return result.exception.exit_code, result.output, result.exception.message
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output, ""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    bin_dir = tmp_path_factory.mktemp("stub-bin")
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def submit(stubs: Path, script: str, work: Path) -> dict[str, list]:
    """Run `script` as sbatch would; what each stand-in was called with."""
    log = work / "log"
    log.mkdir()
    (work / "job.sbatch").write_text(script)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "LOG": str(log), "HOME": str(work)}
    done = subprocess.run(["sbatch", "job.sbatch"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls: dict[str, list] = {"sbatch-options": (log / "sbatch-options").read_text().splitlines()}
    for f in sorted(log.iterdir()):
        if "." in f.name:
            calls.setdefault(f.name.split(".")[0], []).append(f.read_bytes().decode().split("\0")[:-1])
    return calls


RDZV = ["--rdzv_backend", "c10d", "--rdzv_endpoint", "node1:29500", "--rdzv_id", "42"]


@pytest.mark.parametrize("runtime, image", [("pyxis", "/shared/envbuild-0123.sqsh"), ("apptainer", "/shared/x.sif")])
def test_train_arguments_arrive_intact_and_shell_text_arrives_as_data(stubs, tmp_path, runtime, image):
    train = 'train.py --lr 1e-4 --name "a b" ; touch PWNED $(touch PWNED2) `touch PWNED3` "x\ny" \'$HOME\''
    code, script, _ = job("--image", image, "--runtime", runtime, "--train", train)
    assert code == 0
    calls = submit(stubs, script, tmp_path)
    assert calls["sbatch-options"] == ["--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--time=24:00:00"]
    assert calls["torchrun"] == [["--nnodes", "2", "--nproc_per_node", "8", *RDZV, "train.py", "--lr", "1e-4",
                                  "--name", "a b", ";", "touch", "PWNED", "$(touch", "PWNED2)", "`touch",
                                  "PWNED3`", "x\ny", "$HOME"]]
    assert calls["python"] == [["/opt/envbuild/smoke.py", "--multinode"]]
    assert not list(tmp_path.glob("PWNED*"))
    if runtime == "pyxis":
        assert sorted(c[:2] for c in calls["srun"]) == [["--ntasks-per-node=8", "--container-image=/shared/envbuild-0123.sqsh"],
                                                       ["--ntasks=2", "--ntasks-per-node=1"]]
    else:
        assert calls["apptainer"][0][:3] == ["exec", "--nv", "/shared/x.sif"]


@pytest.mark.parametrize("args, words", [
    (["--time", "1:00\n#SBATCH --wrap=id"], ["--time '1:00\\n#SBATCH --wrap=id'", "not a Slurm time limit"]),
    (["--time", "forever"], ["--time 'forever'", "--time UNLIMITED", "--time 7-00:00:00"]),
    (["--time", "99999999-00"], ["more than Slurm can hold"]),
    (["--nodes", "1" * 20], ["--nodes", "above 2,147,483,647", "nearest valid value: --nodes 2147483647"]),
    (["--nodes", "0"], ["--nodes '0': it is below 1", "--nodes 1"]),
    (["--gpus-per-node", "100000"], ["--gpus-per-node '100000'", "above 64", "--gpus-per-node 8"]),
    (["--tasks-per-node", "100000"], ["--tasks-per-node", "MAX_TASKS_PER_NODE"]),
    (["--image", "/shared/x.sif"], ["--image /shared/x.sif is an Apptainer image", "--runtime apptainer"]),
    (["--image", "/shared/x.sqsh", "--runtime", "apptainer"], ["is an enroot image", "--runtime pyxis", ".sif"]),
    (["--image", "/shared/x\n.sqsh"], ["--image '/shared/x\\n.sqsh'", "control character"]),
    (["--image", "x.tar", "--runtime", "apptainer"], ["neither a .sif nor an image URI"]),
    (["--train", "train.py 'unclosed"], ["--train", "close the quote"]),
    (["--train", "   "], ["--train", "holds no command"]),
])
def test_values_slurm_or_the_runtime_cannot_take_are_refused(args, words):
    full = ["--image", "/shared/x.sqsh", *args] if "--image" not in args else args
    code, script, message = job(*full)
    assert code == 2 and script == "", (code, script)
    assert "\n" not in message
    for w in words:
        assert w in message, (w, message)


def test_the_readme_job_scripts_pass_shellcheck(tmp_path):
    from envbuild.render.jobs import Job, job_script

    files = []
    for i, j in enumerate([Job("ghcr.io#acme/envbuild:t"), Job("/shared/t.sif", "apptainer"),
                           Job("/x.sqsh", gpus_per_node=0, train="a.py --name 'a b' \"$(x)\"")]):
        files.append(tmp_path / f"{i}.sh")
        files[-1].write_text(job_script(j))
    r = subprocess.run(["shellcheck", "--severity=style", *map(str, files)], capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{Path(os.sys.executable).parent}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout
