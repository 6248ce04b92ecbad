"""The build plan: each derived fact decided once, so no format can disagree with another.

The two tests below reproduce defects of the renderer that decided CUDA_HOME and PATH in
several places (issue 7); each fails on the code before the plan existed."""

import subprocess

from conftest import ROOT
from envbuild.render.builddir import render_files
from envbuild.resolve.resolver import Request, resolve


def _environment_section(text: str) -> str:
    return text.split("%environment\n", 1)[1].split("\n%", 1)[0]


def test_keep_toolchain_without_nvcc_advertises_no_toolchain(matrix):
    """PyPI-CUDA stack, CPU-only ops: no cuda-toolkit step runs, so no image format may bake
    a CUDA_HOME or put its bin on PATH."""
    r = resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam",
                                keep_toolchain=True))
    files = render_files(r)
    assert "cuda-toolkit" not in files["Dockerfile"].decode()
    for name in ("Dockerfile", "Singularity.def", "Singularity.standalone.def", "manifest.json"):
        text = files[name].decode()
        assert "/opt/cuda-pypi" not in text, name
        assert "CUDA_HOME" not in text, name


def test_keep_toolchain_puts_nvcc_on_path_in_every_format(matrix):
    """Apptainer's %environment must put the kept nvcc on PATH also when the host's PATH is
    set (it always is), exactly as the Dockerfile's ENV does."""
    r = resolve(matrix, Request(gpu="h100", stack="torch2.11-cu130-py3.12", keep_toolchain=True))
    files = render_files(r)
    runtime = files["Dockerfile"].decode().split("AS runtime", 1)[1]
    docker_path = next(line for line in runtime.splitlines() if line.strip().startswith('PATH="'))
    assert "/usr/local/cuda/bin" in docker_path
    for name in ("Singularity.def", "Singularity.standalone.def"):
        section = _environment_section(files[name].decode()).replace(". /opt/envbuild/env.sh", ":")
        out = subprocess.run(["sh", "-c", section + '\nprintf %s "$PATH"'],
                             env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, capture_output=True, text=True, check=True)
        entries = out.stdout.split(":")
        assert entries[:2] == ["/opt/venv/bin", "/usr/local/cuda/bin"], (name, out.stdout)
        assert "/usr/bin" in entries  # the host's PATH is kept after the image's own directories


# ---------------------------------------------------------------- one exact string per block per format

import pytest  # noqa: E402

from envbuild.plan import Copy, Environment, FileCopy, Label, stack_plan  # noqa: E402
from envbuild.resolve.resolver import EnvVar  # noqa: E402

DS_REQUIRES = "'einops hjson msgpack ninja numpy packaging>=20.0 pip psutil py-cpuinfo pydantic>=2.0.0 setuptools tqdm'"
# CUDA 13.0.2's PyPI toolchain has no cuobjdump (bases.yaml audit_since): the ops' SASS audit is
# skipped, and the step says so in the build log.
NO_AUDIT = ("the PyPI toolchain has no cuobjdump before CUDA 13.2 (nvidia-cuda-cuobjdump, the wheel "
            "cuda-toolkit[cuobjdump] installs, has releases from 13.2.51 on "
            "(https://pypi.org/simple/nvidia-cuda-cuobjdump/); cuda-toolkit 13.0.2 has no cuobjdump extra), so the "
            "SASS audit cannot run")
