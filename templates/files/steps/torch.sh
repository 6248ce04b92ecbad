#!/usr/bin/env bash
# torch.sh INDEX|- SPEC...: torch and torchvision (INDEX: PyTorch's CUDA-variant index, or
# - for the PyPI default wheel); the torch_index_url secret replaces INDEX.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
index=$1; shift
override=$(secret torch_index_url)
if [[ -n $override ]]; then index=$override; fi
if [[ $index != "-" ]]; then
    "$(venv_dir)/bin/pip" install --index-url "$index" "$@"
else
    "$(venv_dir)/bin/pip" install "$@"
fi
