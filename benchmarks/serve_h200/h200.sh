#!/usr/bin/env bash
# The serving A/B on a Hopper GPU machine without network, in steps that each rerun safely
# (state lives in $SH, default /tmp/serve_h200; servers run under setsid and outlive a step):
#
#   h200.sh boot            install FlashInfer + vllm-h20 from .stage/boot.tar; start building
#                           both reduced modules (fix + stock) in the background
#   h200.sh take            move carried .stage/piece-* into $SH/pieces (one per device call)
#   h200.sh install         join the pieces, install vLLM 0.26.0 + its wheels into $SITE
#   h200.sh weights         generate a random checkpoint with real magnitudes into the
#                           model directory (LAYERS=4: 1 dense + 3 MoE, ~41 GB, two servers;
#                           LAYERS=3: ~27 GB, four servers side by side; on the GPU);
#                           servers then load it instead of --load-format dummy
#   h200.sh serve NAME...   start servers: fix (port 8001), stock (8002), triton (8003),
#                           deepgemm (8004: vLLM's DeepGEMM MoE, its vendored deep_gemm)
#   h200.sh wait NAME...    wait until each answers /health (or died: its log tail)
#   h200.sh check [A B]     correctness (A vs B, default fix stock), each one's decode-step
#                           routing, a warm-up, and each one's profile
#   h200.sh compare A B     greedy tokens and first-token logprobs of A vs B (check/compare_A-B.json)
#   h200.sh profile NAME... a torch-profiler kernel table of a few decode steps at c128
#   h200.sh warm NAME...    the sweeps' batch shapes once, each wave timed (before sweeping)
#   h200.sh steptime NAME...     decode- and prefill-step time of each server, arms interleaved
#                           (steptime.py; resumes) into $SH/steptime, GPU clocks logged beside;
#                           every server logs its steps' GPU time into $SH/steps/NAME
#   h200.sh sweep SPEC NAME...   vllm-h20 bench sweep (resumes) into $SH/runs/SPEC[-$TAG]
#   h200.sh v4probe         background: vLLM 0.26 on a small DeepSeek-V4 (benchmarks/journey_h200)
#   h200.sh v4release       issue 4/4: a synthetic DeepSeek-V4 release (vllm-h20 synth --preset
#                           v4-h200 --layout v4; 21.6 GB in $V4REL: /dev/shm if it has room, the
#                           disk holds the conversion) with this folder's byte-level tokenizer
#   h200.sh v4convert       vllm-h20 convert + verify it into $SH/v4/converted (timed)
#   h200.sh v4mhc           compile vLLM 0.26's V4 mHC TileLang kernels for every batch size,
#                           14 at a time, into the cache the servers read (before `serve v4*`:
#                           otherwise they compile at start-up and on the request path)
#   h200.sh v4dg            the same for vLLM's DeepGEMM kernels of V4's FP8 linears and O
#                           projection, every token count up to 8,192 (journey lease 3 compiled
#                           47 of them during its decode sweep)
#   h200.sh v4prep          v4release + v4convert in the background (right after boot: they
#                           need only boot's wheels), logged to logs/v4prep.log; `serve v4*`
#                           waits for it
#                           servers v4hum (8011: the release on Humming), v4fix (8012: the
#                           conversion, FlashInfer CUTLASS + fix), v4stock (8013: same, stock),
#                           v4marlin (8014: the release on Marlin, W4A16: how far activation
#                           rounding alone moves it, or the baseline if Humming cannot run)
#   h200.sh jitsave OUT     the JIT caches (TileLang, vLLM's DeepGEMM, Triton, FlashInfer's
#                           DeepGEMM, autotune) -> OUT/jit-cache.tgz[.NN] (15 MiB pieces)
#   h200.sh jitload [DIR]   restore them from DIR (default .stage: carried with boot.tar; boot
#                           does this first); `install` restores those staged with the wheels
#                           (stage.py --jit-cache DIR)
#   h200.sh stop NAME       stop a server
#   h200.sh collect OUT     results (no traces) -> OUT/serve_h200.tar.gz
#
# .stage/ comes from benchmarks/serve_h200/stage.py on a machine with network.
set -uo pipefail
step=${1:?boot|take|install|weights|serve|wait|check|compare|warm|profile|steptime|v4release|v4convert|v4prep|v4mhc|v4dg|v4probe|sweep|jitsave|jitload|stop|collect}; shift
cd "$(dirname "$0")/../.."
repo=$PWD
SH=${SH:-/tmp/serve_h200}
SITE=${SITE:-$SH/site}
mkdir -p "$SH"/{logs,pieces,runs,check,prof,steptime,steps}
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

