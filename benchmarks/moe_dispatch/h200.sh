#!/usr/bin/env bash
# The dispatch evidence on one lent H200, as a few device calls of one machine hold. State lives
# in /tmp/moe-session (the repository copy a call runs in is replaced by the next call's):
#
#   benchmarks/moe_dispatch/h200.sh smoke   # copy the repo, build, a few cases of each kind (~3 min);
#                                           # on success start `full` in the background (setsid)
#   benchmarks/moe_dispatch/h200.sh start   # copy the repo and start `full` without the smoke
#   benchmarks/moe_dispatch/h200.sh full    # kernel-level A/B (every routing x token count),
#                                           # H20 emulations, a re-run of the concentrated
#                                           # routings, fused op (A/B + FlashInfer's tests)
#   benchmarks/moe_dispatch/h200.sh wait S  # follow the background run for up to S seconds
#   benchmarks/moe_dispatch/h200.sh collect OUT   # what exists so far, as <= 8 files, into OUT
#
# SERIES=candidates/fitted-row-tiles measures that patch series (under patches/flashinfer/)
# instead of the shipped one, in the kernel-level runs (--series) and the fused op
# (VLLM_H20_PATCH_SERIES). Needs .fi/ (carried): the FlashInfer 0.7.2.post1 source tarball
# (moe_dispatch/fetch_sources.py) and the FlashInfer 0.6.14 wheels + tests (fused_moe/stage.py,
# run with the same VLLM_H20_PATCH_SERIES so that the series' own test is staged).
set -uo pipefail
step=${1:?smoke|start|full|wait|collect}
S=/tmp/moe-session
export PYTHONUNBUFFERED=1
mkdir -p "$S/out"

# GPU clocks, power and temperature at a step's start or end, beside its results.
clocks() {
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
        --format=csv > "$S/out/nvidia-smi-$1.csv"
}

copy_repo() {
    rm -rf "$S/repo" && mkdir -p "$S/repo" && cp -a . "$S/repo/" && rm -rf "$S/repo/.build"
}

# The kernel-level A/B's command (run.py), its builds and DeepGEMM cache kept in $S/work.
RUN=(python3 benchmarks/moe_dispatch/run.py --flashinfer .fi/flashinfer-0.7.2.post1-src.tar.xz
     --work "$S/work" --series "${SERIES:-}")
if [ -n "${SERIES:-}" ]; then
    export VLLM_H20_PATCH_SERIES=$SERIES
fi

case "$step" in
smoke)
    copy_repo
    cd "$S/repo" || exit 1
    clocks start
    timeout 480 "${RUN[@]}" --out "$S/out/smoke" --quick --routings uniform,same_rank,zipf2,pool8 \
        --no-calibration > "$S/out/smoke.log" 2>&1
    rc=$?
    tail -n 25 "$S/out/smoke.log"
    if [ $rc -ne 0 ]; then
        echo "smoke failed (exit $rc); the full run was not started"
        exit $rc
    fi
    setsid nohup bash benchmarks/moe_dispatch/h200.sh full > "$S/out/full.log" 2>&1 < /dev/null &
    echo "full run started in the background (pid $!)"
    ;;
start)
    # `full` in the background without the smoke (when this commit's smoke passed already).
    copy_repo
    clocks start
    (cd "$S/repo" && setsid nohup bash benchmarks/moe_dispatch/h200.sh full > "$S/out/full.log" 2>&1 \
        < /dev/null &)
    echo "full run started in the background"
    ;;
full)
    cd "$S/repo" || exit 1
    # Timed work first (nothing else on the GPU meanwhile), FlashInfer's tests (compile-bound)
    # last; every step writes its files as it goes and has a time limit.
    echo "[$(date +%T)] kernel-level A/B"
    timeout 900 "${RUN[@]}" --out "$S/out/kernel" > "$S/out/kernel.log" 2>&1
    echo "[$(date +%T)] kernel-level A/B: exit $?"
    echo "[$(date +%T)] H20 emulations"
    timeout 600 "${RUN[@]}" --out "$S/out/emulated" --no-main --no-calibration --emulate "${EMULATE:-all}" \
        > "$S/out/emulated.log" 2>&1
    echo "[$(date +%T)] H20 emulations: exit $?"
    echo "[$(date +%T)] kernel-level A/B again, concentrated routings (the bar's re-run)"
    timeout 600 "${RUN[@]}" --out "$S/out/kernel-rerun" --no-calibration \
        --routings "${RERUN_ROUTINGS:-same_rank,same_spread,pool8,pool16,zipf2,zipf,hot}" \
        > "$S/out/kernel-rerun.log" 2>&1
    echo "[$(date +%T)] kernel-level A/B again: exit $?"
    echo "[$(date +%T)] fused op: build, A/B, FlashInfer's tests on the fix module"
    fused() { timeout "$1" bash benchmarks/fused_moe/h200.sh "$2" "$S/out/fused"; }
    { fused 600 build && fused 600 bench && MODES=per_expert fused "${TEST_LIMIT:-900}" test; } \
        > "$S/out/fused.log" 2>&1
    echo "[$(date +%T)] fused op: exit $?"
    echo "[$(date +%T)] the patch's test on the stock module (it must fail there)"
    MODES=stock fused 600 test > "$S/out/fused-stock-tests.log" 2>&1
    echo "[$(date +%T)] stock-module tests: exit $?"
    clocks end
    echo "[$(date +%T)] done"
    ;;
wait)
    limit=${2:-500}
    for _ in $(seq 1 "$limit"); do
        grep -q "\] done" "$S/out/full.log" 2>/dev/null && break
        sleep 1
    done
    cat "$S/out/full.log" 2>/dev/null
    for f in kernel emulated kernel-rerun fused; do
        [ -f "$S/out/$f.log" ] && { echo "--- $f.log"; tail -n 4 "$S/out/$f.log"; }
    done
    ;;
collect)
    OUT=$(realpath -m "${2:?output directory}")
    mkdir -p "$OUT"
    for part in kernel kernel-rerun fused emulated smoke; do
        [ -d "$S/out/$part" ] && tar -czf "$OUT/$part.tgz" -C "$S/out" "$part"
    done
    tar -czf "$OUT/logs.tgz" -C "$S/out" $(cd "$S/out" && ls ./*.log ./*.csv 2>/dev/null)
    ls -la "$OUT"
    ;;
*)
    echo "unknown step $step (smoke|start|full|wait|collect)" >&2
    exit 2
    ;;
esac
