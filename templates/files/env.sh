# shellcheck shell=sh
# Sourced by the Docker entrypoint and by Apptainer's %environment at every container start:
# POSIX sh; it starts no process on a node without a GPU. Sets only what is unset.
#
# 1. Per-job, node-local run-time compile caches, each set only when unset (a value the user
#    or the cluster set wins). A cache on a shared home is what hangs or corrupts jobs: many
#    ranks on many nodes race on the same files and locks (field reports 1 and 2). The cost:
#    each job compiles what it needs once more; point a variable at a persistent node-local
#    directory to keep a cache across jobs.
#    TORCH_EXTENSIONS_DIR       torch cpp_extension / DeepSpeed JIT builds (field reports 1, 2)
#    TRITON_CACHE_DIR           Triton's compiled kernels (DeepSpeed#5205: stalls on NFS)
#    TORCHINDUCTOR_CACHE_DIR    torch.compile's generated code and FX graph cache
#    PYTORCH_KERNEL_CACHE_PATH  torch's runtime-compiled CUDA kernels (~/.cache/torch/kernels)
#    CUDA_CACHE_PATH            the driver's PTX JIT cache (~/.nv/ComputeCache)
#    VLLM_CACHE_ROOT            vLLM's torch.compile and kernel caches (~/.cache/vllm)
#    FLASHINFER_WORKSPACE_BASE  FlashInfer's JIT-built kernels (under ~/.cache)
#    HF_MODULES_CACHE           transformers' trust_remote_code modules (~/.cache/huggingface)
_envbuild_job=${SLURM_JOB_ID:-}
if [ -z "$_envbuild_job" ]; then
    _envbuild_job="$(id -un 2>/dev/null || id -u)-$$"
fi
_envbuild_dir=${ENVBUILD_LOCAL_DIR:-${TMPDIR:-/tmp}}
for _envbuild_cache in TORCH_EXTENSIONS_DIR:torch_extensions TRITON_CACHE_DIR:triton \
        TORCHINDUCTOR_CACHE_DIR:torchinductor PYTORCH_KERNEL_CACHE_PATH:torch_kernels \
        CUDA_CACHE_PATH:cuda_cache VLLM_CACHE_ROOT:vllm FLASHINFER_WORKSPACE_BASE:flashinfer \
        HF_MODULES_CACHE:hf_modules; do
    _envbuild_var=${_envbuild_cache%%:*}
    eval "_envbuild_have=\${${_envbuild_var}:-}"  # the names are the literals above
    if [ -z "$_envbuild_have" ]; then
        eval "${_envbuild_var}=\"\$_envbuild_dir/${_envbuild_cache#*:}-\$_envbuild_job\"; export ${_envbuild_var}"
    fi
done
unset _envbuild_cache _envbuild_var _envbuild_have

# 2. Node checks, only where a GPU was handed to the container (/dev/nvidiactl or nvidia-smi):
#    - the driver (/proc/driver/nvidia/version, else nvidia-smi) against ENVBUILD_MIN_DRIVER:
#      below it, one warning now instead of CUDA error 803/804 later (empty: no warning);
#    - the manifest's node_env entries whose condition holds on this node, each only if its
#      variable is unset or empty (a user's value always wins).
#    The image's Python (-I -S, stdlib only: envbuild_image/node.py) runs only when a warning
#    is due or the manifest has node_env entries; it prints the warning on stderr and NAME=VALUE
#    lines for this script to export. ENVBUILD_NODE_ROOT (tests only) stands in for / under
#    /dev, /proc and /sys. Paths: envbuild/image/paths.py.
_envbuild_root=${ENVBUILD_NODE_ROOT:-}
if [ -e "$_envbuild_root/dev/nvidiactl" ] || command -v nvidia-smi >/dev/null 2>&1; then
    _envbuild_line=
    if [ -r "$_envbuild_root/proc/driver/nvidia/version" ]; then
        IFS= read -r _envbuild_line <"$_envbuild_root/proc/driver/nvidia/version" || :
    elif command -v nvidia-smi >/dev/null 2>&1; then
        _envbuild_line=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null) || _envbuild_line=
        _envbuild_line=${_envbuild_line%%"
"*}
    fi
    # The driver version: the first dotted number (580.65.06) of that line.
    _envbuild_driver=
    while [ -n "$_envbuild_line" ]; do
        _envbuild_word=${_envbuild_line%%[[:space:]]*}
        _envbuild_line=${_envbuild_line#"$_envbuild_word"}
        _envbuild_line=${_envbuild_line#[[:space:]]}
        case $_envbuild_word in
            '' | *[!0-9.]* | .* | *. | *..*) ;;
            *.*) _envbuild_driver=$_envbuild_word && break ;;
        esac
    done
    _envbuild_want=
    _envbuild_min=${ENVBUILD_MIN_DRIVER:-}
    case $_envbuild_min in '' | *[!0-9.]* | .* | *. | *..*) _envbuild_min= ;; esac
    if [ -n "$_envbuild_driver" ] && [ -n "$_envbuild_min" ]; then
        # Is the driver older than the minimum? Compared field by field, as numbers.
        _envbuild_a=$_envbuild_driver.
        _envbuild_b=$_envbuild_min.
        while [ -n "$_envbuild_a$_envbuild_b" ]; do
            _envbuild_x=${_envbuild_a%%.*}
            _envbuild_y=${_envbuild_b%%.*}
            _envbuild_a=${_envbuild_a#*.}
            _envbuild_b=${_envbuild_b#*.}
            if [ "${_envbuild_x:-0}" -lt "${_envbuild_y:-0}" ]; then
                _envbuild_want=warn && break
            elif [ "${_envbuild_x:-0}" -gt "${_envbuild_y:-0}" ]; then
                break
            fi
        done
    fi
    case $(cat "${ENVBUILD_MANIFEST:-/opt/envbuild/manifest.json}" 2>/dev/null) in
        *'"node_env": []'*) ;;
        *'"node_env"'*) _envbuild_want=${_envbuild_want}node_env ;;
    esac
    if [ -n "$_envbuild_want" ] && [ -x /opt/venv/bin/python ]; then
        _envbuild_set=$(/opt/venv/bin/python -I -S -B -c 'import sys; sys.path[:0] = ["/opt/envbuild/lib"]; from envbuild_image.node import main; main()' --driver "$_envbuild_driver") || _envbuild_set=
        while IFS= read -r _envbuild_line; do
            case $_envbuild_line in *=*) ;; *) continue ;; esac
            _envbuild_name=${_envbuild_line%%=*}
            case $_envbuild_name in '' | [0-9]* | *[!A-Za-z0-9_]*) continue ;; esac
            if eval "[ -z \"\${$_envbuild_name:-}\" ]"; then
                export "${_envbuild_line?}"  # NAME=VALUE
            fi
        done <<EOF
$_envbuild_set
EOF
    fi
fi
unset _envbuild_job _envbuild_dir _envbuild_root _envbuild_line _envbuild_driver _envbuild_word \
    _envbuild_want _envbuild_min _envbuild_a _envbuild_b _envbuild_x _envbuild_y _envbuild_set _envbuild_name