port() { case $1 in fix) echo 8001 ;; stock) echo 8002 ;; triton) echo 8003 ;; deepgemm) echo 8004 ;;
         v4hum) echo 8011 ;; v4fix) echo 8012 ;; v4stock) echo 8013 ;; v4marlin) echo 8014 ;;
         *) echo "unknown server $1 (fix|stock|triton|deepgemm|v4hum|v4fix|v4stock|v4marlin)" >&2
            return 1 ;; esac; }
# The checkpoint and recipe each server runs.
model_of() { case $1 in v4hum|v4marlin) echo "$V4REL" ;; v4fix|v4stock) echo "$V4FP8" ;; *) echo "$model" ;; esac; }
recipe_of() { case $1 in
    v4hum|v4marlin) echo "$repo/recipes/test-h200-dsv4-mxfp4-humming.yaml" ;;
    v4fix|v4stock) echo "$repo/recipes/test-h200-dsv4-fp8-flashinfer-cutlass.yaml" ;;
    *) echo "$recipe" ;; esac; }
# Written once a V4 checkpoint is complete (before verify), for `serve` to wait on.
ready_of() { case $1 in v4hum|v4marlin) echo "$SH/v4/release.ready" ;; *) echo "$SH/v4/converted.ready" ;; esac; }
healthy() { curl -sf -m 2 "localhost:$(port "$1")/health" >/dev/null; }
# Servers and the load generators on separate CPU sets, so a client's work never steals a
# server's core (SERVER_CPUS / CLIENT_CPUS, default: all but the last 4 cores / the last 4).
ncpu=$(nproc)
SERVER_CPUS=${SERVER_CPUS:-0-$(( ncpu > 8 ? ncpu - 5 : ncpu - 1 ))}
CLIENT_CPUS=${CLIENT_CPUS:-$(( ncpu > 8 ? ncpu - 4 : 0 ))-$(( ncpu - 1 ))}
pin() { if command -v taskset >/dev/null; then echo taskset -c "$1"; fi; }
# Whether a background step (v4prep, v4probe) still runs: its pid file, not pgrep -f, since a
# caller's own command line may name the step.
running() { [ -f "$SH/$1.pid" ] && kill -0 "$(cat "$SH/$1.pid")" 2>/dev/null; }
# Wait up to $2 s for server $1's checkpoint to be marked complete, while v4prep still runs.
await_ready() { for _ in $(seq "$2"); do [ -f "$(ready_of "$1")" ] && break; running v4prep || break; sleep 1; done; }
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
# Cache entries with their modification times (when each kernel was compiled), oldest first.
list_by_time() { local dir=$1 out=$2; shift 2
    find "$dir" "$@" -printf '%TY-%Tm-%Td %TH:%TM:%.2TS %s %P\n' 2>/dev/null | sort > "$SH/logs/$out"; }

case $step in
boot)
    bash "$repo/benchmarks/serve_h200/h200.sh" jitload
    if [ ! -f "$SH/stage/.boot" ]; then
        mkdir -p "$SH/stage" && tar -xf .stage/boot.tar -C "$SH/stage" || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$SH"/stage/boot/*.whl || exit 1
        touch "$SH/stage/.boot"
    fi
    if [ ! -f "$SH/build.done" ] && ! pgrep -f "kernels build" >/dev/null; then
        # Both reduced modules, so neither server compiles on its first MoE call.
        setsid bash -c "vllm-h20 kernels build --dispatch both --json > $SH/build.json \
            2> $SH/logs/build.log && touch $SH/build.done" < /dev/null > /dev/null 2>&1 &
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)"
    ;;
