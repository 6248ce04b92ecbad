#!/usr/bin/env bash
# layers.sh VENV DIR LAYER=GLOB[,GLOB...]...: the nvidia-* wheels' libraries (site-packages/nvidia/<package>,
# several GB) move to DIR/<layer>/nvidia/<package>, each leaving a symlink in its place, so the
# final stage copies every LAYER on its own: a pull downloads them in parallel, and two stacks
# with the same CUDA wheels share those layers byte for byte (file times fixed, no bytecode
# caches). torch finds the libraries through its RPATH ($ORIGIN/../../nvidia/...) and Python
# through the package, both across the symlinks. Which layer a package goes in is the build
# plan's (plan.CUDA_LAYER_PACKAGES): the first LAYER with a GLOB matching its directory name.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

venv=$1 dir=$2; shift 2
layers=() globs=()
for spec in "$@"; do
    layers+=("${spec%%=*}") globs+=("${spec#*=}")
    mkdir -p "$dir/${spec%%=*}/nvidia"
done
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
moved=0
if [[ -d $site/nvidia ]]; then
    for package in "$site"/nvidia/*/; do
        package=${package%/}
        name=$(basename "$package")
        [[ $name == __pycache__ || -L $package ]] && continue
        layer=
        for i in "${!layers[@]}"; do
            IFS=, read -r -a patterns <<< "${globs[$i]}"
            for pattern in "${patterns[@]}"; do
                # shellcheck disable=SC2053  # the right side is a glob on purpose
                if [[ $name == $pattern ]]; then layer=${layers[$i]}; break 2; fi
            done
        done
        [[ -n $layer ]] || { log "layers: no LAYER=GLOB argument matches nvidia/$name"; exit 1; }
        mv "$package" "$dir/$layer/nvidia/$name"
        ln -s "$dir/$layer/nvidia/$name" "$package"
        moved=$((moved + 1))
    done
fi
find "$dir" -name __pycache__ -prune -exec rm -rf {} +
find "$dir" -exec touch -h -d @0 {} +
log "layers: $moved nvidia packages in $(printf '%s ' "${layers[@]}")under $dir ($(du -sh "$dir" | cut -f1))"
