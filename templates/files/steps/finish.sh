#!/usr/bin/env bash
# finish.sh: after every compile of the builder (DeepSpeed's ops, the CUDA extensions): the guard,
# then what only the compiles needed leaves the venv, then pip check.
# ENVBUILD_DS_BUILD_ONLY: what the final image drops (ninja), with DeepSpeed's Requires-Dist of it.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

venv=$(venv_dir)
# The guard: constraints pinning what the ops were built against (torch, torchvision, triton,
# the CUDA wheels, DeepSpeed, the CUDA extensions), read by pip and uv through PIP_CONSTRAINT / UV_CONSTRAINT, so a
# user's `pip install` that needs another torch fails with the resolver's conflict instead of
# replacing torch under the pre-built ops.
constraints=${ENVBUILD_CONSTRAINTS:?the finish step needs the constraints path}
mkdir -p "$(dirname "$constraints")"
"$venv/bin/pip" freeze --all | grep -E -i "^(${ENVBUILD_GUARD_PACKAGES:?the plan names the guarded packages})==" \
    | LC_ALL=C sort > "$constraints"
grep -q -i '^torch==' "$constraints"
log "guard: $(wc -l < "$constraints") pins in $constraints"
# Without ninja nothing can JIT-compile at run time, even by accident. DeepSpeed declares
# ninja only for that JIT, so its Requires-Dist of it goes too (recorded in manifest.json's
# dropped_requirements): `pip check` stays true about the image.
for name in ${ENVBUILD_DS_BUILD_ONLY:-}; do
    "$venv/bin/pip" uninstall -y -q "$name"
    "$venv/bin/python" "$STEPS_DIR/requires.py" drop deepspeed "$name"
    log "dropped $name and deepspeed's Requires-Dist of it (build-only)"
done
"$venv/bin/python" "$STEPS_DIR/pip_check.py"