PY_CACHE = "--mount=type=cache,id=envbuild-py,target=/var/cache/envbuild-py,sharing=locked"
EXT_CACHE = "--mount=type=cache,id=envbuild-ext,target=/var/cache/envbuild-ext,sharing=locked"
DS_KEY = "deepspeed/18a4f866a31e37ea"  # the DeepSpeed wheel's key in the wheel cache (envbuild/deepspeed.json)
STEPS = {
    "os": (
        "# python3.11 with headers and a host compiler for the DeepSpeed ops\n"
        "COPY envbuild/steps/lib.sh envbuild/steps/os.sh /opt/envbuild-setup/\n"
        "RUN --mount=type=cache,id=envbuild-apt,target=/var/cache/envbuild-apt,sharing=locked --mount=type=secret,id=ca_cert --mount=type=secret,id=apt_mirror \\\n"
        "    ENVBUILD_APT_HOSTS='deb.debian.org security.debian.org' \\\n"
        "    bash /opt/envbuild-setup/os.sh ca-certificates g++ python3.11-dev python3.11-venv",
        {"files": ["envbuild/steps/lib.sh /opt/envbuild-setup/lib.sh", "envbuild/steps/os.sh /opt/envbuild-setup/os.sh"],
         "post": ["# python3.11 with headers and a host compiler for the DeepSpeed ops",
                  "ENVBUILD_APT_HOSTS='deb.debian.org security.debian.org' bash /opt/envbuild-setup/os.sh "
                  "ca-certificates g++ python3.11-dev python3.11-venv"]}),
    "venv": (
        "# one virtual environment holds the whole stack\n"
        "COPY envbuild/steps/venv.sh /opt/envbuild-setup/venv.sh\n"
        "RUN bash /opt/envbuild-setup/venv.sh /usr/bin/python3.11",
        {"files": ["envbuild/steps/venv.sh /opt/envbuild-setup/venv.sh"],
         "post": ["# one virtual environment holds the whole stack", "bash /opt/envbuild-setup/venv.sh /usr/bin/python3.11"]}),
    "uv": (
        "# uv 0.13.9, which installs the lock's parts: PyPI's wheel by its hashes (matrices/bases.yaml installer), "
        "outside the venv, in the builder only\n"
        "COPY envbuild/steps/uv.sh /opt/envbuild-setup/\n"
        "COPY envbuild/lock/uv.txt /opt/envbuild-setup/lock/\n"
        f"RUN {PY_CACHE} --mount=type=secret,id=ca_cert --mount=type=secret,id=pip_index_url \\\n"
        "    bash /opt/envbuild-setup/uv.sh /opt/envbuild-uv /opt/envbuild-setup/lock/uv.txt",
        {"files": ["envbuild/steps/uv.sh /opt/envbuild-setup/uv.sh", "envbuild/lock/uv.txt /opt/envbuild-setup/lock/uv.txt"],
         "post": ["# uv 0.13.9, which installs the lock's parts: PyPI's wheel by its hashes (matrices/bases.yaml "
                  "installer), outside the venv, in the builder only",
                  "bash /opt/envbuild-setup/uv.sh /opt/envbuild-uv /opt/envbuild-setup/lock/uv.txt"]}),
    "torch": (
        "# torch first: DeepSpeed's ops compile against it (CUDA 13.0, the PyPI default wheel); the whole venv "
        "but DeepSpeed, from the stack's lock, every hash checked, by uv\n"
        "COPY envbuild/steps/torch.sh /opt/envbuild-setup/\n"
        "COPY envbuild/lock/venv.txt /opt/envbuild-setup/lock/\n"
        f"RUN {PY_CACHE} --mount=type=secret,id=ca_cert --mount=type=secret,id=pip_index_url "
        "--mount=type=secret,id=torch_index_url \\\n"
        "    ENVBUILD_UV=/opt/envbuild-uv/bin/uv \\\n"
        "    bash /opt/envbuild-setup/torch.sh - --require-hashes --no-deps -r /opt/envbuild-setup/lock/venv.txt",
        {"files": ["envbuild/steps/torch.sh /opt/envbuild-setup/torch.sh",
                   "envbuild/lock/venv.txt /opt/envbuild-setup/lock/venv.txt"],
         "post": ["# torch first: DeepSpeed's ops compile against it (CUDA 13.0, the PyPI default wheel); the whole "
                  "venv but DeepSpeed, from the stack's lock, every hash checked, by uv",
                  "ENVBUILD_UV=/opt/envbuild-uv/bin/uv "
                  "bash /opt/envbuild-setup/torch.sh - --require-hashes --no-deps -r /opt/envbuild-setup/lock/venv.txt"]}),
    "cuda-toolkit": (
        "# nvcc 13.0.2 from PyPI, outside the venv (CUDA ops fused_adam are compiled with nvcc)\n"
        "COPY envbuild/steps/cuda-toolkit.sh /opt/envbuild-setup/\n"
        "COPY envbuild/lock/toolchain.txt /opt/envbuild-setup/lock/\n"
        f"RUN {PY_CACHE} --mount=type=secret,id=ca_cert --mount=type=secret,id=pip_index_url \\\n"
        "    ENVBUILD_UV=/opt/envbuild-uv/bin/uv \\\n"
        "    bash /opt/envbuild-setup/cuda-toolkit.sh /opt/cuda-pypi /opt/cuda-pypi/nvidia/cu13 --require-hashes "
        "--no-deps -r /opt/envbuild-setup/lock/toolchain.txt",
        {"files": ["envbuild/steps/cuda-toolkit.sh /opt/envbuild-setup/cuda-toolkit.sh",
                   "envbuild/lock/toolchain.txt /opt/envbuild-setup/lock/toolchain.txt"],
         "post": ["# nvcc 13.0.2 from PyPI, outside the venv (CUDA ops fused_adam are compiled with nvcc)",
                  "ENVBUILD_UV=/opt/envbuild-uv/bin/uv bash /opt/envbuild-setup/cuda-toolkit.sh /opt/cuda-pypi /opt/cuda-pypi/nvidia/cu13 "
                  "--require-hashes --no-deps -r /opt/envbuild-setup/lock/toolchain.txt"]}),
    "deepspeed": (
        "# DeepSpeed with its ops pre-built for the target arches; the build fails unless DeepSpeed recorded "
        "every op for cuda\n"
        "COPY envbuild/steps/deepspeed.sh envbuild/steps/cc-wrapper.sh envbuild/steps/nvcc-arch.sh "
        "envbuild/steps/verify_ops.py envbuild/steps/sass_audit.py /opt/envbuild-setup/\n"
        "COPY envbuild/lock/deepspeed.txt /opt/envbuild-setup/lock/\n"
        f"RUN {PY_CACHE} {EXT_CACHE} --mount=type=secret,id=ca_cert --mount=type=secret,id=pip_index_url "
        "--mount=type=secret,id=compile_cache \\\n"
        "    DS_ACCELERATOR=cuda \\\n    DS_BUILD_OPS=0 \\\n    DS_BUILD_CPU_ADAM=1 \\\n    DS_BUILD_FUSED_ADAM=1 \\\n"
        "    TORCH_CUDA_ARCH_LIST=9.0 \\\n    ENVBUILD_CPU_TARGET=x86-64-v3 \\\n"
        "    ENVBUILD_CPU_FLAG=-march=x86-64-v3 \\\n    ENVBUILD_CPU_SIMD=-D__AVX256__ \\\n"
        "    CUDA_HOME=/opt/cuda-pypi/nvidia/cu13 \\\n"
        f"    ENVBUILD_SASS_AUDIT='skipped: {NO_AUDIT}' \\\n"
        f"    ENVBUILD_DS_CACHE_KEY={DS_KEY} \\\n"
        "    bash /opt/envbuild-setup/deepspeed.sh /opt/envbuild-setup/lock/deepspeed.txt cpu_adam fused_adam",
        {"files": ["envbuild/steps/deepspeed.sh /opt/envbuild-setup/deepspeed.sh",
                   "envbuild/steps/cc-wrapper.sh /opt/envbuild-setup/cc-wrapper.sh",
                   "envbuild/steps/nvcc-arch.sh /opt/envbuild-setup/nvcc-arch.sh",
                   "envbuild/steps/verify_ops.py /opt/envbuild-setup/verify_ops.py",
                   "envbuild/steps/sass_audit.py /opt/envbuild-setup/sass_audit.py",
                   "envbuild/lock/deepspeed.txt /opt/envbuild-setup/lock/deepspeed.txt"],
         "post": ["# DeepSpeed with its ops pre-built for the target arches; the build fails unless DeepSpeed "
                  "recorded every op for cuda",
                  "DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 "
                  "TORCH_CUDA_ARCH_LIST=9.0 ENVBUILD_CPU_TARGET=x86-64-v3 ENVBUILD_CPU_FLAG=-march=x86-64-v3 "
                  "ENVBUILD_CPU_SIMD=-D__AVX256__ CUDA_HOME=/opt/cuda-pypi/nvidia/cu13 "
                  f"ENVBUILD_SASS_AUDIT='skipped: {NO_AUDIT}' ENVBUILD_DS_CACHE_KEY={DS_KEY} "
                  "bash /opt/envbuild-setup/deepspeed.sh /opt/envbuild-setup/lock/deepspeed.txt cpu_adam fused_adam"]}),
    "finish": (
        "# the guard pins what was compiled against; the build-only packages leave; pip check\n"
        "COPY envbuild/steps/finish.sh envbuild/steps/pip_check.py envbuild/steps/requires.py /opt/envbuild-setup/\n"
        "RUN ENVBUILD_CONSTRAINTS=/etc/pip/constraint.txt \\\n"
        "    ENVBUILD_GUARD_PACKAGES='torch|torchvision|triton|deepspeed|nvidia-[a-z0-9._-]+|cuda-[a-z0-9._-]+' \\\n"
        "    ENVBUILD_DS_BUILD_ONLY=ninja \\\n"
        "    bash /opt/envbuild-setup/finish.sh",
        {"files": ["envbuild/steps/finish.sh /opt/envbuild-setup/finish.sh",
                   "envbuild/steps/pip_check.py /opt/envbuild-setup/pip_check.py",
                   "envbuild/steps/requires.py /opt/envbuild-setup/requires.py"],
         "post": ["# the guard pins what was compiled against; the build-only packages leave; pip check",
                  "ENVBUILD_CONSTRAINTS=/etc/pip/constraint.txt "
                  "ENVBUILD_GUARD_PACKAGES='torch|torchvision|triton|deepspeed|nvidia-[a-z0-9._-]+|cuda-[a-z0-9._-]+' "
                  "ENVBUILD_DS_BUILD_ONLY=ninja bash /opt/envbuild-setup/finish.sh"]}),
    "layers": (
        "# the CUDA wheels' libraries out of the venv into layers of their own (parallel pulls; shared by stacks "
        "with the same CUDA wheels)\n"
        "COPY envbuild/steps/layers.sh /opt/envbuild-setup/layers.sh\n"
        "RUN bash /opt/envbuild-setup/layers.sh /opt/venv /opt/envbuild-layers "
        "'cuda=cu1[0-9],cublas,cuda_*,cufft,cufile,curand,cusolver,cusparse,nvjitlink,nvtx' cudnn=cudnn nccl=nccl,nvshmem 'other=*'",
        {"files": ["envbuild/steps/layers.sh /opt/envbuild-setup/layers.sh"],
         "post": ["# the CUDA wheels' libraries out of the venv into layers of their own (parallel pulls; shared "
                  "by stacks with the same CUDA wheels)",
                  "bash /opt/envbuild-setup/layers.sh /opt/venv /opt/envbuild-layers "
                  "'cuda=cu1[0-9],cublas,cuda_*,cufft,cufile,curand,cusolver,cusparse,nvjitlink,nvtx' cudnn=cudnn nccl=nccl,nvshmem 'other=*'"]}),
}


