"""Bad input is refused before anything is written: exit 2, one paragraph naming the input,
what is wrong and the nearest valid choice of the same kind."""

from __future__ import annotations

import sys

import pytest

from conftest import FIXTURE_MATRIX
from envbuild.knowledge import rules
from envbuild.knowledge import validate
from envbuild.cli import run
from envbuild.base.errors import EnvbuildError
from envbuild.render.builddir import render_files
from envbuild.image.paths import RUNTIME_PATH
from envbuild.resolve.resolver import Request, resolve

SHA = "sha256:" + "f" * 64


def _render(monkeypatch, capsys, tmp_path, *args):
    """`envbuild render ARGS -o tmp/out` through the real entry point, in-process (the
    subprocess path is covered by test_cli); returns (exit code, stdout, stderr)."""
    output = [] if "-o" in args else ["-o", str(tmp_path / "out")]
    if not {"--image-repo", "--registry"} & set(args):  # a pullable name: no local-only bootstrap warning
        output += ["--image-repo", "localhost:5000/envbuild"]
    monkeypatch.setenv("ENVBUILD_MATRIX_DIR", str(FIXTURE_MATRIX))  # behaviour tests: the frozen matrix
    monkeypatch.setattr(sys, "argv", ["envbuild", "render", *args, *output])
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


