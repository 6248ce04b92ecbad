#!/usr/bin/env bash
# nccl.sh PACKAGE PINNED INSTALLED: after the torch step installed the --nccl release INSTALLED of
# torch's NCCL wheel PACKAGE (the lock's [nccl] section) in place of the PINNED one torch's
# Requires-Dist names. Torch's requirement follows the release installed (manifest.json's
# nccl_override records it), so pip check and a user's `pip install` that resolves torch's
# requirements see the image as built instead of a conflict with the guard (PIP_CONSTRAINT).
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$(venv_dir)/bin/python" "$STEPS_DIR/requires.py" move torch "$@"
log "torch's Requires-Dist of $1 moved from ==$2 to ==$3, the release installed (--nccl)"
