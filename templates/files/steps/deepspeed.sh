#!/usr/bin/env bash
# deepspeed.sh LOCK-PART|SPEC OP...: DeepSpeed with OP... pre-built, then checked.
# LOCK-PART: DeepSpeed's part of the stack's lock (its sdist's hash); its dependencies and
# build requirements are in the venv already, from the lock. Without a lock, SPEC
# (deepspeed==X) and ENVBUILD_DS_BUILD_REQUIRES: what setup.py imports before pip resolves
# anything (deepspeed.yaml build_requires); with --no-build-isolation they must be there first.
# ENVBUILD_DS_BUILD_ONLY: what the final image drops (ninja), with DeepSpeed's Requires-Dist of it.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
spec=$1; shift
venv=$(venv_dir)

# Wrap the host compilers so DeepSpeed's `-march=native` becomes the declared CPU target:
# an image built on an AVX-512 runner must not die with SIGILL on older nodes.
if [[ -n ${ENVBUILD_CPU_TARGET:-} ]]; then
    mkdir -p "$TMP/cc-bin"
    for name in cc c++ gcc g++ x86_64-linux-gnu-gcc x86_64-linux-gnu-g++ aarch64-linux-gnu-gcc aarch64-linux-gnu-g++; do
        if [[ -x /usr/bin/$name ]]; then ln -s "$STEPS_DIR/cc-wrapper.sh" "$TMP/cc-bin/$name"; fi
    done
    export PATH="$TMP/cc-bin:$PATH"
    log "CPU ops target $ENVBUILD_CPU_TARGET (-march=native is rewritten)"
fi
if [[ -f $spec ]]; then
    DS_ENABLE_NINJA=1 "$venv/bin/pip" install --require-hashes --no-deps --no-build-isolation -r "$spec" \
        || lock_failed --require-hashes
else
    # shellcheck disable=SC2086  # a list of requirement strings without spaces
    "$venv/bin/pip" install ${ENVBUILD_DS_BUILD_REQUIRES:?without a lock the deepspeed step needs its build requirements}
    DS_ENABLE_NINJA=1 "$venv/bin/pip" install --no-build-isolation "$spec"
fi
"$venv/bin/python" "$STEPS_DIR/verify_ops.py" "$@"
# The guard: constraints pinning what the ops were built against (torch, torchvision, triton,
# the CUDA wheels, DeepSpeed), read by pip and uv through PIP_CONSTRAINT / UV_CONSTRAINT, so a
# user's `pip install` that needs another torch fails with the resolver's conflict instead of
# replacing torch under the pre-built ops.
constraints=${ENVBUILD_CONSTRAINTS:?the deepspeed step needs the constraints path}
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
    "$venv/bin/python" - "$name" <<'PY'
import pathlib, re, sys
from importlib import metadata
name = sys.argv[1]
dist = metadata.distribution("deepspeed")
meta = next(pathlib.Path(f.locate()) for f in dist.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
kept = [line for line in meta.read_text().splitlines(keepends=True)
        if not re.match(rf"Requires-Dist: *{re.escape(name)}\b(?![-_.\w])", line, re.I)]
meta.write_text("".join(kept))
PY
    log "dropped $name and deepspeed's Requires-Dist of it (build-only)"
done
"$venv/bin/python" "$STEPS_DIR/pip_check.py"