REFUSED = [
    (["--gpu", "h20", "--base-image", "ubuntu:latest"], ["--base-image 'ubuntu:latest' names the tag `latest`",
                                                         "rule base-pinned", "ubuntu@sha256:<digest>"]),
    (["--gpu", "h20", "--builder-image", "registry.corp/cuda"], ["names no tag", "registry.corp/cuda:<release tag>"]),
    # (arguments, words the one-paragraph message must contain)
    # --image-repo: OCI repository grammar, no tag or digest
    (["--gpu", "h20", "--image-repo", "My Repo"], ["--image-repo 'My Repo' is not a valid OCI repository name",
                                                   "nearest valid choice: --image-repo my-repo."]),
    (["--gpu", "h20", "--image-repo", ""], ["--image-repo is empty", "envbuild (the default)"]),
    (["--gpu", "h20", "--image-repo", "ghcr.io/Team/Envbuild"], ["--image-repo ghcr.io/team/envbuild."]),
    (["--gpu", "h20", "--image-repo", "repo:tag"], ["carries a tag (:tag)", "--image-repo repo."]),
    (["--gpu", "h20", "--image-repo", f"reg.example.com/repo@{SHA}"], ["carries a digest",
                                                                       "--image-repo reg.example.com/repo."]),
    (["--gpu", "h20", "--image-repo", "localhost:5000"], ["registry host:port without a repository",
                                                          "--image-repo localhost:5000/envbuild."]),
    (["--gpu", "h20", "--image-repo", "a_-b"], ["--image-repo a-b."]),
    # --base-image / --builder-image: a reference, and the stack's distro release
    (["--gpu", "h20", "--base-image", "Ubuntu:24.04"], ["--base-image 'Ubuntu:24.04' is not a valid image reference",
                                                        "--base-image ubuntu:24.04."]),
    (["--gpu", "h20", "--base-image", "ubuntu@sha256:abc"], ["the digest 'sha256:abc' is not sha256:<64"]),
    (["--gpu", "h20", "--base-image", ""], ["--base-image is empty", "ubuntu:24.04"]),
    (["--gpu", "h20", "--base-image", "ubuntu:22.04"], [
        "--base-image 'ubuntu:22.04' is ubuntu 22.04, but stack torch2.11-cu130-py3.12 is built on ubuntu24.04",
        "--base-image ubuntu:24.04 or nvidia/cuda:13.0.2-base-ubuntu24.04",
        "a stack built on ubuntu22.04: --stack torch2.4-cu121-py3.10"]),
    (["--gpu", "h20", "--base-image", "nvidia/cuda:12.8.1-devel-ubuntu22.04"], [
        "is ubuntu 22.04", "--base-image nvidia/cuda:12.8.1-devel-ubuntu24.04"]),
    (["--gpu", "h20", "--base-image", "ubuntu:jammy"], ["is ubuntu 22.04", "--base-image ubuntu:noble"]),
    (["--gpu", "h20", "--stack", "torch2.11-cu130-py3.11-pypi", "--base-image", "debian:trixie"], [
        "is debian 13, but stack torch2.11-cu130-py3.11-pypi is built on debian12", "--base-image debian:bookworm",
        "no stack in the matrix is built on debian13"]),
    (["--gpu", "h20", "--stack", "torch2.11-cu130-py3.11-pypi", "--base-image", "ubuntu:24.04"], [
        "is ubuntu 24.04", "debian:bookworm-slim", "--stack torch2.10-cu128-py3.12"]),
    (["--gpu", "h20", "--builder-image", "nvidia/cuda:12.6.3-devel-ubuntu24.04"], [
        "is CUDA 12.6", "built for CUDA 13.0", "--builder-image nvidia/cuda:13.0.2-devel-ubuntu24.04."]),
    (["--gpu", "h20", "--builder-image", "nvidia/cuda:13.0.2-runtime-ubuntu24.04"], [
        "a runtime image without nvcc", "--builder-image nvidia/cuda:13.0.2-devel-ubuntu24.04."]),
    # mirrors: http(s) URLs, never echoing a credential
    (["--gpu", "h20", "--apt-mirror", "mirror.example.com"], ["--apt-mirror 'mirror.example.com' is not an http(s) URL",
                                                              "--apt-mirror https://mirror.example.com."]),
    (["--gpu", "h20", "--pip-index-url", "ftp://pypi.example.com/simple"], [
        "--pip-index-url https://pypi.example.com/simple."]),
    (["--gpu", "h20", "--torch-index-url", "https://"], ["has no host"]),
    (["--gpu", "h20", "--pip-index-url", ""], ["--pip-index-url is empty"]),
    (["--gpu", "h20", "--apt-mirror", "https://mirror.example.com/a&b"], ["may not carry", "&"]),
    # --env
    (["--gpu", "h20", "--env", "PATH=/opt/tools/bin"], ["--env PATH=... is not supported",
                                                        "apptainer exec --env PREPEND_PATH=/your/bin",
                                                        f"docker run -e PATH=/your/bin:{RUNTIME_PATH}"]),
    (["--gpu", "h20", "--env", "PATH=/x:$PATH"], ["--env PATH=... is not supported"]),
    (["--gpu", "h20", "--env", "X=a}b"], ["--env X='a}b': it holds '}'", "%environment"]),
    (["--gpu", "h20", "--env", "X=it's"], ["it holds \"'\""]),
    (["--gpu", "h20", "--env", "MY-VAR=1"], ["--env 'MY-VAR' is not a valid environment variable name",
                                             "--env MY_VAR=1."]),
    # empty values are refused, not ignored
    (["--gpu", ""], ["--gpu is empty", "'NVIDIA H100 80GB HBM3'"]),
    (["--gpu", "h20", "--torch", ""], ["--torch is empty", "--torch 2.11", "torch 2.4.1"]),
    (["--gpu", "h20", "--python", " "], ["--python is empty", "--python 3.12"]),
    (["--gpu", "h20", "--cuda", ""], ["--cuda is empty", "--cuda 12.8"]),
    (["--gpu", "h20", "--deepspeed", ""], ["--deepspeed is empty", "--deepspeed 0.19.8"]),
    (["--gpu", "h20", "--ds-ops", ""], ["--ds-ops is empty", "training", "--ds-ops cpu_adam,fused_adam."]),
    (["--gpu", "h20", "--ca-cert", ""], ["--ca-cert is empty"]),
    (["--gpu", "h20", "-o", ""], ["-o/--output is empty"]),
    # --ds-ops: a preset stands alone
    (["--gpu", "h20", "--ds-ops", "training,async_io"], [
        "mixes the preset training with op names",
        "--ds-ops async_io,cpu_adagrad,cpu_adam,cpu_lion,fused_adam,fused_lamb,fused_lion,utils."]),
    (["--gpu", "h20", "--ds-ops", "none, async_io"], ["mixes the preset none", "--ds-ops async_io."]),
    (["--gpu", "h20", "--ds-ops", "cpu_adam,,fused_adam"], ["has an empty item", "--ds-ops cpu_adam,fused_adam."]),
    # --stack with versions that contradict it
    (["--gpu", "h20", "--stack", "torch2.11-cu130-py3.12", "--torch", "2.5"], [
        "--stack torch2.11-cu130-py3.12 has torch 2.11.0, which contradicts --torch 2.5",
        "(stacks with it: torch2.5-cu124-py3.10)"]),
    (["--gpu", "h20", "--stack", "torch2.11-cu130-py3.12", "--python", "3.10"], [
        "has Python 3.12, which contradicts --python 3.10"]),
    (["--gpu", "h20", "--stack", "torch2.11-cu130-py3.12", "--cuda", "12.8"], ["has CUDA 13.0"]),
    # versions of the wrong kind get a hint of the right kind
    (["--gpu", "h20", "--cuda", "cu128"], ["--cuda 'cu128' is a wheel/tag spelling", "--cuda 12.8."]),
    (["--gpu", "h20", "--torch", "cu130"], ["--torch 'cu130' is a CUDA version, not a torch version",
                                            "did you mean --cuda 13.0?"]),
    (["--gpu", "h20", "--python", "cp312"], ["--python 3.12."]),
    (["--gpu", "h20", "--torch", "py3.12"], ["is a Python version", "--python 3.12?"]),
    (["--gpu", "h20", "--cuda", "2.11"], ["--cuda 2.11 matches no CUDA version in the matrix",
                                          "did you mean --torch 2.11?"]),
    (["--gpu", "h20", "--cuda", "twelve"], ["--cuda 'twelve' is neither a version nor a PEP 440 specifier",
                                            "--cuda 12.8, --cuda '>=12.6'"]),
    # a GPU not in the matrix, as nvidia-smi prints it
    (["--gpu", "NVIDIA Quadro P5000"], ["unknown GPU 'NVIDIA Quadro P5000' (read as 'p5000')", "did you mean",
                                     "gpus.yaml (the file this run read"]),
]


