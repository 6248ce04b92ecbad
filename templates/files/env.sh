# shellcheck shell=sh
# Sourced by the Docker entrypoint and by Apptainer's %environment at every container start:
# POSIX sh; on a node with nothing to say it starts no process. Sets only what is unset.
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
#    FLASH_ATTENTION_CUTE_DSL_CACHE_DIR  FlashAttention 4's CuTe DSL kernels (flash_attn/cute/
#                               cache_utils.py; off unless FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1,
#                               which is set here when unset: compiled once per job and node)
# 0. The image's venv first on PATH: pyxis/enroot and Apptainer start a step with the job's PATH,
#    where `python` is the host's or none (seen under pyxis 0.24: "exec: python: not found").
case ":${PATH:-}:" in
    *":/opt/venv/bin:"*) ;;
    *) PATH="/opt/venv/bin${PATH:+:$PATH}"; export PATH ;;
esac

_envbuild_job=${SLURM_JOB_ID:-}
if [ -z "$_envbuild_job" ]; then
    _envbuild_job="$(id -un 2>/dev/null || id -u)-$$"
fi
_envbuild_dir=${ENVBUILD_LOCAL_DIR:-${TMPDIR:-/tmp}}
for _envbuild_cache in TORCH_EXTENSIONS_DIR:torch_extensions TRITON_CACHE_DIR:triton \
        TORCHINDUCTOR_CACHE_DIR:torchinductor PYTORCH_KERNEL_CACHE_PATH:torch_kernels \
        CUDA_CACHE_PATH:cuda_cache VLLM_CACHE_ROOT:vllm FLASHINFER_WORKSPACE_BASE:flashinfer \
        HF_MODULES_CACHE:hf_modules FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:flash_attention_cute_dsl; do
    _envbuild_var=${_envbuild_cache%%:*}
    eval "_envbuild_have=\${${_envbuild_var}:-}"  # the names are the literals above
    if [ -z "$_envbuild_have" ]; then
        eval "${_envbuild_var}=\"\$_envbuild_dir/${_envbuild_cache#*:}-\$_envbuild_job\"; export ${_envbuild_var}"
    fi
done
unset _envbuild_cache _envbuild_var _envbuild_have
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED

# 1b. The NCCL flight recorder's dump (written by each rank when a collective times out: the
#    record of which rank and op stopped, field report 4) goes to a per-job directory on a path
#    the user keeps, not torch's default inside the container (gone with `docker run --rm` or
#    the end of a Slurm job): ${ENVBUILD_DUMP_DIR:-$HOME/envbuild-dumps}/flight_recorder-<job>/
#    rank_<N>, named by the per-job rule above. ENVBUILD_FR_DUMP_VAR (baked) is the variable this
#    torch reads; a value the user set wins. Rank 0 of a job says where, and the command that
#    reads the dumps (ENVBUILD_FR_READER).
case ${ENVBUILD_FR_DUMP_VAR:-} in
    TORCH_FR_DUMP_TEMP_FILE|TORCH_NCCL_DEBUG_INFO_TEMP_FILE)
        eval "_envbuild_have=\${${ENVBUILD_FR_DUMP_VAR}:-}"
        if [ -z "$_envbuild_have" ]; then
            _envbuild_fr="${ENVBUILD_DUMP_DIR:-${HOME:-/tmp}/envbuild-dumps}/flight_recorder-$_envbuild_job"
            if [ -d "$_envbuild_fr" ] || mkdir -p "$_envbuild_fr" 2>/dev/null; then
                eval "${ENVBUILD_FR_DUMP_VAR}=\"\$_envbuild_fr/rank_\"; export ${ENVBUILD_FR_DUMP_VAR}"
                if [ "${SLURM_PROCID:-0}" = 0 ] && [ -n "${SLURM_JOB_ID:-}${WORLD_SIZE:-}" ]; then
                    echo "envbuild: flight-recorder dumps (one per rank, on a collective timeout) go to $_envbuild_fr; read them with: ${ENVBUILD_FR_READER:-torchfrtrace} $_envbuild_fr -p rank_" >&2
                fi
            elif [ "${SLURM_PROCID:-0}" = 0 ]; then
                echo "envbuild: warning: cannot create $_envbuild_fr for flight-recorder dumps; set ENVBUILD_DUMP_DIR to a writable directory you keep after the job (they stay inside the container otherwise)" >&2
            fi
        fi
        unset _envbuild_have _envbuild_fr ;;
