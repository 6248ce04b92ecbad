#!/usr/bin/env bash
# torch.sh INDEX|- PIP_ARG...: torch, torchvision and (from a lock: `--require-hashes
# --no-deps -r PART`) the whole venv but DeepSpeed, with the matrix's uv where the plan names
# it (ENVBUILD_UV), else pip. INDEX: PyTorch's CUDA-variant index, searched before PyPI, or -
# for the PyPI default wheel; the torch_index_url secret replaces it.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
index=$1; shift
override=$(secret torch_index_url)
if [[ -n $override ]]; then index=$override; fi
if [[ -n ${ENVBUILD_UV:-} ]]; then  # the matrix's uv (uv.sh), byte-compiling as pip does
    mapfile -t indexes < <(uv_indexes "$index")
    uv_pip install --python "$(venv_dir)/bin/python" --compile-bytecode "${indexes[@]}" "$@" || lock_failed "$@"
    exit 0
fi
pip=("$(venv_dir)/bin/pip" install)
if [[ $index != "-" ]]; then
    pip+=(--index-url "$index" --extra-index-url "${PIP_INDEX_URL:-https://pypi.org/simple}")
fi
"${pip[@]}" "$@" || lock_failed "$@"
