#!/usr/bin/env bash
# The V4 journey (DeepSeek-V4 release -> convert -> serve both) on a Hopper GPU machine without
# network, in steps that each rerun safely; its own steps here, every other step (boot, take,
# install, serve, wait, check, compare, warm, profile, sweep, jitsave, jitload, stop, collect)
# is serve_h200/h200.sh's, run with this journey's servers (servers.sh beside this file):
#
#   h200.sh v4release       a synthetic DeepSeek-V4 release (vllm-h20 synth --preset v4-h200
#                           --layout v4; 21.6 GB in $V4REL: /dev/shm if it has room, the
#                           disk holds the conversion) with serve_h200's byte-level tokenizer;
#                           V4LAYERS=4: four MoE layers (27.6 GB released, 51 GB converted:
#                           the most the 64 GB disk holds), the decision's model
#   h200.sh v4convert       vllm-h20 convert + verify it into $SH/v4/converted (timed;
#                           V4VERIFY=0: no verify)
#   h200.sh v4prep          v4release + v4convert in the background (right after boot: they
#                           need only boot's wheels), logged to logs/v4prep.log; `serve v4*`
#                           waits for it
#   h200.sh v4mhc           compile vLLM 0.26's V4 mHC TileLang kernels for every batch size,
#                           14 at a time, into the cache the servers read (before `serve`:
#                           otherwise they compile at start-up and on the request path)
#   h200.sh v4dg            the same for vLLM's DeepGEMM kernels of V4's FP8 linears and O
#                           projection, every token count up to 8,192
#   h200.sh v4tune [DIR]    tune vLLM's Triton FP8 MoE for the conversion's experts on this GPU
#                           (triton_tune.py: minutes; resumes) into $SH/triton-configs, which
#                           v4triton reads; before the servers start (they would share the GPU)
#   h200.sh v4probe         background: vLLM 0.26 on a small DeepSeek-V4 (v4_probe.py)
#   h200.sh serve NAME...   servers v4hum (8011: the release on Humming, W4A8), v4fix (8012: the
#                           conversion, FlashInfer CUTLASS + fix), v4stock (8013: same, stock),
#                           v4marlin (8014: the release on Marlin, W4A16), v4triton (8015: the
#                           conversion on vLLM's Triton FP8 MoE, v4tune's config)
set -uo pipefail
step=${1:?v4release|v4convert|v4prep|v4mhc|v4dg|v4tune|v4probe or a serve_h200/h200.sh step}; shift
cd "$(dirname "$0")/../.."
source benchmarks/serve_h200/env.sh
export SERVERS=$repo/benchmarks/journey_h200/servers.sh
source "$SERVERS"
# A journey precompile script on the release's config.json (the conversion's is the same model),
# before the servers start: its JSON under check/, its log under logs/ (name $3).
precompile() { local step=$1 script=$2 name=$3 rc
    await_ready v4hum 300
    [ -f "$V4REL/config.json" ] || { echo "$step: no release in $V4REL (v4release first)"; return 1; }
    python3 "benchmarks/journey_h200/$script.py" "$V4REL" --json "$SH/check/$name.json" \
        > "$SH/logs/$name.log" 2>&1
    rc=$?
    grep -v "^\s*$" "$SH/logs/$name.log" | tail -n 4
    return $rc; }

case $step in
v4release)
    if [ ! -f "$V4REL/model.safetensors.index.json" ]; then
        rm -rf "$V4REL"
        s0=$(date +%s)
        # 8 shards: convert works on one shard per process (8 at most).
        vllm-h20 synth "$V4REL" --preset "${V4PRESET:-v4-h200}" --layout v4 --shards 8 \
            ${V4LAYERS:+--layers "$V4LAYERS"} || exit 1
        # GuideLLM sizes prompts with the model's tokenizer: a byte-level BPE, not synth's stub.
        python3 -c "import sys; sys.path.insert(0, 'benchmarks/serve_h200'); from pathlib import Path; \
from make_model import write_tokenizer; write_tokenizer(Path('$V4REL'))" || exit 1
        echo "synth: $(( $(date +%s) - s0 )) s" | tee "$SH/logs/v4-release.txt"
    fi
    mkdir -p "$SH/v4" && touch "$(ready_of v4hum)"
    du -sh "$V4REL"; df -h /dev/shm "$SH" | tail -n 2
    ;;
