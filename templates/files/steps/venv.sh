#!/usr/bin/env bash
# venv.sh PYTHON: the stack's virtual environment at $VIRTUAL_ENV.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$1" -m venv "$(venv_dir)"
