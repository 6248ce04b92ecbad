"""Code that runs inside the images: the smoke test and the node checks env.sh runs at start.

Standard library only at import time (torch and DeepSpeed are imported inside the checks that
need them), and relative imports only, so the one package works under two names: imported on
the host as ``envbuild.image`` (render, rules and tests use it) and copied into every image as
``/opt/envbuild/lib/envbuild_image`` (see :mod:`.paths`). Keep this file free of imports: env.sh
imports the package at every container start on GPU nodes.
"""


def modules() -> tuple[str, ...]:
    """The package's module files, sorted: what render copies into a build directory."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    return tuple(sorted(name for name in os.listdir(here) if name.endswith(".py")))


def module_bytes(name: str) -> bytes:
    """One module's source, as copied into the image."""
    import os

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), "rb") as handle:
        return handle.read()