@pytest.fixture(scope="module")
def ci_plan(matrix):
    return stack_plan(resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi",
                                              ds_ops="cpu_adam,fused_adam")))


@pytest.mark.parametrize("fmt", ["docker", "apptainer"])
@pytest.mark.parametrize("name", list(STEPS))
def test_each_step_renders_exactly(ci_plan, name, fmt):
    step = next(s for s in ci_plan.builder.steps if s.name == name)
    assert step.render(fmt) == STEPS[name][0 if fmt == "docker" else 1]


def test_steps_are_in_build_order(ci_plan):
    assert [s.name for s in ci_plan.builder.steps] == list(STEPS)


BLOCKS = [
    (Copy((FileCopy("manifest.json", "/opt/envbuild/manifest.json"),)),
     "COPY manifest.json /opt/envbuild/manifest.json",
     {"files": ["manifest.json /opt/envbuild/manifest.json"]}),
    (Copy((FileCopy("envbuild/a.sh", "/opt/x/a.sh"), FileCopy("envbuild/b.sh", "/opt/x/b.sh"))),
     "COPY envbuild/a.sh envbuild/b.sh /opt/x/",
     {"files": ["envbuild/a.sh /opt/x/a.sh", "envbuild/b.sh /opt/x/b.sh"]}),
    (Environment((EnvVar("NCCL_DEBUG", "WARN", "", "", "gpu"),
                  EnvVar("PATH", "/opt/venv/bin:/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                                 "/usr/bin:/sbin:/bin", "", "", "base"))),
     'ENV NCCL_DEBUG="WARN" \\\n    PATH="/opt/venv/bin:/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:'
     '/usr/sbin:/usr/bin:/sbin:/bin"',
     {"environment": ['NCCL_DEBUG="${NCCL_DEBUG:-WARN}"', "export NCCL_DEBUG",
                      'PATH="/opt/venv/bin:${PATH:-/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:'
                      '/usr/bin:/sbin:/bin}"', "export PATH"]}),
    (Environment((EnvVar("GREETING", "grüß dich", "", "", "gpu"),)),
     'ENV GREETING="grüß dich"',  # UTF-8 as it is, not \\u escapes
     {"environment": ['GREETING="${GREETING:-grüß dich}"', "export GREETING"]}),
    (Label((("io.envbuild.gpu", "h20"), ("io.envbuild.stack", "s1"))),
     'LABEL io.envbuild.gpu="h20" \\\n      io.envbuild.stack="s1"',
     {"labels": ["io.envbuild.gpu h20", "io.envbuild.stack s1"]}),
]


@pytest.mark.parametrize("fmt", ["docker", "apptainer"])
@pytest.mark.parametrize("block, docker, apptainer", BLOCKS, ids=["copy-one", "copy-dir", "env", "env-utf8", "label"])
def test_each_block_renders_exactly(block, docker, apptainer, fmt):
    assert block.render(fmt) == (docker if fmt == "docker" else apptainer)


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="unknown output format 'bake'"):
        Copy(()).render("bake")


def test_keep_toolchain_is_one_property_of_the_runtime_stage(matrix):
    """--keep-toolchain derives the runtime from the builder: Docker reuses the stage, and
    Apptainer (which cannot) re-runs the builder's OS step and copies its products."""
    plan = stack_plan(resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", keep_toolchain=True)))
    assert plan.runtime.reuses_builder and plan.runtime.render("docker") == "FROM builder AS runtime"
    final = plan.runtime.render("apptainer")
    assert final["from_builder"] == ["/opt/envbuild-layers /opt/envbuild-layers", "/opt/venv /opt/venv",
                                     "/opt/envbuild-setup /opt/envbuild-setup",
                                     "/etc/pip/constraint.txt /etc/pip/constraint.txt", "/opt/cuda-pypi /opt/cuda-pypi"]
    assert final["post"][-1] == "rm -rf /opt/envbuild-setup"
    assert plan.runtime.steps[0].args == plan.builder.steps[0].args  # the compilers come back
    lean = stack_plan(resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi")))
    assert not lean.runtime.reuses_builder and "python3.11-venv" not in lean.runtime.steps[0].args  # no builder OS step


def test_the_runtime_carries_a_c_compiler_for_torch_compile_unless_told_not_to(matrix):
    """torch.compile compiles C at run time (Triton's launcher, Inductor's CPU code); the
    final image has g++ and Python's headers, but never nvcc or ninja."""
    plan = stack_plan(resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi")))
    assert plan.runtime.steps[0].args == ("ca-certificates", "python3.11", "g++", "python3.11-dev")
    assert plan.manifest["runtime_compiler"] is True
    bare = stack_plan(resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", no_compiler=True)))
    assert bare.runtime.steps[0].args == ("ca-certificates", "python3.11")
    assert bare.manifest["runtime_compiler"] is False and bare.tag.endswith("-nocc")


def test_a_stack_without_a_lock_installs_its_pins_and_says_it_is_not_hash_locked(matrix):
    """The fixture's cu126 stack needs PyTorch's own index, which `envbuild lock` could not
    reach here: it has no lock, so its steps install the row's pins and say so."""
    plan = stack_plan(resolve(matrix, Request(gpu="v100", stack="torch2.11-cu126-py3.12", ds_ops="cpu_adam")))
    assert plan.lock is None and plan.generated_files == {}
    steps = {s.name: s.render("docker") for s in plan.builder.steps}
    assert steps["torch"].endswith("bash /opt/envbuild-setup/torch.sh https://download.pytorch.org/whl/cu126 "
                                   "torch==2.11.0 torchvision==0.26.0")
    assert "NOT hash-locked" in steps["torch"]
    assert f"ENVBUILD_DS_BUILD_REQUIRES={DS_REQUIRES}" in steps["deepspeed"]
    assert steps["deepspeed"].endswith("bash /opt/envbuild-setup/deepspeed.sh deepspeed==0.19.8 cpu_adam")
    assert dict(plan.labels.pairs)["io.envbuild.lock"] == "none" and plan.manifest["lock"] is None


def test_a_locked_stack_ships_its_lock_and_names_its_digest(ci_plan):
    lock = ci_plan.lock
    assert ci_plan.generated_files["envbuild/lock.txt"] == lock.text
    assert "deepspeed==" not in ci_plan.generated_files["envbuild/lock/venv.txt"]
    assert ci_plan.generated_files["envbuild/lock/deepspeed.txt"].startswith("deepspeed==0.19.8 \\\n    --hash=sha256:")
    assert FileCopy("envbuild/lock.txt", "/opt/envbuild/lock.txt") in ci_plan.image_files.files
    assert dict(ci_plan.labels.pairs)["io.envbuild.lock"] == f"sha256:{lock.sha256}"
    assert ci_plan.manifest["lock"]["sha256"] == lock.sha256 and ci_plan.manifest["lock"]["dropped"] == ["ninja"]
    assert ci_plan.manifest["dropped_requirements"][0]["package"] == "ninja"


def test_the_manifest_follows_its_schema_and_the_labels_are_derived_from_it(ci_plan, matrix):
    """One declaration (plan/schema.py) gives the manifest's keys in order, the io.envbuild.*
    labels and docs/manifest.md: a label can no longer drift from the key it shows."""
    from envbuild.plan import schema

    assert list(ci_plan.manifest) == [k.name for k in schema.MANIFEST if not k.optional]  # nccl_override: --nccl only
    ours = [(k, v) for k, v in ci_plan.labels.pairs if k.startswith(schema.LABEL_PREFIX)]
    assert ours == schema.labels(ci_plan.manifest)
    shown = dict(ours)
    m = ci_plan.manifest
    assert shown["io.envbuild.ds-ops"] == ",".join(m["ds_ops"])
    assert shown["io.envbuild.min-driver"] == m["driver"]["min_driver"]
    assert shown["io.envbuild.lock"] == f"sha256:{m['lock']['sha256']}"
    assert "io.envbuild.extensions" not in shown  # no extension: no label
    ext = stack_plan(resolve(matrix, Request(gpu="h100", extensions=("causal-conv1d",))))
    assert dict(ext.labels.pairs)["io.envbuild.extensions"] == "causal-conv1d==" + ext.manifest["extensions"][0]["version"]
    with pytest.raises(AssertionError, match="differ from the schema"):
        schema.ordered({**ci_plan.manifest, "undeclared": 1})


def test_a_kept_builder_drops_its_base_images_own_nccl(matrix):
    """--keep-toolchain: the final image is the builder, whose nvidia/cuda base carries libnccl2
    beside the nvidia-nccl wheel; both stages' steps purge it (Apptainer starts from the base
    again), a lean image has no such step."""
    kept = stack_plan(resolve(matrix, Request(gpu="h20", keep_toolchain=True)))
    assert [s.args for s in kept.builder.steps if s.name == "os-drop"] == [("libnccl2", "libnccl-dev")]
    assert [s.name for s in kept.runtime.steps] == ["os", "os-drop"]
    lean = stack_plan(resolve(matrix, Request(gpu="h20")))
    assert not [s for s in (*lean.builder.steps, *lean.runtime.steps) if s.name == "os-drop"]


def test_the_curand_ops_take_the_locks_curand_section_link_it_and_find_it_at_run_time(matrix_copy):
    """The ops that link -lcurand, on the PyPI toolchain: the torch step installs the lock's
    [curand] section into the venv with the rest (hash-locked), the toolchain step links its
    library under the name -lcurand finds, and DeepSpeed's link records the venv's CUDA library
    directory as the ops' RUNPATH (torch 2.15 loads no libcurand, so nothing else would find it).
    An image without those ops has none of it."""
    from test_rules import CURAND_OPS, with_curand_section

    from envbuild.knowledge.matrix import load_matrix

    m = load_matrix(with_curand_section(matrix_copy))
    plan = stack_plan(resolve(m, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops=",".join(CURAND_OPS))))
    venv = plan.generated_files["envbuild/lock/venv.txt"]
    assert venv.endswith(plan.lock.requirements("curand")) and venv.count("nvidia-curand==") == 1
    steps = {s.name: s.render("docker") for s in plan.builder.steps}
    assert "ENVBUILD_TOOLCHAIN_ADDS=libcurand" in steps["cuda-toolkit"]
    assert "LDFLAGS=-Wl,-rpath,/opt/venv/lib/python3.11/site-packages/nvidia/cu13/lib" in steps["deepspeed"]
    assert "with its [curand] section" in steps["torch"]
    assert plan.manifest["lock"]["sections"] == ["venv", "curand"]  # what the smoke test's lock check reads
    assert plan.manifest["lock"]["packages"] == len(plan.lock.sections["venv"]) + 1
    plain = stack_plan(resolve(m, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam,fused_adam")))
    assert "curand" not in plain.generated_files["envbuild/lock/venv.txt"]
    assert plain.manifest["lock"]["sections"] == ["venv"]
    assert not any("TOOLCHAIN_ADDS" in s.render("docker") or "LDFLAGS" in s.render("docker") for s in plain.builder.steps)


def test_the_smoke_tests_lock_check_takes_the_sections_the_venv_installed(tmp_path):
    """An image with cuRAND ops holds nvidia-curand from the lock's [curand] section: the venv is
    exactly [venv] plus the sections the manifest names; one the manifest does not name is extra."""
    from envbuild.image import checks

    lock = tmp_path / "lock.txt"
    lock.write_text("# [venv]\ntorch==2.15.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"
                    "# [toolchain]\nnvidia-cuda-nvcc==13.2.78 \\\n    --hash=sha256:" + "1" * 64 + "\n"
                    "# [curand]\nnvidia-curand==10.4.2.66 \\\n    --hash=sha256:" + "2" * 64 + "\n")
    venv = {"torch": "2.15.0", "nvidia-curand": "10.4.2.66"}
    ok, msg = checks.check_lock({"lock": {"path": str(lock), "sections": ["venv", "curand"]}}, venv)
    assert ok, msg
    ok, msg = checks.check_lock({"lock": {"path": str(lock)}}, venv)  # a manifest from before sections: [venv]
    assert not ok and msg == "not in the lock nvidia-curand==10.4.2.66"
    ok, msg = checks.check_lock({"lock": {"path": str(lock), "sections": ["venv", "curand"]}}, {"torch": "2.15.0"})
    assert not ok and msg == "missing nvidia-curand==10.4.2.66"


# ---------------------------------------------------------------- installs (issue 41): uv, cache mounts

def _ci_files(matrix, **request) -> dict[str, str]:
    files = render_files(resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi", ds_ops="cpu_adam,fused_adam",
                                                **request)))
    return {name: data.decode() if isinstance(data, bytes) else data for name, data in files.items()}


def _runs(dockerfile: str) -> list[str]:
    """Each RUN instruction with its continuation lines joined."""
    joined = dockerfile.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.startswith("RUN ")]


def test_every_lock_part_installs_with_the_matrixs_uv_by_hash_from_a_cache_mount(matrix):
    """The venv's and the toolchain's lock parts go through uv (ENVBUILD_UV: torch.sh and
    cuda-toolkit.sh run `uv pip install`) with --require-hashes --no-deps and pip's and uv's cache
    mount; uv itself comes by its hashes from the matrix's pin (lock/uv.txt), before them; every
    apt step mounts apt's cache."""
    files = _ci_files(matrix)
    pin = matrix.bases.installer
    assert files["envbuild/lock/uv.txt"] == pin.requirement + "\n" and pin.requirement.count("--hash=sha256:") >= 2
    runs = _runs(files["Dockerfile"])
    cache = {"py": "--mount=type=cache,id=envbuild-py,target=/var/cache/envbuild-py,sharing=locked",
             "apt": "--mount=type=cache,id=envbuild-apt,target=/var/cache/envbuild-apt,sharing=locked"}
    uv = [i for i, r in enumerate(runs) if "/uv.sh /opt/envbuild-uv /opt/envbuild-setup/lock/uv.txt" in r]
    installs = [i for i, r in enumerate(runs) if "/torch.sh " in r or "/cuda-toolkit.sh " in r]
    assert len(uv) == 1 and len(installs) == 2 and uv[0] < min(installs)
    for i in uv + installs:
        assert cache["py"] in runs[i]
    for i in installs:
        assert "ENVBUILD_UV=/opt/envbuild-uv/bin/uv" in runs[i] and "--require-hashes --no-deps -r" in runs[i]
    apt = [r for r in runs if "/os.sh " in r]
    assert len(apt) == 3 and all(cache["apt"] in r for r in apt)  # builder, runtime, the fabric's runtime packages
    steps = ROOT / "templates" / "files" / "steps"
    for script in ("torch.sh", "cuda-toolkit.sh"):
        assert 'uv_pip install --python "$(venv_dir)/bin/python"' in (steps / script).read_text()
    assert '"${ENVBUILD_UV:?' in (steps / "lib.sh").read_text() and 'pip "$subcommand" --no-config' in (steps / "lib.sh").read_text()


def test_nothing_of_a_cache_mount_reaches_the_final_image(matrix):
    """Every cache mount's target lies outside what the final image takes from the builder and
    outside every COPY, in each kind of render (a kept toolchain's final stage is the builder:
    a cache mount never reaches a layer, but its target must not be a directory the image keeps);
    and the targets are the directories lib.sh uses only where they are mounted."""
    from envbuild.plan.blocks import APT_CACHE, PY_CACHE

    lib = (ROOT / "templates" / "files" / "steps" / "lib.sh").read_text()
    assert f"APT_CACHE={APT_CACHE[1]}\n" in lib and f"PY_CACHE={PY_CACHE[1]}\n" in lib
    for request in ({}, {"keep_toolchain": True}, {"fabric": "aws-efa"}):
        plan = stack_plan(resolve(matrix, Request(gpu="h20", stack="torch2.11-cu130-py3.11-pypi",
                                                  ds_ops="cpu_adam,fused_adam", **request)))
        steps = (*plan.builder.steps, *plan.runtime.steps, *plan.runtime.after_copy)
        targets = {t for s in steps for _, t in s.caches}
        assert {APT_CACHE[1], PY_CACHE[1]} <= targets, request
        kept = [*plan.runtime.from_builder, *(f.target for s in steps for f in s.files)]
        copied = [line.split()[-2] for line in _ci_files(matrix, **request)["Dockerfile"].splitlines()
                  if line.startswith("COPY ")]
        for target in targets:
            for path in (*kept, *copied):
                assert not (path + "/").startswith(target + "/") and not (target + "/").startswith(path.rstrip("/") + "/"), \
                    (request, target, path)


def test_pip_check_runs_after_the_uv_installs(matrix):
    """The finish step (pip check, the guard) still runs after every install, uv's included."""
    runs = _runs(_ci_files(matrix)["Dockerfile"])
    order = [next(i for i, r in enumerate(runs) if f"/{name}.sh" in r) for name in ("uv", "torch", "cuda-toolkit", "finish")]
    assert order == sorted(order)
    assert '"$venv/bin/python" "$STEPS_DIR/pip_check.py"' in (ROOT / "templates" / "files" / "steps" / "finish.sh").read_text()


def test_the_apptainer_definition_installs_the_lock_with_uv_by_hash_without_cache_mounts(matrix):
    """Apptainer cannot mount caches: the definition installs uv and the lock parts the same way,
    every hash checked, and downloads as before (lib.sh uses a cache only where one is mounted)."""
    files = _ci_files(matrix)
    text = files["Singularity.standalone.def"]
    assert "envbuild/lock/uv.txt /opt/envbuild-setup/lock/uv.txt" in text
    assert "bash /opt/envbuild-setup/uv.sh /opt/envbuild-uv /opt/envbuild-setup/lock/uv.txt" in text
    assert ("ENVBUILD_UV=/opt/envbuild-uv/bin/uv bash /opt/envbuild-setup/torch.sh - --require-hashes --no-deps "
            "-r /opt/envbuild-setup/lock/venv.txt") in text
    assert "--mount" not in text and "/opt/envbuild-uv" not in text.split("Stage: final", 1)[1].split("%post", 1)[0]


def test_a_matrix_without_an_installer_installs_with_pip(matrix_copy):
    """A lab's matrix from before the installer pin still renders, installing with pip as before."""
    import re

    from envbuild.knowledge.matrix import load_matrix

    bases = matrix_copy / "bases.yaml"
    bases.write_text(re.sub(r"\ninstaller:\n(  .*\n)+", "\n", bases.read_text()))
    files = _ci_files(load_matrix(matrix_copy))
    assert "uv.sh" not in files["Dockerfile"] and "ENVBUILD_UV" not in files["Dockerfile"]
    assert "envbuild/lock/uv.txt" not in files
    assert "bash /opt/envbuild-setup/torch.sh - --require-hashes --no-deps" in files["Dockerfile"]
