"""requires.py: one installed distribution's Requires-Dist, kept true to what the image installs.

    requires.py drop DIST NAME                        DIST no longer requires NAME
    requires.py move DIST PACKAGE PINNED INSTALLED    DIST's PACKAGE==PINNED becomes ==INSTALLED

finish.sh drops DeepSpeed's requirement of ninja, which the final image leaves out so nothing can
JIT-compile (manifest.json's dropped_requirements); nccl.sh moves torch's pin of its NCCL wheel to
the --nccl release installed (nccl_override). `pip check`, and a user's `pip install` that
resolves the requirements again, then see the image as built. Stdlib only: runs in the builder.
"""

import pathlib
import re
import sys
from importlib import metadata


def metadata_file(dist):
    """The METADATA file of the installed distribution `dist`."""
    files = metadata.distribution(dist).files or []
    return next(pathlib.Path(f.locate()) for f in files
                if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))


def dropped(text, name):
    """METADATA `text` without its Requires-Dist lines of `name` (any case, any marker); a
    package whose name only starts with `name` stays.

    >>> dropped("Requires-Dist: ninja\\nRequires-Dist: ninja-build\\nRequires-Dist: Ninja ; extra == 'x'\\n", "ninja")
    'Requires-Dist: ninja-build\\n'
    """
    pattern = re.compile(rf"Requires-Dist: *{re.escape(name)}\b(?![-_.\w])", re.I)
    return "".join(line for line in text.splitlines(keepends=True) if not pattern.match(line))


def moved(text, package, pinned, installed):
    """METADATA `text` with its `package==pinned` requirement at `installed`, and how many moved.

    >>> moved("Requires-Dist: nvidia-nccl-cu13==2.27.7; platform_system == 'Linux'\\n", "nvidia-nccl-cu13",
    ...       "2.27.7", "2.28.9")
    ("Requires-Dist: nvidia-nccl-cu13==2.28.9; platform_system == 'Linux'\\n", 1)
    >>> moved("Requires-Dist: nvidia-nccl-cu13==2.27.70\\n", "nvidia-nccl-cu13", "2.27.7", "2.28.9")[1]
    0
    """
    pattern = re.compile(rf"^(Requires-Dist: *{re.escape(package)} *\(?==){re.escape(pinned)}(?![\w.])", re.I | re.M)
    return pattern.subn(rf"\g<1>{installed}", text)


def main(argv):
    if len(argv) == 3 and argv[0] == "drop":
        dist, name = argv[1:]
        meta = metadata_file(dist)
        meta.write_text(dropped(meta.read_text(), name))
        return 0
    if len(argv) == 5 and argv[0] == "move":
        dist, package, pinned, installed = argv[1:]
        have = metadata.version(package)
        if have != installed:
            sys.exit(f"envbuild: {dist}'s requirement of {package} cannot follow {installed}: the venv has {have}")
        meta = metadata_file(dist)
        text, count = moved(meta.read_text(), package, pinned, installed)
        if count == 0:
            sys.exit(f"envbuild: {dist}'s METADATA has no Requires-Dist {package}=={pinned} to move to {installed}")
        meta.write_text(text)
        return 0
    sys.exit("usage: requires.py drop DIST NAME | requires.py move DIST PACKAGE PINNED INSTALLED")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
