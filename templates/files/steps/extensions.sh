#!/usr/bin/env bash
# extensions.sh SPEC: the CUDA extensions SPEC (extensions.json, written by the build plan)
# names, each compiled from its hash-checked sdist (or GitHub archives, each tar stream's
# sha256 checked: FA3) against the venv's torch for the GPU's
# arches only, cached by what determines the wheel, installed with hash checking and
# verified (imports with no undefined symbol; SASS for every arch): extensions.py.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
cuda_link_stubs
nvcc_reproducible
export ENVBUILD_TMP="$TMP"
# A source only on GitHub (FA3) is fetched from its archive URL, or from this base instead of
# https://github.com (the fabrics' secret: a local copy), its tar stream's sha256 checked either way.
ENVBUILD_SOURCE_MIRROR=$(secret source_mirror)
export ENVBUILD_SOURCE_MIRROR
# cpp_extension runs this instead of nvcc (PYTORCH_NVCC): it keeps only the GPU's arches of the
# -gencode flags an extension's setup.py hard-codes (causal-conv1d lists nine).
export PYTORCH_NVCC="$STEPS_DIR/nvcc-arch.sh"
# nvcc (its phases, host compiles included) through the compile cache when the build has one
compile_cache_start
"$(venv_dir)/bin/python" "$STEPS_DIR/extensions.py" "$1"
compile_cache_report extensions