esac

# 2. Node checks, with shell builtins only: on a node with nothing to say no process starts.
#    The image's Python (-I -S, stdlib only: envbuild_image/node.py, whose nodefacts.py and
#    container.py make the same tests and word the warnings) runs only when one of them finds something; it prints each warning
#    on stderr (one paragraph, with the docker run / apptainer / pyxis flags that fix it) and
#    NAME=VALUE lines for this script to export. Nothing here fails a start. ENVBUILD_NODE_ROOT
#    (tests only) stands in for / under /dev, /proc and /sys. Paths: envbuild/image/paths.py.
#    a. Where a GPU was handed to the container (/dev/nvidiactl or nvidia-smi):
#       - the driver (/proc/driver/nvidia/version, else nvidia-smi) against ENVBUILD_MIN_DRIVER:
#         below it, one warning now instead of CUDA error 803/804 later (empty: no warning);
#       - the manifest's node_env entries whose condition holds on this node, each only if its
#         variable is unset or empty (a user's value always wins).
#    b. Where the driver's user space was not handed in (no nvidia-smi, no libcuda.so.1; the
#       host's /dev/nvidiactl alone says nothing: apptainer and enroot bind the host's /dev), but
#       the host's nvidia driver is loaded and one of its PCI devices (sysfs shows them in any
#       container) is an NVIDIA display/3D controller (vendor 0x10de, class 0x03xxxx): --gpus /
#       --nv was forgotten. NVIDIA_VISIBLE_DEVICES=none or void says a CPU-only job meant it.
#    c. RDMA devices in /sys/class/infiniband that this container cannot use: no
#       /dev/infiniband/uverbs*, or a locked-memory limit below 1 GiB without CAP_IPC_LOCK (bit
#       14 of CapEff, which counts only in the initial user namespace: uid_map 0 0 4294967295).
#    d. A /dev/shm below 1 GiB (its size= in /proc/mounts; Docker's default is 64 MiB).
_envbuild_root=${ENVBUILD_NODE_ROOT:-}
_envbuild_want=
_envbuild_driver=
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
    while [ -n "$_envbuild_line" ]; do
        _envbuild_word=${_envbuild_line%%[[:space:]]*}
        _envbuild_line=${_envbuild_line#"$_envbuild_word"}
        _envbuild_line=${_envbuild_line#[[:space:]]}
        case $_envbuild_word in
            '' | *[!0-9.]* | .* | *. | *..*) ;;
            *.*) _envbuild_driver=$_envbuild_word && break ;;
        esac
    done
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
fi
if [ -d "$_envbuild_root/sys/bus/pci/drivers/nvidia" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    # The driver's user space was handed in when libcuda.so.1 is where the NVIDIA Container
    # Toolkit (docker --gpus, enroot, Kubernetes) or apptainer --nv put it.
    _envbuild_line=${NVIDIA_VISIBLE_DEVICES-all}
    for _envbuild_dev in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /.singularity.d/libs; do
        if [ -e "$_envbuild_root$_envbuild_dev/libcuda.so.1" ]; then _envbuild_line=none && break; fi
    done
    case $_envbuild_line in
        '' | none | void | NONE | VOID) ;;
        *)
            for _envbuild_dev in "$_envbuild_root"/sys/bus/pci/devices/*; do
                _envbuild_line=
                if [ -r "$_envbuild_dev/vendor" ]; then IFS= read -r _envbuild_line <"$_envbuild_dev/vendor" || :; fi
                [ "$_envbuild_line" = 0x10de ] || continue
                _envbuild_line=
                if [ -r "$_envbuild_dev/class" ]; then IFS= read -r _envbuild_line <"$_envbuild_dev/class" || :; fi
                case $_envbuild_line in 0x03*) _envbuild_want=${_envbuild_want}gpu && break ;; esac
            done
            ;;
    esac
fi
for _envbuild_dev in "$_envbuild_root"/sys/class/infiniband/*; do
    [ -e "$_envbuild_dev" ] || break  # no RDMA device: the pattern stayed as it is
    _envbuild_line=
    for _envbuild_word in "$_envbuild_root"/dev/infiniband/uverbs*; do
        [ -e "$_envbuild_word" ] && _envbuild_line=devices
        break
    done
    if [ -z "$_envbuild_line" ]; then
        _envbuild_want=${_envbuild_want}rdma
        break
    fi
    # The soft locked-memory limit: "Max locked memory  <soft>  <hard>  bytes" (or unlimited).
    _envbuild_x=
    if [ -r "$_envbuild_root/proc/self/limits" ]; then
        while read -r _envbuild_a _envbuild_b _envbuild_y _envbuild_x _envbuild_line; do
            [ "$_envbuild_a $_envbuild_b $_envbuild_y" = "Max locked memory" ] && break
            _envbuild_x=
        done <"$_envbuild_root/proc/self/limits"
    fi
    case $_envbuild_x in
        '' | *[!0-9]* | ???????????*) ;;  # unlimited, unreadable, or 11 digits and more: >= 1 GiB
        *)
            if [ "$_envbuild_x" -lt 1073741824 ]; then
                # CAP_IPC_LOCK is bit 14: the 4th hex digit from the right of CapEff is 4-7 or c-f.
                _envbuild_y=
                if [ -r "$_envbuild_root/proc/self/status" ]; then
                    while read -r _envbuild_a _envbuild_b _envbuild_line; do
                        case $_envbuild_a in CapEff:) _envbuild_y=$_envbuild_b && break ;; esac
                    done <"$_envbuild_root/proc/self/status"
                fi
                _envbuild_y=${_envbuild_y%???}
                case ${_envbuild_y#"${_envbuild_y%?}"} in
                    [4-7c-fC-F])
                        _envbuild_a=0 _envbuild_b=0 _envbuild_y=4294967295
                        if [ -r "$_envbuild_root/proc/self/uid_map" ]; then
                            read -r _envbuild_a _envbuild_b _envbuild_y _envbuild_line \
                                <"$_envbuild_root/proc/self/uid_map" || :
                        fi
                        if [ "$_envbuild_a $_envbuild_b $_envbuild_y" != "0 0 4294967295" ]; then
                            _envbuild_want=${_envbuild_want}rdma
                        fi
                        ;;
                    *) _envbuild_want=${_envbuild_want}rdma ;;
                esac
            fi
            ;;
    esac
    break
done
# /dev/shm's size= in /proc/mounts (the kernel writes it in KiB: size=65536k); the last mount wins.
_envbuild_x=
if [ -r "$_envbuild_root/proc/mounts" ]; then
    while read -r _envbuild_a _envbuild_b _envbuild_y _envbuild_line; do
        if [ "$_envbuild_b" = /dev/shm ]; then _envbuild_x=",${_envbuild_line%% *},"; fi
    done <"$_envbuild_root/proc/mounts"
fi
case $_envbuild_x in
    *,size=*)
        _envbuild_x=${_envbuild_x#*,size=}
        _envbuild_x=${_envbuild_x%%,*}
        _envbuild_y=${_envbuild_x%[kKmMgG]}
        case $_envbuild_y in '' | *[!0-9]* | ???????????*) _envbuild_y= ;; esac  # 11 digits: >= 1 GiB in any unit
        case $_envbuild_x in
            *[kK]) _envbuild_b=1048576 ;;
            *[mM]) _envbuild_b=1024 ;;
            *[gG]) _envbuild_b=1 ;;
            *) _envbuild_b=1073741824 ;;
        esac
        if [ -n "$_envbuild_y" ] && [ "$_envbuild_y" -lt "$_envbuild_b" ]; then
            _envbuild_want=${_envbuild_want}shm
        fi
        ;;
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
unset _envbuild_job _envbuild_dir _envbuild_root _envbuild_line _envbuild_driver _envbuild_word _envbuild_dev \
    _envbuild_want _envbuild_min _envbuild_a _envbuild_b _envbuild_x _envbuild_y _envbuild_set _envbuild_name