@pytest.mark.parametrize("args, words", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refused(monkeypatch, capsys, tmp_path, args, words):
    code, _, err = _render(monkeypatch, capsys, tmp_path, *args)
    assert code == 2, err
    msg = " ".join(err.split())
    assert msg.startswith("envbuild: error:") and err.strip().count("\n\n") == 0 and "Traceback" not in err
    for w in words:
        assert w in msg, (w, msg)
    assert list(tmp_path.iterdir()) == []


def test_a_credential_in_a_bad_url_is_not_echoed(monkeypatch, capsys, tmp_path):
    code, _, err = _render(monkeypatch, capsys, tmp_path, "--gpu", "h20", "--pip-index-url",
                           "https://user:s3cret-token@pypi.example.com/simple with space")
    assert code == 2 and "s3cret-token" not in err and "https://***@pypi.example.com" in err


ACCEPTED = [
    ["--gpu", "h20", "--image-repo", "registry.example.com:5000/team/env-build"],
    ["--gpu", "h20", "--image-repo", "localhost/x__y.z"],
    ["--gpu", "h20", "--base-image", "registry.corp/base:v3"],  # no release in the name: no claim
    ["--gpu", "h20", "--base-image", f"ubuntu@{SHA}"],
    ["--gpu", "h20", "--base-image", "mirror.example.com/library/ubuntu:24.04"],
    ["--gpu", "h20", "--builder-image", "nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04"],
    ["--gpu", "h20", "--stack", "torch2.11-cu130-py3.11-pypi", "--base-image", "local/debian:12-slim"],
    ["--gpu", "h20", "--stack", "torch2.11-cu130-py3.11-pypi", "--base-image", "python:3.11-slim-bookworm"],
    ["--gpu", "h20", "--apt-mirror", "http://10.0.0.1:3142", "--pip-index-url", "https://u:p@pypi.example.com/simple"],
    ["--gpu", "h20", "--stack", "torch2.11-cu130-py3.12", "--torch", "2.11", "--cuda", "13"],
    ["--gpu", "NVIDIA H100 80GB HBM3"],
]


@pytest.mark.parametrize("args", ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_accepted(monkeypatch, capsys, tmp_path, args):
    code, _, err = _render(monkeypatch, capsys, tmp_path, *args)
    assert code == 0, err
    assert (tmp_path / "out" / "Dockerfile").is_file()


# ---------------------------------------------------------------- OCI grammar on upstream cases
# github.com/distribution/reference reference_test.go, TestReferenceParse (the docker/OCI
# reference parser's own cases); IPv6 hosts and the 255-character name limit included.

UPSTREAM_VALID = [
    "test_com", "test.com:tag", "test.com:5000", "test.com/repo:tag", "test:5000/repo", "test:5000/repo:tag",
    f"test:5000/repo@{SHA}", f"test:5000/repo:tag@{SHA}", "lowercase:Uppercase",
    "a/" * 127 + "a:tag-puts-this-over-max", "sub-dom1.foo.com/bar/baz/quux",
    "sub-dom1.foo.com/bar/baz/quux:some-long-tag", "b.gcr.io/test.example.com/my-app:test.example.com",
    "xn--n3h.com/myimage:xn--n3h.com", "xn--7o8h.com/myimage:xn--7o8h.com@sha512:" + "f" * 128,
    "foo_bar.com:8080", "foo/foo_bar.com:8080", "192.168.1.1", "192.168.1.1:tag", "192.168.1.1:5000",
    "192.168.1.1/repo", "192.168.1.1:5000/repo", "192.168.1.1:5000/repo:5050", "[2001:db8::1]/repo",
    "[2001:db8:1:2:3:4:5:6]/repo:tag", "[2001:db8::1]:5000/repo", "[2001:db8::1]:5000/repo:tag",
    f"[2001:db8::1]:5000/repo@{SHA}", f"[2001:db8::1]:5000/repo:tag@{SHA}", "[2001:db8::]:5000/repo",
    "[::1]:5000/repo",
]
UPSTREAM_INVALID = [
    ":justtag", f"@{SHA}", "repo@sha256:" + "f" * 34, "validname@invaliddigest:" + "f" * 64, "Uppercase:tag",
    "test:5000/Uppercase/lowercase:tag", "a/" * 128 + "a:tag", "aa/asdf$$^/aa", "[2001:db8::1]",
    "[2001:db8::1]:5000", "[2001:db8::1]:tag", "[fe80::1%eth0]:5000/repo", "[fe80::1%@invalidzone]:5000/repo",
]


@pytest.mark.parametrize("ref", UPSTREAM_VALID)
def test_upstream_valid_references(ref):
    validate.check_image_reference("--base-image", ref)


@pytest.mark.parametrize("ref", UPSTREAM_INVALID)
def test_upstream_invalid_references(ref):
    with pytest.raises(EnvbuildError, match="is not a valid image reference"):
        validate.check_image_reference("--base-image", ref)


# ---------------------------------------------------------------- releases named by images


@pytest.mark.parametrize("ref, release", [
    ("ubuntu:22.04", ("ubuntu", "22.04")),
    ("ubuntu:noble-20240801", ("ubuntu", "24.04")),
    ("nvidia/cuda:12.8.1-devel-ubuntu22.04", ("ubuntu", "22.04")),
    ("nvcr.io/nvidia/cuda:12.4.1-cudnn-runtime-ubuntu20.04", ("ubuntu", "20.04")),
    ("debian:bookworm-slim", ("debian", "12")),
    ("debian:12.5", ("debian", "12")),
    ("python:3.11-slim-trixie", ("debian", "13")),
    ("nvidia/cuda:12.8.1-devel-rockylinux9", ("rockylinux", "9")),
    ("nvidia/cuda:12.8.1-devel-ubi9", ("ubi", "9")),
    ("registry.corp/base:v3", None),
    ("ubuntu:latest", None),
    (f"ubuntu@{SHA}", None),
    ("local/debian", None),
])
def test_image_release(ref, release):
    assert rules.image_release(ref) == release


# ---------------------------------------------------------------- GPU names as nvidia-smi prints them


@pytest.mark.parametrize("printed, profile", [
    ("NVIDIA H100 80GB HBM3", "h100"),   # NVIDIA/nccl#1967 nvidia-smi table; pytorch/test-infra#7631
    ("NVIDIA H100 NVL", "h100"),         # NVIDIA/nccl#1608 `nvidia-smi nvlink -s`
    ("NVIDIA H100 PCIe", "h100"),        # pytorch/pytorch#90761
    ("NVIDIA A100-SXM4-40GB", "a100"),   # mosaicml/composer#2265 torch.cuda.get_device_name()
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-PCIE-40GB", "a100"),
    ("Tesla V100-SXM2-32GB", "v100"),    # NVIDIA/nvidia-docker#1076 `nvidia-smi -q` Product Name
    ("Tesla V100-SXM2-16GB", "v100"),    # NVIDIA/nvidia-docker#914
    ("NVIDIA GeForce RTX 3090", "rtx3090"),  # pytorch/pytorch#75198
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GH200 480GB", "gh200"),     # pytorch/pytorch#194276
    ("NVIDIA B200", "b200"),             # pytorch/test-infra#7631
    ("NVIDIA H20", "h20"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L40", "l40"),
    ("Tesla T4", "t4"),
    ("NVIDIA A10G", "a10"),
    ("h20", "h20"),
    ("nvidia-h20", "h20"),
    ("H20_96GB", "h20"),
])
def test_gpu_names_as_printed(matrix, printed, profile):
    assert matrix.gpu(printed).name == profile


@pytest.mark.parametrize("printed", ["NVIDIA RTX A5000", "Quadro RTX 6000", "NVIDIA GeForce RTX 4070 Laptop GPU"])
def test_gpus_not_in_the_matrix_get_a_gpu_suggestion(matrix, printed):
    with pytest.raises(EnvbuildError) as e:
        matrix.gpu(printed)
    assert f"unknown GPU '{printed}'" in e.value.message and "did you mean rtx" in e.value.message


# ---------------------------------------------------------------- what is accepted renders correctly


def test_ds_ops_with_spaces_are_trimmed_to_the_same_build(matrix):
    spaced = render_files(resolve(matrix, Request(gpu="h20", ds_ops=" cpu_adam , fused_adam ")))
    plain = render_files(resolve(matrix, Request(gpu="h20", ds_ops="cpu_adam,fused_adam")))
    assert spaced == plain


def test_non_ascii_env_values_are_written_as_utf8_in_both_formats(matrix):
    files = render_files(resolve(matrix, Request(gpu="h20", env=(("RUN_NAME", "essai-été ✓"),))))
    assert 'RUN_NAME="essai-été ✓"' in files["Dockerfile"].decode()
    assert 'RUN_NAME="${RUN_NAME:-essai-été ✓}"' in files["Singularity.def"].decode()
    assert "\\u00e9" not in files["Dockerfile"].decode()


def test_path_is_the_same_in_docker_and_apptainer_because_only_envbuild_sets_it(matrix):
    with pytest.raises(EnvbuildError, match="--env PATH"):
        resolve(matrix, Request(gpu="h20", env=(("PATH", "/x"),)))


@pytest.mark.parametrize("pair, words", [
    ("TORCH_EXTENSIONS_DIR=/home/alice/.cache/torch_extensions", ["shared home/network filesystem",
                                                                   "field reports 1 and 2"]),
    ("TORCH_EXTENSIONS_DIR=~/.cache/te", ["'~' is not expanded"]),
    ("TRITON_CACHE_DIR=/lustre/proj/triton", ["shared home/network filesystem"]),
    ("DS_ACCELERATOR=cpu", ["pre-built for cuda", "JIT-compiles"]),
    ("DS_BUILD_OPS=1", ["DeepSpeed build switch", "--ds-ops"]),
    ("TORCH_CUDA_ARCH_LIST=8.0", ["pre-built for 9.0 (h20)"]),
    ("LD_LIBRARY_PATH=/opt/lib", ["/usr/local/nvidia/lib"]),
])
def test_overrides_that_bring_back_what_the_image_prevents_warn(monkeypatch, capsys, tmp_path, pair, words):
    code, _, err = _render(monkeypatch, capsys, tmp_path, "--gpu", "h20", "--env", pair)
    assert code == 0, err
    msg = " ".join(err.split())
    assert msg.startswith("envbuild: warning: --env ") and "error" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_harmless_overrides_do_not_warn(monkeypatch, capsys, tmp_path):
    code, _, err = _render(monkeypatch, capsys, tmp_path, "--gpu", "h20", "--env", "NCCL_DEBUG=INFO",
                           "--env", "TORCH_EXTENSIONS_DIR=/tmp/te", "--env", "DS_ACCELERATOR=cuda")
    assert code == 0 and err == ""


def test_review_findings_are_refused_or_fixed(monkeypatch, capsys, tmp_path):
    """Found by review: an empty --stack resolved the default, a repeated --env silently
    took the last value, a Debian base for an Ubuntu stack was 'fixed' to debian:noble, and a
    CUDA 12.8 base under a CUDA 13 stack slipped through."""
    for args, words in (
        (["--gpu", "h20", "--stack", ""], ["--stack is empty"]),
        (["--gpu", "h20", "--env", "A=1", "--env", "A=2"], ["--env A is given 2 times"]),
        (["--gpu", "h100", "--stack", "torch2.11-cu130-py3.12", "--builder-image", "debian:bookworm"],
         ["is debian 12", "--builder-image nvidia/cuda:13.0.2-devel-ubuntu24.04"]),
        (["--gpu", "h100", "--stack", "torch2.11-cu130-py3.12", "--base-image", "nvidia/cuda:12.8.1-base-ubuntu24.04"],
         ["is CUDA 12.8", "NVIDIA_REQUIRE_CUDA", "--base-image nvidia/cuda:13.0.2-base-ubuntu24.04"]),
    ):
        code, _, err = _render(monkeypatch, capsys, tmp_path, *args)
        msg = " ".join(err.split())
        assert code == 2 and all(w in msg for w in words), (args, msg)
        assert "noble" not in msg and list(tmp_path.iterdir()) == []
