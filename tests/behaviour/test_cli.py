"""The CLI as a user meets it: exit codes, one-paragraph errors, nothing half-written."""

import json
import re

import pytest

BAD_INPUT = [
    # (arguments, words the message must contain)
    (["--gpu", "h21"], ["unknown GPU 'h21'", "did you mean h20, h200"]),
    (["--gpu", "b200", "--torch", "2.5"], ["no stack fits --gpu b200 --torch 2.5", "needs torch >=2.7",
                                           "Nearest valid choices", "--torch 2.7.1"]),
    (["--gpu", "h100", "--torch", "2.4", "--python", "3.13"], ["--python 3.13", "torch 2.4.1 has no wheels",
                                                               "--python 3.10, 3.11, 3.12"]),
    (["--gpu", "h100", "--torch", ">=2.x"], ["--torch '>=2.x'", "PEP 440 specifier"]),
    (["--gpu", "h100", "--python", "3.11", "--cuda", "12.1"], ["no stack fits", "Nearest valid choices"]),
    (["--gpu", "h20", "--stack", "torch2.11-cu13"], ["unknown stack 'torch2.11-cu13'", "did you mean"]),
    (["--gpu", "h20", "--ds-ops", "fused_adamm"], ["unknown DeepSpeed op 'fused_adamm'", "did you mean fused_adam"]),
    (["--gpu", "h20", "--ds-ops", "sparse_attn"], ["op 'sparse_attn' cannot be pre-built", "removed in DeepSpeed 0.19.7"]),
    (["--gpu", "h20", "--cpu-target", "native"], ["--cpu-target 'native'", "x86-64-v3"]),
    (["--gpu", "h20", "--env", "NOEQUALS"], ["--env 'NOEQUALS' must be NAME=VALUE"]),
    (["--gpu", "h20", "--ca-cert", "/nonexistent/ca.pem"], ["--ca-cert /nonexistent/ca.pem", "cannot read"]),
    (["--gpu", "v100", "--ext", "flash-attn"], ["--ext flash-attn", "needs compute capability >= 8.0",
                                               "v100 is sm_70", "rule ext-gpu", "GPUs it fits: a10, a100",
                                               "drop --ext flash-attn for v100"]),
    (["--gpu", "h100", "--ext", "flash-atn"], ["--ext 'flash-atn' is not a CUDA extension", "did you mean flash-attn"]),
    (["--gpu", "h100", "--ext", "flash\nRUN id"], ["--ext 'flash\\nRUN id' is not a CUDA extension"]),  # shown escaped
    (["--gpu", "h100", "--ext", "flash-attn,"], ["--ext 'flash-attn,' has an empty item", "--ext flash-attn."]),
    (["--gpu", "h100", "--stack", "torch2.11-cu130-py3.11-pypi", "--ext", "causal-conv1d"],
     ["no stack fits", "must pass the SASS audit", "no cuobjdump before CUDA 13.2", "stack torch2.11-cu130-py3.12"]),
]


def _assert_clean_failure(r, words, code=2):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    msg = r.stderr.strip()
    assert msg.startswith("envbuild: error:"), msg
    assert "\n\n" not in msg  # one paragraph
    for w in words:
        assert w in " ".join(msg.split()), (w, msg)


@pytest.mark.parametrize("args, words", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input(cli, tmp_path, args, words):
    out = tmp_path / "out"
    r = cli("render", *args, "-o", str(out))
    _assert_clean_failure(r, words)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_no_stack_left_after_filtering(cli, tmp_path):
    r = cli("render", "--gpu", "v100", "--cuda", "13.0", "-o", str(tmp_path / "o"))
    _assert_clean_failure(r, ["no stack fits --gpu v100 --cuda 13.0", "no code for v100 (sm_70)",
                              "--cuda 12.8"])
    assert list(tmp_path.iterdir()) == []


def test_malformed_matrix_file(cli, matrix_copy, tmp_path):
    p = matrix_copy / "gpus.yaml"
    p.write_text(p.read_text().replace('cc: "7.5", memory_gb: [16], generation: Turing',
                                       'cc: 7.5.1, memory_gb: [16], generation: Turing'))
    r = cli("render", "--gpu", "h20", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "o"))
    _assert_clean_failure(r, [str(p), "profiles[1] (t4).cc", "expected a compute capability like '9.0'"])
    assert not (tmp_path / "o").exists()


