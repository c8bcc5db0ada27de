# The serving A/B's servers (sourced by h200.sh; another driver passes its own table in
# SERVERS, as the V4 journey does): each server's port, checkpoint, recipe, whether it needs the
# reduced modules built first, and its own environment and vLLM flags (`server_opts NAME`
# appends to the caller's `envs` and `args` arrays; non-zero: do not start it).
port() { case $1 in fix) echo 8001 ;; stock) echo 8002 ;; triton) echo 8003 ;; deepgemm) echo 8004 ;;
         *) echo "unknown server $1 (fix|stock|triton|deepgemm)" >&2; return 1 ;; esac; }
model_of() { echo "$model"; }
recipe_of() { echo "$recipe"; }
needs_build() { case $1 in fix|stock) return 0 ;; *) return 1 ;; esac; }
server_opts() {
    # A generated checkpoint (the `weights` step) replaces the recipe's dummy weights.
    [ -f "$model/model.safetensors.index.json" ] && args+=(--load-format auto)
    case $1 in
        stock) envs+=(VLLM_H20_MOE_DISPATCH=stock) ;;
        triton) args+=(--moe-backend triton) ;;
        deepgemm) args+=(--moe-backend deep_gemm) ;;
    esac
    return 0; }
