"""Node-side checks: the driver floor, the manifest's conditional node_env and the container
warnings (RDMA devices the container cannot use, a small /dev/shm, a GPU node's GPUs not handed
in), as env.sh applies them at container start and as the smoke test's checks see them.

No GPU, NVIDIA driver or RDMA device exists here. The node's own files are stood in for by a
directory (ENVBUILD_NODE_ROOT, env.sh's and nodefacts.py's test hook): /dev/nvidiactl and
/proc/driver/nvidia/version with real contents copied from public issue threads (URLs below),
and the trees in tests/fixtures/nodes (real hosts' sysfs from public threads, real containers'
/proc captured from Docker; README there); nvidia-smi is a stand-in script printing what the
real one printed in those threads. env.sh itself runs for real, in dash and bash, with only its
image paths pointed at this checkout.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from envbuild.image import checks, node, nodefacts, paths
from envbuild.image.container import container_problems

# (source, /proc/driver/nvidia/version as posted, the version in it)
DRIVER_FILES = [
    ("https://github.com/dylanaraps/neofetch/issues/876",
     "NVRM version: NVIDIA UNIX x86_64 Kernel Module  384.98  Thu Oct 26 15:16:01 PDT 2017\n"
     "GCC version:  gcc version 7.2.0 (Ubuntu 7.2.0-8ubuntu3) \n", "384.98"),
    ("https://github.com/nix-community/nixGL/issues/186",
     "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  565.57.01  Release Build  "
     "(dvs-builder@U16-A24-9-2)  Thu Oct 10 12:15:00 UTC 2024\n"
     "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n", "565.57.01"),
    ("https://github.com/hyprwm/Hyprland/pull/6715",
     "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  555.58  Release Build  (portage@localhost)  "
     "Сб 29 июн 2024 14:36:22 MSK\n", "555.58"),
    ("https://github.com/nix-community/nixGL/issues/139",
     "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  35.3.1  Release Build  "
     "(buildbrain@mobile-u64-6289-d7000)  Sun Mar 19 08:09:33 PDT 2023\n"
     "GCC version:  gcc version 9.3.0 (Buildroot 2020.08) \n", "35.3.1"),
]
# `nvidia-smi --query-gpu=driver_version --format=csv,noheader` on two GPUs,
# https://github.com/pytorch/pytorch/pull/88364
NVIDIA_SMI_TWO_GPUS = "515.57\n515.57\n"
SHELLS = [s for s in ("dash", "bash") if shutil.which(s)]

MANIFEST = {
    "tag": "t", "python": "3.11", "torch": "2.11.0", "cuda": "13.0", "deepspeed": "0.19.8", "ds_ops": [],
    "driver": {"cuda": "13.0", "min_driver": "580.65.06", "forward_compat": "cuda-compat-13-0 on data-centre GPUs",
               "source": "CUDA 13.0 release notes"},
    "node_env": [
        {"name": "NCCL_IB_DISABLE", "value": "1", "when": {"driver_below": "550.40.07"}, "reason": "r", "source": "s"},
        {"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker", "when": {"infiniband": "absent"}, "reason": "r",
         "source": "s"},
    ],
}


def make_root(tmp_path: Path, version_file: str | None = None, nvidiactl: bool = True, ib: tuple = ()) -> Path:
    root = tmp_path / "node"
    (root / "dev").mkdir(parents=True, exist_ok=True)
    if nvidiactl:
        (root / "dev" / "nvidiactl").write_text("")
    if version_file is not None:
        (root / "proc" / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
        (root / "proc" / "driver" / "nvidia" / "version").write_text(version_file, encoding="utf-8")
    for index, dev in enumerate(ib):  # RDMA devices, handed to the container (docker --device /dev/infiniband)
        (root / "sys" / "class" / "infiniband" / dev).mkdir(parents=True)
        (root / "dev" / "infiniband").mkdir(parents=True, exist_ok=True)
        (root / "dev" / "infiniband" / f"uverbs{index}").write_text("")
    return root


def fake_nvidia_smi(tmp_path: Path, stdout: str, code: int = 0) -> Path:
    """A stand-in nvidia-smi (there is no driver here) printing what the real one printed."""
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    (bindir / "nvidia-smi.out").write_text(stdout)
    smi = bindir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n/bin/cat {bindir / 'nvidia-smi.out'}\nexit {code}\n")
    smi.chmod(0o755)
    return bindir


# --------------------------------------------------------------------------- parsing (python side)
@pytest.mark.parametrize("source, text, version", DRIVER_FILES, ids=[d[2] for d in DRIVER_FILES])
def test_driver_file_parses(source, text, version):
    assert nodefacts.parse_driver_file(text) == version


def test_nvidia_smi_output_parses():
    assert nodefacts.parse_nvidia_smi(NVIDIA_SMI_TWO_GPUS) == "515.57"
    assert nodefacts.parse_nvidia_smi("\n") is None
    assert nodefacts.parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver") is None


@pytest.mark.parametrize("word, ok", [("580.65.06", True), ("384.98", True), ("2017", False), ("15:16:01", False),
                                      ("x86_64", False), ("1.", False), (".5", False), ("1..2", False),
                                      ("٥.٥", False)])
def test_dotted_number(word, ok):
    assert nodefacts.is_dotted_number(word) is ok


def test_read_driver_prefers_the_proc_file_then_nvidia_smi(tmp_path, monkeypatch):
    root = make_root(tmp_path, DRIVER_FILES[1][1])
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path, NVIDIA_SMI_TWO_GPUS)))
    assert nodefacts.read_driver(str(root)) == ("565.57.01", nodefacts.DRIVER_FILE)
    assert nodefacts.read_driver(str(tmp_path / "elsewhere")) == ("515.57", "nvidia-smi")
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed", code=9)))
    found, why = nodefacts.read_driver(str(tmp_path / "elsewhere"))
    assert found is None and "exited 9" in why
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert nodefacts.read_driver(str(tmp_path / "elsewhere"))[0] is None


def test_probe_sees_gpu_and_infiniband(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = nodefacts.probe(str(make_root(tmp_path, DRIVER_FILES[0][1], ib=("mlx5_0", "mlx5_1"))))
    assert (facts.driver, facts.gpu_visible, facts.infiniband) == ("384.98", True, ["mlx5_0", "mlx5_1"])
    bare = nodefacts.probe(str(tmp_path / "nothing"))
    assert (bare.driver, bare.gpu_visible, bare.infiniband) == (None, False, [])


# --------------------------------------------------------------------------- decisions
def facts(driver="535.104.05", visible=True, ib=()):
    return nodefacts.NodeFacts(driver, "test", visible, list(ib))


def test_driver_floor_env_wins_and_empty_env_silences_only_the_start_warning():
    assert node.driver_floor(MANIFEST, {}) == ("580.65.06", "manifest")
    assert node.driver_floor(MANIFEST, {paths.MIN_DRIVER_ENV: "570.0"}) == ("570.0", paths.MIN_DRIVER_ENV)
    assert node.driver_floor(MANIFEST, {paths.MIN_DRIVER_ENV: ""}, use_manifest=False) == (None, "none recorded")
    assert node.driver_floor({}, {}) == (None, "none recorded")


def test_too_old_message_says_what_and_what_to_do():
    msg = node.driver_problem(facts("535.104.05"), MANIFEST, {})
    for part in ("535.104.05", "580.65.06", "CUDA 13.0", "803", "804", "older CUDA", "--cuda",
                 "forward-compatibility", "cuda-compat-13-0", "data-centre", MANIFEST["driver"]["forward_compat"]):
        assert part in msg, part
    assert node.driver_problem(facts("580.65.06"), MANIFEST, {}) is None
    assert node.driver_problem(facts(None), MANIFEST, {}) is None
    assert node.driver_problem(facts("535.104.05"), {"cuda": "12.8"}, {}) is None  # no floor recorded


@pytest.mark.parametrize("when, node_facts, holds, why", [
    ({"driver_below": "550.40.07"}, facts("535.104.05"), True, "driver 535.104.05 < 550.40.07"),
    ({"driver_below": "550.40.07"}, facts("550.40.07"), False, "driver 550.40.07 >= 550.40.07"),
    ({"driver_below": "550.40.07"}, facts(None), False, "no driver visible"),
    ({"driver_below": "new"}, facts(), False, "invalid driver_below"),
    ({"infiniband": "absent"}, facts(), True, "no InfiniBand device"),
    ({"infiniband": "absent"}, facts(ib=("mlx5_0",)), False, "InfiniBand devices mlx5_0"),
    ({"infiniband": "present"}, facts(ib=("mlx5_0",)), True, "InfiniBand mlx5_0"),
    ({"infiniband": "maybe"}, facts(), False, "invalid infiniband"),
    ({"driver_below": "550.40.07", "infiniband": "absent"}, facts("535.1"), True, "driver 535.1 < 550.40.07"),
    ({"driver_below": "550.40.07", "infiniband": "absent"}, facts("535.1", ib=("ib0",)), False, "InfiniBand"),
    ({"gpu_count_above": 4}, facts(), False, "unknown condition 'gpu_count_above'"),
    ({}, facts(), True, "no condition"),
])
def test_condition_holds(when, node_facts, holds, why):
    got, reason = node.condition_holds(when, node_facts)
    assert got is holds and why in reason


def test_node_env_decisions_user_wins_and_bad_entries_are_refused():
    manifest = {"node_env": [*MANIFEST["node_env"],
                             {"name": "BAD NAME", "value": "1", "when": {}},
                             {"name": "1X", "value": "1", "when": {}},
                             {"name": "NCCL_OK", "value": "two\nlines", "when": {}},
                             "not a dict"]}
    got = node.node_env_decisions(manifest, facts("535.104.05"), {"NCCL_SOCKET_IFNAME": "eth0"})
    assert [(d["name"], d["state"]) for d in got] == [
        ("NCCL_IB_DISABLE", "apply"), ("NCCL_SOCKET_IFNAME", "user"), ("BAD NAME", "invalid"), ("1X", "invalid"),
        ("NCCL_OK", "invalid"), ("not a dict", "invalid")]
    empty_is_unset = node.node_env_decisions(manifest, facts("560.0"), {"NCCL_SOCKET_IFNAME": ""})
    assert [(d["name"], d["state"]) for d in empty_is_unset[:2]] == [("NCCL_IB_DISABLE", "skip"),
                                                                     ("NCCL_SOCKET_IFNAME", "apply")]


# --------------------------------------------------------------------------- smoke checks
def test_driver_check_gpu_and_cpu_modes():
    ok, detail, _, data = checks.check_driver(MANIFEST, True, facts("580.82.07"), {})
    assert ok and "580.82.07 >= 580.65.06" in detail and data["min_driver"] == "580.65.06"
    ok, detail, _, data = checks.check_driver(MANIFEST, True, facts("535.104.05"), {})
    assert not ok and detail == node.driver_problem(facts("535.104.05"), MANIFEST, {})
    # CPU mode because the driver is too old for torch to see the GPU: still a failure, same words
    ok, detail, _, _ = checks.check_driver(MANIFEST, False, facts("535.104.05", visible=True), {})
    assert not ok and "803" in detail
    skipped = checks.check_driver(MANIFEST, False, facts(None, visible=False), {})
    assert skipped.reason.startswith("CPU mode") and skipped.data["driver"] is None
    assert checks.check_driver({"cuda": "12.8"}, True, facts("535.1"), {})[0] is True  # no floor recorded
    ok, detail, _, _ = checks.check_driver(MANIFEST, True, facts(None), {})
    assert ok and "not readable" in detail
    ok, detail, _, _ = checks.check_driver(MANIFEST, True, facts("590.1"), {paths.MIN_DRIVER_ENV: "latest"})
    assert not ok and "invalid driver floor 'latest'" in detail


def test_node_env_check():
    here = facts("535.104.05")
    applied = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "^lo,docker"}
    ok, detail = checks.check_node_env(MANIFEST, True, here, applied)
    assert ok and "NCCL_IB_DISABLE=1 set (driver 535.104.05 < 550.40.07)" in detail
    ok, detail = checks.check_node_env(MANIFEST, True, here, {"NCCL_SOCKET_IFNAME": "eth0"})
    assert not ok and "NCCL_IB_DISABLE unset but needed here" in detail and "set by the user" in detail
    ok, detail = checks.check_node_env(MANIFEST, True, facts("570.1", ib=("mlx5_0",)), {})
    assert ok and detail.count("not needed") == 2
    assert checks.check_node_env({"node_env": []}, True, here, {}).reason.startswith("the manifest has no")
    assert checks.check_node_env(MANIFEST, False, facts(None, visible=False), {}).reason.startswith("CPU mode")


# --------------------------------------------------------------------------- env.sh for real
class EnvSh:
    """env.sh with its image paths pointed at this checkout; python is a wrapper that records
    each call (to prove when env.sh starts it) and runs this interpreter."""

    def __init__(self, tmp_path: Path, python_body: str | None = None):
        text = (ROOT / "templates" / "files" / "env.sh").read_text()
        for path in (paths.VENV_PYTHON, f'"{paths.LIB}"', paths.MANIFEST, f"{paths.VENV}/bin"):
            assert path in text, f"env.sh no longer names {path} (envbuild/image/paths.py)"
        lib = tmp_path / "lib"
        shutil.copytree(ROOT / "envbuild" / "image", lib / paths.PACKAGE,
                        ignore=shutil.ignore_patterns("__pycache__"))
        self.calls = tmp_path / "python-calls"
        wrapper = tmp_path / "python"
        body = python_body or f'exec {sys.executable} "$@"'
        wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >>{self.calls}\n{body}\n')
        wrapper.chmod(0o755)
        self.path = tmp_path / "env.sh"
        self.path.write_text(text.replace(paths.VENV_PYTHON, str(wrapper)).replace(f'"{paths.LIB}"', f'"{lib}"'))
        self.manifest = tmp_path / "manifest.json"
        self.manifest.write_text(json.dumps(MANIFEST, indent=2))

    def run(self, shell: str, root: Path, env: dict | None = None, path: str = "/usr/bin:/bin"):
        full = {"PATH": path, "SLURM_JOB_ID": "42", "ENVBUILD_NODE_ROOT": str(root),
                "ENVBUILD_MANIFEST": str(self.manifest), paths.MIN_DRIVER_ENV: "580.65.06", **(env or {})}
        r = subprocess.run([shell, "-c", f". {self.path}\nenv -0"], env=full, capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        environ = dict(kv.split("=", 1) for kv in r.stdout.decode().split("\0") if "=" in kv)
        return environ, r.stderr.decode()

    def python_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("source, text, version", DRIVER_FILES, ids=[d[2] for d in DRIVER_FILES])
def test_env_sh_reads_the_driver_as_python_does(tmp_path, shell, source, text, version):
    env_sh = EnvSh(tmp_path)
    environ, err = env_sh.run(shell, make_root(tmp_path, text), {paths.MIN_DRIVER_ENV: "9999.0"})
    assert env_sh.python_calls()[-1].endswith(f"--driver {version}")
    assert err.count("envbuild: warning:") == 1 and f"NVIDIA driver {version} " in err


@pytest.mark.parametrize("shell", SHELLS)
def test_old_driver_warns_once_and_applies_node_env(tmp_path, shell):
    env_sh = EnvSh(tmp_path)
    environ, err = env_sh.run(shell, make_root(tmp_path, DRIVER_FILES[0][1]))
    assert err.count("envbuild: warning:") == 1
    assert err.strip() == "envbuild: warning: " + node.driver_problem(facts("384.98"), MANIFEST, {})
    assert environ["NCCL_IB_DISABLE"] == "1" and environ["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert environ["TORCH_EXTENSIONS_DIR"] == "/tmp/torch_extensions-42"
    assert not [k for k in environ if k.startswith("_envbuild")]


@pytest.mark.parametrize("shell", SHELLS)
def test_new_driver_is_quiet_and_the_user_value_wins(tmp_path, shell):
    env_sh = EnvSh(tmp_path)
    root = make_root(tmp_path, DRIVER_FILES[1][1], ib=("mlx5_0",))
    environ, err = env_sh.run(shell, root, {paths.MIN_DRIVER_ENV: "565.57.01"})
    assert err == "" and "NCCL_IB_DISABLE" not in environ and "NCCL_SOCKET_IFNAME" not in environ
    environ, err = env_sh.run(shell, make_root(tmp_path / "b", DRIVER_FILES[0][1]),
                              {"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": ""})
    assert environ["NCCL_IB_DISABLE"] == "0"                    # the user's value wins
    assert environ["NCCL_SOCKET_IFNAME"] == "^lo,docker"        # empty counts as unset, as in %environment


@pytest.mark.parametrize("shell", SHELLS)
def test_no_gpu_means_no_word_and_no_python(tmp_path, shell):
    env_sh = EnvSh(tmp_path)
    root = make_root(tmp_path, DRIVER_FILES[0][1], nvidiactl=False)  # a GPU host, container without --gpus
    environ, err = env_sh.run(shell, root)
    assert err == "" and env_sh.python_calls() == [] and "NCCL_IB_DISABLE" not in environ


@pytest.mark.parametrize("shell", SHELLS)
def test_python_only_runs_when_needed(tmp_path, shell):
    env_sh = EnvSh(tmp_path)
    env_sh.manifest.write_text(json.dumps({**MANIFEST, "node_env": []}, indent=2))
    environ, err = env_sh.run(shell, make_root(tmp_path, DRIVER_FILES[1][1]), {paths.MIN_DRIVER_ENV: "560"})
    assert err == "" and env_sh.python_calls() == []
    environ, err = env_sh.run(shell, make_root(tmp_path, DRIVER_FILES[1][1]), {paths.MIN_DRIVER_ENV: ""})
    assert err == "" and env_sh.python_calls() == []            # empty ENVBUILD_MIN_DRIVER: no warning
    env_sh.manifest.write_text(json.dumps(MANIFEST, indent=2))
    env_sh.run(shell, make_root(tmp_path, DRIVER_FILES[1][1]), {paths.MIN_DRIVER_ENV: "560"})
    assert len(env_sh.python_calls()) == 1                      # node_env entries to decide


@pytest.mark.parametrize("shell", SHELLS)
def test_nvidia_smi_fallback(tmp_path, shell):
    env_sh = EnvSh(tmp_path)
    root = make_root(tmp_path, None, nvidiactl=False)
    bindir = fake_nvidia_smi(tmp_path, NVIDIA_SMI_TWO_GPUS)
    environ, err = env_sh.run(shell, root, path=f"{bindir}:/usr/bin:/bin")
    assert "NVIDIA driver 515.57 " in err and environ["NCCL_IB_DISABLE"] == "1"
    assert env_sh.python_calls()[-1].endswith("--driver 515.57")
    failing = fake_nvidia_smi(tmp_path / "f", "NVIDIA-SMI has failed because it couldn't communicate with the "
                                              "NVIDIA driver.", code=9)
    environ, err = env_sh.run(shell, root, path=f"{failing}:/usr/bin:/bin")
    assert "warning" not in err and "NCCL_IB_DISABLE" not in environ


@pytest.mark.parametrize("shell", SHELLS)
def test_env_sh_exports_only_well_formed_names(tmp_path, shell):
    """python replaced by a stand-in printing hostile lines: env.sh exports only NAME=VALUE
    with a valid name, and never evaluates a value."""
    marker = tmp_path / "evaluated"
    lines = ["GOOD=a b $(touch " + str(marker) + ")", "1BAD=x", "BAD NAME=y", "=z", "ALSO_GOOD=", "junk"]
    env_sh = EnvSh(tmp_path, python_body="printf '%s\\n' " + " ".join(f"'{line}'" for line in lines))
    environ, _ = env_sh.run(shell, make_root(tmp_path, DRIVER_FILES[0][1]))
    assert environ["GOOD"] == f"a b $(touch {marker})" and not marker.exists()
    assert "1BAD" not in environ and "BAD NAME" not in environ and environ.get("ALSO_GOOD") == ""
    assert "junk" not in subprocess.run([shell, "-c", f". {env_sh.path}\nexport -p"], capture_output=True, text=True,
                                        env={"PATH": "/usr/bin:/bin", "ENVBUILD_NODE_ROOT": str(tmp_path / "node"),
                                             "ENVBUILD_MANIFEST": str(env_sh.manifest),
                                             paths.MIN_DRIVER_ENV: "580.65.06"}).stdout


def test_node_main_never_fails_a_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ENVBUILD_NODE_ROOT", str(make_root(tmp_path, DRIVER_FILES[0][1])))
    monkeypatch.setenv(paths.MANIFEST_ENV, str(tmp_path / "missing.json"))
    monkeypatch.setenv(paths.MIN_DRIVER_ENV, "580.65.06")
    assert node.main(["--driver", "384.98"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("warning") == 1 and "CUDA ?" in err
    monkeypatch.setattr(node, "node_env_decisions", lambda *a: 1 / 0)
    assert node.main([]) == 0
    assert "node check skipped (ZeroDivisionError" in capsys.readouterr().err


def test_entrypoint_sources_env_sh_from_the_shared_path():
    text = (ROOT / "templates" / "files" / "entrypoint.sh").read_text()
    assert f". {paths.ENV_SH}\n" in text


RUNTIME_CACHES = {"TORCH_EXTENSIONS_DIR": "torch_extensions", "TRITON_CACHE_DIR": "triton",
                  "TORCHINDUCTOR_CACHE_DIR": "torchinductor", "PYTORCH_KERNEL_CACHE_PATH": "torch_kernels",
                  "CUDA_CACHE_PATH": "cuda_cache", "VLLM_CACHE_ROOT": "vllm",
                  "FLASHINFER_WORKSPACE_BASE": "flashinfer", "HF_MODULES_CACHE": "hf_modules"}


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_every_runtime_compile_cache_is_per_job_and_node_local_unless_set(tmp_path, shell):
    """Each cache that JIT-compiles at run time (torch, Triton, Inductor, the driver's PTX
    cache, vLLM, FlashInfer, remote-code modules) goes to $TMPDIR/<name>-<job>, so no two jobs
    share one on an NFS home; a value already set (the user's, the cluster's) is kept, even
    one with spaces in its directory."""
    if not shutil.which(shell):
        pytest.skip(f"{shell} is not installed")
    env_sh = ROOT / "templates" / "files" / "env.sh"
    show = "; ".join(f'printf "%s\\n" "${name}"' for name in RUNTIME_CACHES)
    scratch = tmp_path / "node scratch"
    r = subprocess.run([shell, "-c", f". {env_sh}; {show}"], capture_output=True, text=True, check=True,
                       env={"PATH": "/usr/bin:/bin", "TMPDIR": str(scratch), "SLURM_JOB_ID": "77",
                            "VLLM_CACHE_ROOT": "/mine/vllm", "ENVBUILD_NODE_ROOT": str(tmp_path)})
    got = dict(zip(RUNTIME_CACHES, r.stdout.splitlines()))
    want = {name: f"{scratch}/{sub}-77" for name, sub in RUNTIME_CACHES.items()}
    want["VLLM_CACHE_ROOT"] = "/mine/vllm"
    assert got == want


# =========================================================================== container start-up checks
# RDMA devices the container cannot use, a small /dev/shm, a GPU node's GPUs not handed in:
# container.py words them (container_problems) and env.sh decides with shell builtins whether to
# ask it. The fake trees in tests/fixtures/nodes are real machines' sysfs (public threads) and
# real containers' /proc (captured from Docker here, or pasted in threads): see the README there
# for each source.
NODES = ROOT / "tests" / "fixtures" / "nodes"
HOSTS = sorted(p.name for p in (NODES / "hosts").iterdir())
CONTAINERS = sorted(p.name for p in (NODES / "containers").iterdir())
IB_FABRIC = {"name": "ib", "transport": "IB", "device_drivers": ["mlx5_core", "mlx4_core", "bnxt_en", "ice", "i40e"]}


def node_root(tmp_path: Path, hosts: tuple, container: str | None, gpu: bool | str = False) -> Path:
    """The host trees and one container tree laid on each other, as the container sees /.

    gpu=True: what docker --gpus adds (/dev/nvidiactl, the driver's libcuda.so.1 in the library
    directory); gpu="dev": the host's /dev alone (apptainer without --nv binds it, no libraries).
    """
    root = tmp_path / "root"
    root.mkdir(parents=True, exist_ok=True)
    for part in [NODES / "hosts" / h for h in hosts] + ([NODES / "containers" / container] if container else []):
        shutil.copytree(part, root, symlinks=True, dirs_exist_ok=True)
    if gpu:
        (root / "dev").mkdir(exist_ok=True)
        (root / "dev" / "nvidiactl").write_text("")
    if gpu is True:
        (root / "usr" / "lib" / "x86_64-linux-gnu").mkdir(parents=True, exist_ok=True)
        (root / "usr" / "lib" / "x86_64-linux-gnu" / "libcuda.so.1").write_text("")
    return root


def kinds(problems: list[str]) -> set[str]:
    """Which warnings a list of container_problems messages holds, and the RDMA causes named."""
    out = set()
    for p in problems:
        if "RDMA device" in p:
            out |= {"rdma"} | ({"rdma:devices"} if "no /dev/infiniband/uverbs*" in p else set()) | (
                {"rdma:memlock"} if "locked-memory limit" in p else set())
        elif p.startswith("/dev/shm"):
            out.add("shm")
        elif "NVIDIA GPU" in p:
            out.add("gpu")
        else:
            out.add("?")
    return out


# --------------------------------------------------------------------------- parsing the real files
@pytest.mark.parametrize("container, memlock, ipc_lock, shm", [
    ("docker-default", 8 << 20, False, 64 << 20),
    ("docker-user", 8 << 20, False, 64 << 20),
    ("docker-ipc-host", 8 << 20, False, 24684096 << 10),
    ("docker-shm1g-ipclock", 8 << 20, True, 1 << 30),
    ("userns-remap-root-device-ib", 8 << 20, False, 1 << 30),  # every capability, in a user namespace
    ("docker-device-ib-shm1g", 8 << 20, False, 1 << 30),
    ("docker-rdma-ready", -1, True, 1 << 30),
    ("slurm-enroot", 65536, False, None),
    ("k8s-one-uverbs-mooncake102", None, None, None),
])
def test_container_files_parse(tmp_path, container, memlock, ipc_lock, shm):
    facts = nodefacts.probe(str(node_root(tmp_path, (), container)))
    assert (facts.memlock, facts.ipc_lock, facts.shm) == (memlock, ipc_lock, shm)


def test_capabilities_and_user_namespaces():
    status = (NODES / "containers" / "userns-remap-root-device-ib" / "proc" / "self" / "status").read_text()
    assert nodefacts.parse_cap_eff(status) >> nodefacts.CAP_IPC_LOCK & 1  # bit 14 is set ...
    uid_map = (NODES / "containers" / "userns-remap-root-device-ib" / "proc" / "self" / "uid_map").read_text()
    assert uid_map.split() == ["0", "1000", "1"] and not nodefacts.initial_user_namespace(uid_map)  # ... but not here
    assert nodefacts.initial_user_namespace((NODES / "containers" / "docker-default" / "proc" / "self" / "uid_map")
                                       .read_text())
    assert nodefacts.initial_user_namespace(None)  # a kernel without user namespaces has no uid_map
    assert nodefacts.parse_cap_eff("CapEff:\tzz\n") is None and nodefacts.parse_cap_eff("") is None


@pytest.mark.parametrize("mounts, size", [
    ("shm /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime,size=65536k 0 0\n", 64 << 20),
    ("tmpfs /dev/shm tmpfs rw,nosuid,nodev,inode64 0 0\n", None),          # tmpfs' default: half of RAM
    ("tmpfs /dev/shm tmpfs rw,size=50% 0 0\n", None),                       # a share of RAM: not judged
    ("tmpfs /dev/shm tmpfs rw,size=2g 0 0\n", 2 << 30),
    ("tmpfs /dev/shm tmpfs rw,size=67108864 0 0\n", 64 << 20),
    ("shm /dev/shm tmpfs rw,size=65536k 0 0\ntmpfs /dev/shm tmpfs rw,size=16g 0 0\n", 16 << 30),  # last wins
    ("tmpfs /dev/shmx tmpfs rw,size=1k 0 0\n", None),
    ("", None),
])
def test_shm_size_from_mounts(mounts, size):
    assert nodefacts.parse_shm(mounts) == size


@pytest.mark.parametrize("host, rdma, efa", [
    ("roce-bond-nccl451", {"mlx5_bond_0": ("mlx5_core", ["Ethernet"])}, []),
    ("ib-2hca-nccl489", {"mlx5_0": ("mlx5_core", ["InfiniBand"]), "mlx5_1": ("mlx5_core", ["InfiniBand"])}, []),
    ("xdr-vm-rdmamap17", {"mlx5_0": ("mlx5_core", ["InfiniBand"]), "smi1": ("mlx5_core", ["InfiniBand"])}, []),
    ("erdma-mooncake102", {"erdma_0": ("erdma", []), "erdma_1": ("erdma", [])}, []),
    ("h200-hgx-cubecos259", {}, []),
])
def test_rdma_devices_and_their_drivers(tmp_path, host, rdma, efa):
    facts = nodefacts.probe(str(node_root(tmp_path, (host,), None)))
    assert {k: (v["driver"], v["link_layers"]) for k, v in facts.rdma.items()} == rdma
    assert facts.infiniband == sorted(rdma) and facts.efa == efa


def test_efa_devices(tmp_path):
    facts = nodefacts.probe(str(node_root(tmp_path, ("efa-p5-ekscharts1110",), None)))
    assert len(facts.efa) == 16 and facts.efa == facts.infiniband and facts.efa[0] == "rdmap115s0"
    assert {tuple(d["link_layers"]) for d in facts.rdma.values()} == {("Unknown",)}


@pytest.mark.parametrize("host, gpus, driver", [
    ("h200-hgx-cubecos259", 8, True),   # the three NVSwitches (class 0x0680) are not GPUs
    ("xdr-vm-rdmamap17", 0, False),
    ("quadro-pi-rpi526", 1, False),     # a VGA-class GPU (0x030000) with no NVIDIA driver
    ("roce-bond-nccl451", 0, False),
])
def test_nvidia_gpus_by_pci_class(tmp_path, host, gpus, driver):
    facts = nodefacts.probe(str(node_root(tmp_path, (host,), None)))
    assert (len(facts.nvidia_gpus), facts.nvidia_driver) == (gpus, driver)


# --------------------------------------------------------------------------- the efa condition
@pytest.mark.parametrize("hosts, holds", [
    (("ib-2hca-nccl489",), True),
    (("roce-bond-nccl451",), True),
    (("efa-p5-ekscharts1110",), False),
    (("efa-p5-ekscharts1110", "ib-2hca-nccl489"), False),
    ((), False),
])
def test_ib_fabric_node_env_condition(tmp_path, hosts, holds):
    """The ib fabric pins NCCL_NET=IB on nodes with non-EFA RDMA devices only."""
    facts = nodefacts.probe(str(node_root(tmp_path, hosts, None)))
    assert node.condition_holds({"infiniband": "present", "efa": "absent"}, facts)[0] is holds


@pytest.mark.parametrize("when, node_facts, holds, why", [
    ({"efa": "present"}, facts(ib=("rdmap0s6",)), False, "no EFA device"),
    ({"efa": "absent"}, facts(), True, "no EFA device"),
    ({"efa": "maybe"}, facts(), False, "invalid efa condition"),
])
def test_efa_condition(when, node_facts, holds, why):
    got, reason = node.condition_holds(when, node_facts)
    assert got is holds and why in reason


def test_efa_condition_reasons(tmp_path):
    efa = nodefacts.probe(str(node_root(tmp_path, ("efa-p5-ekscharts1110",), None)))
    holds, why = node.condition_holds({"efa": "present"}, efa)
    assert holds and why.startswith("EFA rdmap115s0, rdmap116s0")
    assert node.condition_holds({"efa": "absent"}, efa) == (False, "EFA devices " + ", ".join(efa.efa))


# --------------------------------------------------------------------------- which warnings, where
SCENARIOS = [  # (hosts, container, gpu handed in, manifest, environ, expected warnings)
    (("roce-bond-nccl451",), "docker-default", False, None, {}, {"rdma", "rdma:devices", "rdma:memlock", "shm"}),
    (("ib-2hca-nccl489",), "docker-device-ib", False, None, {}, {"rdma", "rdma:memlock", "shm"}),
    (("ib-2hca-nccl489",), "docker-rdma-ready", False, None, {}, set()),
    (("ib-2hca-nccl489",), "docker-shm1g-ipclock", False, None, {}, {"rdma", "rdma:devices"}),  # IPC_LOCK: no memlock
    (("ib-2hca-nccl489",), "userns-remap-root-device-ib", False, None, {}, {"rdma", "rdma:memlock"}),
    (("ib-2hca-nccl489",), "docker-device-ib-shm1g", False, None, {}, {"rdma", "rdma:memlock"}),
    (("roce-nccl1866",), "slurm-enroot", False, None, {}, {"rdma", "rdma:memlock"}),
    (("xdr-vm-rdmamap17",), "docker-ipc-host", False, None, {}, {"rdma", "rdma:devices", "rdma:memlock"}),
    (("efa-p5-ekscharts1110",), "docker-default", False, None, {}, {"rdma", "rdma:devices", "rdma:memlock", "shm"}),
    (("efa-p5-ekscharts1110",), "docker-default", False, {"cuda": "13.0", "fabric": IB_FABRIC}, {}, {"shm"}),
    (("erdma-mooncake102",), "k8s-one-uverbs-mooncake102", False, None, {}, set()),  # one device is enough
    (("h200-hgx-cubecos259",), "docker-shm1g-ipclock", False, None, {}, {"gpu"}),
    (("h200-hgx-cubecos259",), "docker-shm1g-ipclock", True, None, {}, set()),
    (("h200-hgx-cubecos259",), "docker-shm1g-ipclock", "dev", None, {}, {"gpu"}),  # apptainer without --nv
    (("h200-hgx-cubecos259",), "docker-shm1g-ipclock", False, None, {"NVIDIA_VISIBLE_DEVICES": "none"}, set()),
    (("h200-hgx-cubecos259", "ib-2hca-nccl489"), "docker-rdma-ready", False, None, {}, {"gpu"}),
    (("h200-hgx-cubecos259", "ib-2hca-nccl489"), "docker-rdma-ready", True, None, {}, set()),
    (("h200-hgx-cubecos259", "ib-2hca-nccl489"), "docker-device-ib", True, None, {}, {"rdma", "rdma:memlock", "shm"}),
    (("quadro-pi-rpi526",), "docker-ipc-host", False, None, {}, set()),  # no NVIDIA driver: no flag helps
    ((), "docker-user", False, None, {}, {"shm"}),
    ((), "docker-ipc-host", False, None, {}, set()),
    (("roce-bond-nccl451",), "docker-default", False, {"cuda": "13.0", "fabric": {"name": "none",
                                                                                "transport": "Socket"}}, {}, {"shm"}),
]


def _scenario_id(s):
    return "+".join(s[0]) + "|" + s[1] + ({True: "|gpu", "dev": "|dev"}.get(s[2], "")) + ("|fabric" if s[3] else "") + (
        "|" + ",".join(f"{k}={v}" for k, v in s[4].items()) if s[4] else "")


@pytest.mark.parametrize("hosts, container, gpu, manifest, environ, want", SCENARIOS,
                         ids=[_scenario_id(s) for s in SCENARIOS])
def test_container_problems(tmp_path, monkeypatch, hosts, container, gpu, manifest, environ, want):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = nodefacts.probe(str(node_root(tmp_path, hosts, container, gpu)))
    problems = container_problems(facts, manifest, environ)
    assert kinds(problems) == want
    assert len(problems) == len({k.split(":")[0] for k in want})  # one paragraph per kind
    for problem in problems:
        assert "\n" not in problem and "docker run" in problem and "apptainer" in problem
        assert "pyxis" in problem or "Slurm" in problem


def test_warnings_name_the_cause_and_the_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = nodefacts.probe(str(node_root(tmp_path, ("h200-hgx-cubecos259", "roce-bond-nccl451"), "docker-default")))
    rdma, shm, gpu = container_problems(facts, {"cuda": "13.0"}, {})
    for part in ("1 RDMA device (mlx5_bond_0: RoCE)", "cannot use it:", "no /dev/infiniband/uverbs*",
                 "locked-memory limit is 8 MiB", "CAP_IPC_LOCK", "--device /dev/infiniband", "--ulimit memlock=-1",
                 "--cap-add IPC_LOCK", "--bind /dev/infiniband", "--container-mounts=/dev/infiniband",
                 "MELLANOX_VISIBLE_DEVICES=all", "PropagateResourceLimitsExcept=MEMLOCK", "NCCL_NET=IB", "sockets"):
        assert part in rdma, part
    for part in ("64 MiB (Docker's default)", "--shm-size=1g", "--ipc=host", "--bind /dev/shm", "Bus error",
                 "medium: Memory"):
        assert part in shm, part
    for part in ("8 NVIDIA GPUs (PCI 0000:18:00.0, 0000:2a:00.0, 0000:3a:00.0, 0000:5d:00.0 and 4 more)",
                 "--gpus all", "--nv", "--gpus=N", "--gres=gpu:N", "NVIDIA_VISIBLE_DEVICES=none"):
        assert part in gpu, part
    # only the flags for the causes found: devices handed in, memlock still too low
    facts = nodefacts.probe(str(node_root(tmp_path / "b", ("ib-2hca-nccl489",), "docker-device-ib")))
    (rdma, _) = container_problems(facts)
    assert "--ulimit memlock=-1" in rdma and "--device" not in rdma and "2 RDMA devices" in rdma


def _clause_options(problem: str) -> list[tuple[frozenset, str]]:
    """(tools named in the clause, option) for every --option of a warning, clause by clause
    (clauses end at '; '): docker run, apptainer, srun/pyxis (srun's own and pyxis' options)."""
    out = []
    for clause in problem.split("; "):
        tools = frozenset(t for key, t in (("docker run", "docker_run"), ("apptainer", "apptainer"),
                                           ("srun", "srun"), ("pyxis", "srun")) if key in clause)
        out += [(tools, option) for option in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", clause)]
    return out


def test_every_flag_a_warning_names_exists(tmp_path, monkeypatch):
    """Each --option of the warnings is one of the tool's own options (tests/fixtures/
    run-tool-options.yaml: read from docker run --help, apptainer's, slurm's and pyxis' sources)."""
    import yaml

    known = {tool: set(d["options"]) for tool, d in yaml.safe_load((ROOT / "tests" / "fixtures" /
                                                                     "run-tool-options.yaml").read_text()).items()}
    known["srun"] = known["slurm"] | known["pyxis"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = nodefacts.probe(str(node_root(tmp_path, ("h200-hgx-cubecos259", "roce-bond-nccl451"), "docker-default")))
    problems = container_problems(facts, {"cuda": "13.0"}, {})
    assert kinds(problems) == {"rdma", "rdma:devices", "rdma:memlock", "shm", "gpu"}
    used = [u for p in problems for u in _clause_options(p)]
    assert {o for _, o in used} >= {"device", "ulimit", "cap-add", "bind", "contain", "containall", "container-mounts",
                                    "shm-size", "ipc", "gpus", "nv", "gres", "env"}
    unknown = [(sorted(tools), o) for tools, o in used if not tools or not any(o in known[t] for t in tools)]
    assert not unknown, unknown


def test_no_cuda_image_gets_no_gpu_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = nodefacts.probe(str(node_root(tmp_path, ("h200-hgx-cubecos259",), "docker-shm1g-ipclock")))
    assert container_problems(facts, {"cuda": None}) == []
    assert kinds(container_problems(facts, {"cuda": "12.8"}, {})) == {"gpu"}


# --------------------------------------------------------------------------- env.sh against the trees
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("hosts, container, gpu, manifest, environ, want", SCENARIOS,
                         ids=[_scenario_id(s) for s in SCENARIOS])
def test_env_sh_prints_what_node_py_finds(tmp_path, monkeypatch, shell, hosts, container, gpu, manifest, environ,
                                         want):
    """env.sh under dash and bash on the same trees: the same warnings, word for word, and Python
    started only where there is something to say (or, with a GPU, node_env to decide)."""
    env_sh = EnvSh(tmp_path)
    if manifest is not None:
        env_sh.manifest.write_text(json.dumps({**manifest, "node_env": []}, indent=2))
    else:
        env_sh.manifest.write_text(json.dumps({**MANIFEST, "node_env": []}, indent=2))
    root = node_root(tmp_path, hosts, container, gpu)
    environ_sh, err = env_sh.run(shell, root, {paths.MIN_DRIVER_ENV: "", **environ})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    expected = container_problems(nodefacts.probe(str(root)), json.loads(env_sh.manifest.read_text()), environ)
    assert err.splitlines() == ["envbuild: warning: " + p for p in expected]
    assert (len(env_sh.python_calls()) == 1) is bool(want)
    assert not [k for k in environ_sh if k.startswith("_envbuild")]


@pytest.mark.parametrize("shell", SHELLS)
def test_env_sh_asks_python_exactly_when_it_has_something_to_say(tmp_path, monkeypatch, shell):
    """Every host (and none) with every container, GPU not handed in: env.sh's builtin pre-checks
    start Python where, and only where, node.py finds a container problem."""
    env_sh = EnvSh(tmp_path)
    env_sh.manifest.write_text(json.dumps({**MANIFEST, "node_env": []}, indent=2))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    seen = 0
    for i, (host, container) in enumerate((h, c) for h in [None, *HOSTS] for c in CONTAINERS):
        root = node_root(tmp_path / str(i), (host,) if host else (), container)
        expected = container_problems(nodefacts.probe(str(root)))
        _, err = env_sh.run(shell, root, {paths.MIN_DRIVER_ENV: ""})
        calls = len(env_sh.python_calls())
        assert (calls > seen) is bool(expected), (host, container)
        assert err.splitlines() == ["envbuild: warning: " + p for p in expected], (host, container)
        seen = calls


@pytest.mark.parametrize("shell", SHELLS)
def test_env_sh_on_an_ordinary_node_starts_no_process(tmp_path, shell):
    """A container started as NCCL's guide says, on an RDMA node without GPUs: env.sh runs on shell
    builtins alone (PATH leads nowhere, so any command it ran would fail loudly)."""
    env_sh = EnvSh(tmp_path)
    root = node_root(tmp_path, ("ib-2hca-nccl489", "quadro-pi-rpi526"), "docker-rdma-ready")
    r = subprocess.run([shutil.which(shell), "-c", f". {env_sh.path}\nexport -p"], capture_output=True, text=True,
                       timeout=60,
                       env={"PATH": str(tmp_path / "nowhere"), "SLURM_JOB_ID": "7", "ENVBUILD_NODE_ROOT": str(root),
                            "ENVBUILD_MANIFEST": str(env_sh.manifest)})
    assert r.returncode == 0 and r.stderr == "" and env_sh.python_calls() == []
    assert "TORCH_EXTENSIONS_DIR" in r.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_env_sh_applies_node_env_only_with_a_gpu(tmp_path, shell):
    """A GPU node started without --gpus: the warning, but no node_env (they tune a NCCL that has
    no GPU to run on); with --gpus: node_env and no warning."""
    env_sh = EnvSh(tmp_path)
    manifest = {**MANIFEST, "node_env": [{"name": "NCCL_NET", "value": "IB",
                                          "when": {"infiniband": "present", "efa": "absent"}}]}
    env_sh.manifest.write_text(json.dumps(manifest, indent=2))
    hosts = ("h200-hgx-cubecos259", "ib-2hca-nccl489")
    environ, err = env_sh.run(shell, node_root(tmp_path / "a", hosts, "docker-rdma-ready"), {paths.MIN_DRIVER_ENV: ""})
    assert "NCCL_NET" not in environ and err.count("envbuild: warning:") == 1 and "NVIDIA GPUs" in err
    environ, err = env_sh.run(shell, node_root(tmp_path / "b", hosts, "docker-rdma-ready", gpu=True),
                              {paths.MIN_DRIVER_ENV: ""})
    assert environ["NCCL_NET"] == "IB" and err == ""
    environ, err = env_sh.run(shell, node_root(tmp_path / "c", ("efa-p5-ekscharts1110", "h200-hgx-cubecos259"),
                                               "docker-rdma-ready", gpu=True), {paths.MIN_DRIVER_ENV: ""})
    assert "NCCL_NET" not in environ and err == ""  # EFA: NCCL_NET=IB would be wrong
    # apptainer without --nv: the host's /dev (so /dev/nvidiactl) but no driver libraries
    environ, err = env_sh.run(shell, node_root(tmp_path / "d", hosts, "docker-rdma-ready", gpu="dev"),
                              {paths.MIN_DRIVER_ENV: ""})
    assert err.count("envbuild: warning:") == 1 and "no nvidia-smi, no libcuda.so.1" in err and "--nv" in err


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("name, text", [
    ("proc/mounts", "shm /dev/shm tmpfs rw,size=50% 0 0\n"),
    ("proc/mounts", "shm /dev/shm tmpfs rw,size=abck 0 0\n"),
    ("proc/mounts", "shm /dev/shm tmpfs rw,size= 0 0\n"),
    ("proc/mounts", "garbage\n\n   \n"),
    ("proc/self/limits", "Max locked memory         unlimited            unlimited            bytes\n"),
    ("proc/self/limits", "Max locked memory         99999999999999999999999  1  bytes\n"),
    ("proc/self/limits", "Max locked memory\n"),
    ("proc/self/status", "CapEff:\t$(touch MARKER)0000a80465fb\n"),
    ("proc/mounts", "shm /dev/shm tmpfs rw,size=99999999999999999999999k 0 0\n"),
    ("proc/self/status", "CapEff:\n"),
    ("proc/self/uid_map", ""),
])
def test_env_sh_survives_odd_files(tmp_path, shell, name, text):
    """Files env.sh cannot make sense of never stop the start and never warn wrongly: it only
    asks Python, which decides the same way, and never evaluates what it read."""
    env_sh = EnvSh(tmp_path)
    root = node_root(tmp_path, ("ib-2hca-nccl489",), "docker-rdma-ready")
    marker = tmp_path / "evaluated"
    (root / name).write_text(text.replace("MARKER", str(marker)))
    environ, err = env_sh.run(shell, root, {paths.MIN_DRIVER_ENV: ""})
    expected = container_problems(nodefacts.probe(str(root)))
    assert err.splitlines() == ["envbuild: warning: " + p for p in expected]
    assert environ["TORCH_EXTENSIONS_DIR"] == "/tmp/torch_extensions-42" and not marker.exists()


@pytest.mark.parametrize("shell", SHELLS)
def test_env_sh_takes_no_nvswitch_for_a_gpu(tmp_path, shell):
    """The H200 node with its GPUs taken away: its NVSwitches (vendor 0x10de, class 0x068000, bound
    to nvidia-nvswitch) remain, sorted first; they are no reason to warn or to start Python."""
    env_sh = EnvSh(tmp_path)
    root = node_root(tmp_path, ("h200-hgx-cubecos259",), "docker-shm1g-ipclock")
    pci = root / "sys" / "bus" / "pci" / "devices"
    gpus = [d for d in pci.iterdir() if (d / "class").read_text() == "0x030200\n"]
    assert len(gpus) == 8
    for d in gpus:
        shutil.rmtree(d)
    environ, err = env_sh.run(shell, root, {paths.MIN_DRIVER_ENV: ""})
    assert err == "" and env_sh.python_calls() == [] and nodefacts.probe(str(root)).nvidia_gpus == []


def test_node_main_prints_container_warnings_without_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ENVBUILD_NODE_ROOT", str(node_root(tmp_path, ("h200-hgx-cubecos259",), "docker-default")))
    monkeypatch.setenv(paths.MANIFEST_ENV, str(tmp_path / "manifest.json"))
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))
    monkeypatch.setenv(paths.MIN_DRIVER_ENV, "580.65.06")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert node.main(["--driver", ""]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("envbuild: warning:") == 2 and "/dev/shm" in err and "8 NVIDIA GPUs" in err


# --------------------------------------------------------------------------- the flight recorder's dump
@pytest.mark.parametrize("shell", SHELLS)
def test_the_flight_recorder_dumps_into_the_documented_per_job_directory(tmp_path, shell):
    """Under Slurm, rank 0 and every other rank point torch's dump variable at
    $HOME/envbuild-dumps/flight_recorder-<SLURM_JOB_ID>/rank_ (created), and rank 0 says so with
    the command that reads the dumps; a value the user set wins; ENVBUILD_DUMP_DIR moves it."""
    env_sh, root, home = EnvSh(tmp_path), make_root(tmp_path, None), tmp_path / "home"
    home.mkdir()
    baked = {"ENVBUILD_FR_DUMP_VAR": "TORCH_FR_DUMP_TEMP_FILE", "ENVBUILD_FR_READER": "torchfrtrace",
             "HOME": str(home), "SLURM_JOB_ID": "4242"}
    environ, err = env_sh.run(shell, root, {**baked, "SLURM_PROCID": "0"})
    job_dir = home / "envbuild-dumps" / "flight_recorder-4242"
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == f"{job_dir}/rank_" and job_dir.is_dir()
    assert f"flight-recorder dumps (one per rank, on a collective timeout) go to {job_dir}" in err
    assert f"read them with: torchfrtrace {job_dir} -p rank_" in err
    environ, err = env_sh.run(shell, root, {**baked, "SLURM_PROCID": "3"})
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == f"{job_dir}/rank_" and "flight-recorder" not in err
    environ, _ = env_sh.run(shell, root, {**baked, "TORCH_FR_DUMP_TEMP_FILE": "/mine/fr_"})
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == "/mine/fr_"
    environ, _ = env_sh.run(shell, root, {**baked, "ENVBUILD_DUMP_DIR": str(tmp_path / "shared")})
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/shared/flight_recorder-4242/rank_"
    older = {**baked, "ENVBUILD_FR_DUMP_VAR": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    environ, _ = env_sh.run(shell, root, older)
    assert environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{job_dir}/rank_" and "TORCH_FR_DUMP_TEMP_FILE" not in environ
    (tmp_path / "ro").write_text("a file, not a directory")
    environ, err = env_sh.run(shell, root, {**baked, "ENVBUILD_DUMP_DIR": str(tmp_path / "ro")})
    assert "TORCH_FR_DUMP_TEMP_FILE" not in environ and "cannot create" in err and "ENVBUILD_DUMP_DIR" in err


def test_each_torch_gets_the_dump_variable_it_reads(matrix):
    from envbuild.resolve.resolver import Request, resolve

    def baked(torch):
        return {e.name: e.value for e in resolve(matrix, Request(gpu="h100", torch=torch)).env}
    assert baked("2.6")["ENVBUILD_FR_DUMP_VAR"] == "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
    assert baked("2.6")["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and "torchfrtrace" not in baked("2.6")["ENVBUILD_FR_READER"]
    assert baked("2.11")["ENVBUILD_FR_DUMP_VAR"] == "TORCH_FR_DUMP_TEMP_FILE"
    assert baked("2.11")["ENVBUILD_FR_READER"] == "torchfrtrace" and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in baked("2.11")


@pytest.mark.parametrize("shell", SHELLS)
def test_env_sh_puts_the_venv_first_on_a_path_that_lacks_it(tmp_path, shell):
    """pyxis and Apptainer start a step with the job's PATH: env.sh puts the image's venv first,
    once, and leaves a PATH that has it alone."""
    env_sh, root = EnvSh(tmp_path), make_root(tmp_path, None)
    environ, _ = env_sh.run(shell, root, path="/usr/bin:/bin")
    assert environ["PATH"] == f"{paths.VENV}/bin:/usr/bin:/bin"
    environ, _ = env_sh.run(shell, root, path=f"/usr/bin:{paths.VENV}/bin:/bin")
    assert environ["PATH"] == f"/usr/bin:{paths.VENV}/bin:/bin"


# --------------------------------------------------------------------------- node conditions are data
# A node condition (`node: {NAME: present|absent}`) is declared once, in fabrics.yaml's
# node_conditions; the manifest carries the definitions and node.py decides them, so a new kind
# of RDMA device is a matrix edit. A Broadcom or Intel RoCE NIC: its RDMA device (bnxt_re0,
# irdma0) sits on a PCI function bound to bnxt_en, ice or i40e (nodefacts.rdma_devices).
ROCE_NIC = """  roce_nic:
    label: RoCE NIC
    devices: {drivers: [bnxt_en, ice, i40e], link_layers: [Ethernet]}
    means: "a Broadcom (bnxt_re) or Intel (irdma) RDMA device on an Ethernet port"
    source: "a test: declared in the matrix only"
"""
GID_INDEX = """  - name: NCCL_IB_GID_INDEX
    value: "3"
    node: {roce_nic: present}
    reason: "a test: a default only the new condition decides"
    source: "a test"
    cost: "none"
"""


def rdma(**devices) -> nodefacts.NodeFacts:
    """Node facts with these RDMA devices: name=(kernel driver, link layers)."""
    found = {name: {"driver": driver, "link_layers": list(layers)} for name, (driver, layers) in devices.items()}
    return nodefacts.NodeFacts("580.82.07", "test", True, sorted(found), rdma=found)


def test_a_condition_declared_only_in_the_matrix_reaches_the_manifest_and_is_decided_on_the_node(matrix_copy):
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.plan import stack_plan
    from envbuild.resolve.resolver import Request, resolve

    fabrics, gpus = matrix_copy / "fabrics.yaml", matrix_copy / "gpus.yaml"
    fabrics.write_text(fabrics.read_text().replace("\nnode_conditions:\n", "\nnode_conditions:\n" + ROCE_NIC, 1))
    gpus.write_text(gpus.read_text().replace("\ncommon_env:\n", "\ncommon_env:\n" + GID_INDEX, 1))
    plan = stack_plan(resolve(load_matrix(matrix_copy), Request(gpu="h20")))
    manifest = json.loads(json.dumps(plan.manifest))  # as the image reads it
    assert manifest["node_conditions"]["roce_nic"] == {
        "label": "RoCE NIC", "devices": {"drivers": ["bnxt_en", "ice", "i40e"], "link_layers": ["Ethernet"]},
        "means": "a Broadcom (bnxt_re) or Intel (irdma) RDMA device on an Ethernet port"}
    assert {"when": {"roce_nic": "present"}, "value": "3"}.items() <= next(
        e for e in manifest["node_env"] if e["name"] == "NCCL_IB_GID_INDEX").items()

    def decided(node_facts):
        return {(d["name"], d["value"]): (d["state"], d["why"]) for d in node.node_env_decisions(manifest, node_facts, {})}

    bnxt = decided(rdma(bnxt_re0=("bnxt_en", ["Ethernet"]), bnxt_re1=("bnxt_en", ["Ethernet"])))
    assert bnxt["NCCL_IB_GID_INDEX", "3"] == ("apply", "RoCE NIC bnxt_re0, bnxt_re1")
    assert bnxt["NCCL_NET", "IB"] == ("apply", "no EFA device; InfiniBand bnxt_re0, bnxt_re1")  # ib's pin unchanged
    assert decided(rdma(irdma0=("ice", ["Ethernet"])))["NCCL_IB_GID_INDEX", "3"] == ("apply", "RoCE NIC irdma0")
    for other, why in [(rdma(mlx5_0=("mlx5_core", ["Ethernet"])), "no RoCE NIC device"),   # ConnectX RoCE
                       (rdma(irdma0=("ice", ["InfiniBand"])), "no RoCE NIC device"),      # both must match
                       (rdma(rdmap0s6=("efa", ["Unknown"])), "no RoCE NIC device"),
                       (rdma(), "no RoCE NIC device")]:
        assert decided(other)["NCCL_IB_GID_INDEX", "3"] == ("skip", why)
    # absent: the same definition, the other way round
    assert node.condition_holds({"roce_nic": "absent"}, rdma(irdma0=("i40e", ["Ethernet"])),
                                manifest["node_conditions"]) == (False, "RoCE NIC devices irdma0")


@pytest.mark.parametrize("hosts, roce, efa", [
    (("roce-bond-nccl451",), True, False),
    (("roce-nccl1866",), True, False),
    (("ib-2hca-nccl489",), False, False),
    (("efa-p5-ekscharts1110",), False, True),
    (("erdma-mooncake102",), False, False),  # no port link layer in its tree
])
def test_a_link_layer_condition_on_real_hosts(tmp_path, hosts, roce, efa):
    conditions = {**node.FALLBACK_CONDITIONS, "roce": {"label": "RoCE", "devices": {"link_layers": ["Ethernet"]}}}
    facts = nodefacts.probe(str(node_root(tmp_path, hosts, None)))
    assert node.condition_holds({"roce": "present"}, facts, conditions)[0] is roce
    assert node.condition_holds({"efa": "present"}, facts, conditions)[0] is efa


@pytest.mark.parametrize("hosts", [(), ("roce-bond-nccl451",), ("ib-2hca-nccl489",), ("efa-p5-ekscharts1110",),
                                   ("efa-p5-ekscharts1110", "ib-2hca-nccl489"), ("erdma-mooncake102",)])
def test_a_manifest_without_node_conditions_decides_infiniband_and_efa_as_before(tmp_path, matrix, hosts):
    """An image built before the table existed: its manifest names infiniband and efa without
    defining them, and the image package's fallbacks give them the meaning the matrix declares."""
    from envbuild.plan import stack_plan
    from envbuild.resolve.resolver import Request, resolve

    facts = nodefacts.probe(str(node_root(tmp_path, hosts, None)))
    for request in (Request(gpu="h20"), Request(gpu="rtx4090"), Request(gpu="h20", fabric="efa")):
        new = json.loads(json.dumps(stack_plan(resolve(matrix, request)).manifest))
        old = {k: v for k, v in new.items() if k != "node_conditions"}
        assert set(new["node_conditions"]) <= {"infiniband", "efa"}
        assert node.node_env_decisions(old, facts, {}) == node.node_env_decisions(new, facts, {})
    for name, declared in matrix.fabrics_file.node_conditions.items():
        assert node.FALLBACK_CONDITIONS[name] == {k: v for k, v in declared.record().items() if k != "means"}


def test_a_malformed_or_unknown_definition_does_not_hold():
    facts = rdma(mlx5_0=("mlx5_core", ["InfiniBand"]))
    for definition in ({"label": "X", "devices": "all"}, {"label": "X", "devices": {}},
                       {"label": "X", "devices": {"drivers": "mlx5_core"}}, "any", None):
        holds, why = node.condition_holds({"x": "present"}, facts, {"x": definition})
        assert not holds and why == "invalid definition of condition 'x' in the manifest's node_conditions"
    manifest = {"node_conditions": "junk", "node_env": [{"name": "A", "value": "1", "when": {"efa": "absent"}},
                                                        {"name": "B", "value": "1", "when": {"roce": "present"}}]}
    assert [(d["state"], d["why"]) for d in node.node_env_decisions(manifest, facts, {})] == [
        ("apply", "no EFA device"), ("skip", "unknown condition 'roce'")]
