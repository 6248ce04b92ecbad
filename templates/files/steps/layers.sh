#!/usr/bin/env bash
# layers.sh VENV DIR LAYER...: the nvidia-* wheels' libraries (site-packages/nvidia/<package>,
# several GB) move to DIR/<layer>/nvidia/<package>, each leaving a symlink in its place, so the
# final stage copies every LAYER on its own: a pull downloads them in parallel, and two stacks
# with the same CUDA wheels share those layers byte for byte (file times fixed, no bytecode
# caches). torch finds the libraries through its RPATH ($ORIGIN/../../nvidia/...) and Python
# through the package, both across the symlinks. LAYERs: cuda cudnn nccl other.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

venv=$1 dir=$2; shift 2
for layer in "$@"; do mkdir -p "$dir/$layer/nvidia"; done
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
moved=0
if [[ -d $site/nvidia ]]; then
    for package in "$site"/nvidia/*/; do
        package=${package%/}
        name=$(basename "$package")
        [[ $name == __pycache__ || -L $package ]] && continue
        case $name in
            cudnn) layer=cudnn ;;
            nccl | nvshmem) layer=nccl ;;
            cu1[0-9] | cublas | cuda_* | cufft | cufile | curand | cusolver | cusparse | nvjitlink | nvtx) layer=cuda ;;
            *) layer=other ;;
        esac
        mv "$package" "$dir/$layer/nvidia/$name"
        ln -s "$dir/$layer/nvidia/$name" "$package"
        moved=$((moved + 1))
    done
fi
find "$dir" -name __pycache__ -prune -exec rm -rf {} +
find "$dir" -exec touch -h -d @0 {} +
log "layers: $moved nvidia packages in $(printf '%s ' "$@")under $dir ($(du -sh "$dir" | cut -f1))"
