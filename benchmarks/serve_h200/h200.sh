#!/usr/bin/env bash
# The serving A/B on a Hopper GPU machine without network, in steps that each rerun safely
# (state lives in $SH, default /tmp/serve_h200; servers run under setsid and outlive a step):
#
#   h200.sh boot            install FlashInfer + vllm-h20 from .stage/boot.tar; start building
#                           both reduced modules (fix + stock) in the background
#                           (BUILD_DISPATCH=per_expert: the fix's alone)
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
#   h200.sh sweep SPEC NAME...   vllm-h20 bench sweep (resumes) into $SH/sweeps/SPEC[-$TAG]
#                           (SWEEP_ARGS: more of its flags; SERVE_ARGS at `serve`: more vLLM
#                           flags for every server)
#   h200.sh sweep-bg SPEC NAME...   the same sweep in the background (setsid), so a run outlives
#                           the device call that started it; log $SH/logs/sweep-SPEC.log
#   h200.sh sweep-wait SPEC wait up to WAIT_S (default 540) for it: its exit status, or 3 while
#                           it still runs
#   h200.sh jitsave OUT     the JIT caches (TileLang, vLLM's DeepGEMM, Triton, FlashInfer's
#                           DeepGEMM, autotune) -> OUT/jit-cache.tgz[.NN] (15 MiB pieces)
#   h200.sh jitload [DIR]   restore them from DIR (default .stage: carried with boot.tar; boot
#                           does this first); `install` restores those staged with the wheels
#                           (stage.py --jit-cache DIR)
#   h200.sh stop NAME       stop a server
#   h200.sh collect OUT     results (no traces) -> OUT/serve_h200.tar.gz
#
# .stage/ comes from benchmarks/serve_h200/stage.py on a machine with network.
# The V4 journey's steps and servers (v4*) are benchmarks/journey_h200/h200.sh's; it runs the
# steps above with its own server table (SERVERS=.../journey_h200/servers.sh).
set -uo pipefail
step=${1:?boot|take|install|weights|serve|wait|check|compare|warm|profile|steptime|sweep|sweep-bg|sweep-wait|jitsave|jitload|stop|collect}; shift
cd "$(dirname "$0")/../.."
source benchmarks/serve_h200/env.sh
SERVERS=${SERVERS:-$repo/benchmarks/serve_h200/servers.sh}
source "$SERVERS"
export SERVERS  # steps that call this script again keep the same table
healthy() { curl -sf -m 2 "localhost:$(port "$1")/health" >/dev/null; }
# A sweep's folder name under $SH/sweeps: the spec's, and $TAG for another set of targets.
sweep_name() { echo "$(basename "$1" .yaml)${TAG:+-$TAG}"; }
# Clocks, power, temperature and utilization once a second, appended to $1 in the background
# while a measuring step runs (a throttled stretch shows); its pid in $smi, to kill after.
log_gpu() {
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
        --format=csv -l 1 >> "$1" 2>/dev/null &
    smi=$!
}

# Whether boot's background module build still runs: its shell writes its pid into $SH (a
# process-table search would also find another build on the machine, or a test's).
building() { [ -f "$SH/build.pid" ] && kill -0 "$(cat "$SH/build.pid")" 2>/dev/null; }