take)
    for p in .stage/piece-*; do [ -e "$p" ] && mv "$p" "$SH/pieces/"; done
    ls -l "$SH/pieces" | tail -n +2 | awk '{print $5, $9}'
    ;;
install)
    if [ ! -f "$SH/stage/.installed" ]; then
        want=$(cat "$SH/stage/boot/pieces.txt")
        have=$(ls "$SH/pieces" | wc -l)
        [ "$have" = "$want" ] || { echo "have $have of $want pieces"; exit 1; }
        cat "$SH"/pieces/piece-* | tar -x -C "$SH/stage" || exit 1
        # A previous lease's JIT caches, when staged with them (stage.py --jit-cache).
        if [ -d "$SH/stage/jit" ]; then
            bash "$repo/benchmarks/serve_h200/h200.sh" jitload "$SH/stage/jit" || exit 1
        fi
        # pip --target skips every top-level folder the target already holds ("already
        # exists"), so wheels sharing one lose files (CuTe DSL's three share nvidia_cutlass_dsl/:
        # the journey's first lease lost `cutlass.cute` that way). One pip run into an empty
        # folder installs them as a prefix would; the result is then merged into boot's $SITE.
        rm -rf "$SH/site.new"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SH/site.new" \
            "$SH"/stage/wheels/*.whl 2>&1 | tail -n 5
        cp -a "$SH/site.new/." "$SITE/" || exit 1
        rm -rf "$SH/site.new"
        python3 -c "import vllm; print('vllm', vllm.__version__)" || exit 1
        # vLLM's own script, where its wheel's did not land in bin/.
        if [ ! -x "$SITE/bin/vllm" ]; then
            mkdir -p "$SITE/bin"
            printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > "$SITE/bin/vllm"
            chmod +x "$SITE/bin/vllm"
        fi
        touch "$SH/stage/.installed"
    fi
    vllm-h20 recipe check "$recipe" || exit 1
    ;;
weights)
    if [ ! -f "$model/model.safetensors.index.json" ]; then
        python3 benchmarks/serve_h200/make_model.py "$model" --weights --layers "${LAYERS:-4}" \
            --device cuda || exit 1
    fi
    du -sh "$model"; df -h "$SH" | tail -n 1
    ;;
