"""The build stage's Python: the scripts the image's RUN steps call (steps/extensions.sh runs
extensions.py, deepspeed.sh runs verify_ops.py and sass_audit.py, finish.sh and extend.sh run
pip_check.py, finish.sh and nccl.sh run requires.py, extend.sh runs import_check.py). Standard library only, under the import
contracts like the in-image package: they run in the builder with its Python, before and
without envbuild. Each is copied flat into the image's setup directory beside the bash steps
(templates/files/steps) and run as a script, so they import each other as top-level modules;
pytest does not collect them (verify_ops runs at import), tests load them by path."""

from pathlib import Path

SCRIPTS = ("extensions.py", "sass_audit.py", "import_check.py", "pip_check.py", "requires.py", "verify_ops.py")


def path(name: str) -> Path:
    """Where a build-stage script is in this installation."""
    return Path(__file__).parent / name
