#!/usr/bin/env bash
# nccl.sh PACKAGE PINNED INSTALLED: after the torch step installed the --nccl release INSTALLED of
# torch's NCCL wheel PACKAGE (the lock's [nccl] section) in place of the PINNED one torch's
# Requires-Dist names. Torch's requirement follows the release installed (manifest.json's
# nccl_override records it), so pip check and a user's `pip install` that resolves torch's
# requirements see the image as built instead of a conflict with the guard (PIP_CONSTRAINT).
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$(venv_dir)/bin/python" - "$@" <<'PY'
import pathlib, re, sys
from importlib import metadata
package, pinned, installed = sys.argv[1:4]
have = metadata.version(package)
if have != installed:
    sys.exit(f"envbuild: --nccl {installed}: the venv has {package} {have}")
dist = metadata.distribution("torch")
meta = next(pathlib.Path(f.locate()) for f in dist.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
pattern = re.compile(rf"^(Requires-Dist: *{re.escape(package)} *\(?==){re.escape(pinned)}(?![\w.])", re.I | re.M)
text, count = pattern.subn(rf"\g<1>{installed}", meta.read_text())
if count == 0:
    sys.exit(f"envbuild: --nccl {installed}: torch's METADATA has no Requires-Dist {package}=={pinned} to move")
meta.write_text(text)
PY
log "torch's Requires-Dist of $1 moved from ==$2 to ==$3, the release installed (--nccl)"
