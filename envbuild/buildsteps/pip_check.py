"""pip_check.py: `pip check` of this interpreter's environment, failing the build on any
problem but one upstream metadata defect, which it names instead.

NVIDIA's aarch64 wheels of nvidia-cusparselt-cu13 0.8.1 (file
nvidia_cusparselt_cu13-0.8.1-py3-none-manylinux2014_aarch64.whl on PyPI) say
"Tag: py3-none-manylinux2014_sbsa" in their WHEEL file: "sbsa" is NVIDIA's name for Arm servers,
not a Python platform tag, so pip check calls the installed wheel "not supported on this
platform" on every aarch64 machine. Such a line is accepted only when every platform tag of
the wheel names this machine through that alias; the wheel itself was chosen by its file name
and installed by hash from the lock. Stdlib only: runs in the image.
"""

import platform
import re
import subprocess
import sys
from importlib import metadata

# Architecture names in WHEEL tags that are not Python's, and the machine each one means.
ARCH_ALIASES = {"sbsa": "aarch64"}
UNSUPPORTED = re.compile(r"^(?P<name>\S+) (?P<version>\S+) is not supported on this platform$")


def wheel_tags(name):
    """The Tag lines of an installed distribution's WHEEL file ([] if it has none)."""
    text = metadata.distribution(name).read_text("WHEEL") or ""
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")]


def misnamed_platform(tags, machine):
    """Whether every platform tag names `machine` only through an alias of ARCH_ALIASES.

    >>> misnamed_platform(["py3-none-manylinux2014_sbsa"], "aarch64")
    True
    >>> misnamed_platform(["py3-none-manylinux2014_sbsa"], "x86_64")
    False
    >>> misnamed_platform(["py3-none-manylinux2014_x86_64"], "aarch64")
    False
    >>> misnamed_platform([], "aarch64")
    False
    """
    platforms = [tag.rsplit("-", 1)[-1] for tag in tags]
    return bool(platforms) and all(
        any(plat.endswith("_" + alias) and meant == machine for alias, meant in ARCH_ALIASES.items())
        for plat in platforms)


def sort_lines(output, machine, tags_of=wheel_tags):
    """pip check's lines split into (problems, tolerated), each tolerated one with why."""
    problems, tolerated = [], []
    for line in output.splitlines():
        found = UNSUPPORTED.match(line.strip())
        try:
            tags = tags_of(found["name"]) if found else []
        except metadata.PackageNotFoundError:
            tags = []
        if found and misnamed_platform(tags, machine):
            tolerated.append(f"{found['name']} {found['version']}: its WHEEL says {', '.join(tags)} "
                             f"(NVIDIA's name for {machine}); the file installed is the {machine} wheel "
                             f"pinned by hash, so pip's 'not supported on this platform' is a metadata defect")
        elif line.strip() and line.strip() != "No broken requirements found.":
            problems.append(line.strip())
    return problems, tolerated


def main():
    run = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    sys.stderr.write(run.stderr)
    problems, tolerated = sort_lines(run.stdout, platform.machine())
    for why in tolerated:
        print(f"envbuild: pip check: tolerated {why}")
    if run.returncode != 0 and (problems or not tolerated):
        print(run.stdout, end="")
        return 1
    if tolerated:
        print(f"envbuild: pip check: nothing else ({len(tolerated)} tolerated)")
    else:
        print(run.stdout, end="")  # pip's own "No broken requirements found."
    return 0


if __name__ == "__main__":
    sys.exit(main())
