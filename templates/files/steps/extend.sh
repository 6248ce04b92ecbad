#!/usr/bin/env bash
# extend.sh LOCK MANIFEST NAME...: a user's packages on top of a stack image, from their
# layer lock (every hash checked; the image's PIP_CONSTRAINT guard still applies), then
# pip check and an import of each top-level package NAME, recorded in MANIFEST.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
lock=$1 manifest=$2; shift 2
"$(venv_dir)/bin/pip" install --require-hashes --no-deps -r "$lock" || lock_failed --require-hashes
"$(venv_dir)/bin/python" "$STEPS_DIR/pip_check.py"
"$(venv_dir)/bin/python" "$STEPS_DIR/import_check.py" "$manifest" "$@"
