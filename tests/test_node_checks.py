"""Node-side checks: the driver floor and the manifest's conditional node_env, as env.sh
applies them at container start and as the smoke test's `driver` / `node_env` checks see them.

No GPU or NVIDIA driver exists here. The driver's own files are stood in for by a directory
(ENVBUILD_NODE_ROOT, env.sh's and node.py's test hook) holding /dev/nvidiactl and
/proc/driver/nvidia/version with real contents copied from public issue threads (URLs below);
nvidia-smi is a stand-in script printing what the real one printed in those threads. env.sh
itself runs for real, in dash and bash, with only its image paths pointed at this checkout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from envbuild.image import checks, node, paths

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
    for dev in ib:
        (root / "sys" / "class" / "infiniband" / dev).mkdir(parents=True)
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
    assert node.parse_driver_file(text) == version


def test_nvidia_smi_output_parses():
    assert node.parse_nvidia_smi(NVIDIA_SMI_TWO_GPUS) == "515.57"
    assert node.parse_nvidia_smi("\n") is None
    assert node.parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver") is None


@pytest.mark.parametrize("word, ok", [("580.65.06", True), ("384.98", True), ("2017", False), ("15:16:01", False),
                                      ("x86_64", False), ("1.", False), (".5", False), ("1..2", False),
                                      ("٥.٥", False)])
def test_dotted_number(word, ok):
    assert node.is_dotted_number(word) is ok


def test_read_driver_prefers_the_proc_file_then_nvidia_smi(tmp_path, monkeypatch):
    root = make_root(tmp_path, DRIVER_FILES[1][1])
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path, NVIDIA_SMI_TWO_GPUS)))
    assert node.read_driver(str(root)) == ("565.57.01", node.DRIVER_FILE)
    assert node.read_driver(str(tmp_path / "elsewhere")) == ("515.57", "nvidia-smi")
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed", code=9)))
    found, why = node.read_driver(str(tmp_path / "elsewhere"))
    assert found is None and "exited 9" in why
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert node.read_driver(str(tmp_path / "elsewhere"))[0] is None


def test_probe_sees_gpu_and_infiniband(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = node.probe(str(make_root(tmp_path, DRIVER_FILES[0][1], ib=("mlx5_0", "mlx5_1"))))
    assert (facts.driver, facts.gpu_visible, facts.infiniband) == ("384.98", True, ["mlx5_0", "mlx5_1"])
    bare = node.probe(str(tmp_path / "nothing"))
    assert (bare.driver, bare.gpu_visible, bare.infiniband) == (None, False, [])


# --------------------------------------------------------------------------- decisions
def facts(driver="535.104.05", visible=True, ib=()):
    return node.NodeFacts(driver, "test", visible, list(ib))


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
        for path in (paths.VENV_PYTHON, f'"{paths.LIB}"', paths.MANIFEST):
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
