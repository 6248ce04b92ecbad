"""Where envbuild puts things inside an image: the one list both sides read.

The host (render, `envbuild smoke`) and the in-image code (smoke test, node checks) import
these names; env.sh and entrypoint.sh are POSIX sh and spell the same paths out, and a test
keeps them equal to these.
"""

VENV = "/opt/venv"
VENV_PYTHON = VENV + "/bin/python"



def venv_cuda_lib(python: str, cuda_home: str) -> str:
    """Where NVIDIA's CUDA wheels in the venv put their libraries: site-packages/nvidia/<cu13>/lib,
    the directory the PyPI toolchain's CUDA_HOME is named after (nvidia/cu13)."""
    return f"{VENV}/lib/python{python}/site-packages/nvidia/{cuda_home.rstrip('/').rsplit('/', 1)[-1]}/lib"


HOME = "/opt/envbuild"
MANIFEST = HOME + "/manifest.json"
ENV_SH = HOME + "/env.sh"
ENTRYPOINT = HOME + "/entrypoint.sh"
SMOKE = HOME + "/smoke.py"

# The in-image package: this directory, copied as LIB/PACKAGE (run: python -m PACKAGE with LIB on sys.path).
LIB = HOME + "/lib"
PACKAGE = "envbuild_image"

# Build-time only: the build step scripts and the builder's helpers (removed from the final image).
SETUP_DIR = "/opt/envbuild-setup"

# The guard: pip/uv constraints pinning what the DeepSpeed ops were built against (NGC's path).
CONSTRAINTS = "/etc/pip/constraint.txt"

# The stack's lock (matrices/locks), beside the manifest: what the venv holds, with hashes.
LOCK = HOME + "/lock.txt"
OS_LOCK = HOME + "/os-lock.txt"  # every OS package the image installed, by version and .deb sha256
# An extended image's own packages (envbuild extend), locked against LOCK.
EXTEND_LOCK = HOME + "/extend-lock.txt"

# What the builder learned while building, copied into the final image: the CUDA extensions'
# wheels (name, version, sha256, cache key, SASS audit) and their hash-pinned lock lines.
BUILT = HOME + "/built"
EXTENSIONS_RECORD = BUILT + "/extensions.json"
EXTENSIONS_LOCK = BUILT + "/extensions-lock.txt"
# The builder's wheel cache for the CUDA extensions (a BuildKit cache mount: never in a layer).
EXTENSION_CACHE = "/var/cache/envbuild-ext"

# Environment variables the image reads.
MANIFEST_ENV = "ENVBUILD_MANIFEST"
MIN_DRIVER_ENV = "ENVBUILD_MIN_DRIVER"

# The system's own program directories; the image's directories (the venv first) go before them.
SYSTEM_PATH = "/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUNTIME_PATH = VENV + "/bin:" + SYSTEM_PATH

# The node's RDMA devices: the verbs character devices a container needs for NCCL's IB transport
# (docker run --device), and the kernel's list of RDMA devices (sysfs, visible in containers).
RDMA_DEVICES = "/dev/infiniband"
RDMA_SYSFS = "/sys/class/infiniband"