serve)
    for n in "$@"; do
        p=$(port "$n") || exit 1
        healthy "$n" && { echo "$n: already serving on $p"; continue; }
        pgrep -f -- "--port $p" >/dev/null && { echo "$n: starting (pid $(pgrep -f -- "--port $p" | head -1))"; continue; }
        case $n in fix|stock|v4fix|v4stock) need_build=1 ;; *) need_build= ;; esac
        if [ -n "$need_build" ]; then
            for _ in $(seq 600); do [ -f "$SH/build.done" ] && break; pgrep -f "kernels build" >/dev/null || break; sleep 1; done
            [ -f "$SH/build.done" ] || { echo "kernels build failed:"; tail -n 20 "$SH/logs/build.log"; exit 1; }
        fi
        args=(--port "$p" --served-model-name "$n"
              --profiler-config "{\"profiler\": \"torch\", \"torch_profiler_dir\": \"$SH/prof/$n\", \"torch_profiler_with_stack\": false, \"ignore_frontend\": true, \"delay_iterations\": 8, \"max_iterations\": 12}")
        m=$(model_of "$n")
        case $n in v4*)  # the checkpoint may still be in the making (v4prep); verify may not
            await_ready "$n" 540 ;;
        esac
        [ -f "$m/model.safetensors.index.json" ] || case $n in v4*)
            echo "$n: no checkpoint in $m (v4release / v4convert first)"; exit 1 ;; esac
        # A generated checkpoint (the `weights` step) replaces the V3 recipe's dummy weights.
        [ "$m" = "$model" ] && [ -f "$m/model.safetensors.index.json" ] && args+=(--load-format auto)
        # Each engine step's GPU time (CUDA events, vllm_h20/serve/steptimes.py): steptime.py
        # reads it beside the wall clock.
        envs=(VLLM_H20_STRICT=1 "VLLM_H20_STEP_TIMES=$SH/steps/$n")
        [ "$n" = v4marlin ] && args+=(--moe-backend marlin)  # the recipe's Humming, overridden
        case $n in
            stock|v4stock) envs+=(VLLM_H20_MOE_DISPATCH=stock) ;;
            triton) args+=(--moe-backend triton) ;;
            deepgemm) args+=(--moe-backend deep_gemm) ;;
            # W4A8, the seed's baseline: vLLM 0.26 gives Humming BF16 activations unless told
            # (V4HUM_INPUT='{}' serves W4A16); FP8 with per-token scales here (vLLM 0.33 runs
            # block FP8, group 128, for V4.1's declared MXFP8 activations).
            v4hum|v4marlin) envs+=("VLLM_HUMMING_INPUT_QUANT_CONFIG=${V4HUM_INPUT:-{\"input_dtype\": \"float8e4m3\"\}}") ;;
        esac
        # DeepSeek-V4 needs vLLM's DeepGEMM linear kernel: it alone reshapes wo_a's grouped
        # (bmm) weight scales for V4's fp8_einsum O projection (layout.hpp: t.dim() == N
        # otherwise), and vLLM's CUTLASS one rejects the release's E8M0 scales (dispatch_scaled_mm).
        case $n in v4*) envs+=(VLLM_DISABLED_KERNELS=FlashInferFp8DeepGEMMDynamicBlockScaledKernel) ;; esac
        printf '%s\n' "${envs[@]}" > "$SH/logs/$n.env"  # what each server ran under
        env "${envs[@]}" setsid $(pin "$SERVER_CPUS") vllm-h20 serve "$(recipe_of "$n")" --model "$m" --gpu h200 \
            -- "${args[@]}" \
            > "$SH/logs/$n.log" 2>&1 < /dev/null &
        echo "$n: started on port $p"
    done
    ;;
wait)
    deadline=$(( $(date +%s) + ${WAIT_S:-540} ))
    for n in "$@"; do
        p=$(port "$n") || exit 1
        until healthy "$n"; do
            if ! pgrep -f -- "--port $p" >/dev/null; then
                echo "$n: server exited:"; grep -v "^\s*$" "$SH/logs/$n.log" | tail -n 25; exit 1
            fi
            [ "$(date +%s)" -ge "$deadline" ] && { echo "$n: not healthy yet"; tail -n 3 "$SH/logs/$n.log"; exit 3; }
            sleep 2
        done
        echo "$n: healthy; $(grep -m1 -o 'vllm-h20: .*' "$SH/logs/$n.log" | cut -c1-160)"
    done
    ;;
check)
    # Two servers (default: fix stock; the journey: v4hum v4fix): greedy comparison, then each
    # one's decode-step routing and kernel profile.
    a=${1:-fix}; b=${2:-stock}
    bash "$repo/benchmarks/serve_h200/h200.sh" compare "$a" "$b" || exit 1
    for n in "$a" "$b"; do
        python3 benchmarks/serve_h200/probe.py routing --out "$SH/check" "$n=$(port "$n")" || exit 1
    done
    # Kernels compiled on the request path would fill the profile window (round 3 lost the
    # fix's profile that way): the sweeps' shapes once first.
    bash "$repo/benchmarks/serve_h200/h200.sh" warm "$a" "$b"
    bash "$repo/benchmarks/serve_h200/h200.sh" profile "$a" "$b" || exit 1
    ;;
compare)
    a=${1:?server}; b=${2:?server}
    python3 benchmarks/serve_h200/probe.py compare --out "$SH/check" "$a=$(port "$a")" \
        "$b=$(port "$b")"
    ;;