case $step in
boot)
    bash "$repo/benchmarks/serve_h200/h200.sh" jitload
    if [ ! -f "$SH/stage/.boot" ]; then
        mkdir -p "$SH/stage" && tar -xf .stage/boot.tar -C "$SH/stage" || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$SH"/stage/boot/*.whl || exit 1
        touch "$SH/stage/.boot"
    fi
    if [ ! -f "$SH/build.done" ] && ! building; then
        # Both reduced modules (BUILD_DISPATCH=per_expert: the fix's alone), so no server
        # compiles on its first MoE call.
        rm -f "$SH/build.pid"
        setsid bash -c "echo \$\$ > $SH/build.pid
            { vllm-h20 kernels build --dispatch ${BUILD_DISPATCH:-both} --json > $SH/build.json; } \
            2> $SH/logs/build.log && touch $SH/build.done" < /dev/null > /dev/null 2>&1 &
        for _ in $(seq 50); do [ -f "$SH/build.pid" ] && break; sleep 0.1; done
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
        if needs_build "$n"; then
            for _ in $(seq 600); do [ -f "$SH/build.done" ] && break; building || break; sleep 1; done
            [ -f "$SH/build.done" ] || { echo "kernels build failed:"; tail -n 20 "$SH/logs/build.log"; exit 1; }
        fi
        args=(--port "$p" --served-model-name "$n"
              --profiler-config "{\"profiler\": \"torch\", \"torch_profiler_dir\": \"$SH/prof/$n\", \"torch_profiler_with_stack\": false, \"ignore_frontend\": true, \"delay_iterations\": 8, \"max_iterations\": 12}")
        # Each engine step's GPU time (CUDA events, vllm_h20/serve/steptimes.py): steptime.py
        # reads it beside the wall clock.
        envs=(VLLM_H20_STRICT=1 "VLLM_H20_STEP_TIMES=$SH/steps/$n")
        server_opts "$n" || exit 1  # the server table's own environment and flags
        args+=(${SERVE_ARGS:-})  # the same extra vLLM flags for every server of a lease
        printf '%s\n' "${envs[@]}" > "$SH/logs/$n.env"  # what each server ran under
        env "${envs[@]}" setsid $(pin "$SERVER_CPUS") vllm-h20 serve "$(recipe_of "$n")" --model "$(model_of "$n")" --gpu h200 \
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
steptime)
    specs=(); for n in "$@"; do specs+=("$n=$(port "$n")"); done
    log_gpu "$SH/steptime/nvidia-smi.csv"
    $(pin "$CLIENT_CPUS") python3 benchmarks/serve_h200/steptime.py --out "$SH/steptime" \
        --step-times "$SH/steps" ${STEPTIME_ARGS:-} "${specs[@]}"
    rc=$?
    kill "$smi" 2>/dev/null
    exit $rc
    ;;
sweep)
    spec=${1:?spec}; shift
    targets=(); for n in "$@"; do targets+=(--target "$n=http://127.0.0.1:$(port "$n")"); done
    name=$(sweep_name "$spec")
    resume=(); [ -d "$SH/sweeps/$name" ] && resume=(--resume)
    # Beside the sweep's folder, not in it: `bench sweep` refuses a folder that is not a sweep.
    log_gpu "$SH/sweeps/nvidia-smi-$name.csv"
    # SWEEP_ARGS: more `bench sweep` flags (e.g. --concurrency 128: one tier of the spec now)
    $(pin "$CLIENT_CPUS") vllm-h20 bench sweep "$spec" "${targets[@]}" --tokenizer "$(model_of "$1")" \
        --out "$SH/sweeps/$name" "${resume[@]}" ${SWEEP_ARGS:-}
    rc=$?
    kill "$smi" 2>/dev/null
    exit $rc
    ;;
sweep-bg)
    # A sweep run takes 90-107 s; one cut by the end of a device call is lost and run again. In
    # the background it goes on between calls (a machine is kept while calls follow at once).
    spec=${1:?spec}; name=sweep-$(sweep_name "$spec")
    if running "$name"; then echo "$name: already running (pid $(cat "$SH/$name.pid"))"; exit 0; fi
    rm -f "$SH/$name.rc"
    RC="$SH/$name.rc" start_bg "$name" "$SH/logs/$name.log" \
        bash -c 'bash "$0" sweep "$@"; echo $? > "$RC"' "$repo/benchmarks/serve_h200/h200.sh" "$@"
    echo "$name: started in the background (pid $(cat "$SH/$name.pid")); log $SH/logs/$name.log"
    ;;
sweep-wait)
    spec=${1:?spec}; name=sweep-$(sweep_name "$spec")
    deadline=$(( $(date +%s) + ${WAIT_S:-540} ))
    until [ -f "$SH/$name.rc" ]; do
        # (the status is written as the sweep ends: look for it once more before calling it lost)
        if ! running "$name" && [ ! -f "$SH/$name.rc" ]; then
            echo "$name: not running, and no exit status in $SH/$name.rc"; exit 1
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            grep -E '^(ok|FAIL) ' "$SH/logs/$name.log" | tail -n 3
            echo "$name: still running"; exit 3
        fi
        sleep 2
    done
    tail -n 5 "$SH/logs/$name.log"
    exit "$(cat "$SH/$name.rc")"
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
    tar -czf "$OUT/serve_h200.tar.gz" -C "$SH" logs check sweeps steptime steps
    ls -l "$OUT"
    ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