def test_output_path_that_cannot_be_written(cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = cli("render", "--gpu", "h20", "-o", str(blocker / "out"))
    _assert_clean_failure(r, [f"output path {blocker / 'out'} cannot be written", "-o/--output"])
    r = cli("render", "--gpu", "h20", "-o", str(blocker))
    _assert_clean_failure(r, ["exists and is not a directory"])
    assert blocker.read_text() == "not a directory"


def test_render_prints_the_stack_and_path(cli, tmp_path):
    r = cli("render", "--gpu", "H20", "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    for w in ("torch2.11-cu130-py3.12", "2.11.0", "0.19.8", "h20 (sm_90)", str(tmp_path / "o")):
        assert w in r.stdout


def test_default_output_is_build_tag(cli, tmp_path):
    r = cli("render", "--gpu", "h20", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "build" / "torch2.11.0-cu130-py3.12-ds0.19.8-h20" / "Dockerfile").is_file()


def test_explain_writes_nothing(cli, tmp_path):
    r = cli("render", "--gpu", "b200", "--explain", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "rejected" in r.stdout and "CHOSEN" in r.stdout and "[gpu-floor]" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_matrix_and_gpus_json(cli, matrix):
    stacks = json.loads(cli("matrix", "--json").stdout)
    assert [s["id"] for s in stacks] == [s.id for s in matrix.stacks]
    gpus = json.loads(cli("gpus", "--json").stdout)
    h20 = next(g for g in gpus if g["name"] == "h20")
    assert h20["cc"] == "9.0" and h20["env"][0]["name"] == "NCCL_P2P_DISABLE" and h20["env"][0]["cost"]
    table = cli("gpus", env={"COLUMNS": "300"}).stdout
    assert "NCCL_P2P_DISABLE=1" in table and "h20" in table
    assert "field report 5" in table and "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in table  # reasons and sources
    assert "driver < 550.40.07" in table  # a node-decided default says when it applies
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in table.split("not baked", 1)[1]  # and what was left out


def _env_lines(dockerfile: str) -> dict[str, str]:
    """NAME -> value of every ENV line of the final stage (the builder's are build-time only)."""
    final = dockerfile.split("AS runtime", 1)[1]
    out = {}
    for block in re.findall(r"^ENV (.*?)(?=\n(?!    ))", final, re.M | re.S):
        for name, value in re.findall(r'([A-Z_][A-Z0-9_]*)=("(?:[^"\\]|\\.)*")', block):
            out[name] = json.loads(value)
    return out


@pytest.mark.parametrize("gpu", ["h20", "rtx4090"])
def test_gpus_json_lists_every_variable_a_rendered_image_sets(cli, gpu, tmp_path):
    """Every ENV line of a rendered Dockerfile is matrix data that `envbuild gpus --json` shows,
    with its reason and source: nothing an image bakes is decided in a Python string."""
    profile = next(g for g in json.loads(cli("gpus", "--json").stdout) if g["name"] == gpu)
    listed = {e["name"]: e for key in ("image_env", "common_env", "fabric_env", "env") for e in profile[key]}
    r = cli("render", "--gpu", gpu, "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    baked = _env_lines((tmp_path / "o" / "Dockerfile").read_text())
    assert len(baked) >= 12 and set(baked) <= set(listed), set(baked) - set(listed)
    for name in baked:
        assert listed[name]["reason"] and listed[name]["source"], name
    assert {e["name"] for e in profile["image_env"] if e.get("toolchain") != "kept"} <= set(baked)


def test_the_default_render_picks_the_newest_torch_on_pypi(cli, production_matrix, tmp_path):
    newest = max(production_matrix.torch_file.releases, key=lambda r: tuple(map(int, r.torch.split("."))))
    r = cli("render", "--gpu", "h20", "-o", str(tmp_path / "o"), production=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["torch"] == newest.torch


@pytest.mark.parametrize("gpus", ["0,1", "device=0"])
def test_smoke_gpus_that_are_not_all_or_a_count_are_refused(cli, gpus):
    """They reached int(gpus) inside the engine: an internal error, exit 70."""
    r = cli("smoke", "envbuild:none", "--gpus", gpus)
    _assert_clean_failure(r, [f"--gpus '{gpus}' is not 'all' or a count", "--gpus all"])


def test_next_lines_never_print_a_password(cli, tmp_path):
    r = cli("render", "--gpu", "h20", "--pip-index-url", "https://user:s3cret@mirror.example/simple",
            "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "s3cret" not in r.stdout + r.stderr and "https://***@mirror.example/simple" in r.stdout
