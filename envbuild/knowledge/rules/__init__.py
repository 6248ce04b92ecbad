"""Every compatibility rule, in one place: this index, one module per family.

Rules read the matrix data (torch.yaml, deepspeed.yaml, gpus.yaml, bases.yaml) and answer
with :class:`Rejection` objects, never booleans, so ``--explain`` and error messages can
say which rule rejected what and why. The rule names are stable strings users see, here by
the family module that makes them:

:mod:`.stacks`: a stack row on its own (checked when the matrix loads), and the request

- ``torch-cuda``      the torch release has a wheel for that CUDA
- ``torch-python``    the torch release has wheels for that Python
- ``deepspeed-torch`` the DeepSpeed release accepts that torch
- ``deepspeed-no-gpu`` the DeepSpeed release installs on a builder without a GPU
- ``os-python``       the base OS family ships that Python
- ``toolchain``       the builder's nvcc matches torch's CUDA (and torch's cuda-toolkit pin)
- ``request``         the stack matches the versions the user asked for

:mod:`.gpus`: can a stack serve a GPU

- ``gpu-host-arch``   PyPI has CUDA torch wheels for a CPU architecture the GPU's nodes have (Grace: aarch64)
- ``gpu-floor``       the GPU's own torch/CUDA floor (Blackwell: torch >= 2.7, CUDA >= 12.8)
- ``gpu-arch``        the torch build carries code for the GPU's compute capability
- ``gpu-jit-arch``    torch's cpp_extension accepts the GPU's arch (needed to pre-build ops)

:mod:`.deepspeed_ops` and :mod:`.cpu_targets`: what the builder compiles for DeepSpeed

- ``ds-op``           a DeepSpeed op can be pre-built for this stack, GPU and CPU architecture
- ``cpu-target``      the CPU target of the host-compiled ops fits the image's architecture and GCC

:mod:`.fabrics` and :mod:`.nccl`: the interconnect

- ``fabric-os``       the base OS release has the packages the fabric needs (bases.yaml capabilities)
- ``fabric-arch``     the fabric exists for the image's CPU architecture
- ``fabric-nccl``     the fabric's NCCL plugin (or host NCCL) works with the NCCL torch bundles
- ``fabric-gpu``      a cloud's fabric profile is for its VM sizes' GPUs only (azure-ndv5: H100)
- ``nccl``            a --nccl release may replace the NCCL torch pins: the same CUDA major as the stack's
                      NCCL wheel family, NCCL 2 (the libnccl.so.2 ABI torch links), not older than torch's
                      pin, a wheel on PyPI for the image's CPU, glibc and Python, and the fabric's NCCL range

:mod:`.extensions`: CUDA extensions (extensions.yaml)

- ``ext-gpu``         a CUDA extension's kernels support the GPU's compute capability (flash-attn 2: sm_80+)
- ``ext-stack``       a CUDA extension's source builds against the stack's torch, CUDA and Python
- ``ext-arch``        a CUDA extension has been built for the image's CPU architecture
- ``ext-deps``        a CUDA extension's runtime requirements are in the stack's lock (nothing unlocked sneaks in)
- ``ext-audit``       an extension with device code of its own is on a toolchain with NVIDIA's cuobjdump, so its SASS can be audited
- ``ext-conflict``    two extensions that cannot share an image (files one overwrites, disjoint pins of one dependency) are refused together
- ``ext-nvcc``        a source build for a GPU its setup.py emits code for only from a newer nvcc (sm_100/sm_120 from 12.8) is refused
- ``ext-glibc``       the stack's base image has the glibc the extension's closure has wheels for (mamba-ssm on aarch64: 2.34)
- ``ext-source``    a CUDA extension has a source that builds, fetched by a recorded sha256 (its PyPI sdist, or GitHub archives pinned by their tar streams' sha256: FA3)
- ``ext-wheel``     a wheel-only extension has a PyPI wheel for the stack's CPU, CUDA major, torch and Python
- ``ext-needs``     an extension that needs another (mamba-ssm: causal-conv1d) is requested with it
- ``ext-not-prebuilt`` a package that compiles against torch and CUDA at pip install, and that envbuild does not pre-build, is refused by name

Rules that refuse the request itself, before or after a stack is chosen (an error naming the
rule, not a Rejection): ``torch-python`` and ``os-python`` for a --python no stack could have,
``cpu-target`` for a target the matrix does not know (both :func:`check_request`), ``nccl`` for
a --nccl release the chosen stack does not accept (:func:`select_nccl`), ``base-os`` (a
--base-image or --builder-image must be the stack's distro release) and ``base-cuda`` (a named
CUDA image must be the stack's CUDA, and a devel one where the builder needs nvcc),
``base-pinned`` (a base image names a release tag or a digest: no tag means the tag latest,
which moves; all three :func:`check_base_images` in :mod:`.bases`), ``qemu`` (--qemu only for
an arm64 image, where it does something: :func:`check_emulation`).

The families share :mod:`.rejection` (the answer) and :mod:`.versions` (version arithmetic)
and import no sibling but one: the request-wide check in :mod:`.stacks` names the CPU targets
of :mod:`.cpu_targets` (the layers contract in pyproject.toml holds it).
"""

