# The V4 journey's servers (sourced by journey_h200/h200.sh, and by serve_h200/h200.sh when the
# journey's driver hands it a step: SERVERS points here): the release on Humming (v4hum, W4A8)
# and Marlin (v4marlin, W4A16), the conversion on FlashInfer CUTLASS with the fix (v4fix) and
# without (v4stock), and on vLLM's Triton FP8 MoE with a tuned config (v4triton).
# `server_opts NAME` appends to the caller's `envs` and `args` arrays and waits for the
# server's checkpoint while v4prep still makes it.

# The synthetic release lives in RAM when /dev/shm has room (the 64 GB disk then holds the
# 41 GB conversion beside the V3 checkpoint's absence), else beside the conversion.
# Decided once and remembered: the release itself fills /dev/shm, so a later step would
# otherwise decide differently.
if [ -z "${V4REL:-}" ]; then
    if [ -f "$SH/v4rel.path" ]; then
        V4REL=$(cat "$SH/v4rel.path")
    else
        shm_free=$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')
        if [ "${shm_free:-0}" -gt $((30 << 30)) ]; then V4REL=/dev/shm/v4-release; else V4REL=$SH/v4/release; fi
        echo "$V4REL" > "$SH/v4rel.path"
    fi
fi
V4FP8=$SH/v4/converted

port() { case $1 in v4hum) echo 8011 ;; v4fix) echo 8012 ;; v4stock) echo 8013 ;; v4marlin) echo 8014 ;;
         v4triton) echo 8015 ;;
         *) echo "unknown server $1 (v4hum|v4fix|v4stock|v4marlin|v4triton)" >&2; return 1 ;; esac; }
model_of() { case $1 in v4hum|v4marlin) echo "$V4REL" ;; *) echo "$V4FP8" ;; esac; }
recipe_of() { case $1 in
    v4hum|v4marlin) echo "$repo/recipes/test-h200-dsv4-mxfp4-humming.yaml" ;;
    *) echo "$repo/recipes/test-h200-dsv4-fp8-flashinfer-cutlass.yaml" ;; esac; }
needs_build() { case $1 in v4fix|v4stock) return 0 ;; *) return 1 ;; esac; }
# Written once a V4 checkpoint is complete (before verify), for `serve` to wait on.
ready_of() { case $1 in v4hum|v4marlin) echo "$SH/v4/release.ready" ;; *) echo "$SH/v4/converted.ready" ;; esac; }
# Wait up to $2 s for server $1's checkpoint to be marked complete, while v4prep still runs.
await_ready() { for _ in $(seq "$2"); do [ -f "$(ready_of "$1")" ] && break; running v4prep || break; sleep 1; done; }
server_opts() { local m
    m=$(model_of "$1")
    await_ready "$1" 540  # the checkpoint may still be in the making (v4prep); verify may not
    [ -f "$m/model.safetensors.index.json" ] || { echo "$1: no checkpoint in $m (v4release / v4convert first)"; return 1; }
    case $1 in
        v4stock) envs+=(VLLM_H20_MOE_DISPATCH=stock) ;;
        v4marlin) args+=(--moe-backend marlin) ;;  # the recipe's Humming, overridden
        # vLLM's Triton FP8 MoE on the conversion, with the config `h200.sh v4tune` wrote
        # (vLLM ships none for these shapes; without it vLLM logs "Using default MoE config").
        v4triton) args+=(--moe-backend triton)
            [ -d "$SH/triton-configs" ] || { echo "v4triton: no $SH/triton-configs (h200.sh v4tune first)"; return 1; }
            envs+=("VLLM_TUNED_CONFIG_FOLDER=$SH/triton-configs") ;;
    esac
    # W4A8, the seed's baseline: vLLM 0.26 gives Humming BF16 activations unless told
    # (V4HUM_INPUT='{}' serves W4A16); FP8 with per-token scales here (vLLM 0.33 runs
    # block FP8, group 128, for V4.1's declared MXFP8 activations).
    case $1 in v4hum|v4marlin)
        envs+=("VLLM_HUMMING_INPUT_QUANT_CONFIG=${V4HUM_INPUT:-{\"input_dtype\": \"float8e4m3\"\}}") ;;
    esac
    # DeepSeek-V4 needs vLLM's DeepGEMM linear kernel: it alone reshapes wo_a's grouped
    # (bmm) weight scales for V4's fp8_einsum O projection (layout.hpp: t.dim() == N
    # otherwise), and vLLM's CUTLASS one rejects the release's E8M0 scales (dispatch_scaled_mm).
    envs+=(VLLM_DISABLED_KERNELS=FlashInferFp8DeepGEMMDynamicBlockScaledKernel)
    return 0; }