v4convert)
    mkdir -p "$SH/v4"
    if [ ! -f "$V4FP8/model.safetensors.index.json" ]; then
        s0=$(date +%s)
        vllm-h20 convert "$V4REL" "$V4FP8" --resume || exit 1
        echo "convert: $(( $(date +%s) - s0 )) s" | tee "$SH/logs/v4-convert.txt"
        cp "$V4FP8"/*report*.json "$SH/logs/" 2>/dev/null
    fi
    touch "$(ready_of v4fix)"  # the servers may start while verify reads the checkpoints
    # V4VERIFY=0: no verify (its 8 processes slow the servers' start-up beside them; lease 2
    # measured it on this machine).
    [ "${V4VERIFY:-1}" = 0 ] && { echo "verify: skipped (V4VERIFY=0)" | tee -a "$SH/logs/v4-convert.txt"; exit 0; }
    s0=$(date +%s)
    vllm-h20 verify "$V4REL" "$V4FP8" > "$SH/logs/v4-verify.txt" 2>&1
    rc=$?
    echo "verify: rc $rc, $(( $(date +%s) - s0 )) s" | tee -a "$SH/logs/v4-convert.txt"
    tail -n 5 "$SH/logs/v4-verify.txt"
    du -sh "$V4FP8"; df -h "$SH" | tail -n 1
    exit $rc
    ;;
v4mhc)
    precompile v4mhc mhc_precompile mhc-precompile
    ;;
v4dg)
    precompile v4dg deepgemm_precompile deepgemm-precompile
    ;;
v4prep)
    running v4prep && { echo "v4prep: running"; tail -n 2 "$SH/logs/v4prep.log"; exit 0; }
    if [ -f "$V4FP8/model.safetensors.index.json" ]; then
        echo "v4prep: done"; cat "$SH/logs/v4-release.txt" "$SH/logs/v4-convert.txt" 2>/dev/null
        exit 0
    fi
    start_bg v4prep "$SH/logs/v4prep.log" bash -c "bash $repo/benchmarks/journey_h200/h200.sh \
        v4release && V4VERIFY=${V4VERIFY:-1} bash $repo/benchmarks/journey_h200/h200.sh v4convert"
    echo "v4prep: started (logs/v4prep.log)"
    ;;
v4tune)
    # (a folder with the same experts' config.json instead of the conversion: `v4tune DIR`;
    # TUNE_SIZES="64 128 256": only these batch sizes now, the rest on a later call)
    model=${1:-$V4FP8}
    [ "$model" = "$V4FP8" ] && await_ready v4fix 540
    [ -f "$model/config.json" ] || { echo "v4tune: no config.json in $model (v4convert first)"; exit 1; }
    python3 benchmarks/journey_h200/triton_tune.py "$model" --out "$SH/triton-configs" \
        ${TUNE_SIZES:+--batch-sizes $TUNE_SIZES} >> "$SH/logs/triton-tune.log" 2>&1
    rc=$?
    cp "$SH/triton-configs"/*.json "$SH/logs/" 2>/dev/null  # collect takes logs/
    grep -v "^\s*$" "$SH/logs/triton-tune.log" | tail -n 12
    exit $rc
    ;;
v4probe)
    # Issue 4/4's first look, in the background while nothing is measured: does vLLM 0.26 run
    # a small DeepSeek-V4 (dummy weights) here, with MXFP4 and with FP8 experts?
    running v4probe && { echo "v4 probe: running"; exit 0; }
    start_bg v4probe /dev/null bash -c "python3 benchmarks/journey_h200/v4_probe.py $SH/check/v4 \
            --expert-dtype fp4 > $SH/logs/v4-fp4.log 2>&1; \
            python3 benchmarks/journey_h200/v4_probe.py $SH/check/v4 --expert-dtype fp8 \
            --moe-backend flashinfer_cutlass > $SH/logs/v4-fp8.log 2>&1; \
            python3 benchmarks/journey_h200/v4_probe.py $SH/check/v4 --expert-dtype fp4 \
            --moe-backend humming > $SH/logs/v4-fp4-humming.log 2>&1"
    echo "v4 probe: started"
    ;;
*) exec bash "$repo/benchmarks/serve_h200/h200.sh" "$step" "$@" ;;
esac
