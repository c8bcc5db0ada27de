#!/usr/bin/env bash
# The fused-MoE proof on a Hopper GPU machine without network, in steps that can each be
# rerun (the JIT caches live in .build/fused_moe, kept between steps):
#
#   benchmarks/fused_moe/h200.sh build OUT   # vllm-h20 kernels build: fix, then stock module
#   benchmarks/fused_moe/h200.sh test OUT    # FlashInfer's SM90 block-scale test + the patch's
#                                            # test, on the fix module and on the stock module
#                                            # (MODES="per_expert" or "stock": one of them)
#   benchmarks/fused_moe/h200.sh bench OUT   # run.py: 110 cases x 8 EP ranks, stock vs fix
#   benchmarks/fused_moe/h200.sh all OUT
#
# Needs .fi/ from benchmarks/fused_moe/stage.py (FlashInfer + TVM FFI wheels, FlashInfer's
# tests) unless FlashInfer is installed already.
set -uo pipefail
step=${1:?build|test|bench|all}
OUT=$(realpath -m "${2:?output directory}")
cd "$(dirname "$0")/../.."
repo=$PWD
work=$repo/.build/fused_moe
mkdir -p "$work" "$OUT"
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=$work/jit VLLM_H20_CACHE_DIR=$work/vllm-h20
# DeepGEMM names a cached kernel by its template arguments only: one cache per state of the
# patches, or a changed patch would run the kernels of the one before it.
patches_sha=$(find patches/flashinfer -name '*.patch' -type f | LC_ALL=C sort | xargs cat | sha256sum)
export TRTLLM_DG_CACHE_DIR=$work/deepgemm/${patches_sha:0:12}
# DeepGEMM compiles its kernels with nvcc at run time; without one it silently runs another path.
TRTLLM_DG_NVCC_COMPILER=${TRTLLM_DG_NVCC_COMPILER:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
export TRTLLM_DG_NVCC_COMPILER
if ! python3 -c "import flashinfer, tvm_ffi" 2>/dev/null; then
    if [ ! -d /tmp/site/flashinfer ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            "$repo"/.fi/wheels/*.whl || exit 1
    fi
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
rc=0

if [ "$step" = build ] || [ "$step" = all ]; then
    python3 benchmarks/fused_moe/run.py --out "$OUT" --work "$work" --build-only || exit 1
fi

if [ "$step" = test ] || [ "$step" = all ]; then
    tests=$repo/.fi/flashinfer-tests
    for mode in ${MODES:-per_expert stock}; do
        for sel in "tests/moe/test_trtllm_cutlass_fused_moe.py -k fp8_block_scaling" \
                   "tests/moe/test_fp8_blockscale_moe_expected_m.py"; do
            name=$(basename "${sel%% *}" .py)
            # shellcheck disable=SC2086 # $sel is a file plus pytest options
            (cd "$tests" && VLLM_H20_MOE_DISPATCH=$mode \
                PYTHONPATH=$repo/benchmarks/fused_moe/activate:$PYTHONPATH \
                python3 -m pytest -p no:cacheprovider -q -rA $sel) \
                > "$OUT/fused_moe_tests_${mode}_${name}.log" 2>&1
            echo "$mode $name: exit $? $(tail -n 1 "$OUT/fused_moe_tests_${mode}_${name}.log")"
        done
    done
fi

if [ "$step" = bench ] || [ "$step" = all ]; then
    python3 benchmarks/fused_moe/run.py --out "$OUT" --work "$work" --skip-build || rc=1
fi
exit $rc