from envbuild.knowledge.rules.bases import (
    DEBIAN_CODENAMES,
    OTHER_DISTROS,
    UBUNTU_CODENAMES,
    check_apt_mirror,
    check_base_images,
    image_release,
    unpinned,
)
from envbuild.knowledge.rules.cpu_targets import (
    DEFAULT_CPU_TARGET,
    PLATFORMS,
    cpu_target_rejection,
    default_cpu_target_rejection,
)
from envbuild.knowledge.rules.deepspeed_ops import DEFAULT_OPS, capabilities, nvcc_required, op_rejection, select_ops
from envbuild.knowledge.rules.extensions import (
    check_extensions,
    extension_gpu_rejection,
    extension_gpus,
    extension_needs,
    extension_not_prebuilt,
    extension_patches,
    extension_rejections,
    extension_requirements,
    extension_wheel,
    glibc_rejection,
    requirement_name,
)
from envbuild.knowledge.rules.fabrics import fabric_rejections
from envbuild.knowledge.rules.gpus import arch_runs_on, check_emulation, gpu_rejections, image_arch
from envbuild.knowledge.rules.nccl import accepted_nccl, nccl_rejection, nccl_unusable, nccl_wheels, select_nccl
from envbuild.knowledge.rules.rejection import Rejection
from envbuild.knowledge.rules.stacks import PYTHONS, check_request, request_rejections, stack_rejections
from envbuild.knowledge.rules.versions import (
    compute_capability,
    contains,
    lowest_pinned_version,
    mm,
    pin_overlaps,
    user_specifier,
)

__all__ = [
    # rejection, versions: what every family shares
    "Rejection",
    "compute_capability", "contains", "lowest_pinned_version", "mm", "pin_overlaps", "user_specifier",
    # stacks: a stack row on its own, against the request, and the request as a whole
    "PYTHONS", "check_request", "request_rejections", "stack_rejections",
    # gpus: can a stack serve a GPU (arch_runs_on: the gpu-arch rule, defined once in envbuild/image/arch.py)
    "arch_runs_on", "check_emulation", "gpu_rejections", "image_arch",
    # cpu_targets: the CPU an image is for
    "DEFAULT_CPU_TARGET", "PLATFORMS", "cpu_target_rejection", "default_cpu_target_rejection",
    # deepspeed_ops: the ops the builder pre-builds
    "DEFAULT_OPS", "capabilities", "nvcc_required", "op_rejection", "select_ops",
    # extensions: CUDA extensions
    "check_extensions", "extension_gpu_rejection", "extension_gpus", "extension_needs", "extension_not_prebuilt",
    "extension_patches", "extension_rejections", "extension_requirements", "extension_wheel", "glibc_rejection",
    "requirement_name",
    # bases: the base images and the archive their packages come from
    "DEBIAN_CODENAMES", "OTHER_DISTROS", "UBUNTU_CODENAMES", "check_apt_mirror", "check_base_images",
    "image_release", "unpinned",
    # fabrics, nccl: the interconnect
    "fabric_rejections",
    "accepted_nccl", "nccl_rejection", "nccl_unusable", "nccl_wheels", "select_nccl",
]