warm)
    # The sweeps' batch shapes once per server, timed per wave (check/warm.json): kernels
    # compiled on the request path show here, and stay out of the sweeps' windows.
    specs=(); for n in "$@"; do specs+=("$n=$(port "$n")"); done
    python3 benchmarks/serve_h200/probe.py warm --out "$SH/check" "${specs[@]}"
    ;;
profile)
    for n in "$@"; do
        python3 benchmarks/serve_h200/probe.py profile --out "$SH/check" --trace-dir "$SH/prof/$n" "$n=$(port "$n")" || exit 1
    done
    ;;
v4release)
    if [ ! -f "$V4REL/model.safetensors.index.json" ]; then
        rm -rf "$V4REL"
        s0=$(date +%s)
        # 8 shards: convert works on one shard per process (8 at most).
        vllm-h20 synth "$V4REL" --preset "${V4PRESET:-v4-h200}" --layout v4 --shards 8 || exit 1
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
    setsid bash -c "bash $repo/benchmarks/serve_h200/h200.sh v4release && \
        V4VERIFY=${V4VERIFY:-1} bash $repo/benchmarks/serve_h200/h200.sh v4convert" \
        < /dev/null > "$SH/logs/v4prep.log" 2>&1 &
    echo $! > "$SH/v4prep.pid"
    echo "v4prep: started (logs/v4prep.log)"
    ;;
v4probe)
    # Issue 4/4's first look, in the background while nothing is measured: does vLLM 0.26 run
    # a small DeepSeek-V4 (dummy weights) here, with MXFP4 and with FP8 experts?
    running v4probe && { echo "v4 probe: running"; exit 0; }
    setsid bash -c "python3 benchmarks/journey_h200/v4_probe.py $SH/check/v4 --expert-dtype fp4 \
            > $SH/logs/v4-fp4.log 2>&1; python3 benchmarks/journey_h200/v4_probe.py $SH/check/v4 \
            --expert-dtype fp8 --moe-backend flashinfer_cutlass > $SH/logs/v4-fp8.log 2>&1; \
            python3 benchmarks/journey_h200/v4_probe.py $SH/check/v4 --expert-dtype fp4 \
            --moe-backend humming > $SH/logs/v4-fp4-humming.log 2>&1" \
        < /dev/null > /dev/null 2>&1 &
    echo $! > "$SH/v4probe.pid"
    echo "v4 probe: started"
    ;;
steptime)
    specs=(); for n in "$@"; do specs+=("$n=$(port "$n")"); done
    # Clocks, power and temperature once a second while it runs: a throttled stretch shows.
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
        --format=csv -l 1 >> "$SH/steptime/nvidia-smi.csv" 2>/dev/null &
    smi=$!
    $(pin "$CLIENT_CPUS") python3 benchmarks/serve_h200/steptime.py --out "$SH/steptime" \
        --step-times "$SH/steps" ${STEPTIME_ARGS:-} "${specs[@]}"
    rc=$?
    kill "$smi" 2>/dev/null
    exit $rc
    ;;
sweep)
    spec=${1:?spec}; shift
    targets=(); for n in "$@"; do targets+=(--target "$n=http://127.0.0.1:$(port "$n")"); done
    name=$(basename "$spec" .yaml)${TAG:+-$TAG}   # TAG: another set of targets, same spec
    resume=(); [ -d "$SH/runs/$name" ] && resume=(--resume)
    $(pin "$CLIENT_CPUS") vllm-h20 bench sweep "$spec" "${targets[@]}" --tokenizer "$(model_of "$1")" \
        --out "$SH/runs/$name" "${resume[@]}"
    ;;
