#!/usr/bin/env bash
# torch.sh INDEX|- PIP_ARG...: torch, torchvision and (from a lock: `--require-hashes
# --no-deps -r PART`) the whole venv but DeepSpeed. INDEX: PyTorch's CUDA-variant index,
# searched before PyPI, or - for the PyPI default wheel; the torch_index_url secret replaces it.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
index=$1; shift
override=$(secret torch_index_url)
if [[ -n $override ]]; then index=$override; fi
pip=("$(venv_dir)/bin/pip" install)
if [[ $index != "-" ]]; then
    pip+=(--index-url "$index" --extra-index-url "${PIP_INDEX_URL:-https://pypi.org/simple}")
fi
"${pip[@]}" "$@" || lock_failed "$@"
