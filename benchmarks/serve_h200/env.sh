# Sourced by both GPU-machine drivers (serve_h200/h200.sh, journey_h200/h200.sh) after they
# cd to the repository root: where state lives ($SH), the installed wheels ($SITE), every JIT
# cache, the kernels every server runs with, and the CPU sets. Defines nothing else.
repo=$PWD
SH=${SH:-/tmp/serve_h200}
SITE=${SITE:-$SH/site}
mkdir -p "$SH"/{logs,pieces,sweeps,check,prof,steptime,steps}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# pip --target installs .pth files that nothing runs from PYTHONPATH: CuTe DSL's (the `cutlass`
# package DeepSeek-V4's kernels import) adds this folder.
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages PATH=$SITE/bin:$PATH
# The fix module and the DeepGEMM kernels it compiles at run time are cached here, shared by
# every server and by `kernels build` (the patched kernels' names differ from stock ones).
export FLASHINFER_WORKSPACE_BASE=$SH/jit VLLM_H20_CACHE_DIR=$SH/vllm-h20
export TRTLLM_DG_CACHE_DIR=$SH/deepgemm
# DeepSeek-V4's mHC kernels (TileLang JIT): `v4mhc` compiles them here, every server reads them.
export TILELANG_CACHE_DIR=$SH/tilelang
# vLLM's own caches (its vendored DeepGEMM's JIT kernels, FlashInfer's autotune configs) and
# Triton's, under $SH too: `jitsave` brings them back and the next lease's `boot` restores them,
# so kernels compiled once are not compiled on the next lease's request path.
export VLLM_CACHE_ROOT=$SH/vllm-cache TRITON_CACHE_DIR=$SH/triton
JIT_DIRS=(tilelang vllm-cache triton deepgemm)
TRTLLM_DG_NVCC_COMPILER=${TRTLLM_DG_NVCC_COMPILER:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
export TRTLLM_DG_NVCC_COMPILER
# The FP8 linears on vLLM's precompiled CUTLASS block-scale kernel in every server: its
# default here (FlashInfer's DeepGEMM) JIT-compiles ~1,300 kernels at start (> 5 min).
export VLLM_DISABLED_KERNELS=FlashInferFp8DeepGEMMDynamicBlockScaledKernel,DeepGemmFp8BlockScaledMMKernel
export VLLM_DEEP_GEMM_WARMUP=skip
model=$SH/stage/model
recipe=$repo/recipes/test-h200-dsv3-fp8-flashinfer-cutlass.yaml
# Servers and the load generators on separate CPU sets, so a client's work never steals a
# server's core (SERVER_CPUS / CLIENT_CPUS, default: all but the last 4 cores / the last 4).
ncpu=$(nproc)
SERVER_CPUS=${SERVER_CPUS:-0-$(( ncpu > 8 ? ncpu - 5 : ncpu - 1 ))}
CLIENT_CPUS=${CLIENT_CPUS:-$(( ncpu > 8 ? ncpu - 4 : 0 ))-$(( ncpu - 1 ))}
pin() { if command -v taskset >/dev/null; then echo taskset -c "$1"; fi; }
# Whether a background step (v4prep, v4probe, sweep-bg) still runs: its pid file, not pgrep -f,
# since a caller's own command line may name the step.
running() { [ -f "$SH/$1.pid" ] && kill -0 "$(cat "$SH/$1.pid")" 2>/dev/null; }
# Start a background step NAME: the command under setsid (it outlives the device call), its
# output to LOG, its pid where `running` looks.
start_bg() {
    local name=$1 log=$2; shift 2
    setsid "$@" < /dev/null > "$log" 2>&1 &
    echo $! > "$SH/$name.pid"
}
# Cache entries with their modification times (when each kernel was compiled), oldest first.
list_by_time() { local dir=$1 out=$2; shift 2
    find "$dir" "$@" -printf '%TY-%Tm-%Td %TH:%TM:%.2TS %s %P\n' 2>/dev/null | sort > "$SH/logs/$out"; }