jitsave)
    OUT=${1:?out dir}; mkdir -p "$OUT"
    dirs=(); for d in "${JIT_DIRS[@]}"; do [ -d "$SH/$d" ] && dirs+=("$d"); done
    [ ${#dirs[@]} -gt 0 ] || { echo "jitsave: no JIT cache under $SH"; exit 1; }
    rm -f "$OUT"/jit-cache.tgz*
    # The device tool returns files of at most 16 MiB: one piece, or 15 MiB pieces.
    tar -czf - -C "$SH" --exclude='tmp' "${dirs[@]}" | split -b 15M -d -a 2 - "$OUT/jit-cache.tgz."
    [ "$(ls "$OUT"/jit-cache.tgz.* | wc -l)" = 1 ] && mv "$OUT/jit-cache.tgz.00" "$OUT/jit-cache.tgz"
    du -sh "${dirs[@]/#/$SH/}" 2>/dev/null; ls -l "$OUT"/jit-cache.tgz*
    ;;
jitload)
    src=${1:-.stage}
    ls "$src"/jit-cache.tgz* >/dev/null 2>&1 || exit 0  # nothing carried: cold caches
    [ -f "$SH/jit.loaded" ] && exit 0
    # Into a folder of its own first: a damaged archive leaves no truncated kernel behind.
    rm -rf "$SH/jit.new" && mkdir -p "$SH/jit.new"
    if ! cat "$src"/jit-cache.tgz* | tar -xz -C "$SH/jit.new" 2>/dev/null; then
        rm -rf "$SH/jit.new"; echo "jitload: $src/jit-cache.tgz* is damaged; not restored"; exit 1
    fi
    cp -a "$SH/jit.new/." "$SH/" && rm -rf "$SH/jit.new" && touch "$SH/jit.loaded"
    echo "jitload: restored $(cd "$SH" && du -sh "${JIT_DIRS[@]}" 2>/dev/null | tr '\n' ' ')"
    ;;
stop)
    # The server is a session leader (setsid): end its whole process group, engine core too.
    for n in "$@"; do
        pid=$(pgrep -f -- "--port $(port "$n")" | head -n 1)
        [ -n "$pid" ] || { echo "$n: not running"; continue; }
        pgid=$(ps -o pgid= "$pid" | tr -d ' ')
        kill -TERM -- "-$pgid"
        for _ in $(seq 60); do pgrep -g "$pgid" >/dev/null || break; sleep 1; done
        pgrep -g "$pgid" >/dev/null && kill -KILL -- "-$pgid"
        echo "$n: stopped"
    done
    ;;
collect)
    OUT=${1:?out dir}; mkdir -p "$OUT"
    nvidia-smi > "$SH/logs/nvidia-smi.txt" 2>&1
    python3 -m pip list --path "$SITE" 2>/dev/null > "$SH/logs/site-packages.txt"
    python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" >> "$SH/logs/site-packages.txt"
    cp "$SH/build.json" "$SH/logs/" 2>/dev/null
    # When each DeepGEMM kernel was compiled: a kernel compiled while serving stalls the server.
    list_by_time "$TRTLLM_DG_CACHE_DIR" deepgemm-cache.txt -type f
    list_by_time "$TILELANG_CACHE_DIR" tilelang-cache.txt -mindepth 2 -maxdepth 2
    # vLLM's vendored DeepGEMM: each kernel file, when it was compiled (V4's linears, O
    # projection and indexer; compiled on first use unless a cache came with jitload).
    list_by_time "$VLLM_CACHE_ROOT/deep_gemm" vllm-deepgemm-cache.txt -type f
    # ... and the configuration of each (shape, blocks, stages): which GEMM compiled when.
    python3 benchmarks/journey_h200/deepgemm_precompile.py --list "$VLLM_CACHE_ROOT/deep_gemm" \
        > "$SH/logs/vllm-deepgemm-kernels.txt" 2>&1
    # Triton's kernels (one metadata JSON each): `stalls.py` counts both per sweep cell.
    list_by_time "$TRITON_CACHE_DIR" triton-cache.txt -name '*.json' ! -name '__grp__*'
    tar -czf "$OUT/serve_h200.tar.gz" -C "$SH" logs check runs steptime steps
    ls -l "$OUT"
    ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
