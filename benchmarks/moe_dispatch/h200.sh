#!/usr/bin/env bash
# The dispatch evidence on one lent H200, as a few device calls of one machine hold. State lives
# in /tmp/moe-session, or $MOE_SESSION (the repository copy a call runs in is replaced by the
# next call's):
#
#   benchmarks/moe_dispatch/h200.sh smoke   # copy the repo, build, a few cases of two families
#                                           # (~3 min); on success start `full` in the background
#   benchmarks/moe_dispatch/h200.sh start   # copy the repo and start `full` without the smoke
#   benchmarks/moe_dispatch/h200.sh full    # the steps, in order: kernel (run.py over spec.yaml:
#                                           # every family x routing x token count), emulated
#                                           # (spec-h20.yaml at 78 SMs on all SMs, 40 and 20 CTAs,
#                                           # with --calibrate), rerun (the concentrated routings
#                                           # again), fused (the fused op: A/B + FlashInfer's tests),
#                                           # stock_tests; STEPS picks some ("profile" adds run.py
#                                           # --profile over PROFILE_ROUTINGS x PROFILE_TOKENS);
#                                           # FAMILIES, ROUTINGS, TOKENS narrow kernel and rerun
#                                           # (run.py's --families, --routings, --tokens); SPEC
#                                           # names another spec (a candidate's). Exits non-zero
#                                           # when a step failed (session log: each step's status)
#   benchmarks/moe_dispatch/h200.sh wait S  # follow the background run for up to S seconds
#   benchmarks/moe_dispatch/h200.sh collect OUT   # what exists so far, as <= 8 files, into OUT
#
# The candidate series that lost are measured from the tag experiments/2026-12-06 (its own
# run.py). Needs .fi/ (carried): the FlashInfer 0.7.2.post1 source tarball
# (moe_dispatch/fetch_sources.py) and the FlashInfer 0.6.14 wheels + tests (fused_moe/stage.py).
set -uo pipefail
step=${1:?smoke|start|full|wait|collect}
S=${MOE_SESSION:-/tmp/moe-session}
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

# The kernel-level A/B's command (run.py), its builds and DeepGEMM caches kept in $S/work, in one
# directory per state of the spec's patches (run.py's work_for): a later start with a changed
# patch builds it anew instead of timing the earlier one.
RUN=(python3 benchmarks/moe_dispatch/run.py --flashinfer .fi/flashinfer-0.7.2.post1-src.tar.xz
     --work "$S/work")
# The selection kernel and rerun share (empty: the whole spec).
SEL=(${SPEC:+--spec "$SPEC"} ${FAMILIES:+--families "$FAMILIES"} ${TOKENS:+--tokens "$TOKENS"})

case "$step" in
smoke)
    copy_repo
    cd "$S/repo" || exit 1
    clocks start
    timeout 480 "${RUN[@]}" --out "$S/out/smoke" --families v4.1-flash-ep8,dsv3-ep8 \
        --tokens 1,128,3072 --routings uniform,same_rank,zipf2,pool8 > "$S/out/smoke.log" 2>&1
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
    # last; every step writes its files as it goes and has a time limit. STEPS picks some of
    # them (default: all, in this order), e.g. STEPS="fused stock_tests" after a lease that ran
    # out before them.
    all_steps="kernel emulated rerun fused stock_tests"
    for name in ${STEPS:-}; do
        case " profile $all_steps " in
        *" $name "*) ;;
        *)
            echo "h200.sh full: unknown step '$name' in STEPS (profile $all_steps)" >&2
            exit 2
            ;;
        esac
    done
    failed=0
    # One step: its start, then its exit status taken before anything else runs.
    run_step() {
        local name=$1 label=$2
        case " ${STEPS:-$all_steps} " in
        *" $name "*) ;;
        *) return 0 ;;
        esac
        echo "[$(date +%T)] $label"
        "run_$name"
        local rc=$?
        echo "[$(date +%T)] $label: exit $rc"
        [ "$rc" -eq 0 ] || failed=$((failed + 1))
    }
    run_profile() {
        timeout 900 "${RUN[@]}" "${SEL[@]}" --profile --out "$S/out/profile" \
            --routings "${PROFILE_ROUTINGS:-uniform,trained,pool16}" \
            --tokens "${PROFILE_TOKENS:-1024,3072,8192}" > "$S/out/profile.log" 2>&1
    }
    run_kernel() {
        timeout 1800 "${RUN[@]}" "${SEL[@]}" ${ROUTINGS:+--routings "$ROUTINGS"} \
            --out "$S/out/kernel" > "$S/out/kernel.log" 2>&1
    }
    # H20 emulations: spec-h20.yaml's calibration-build versions planning for 78 SMs, on all
    # SMs and on 40 / 20 CTAs (an H20's FP8 rate), each with the forced-kernel calibration.
    run_emulated() {
        local rc=0 grid
        for grid in ${EMULATE_GRIDS:-78 40 20}; do
            VLLM_H20_NUM_SMS=78 VLLM_H20_GRID_SMS=$grid timeout 900 "${RUN[@]}" \
                --spec benchmarks/moe_dispatch/spec-h20.yaml --calibrate \
                --out "$S/out/emulated/grid$grid" > "$S/out/emulated-grid$grid.log" 2>&1 || rc=$?
        done
        return "$rc"
    }
    run_rerun() {
        timeout 900 "${RUN[@]}" "${SEL[@]}" --out "$S/out/kernel-rerun" \
            --routings "${RERUN_ROUTINGS:-same_rank,same_spread,pool8,pool16,zipf2,zipf,hot}" \
            ${PROFILE:+--profile} > "$S/out/kernel-rerun.log" 2>&1
    }
    fused() { timeout "$1" bash benchmarks/fused_moe/h200.sh "$2" "$S/out/fused"; }
    # FlashInfer's tests run whenever the module built: the A/B's own check failing (its fp32
    # reference, both modules alike) says nothing about them.
    run_fused() {
        fused 600 build || return
        local rc=0
        fused 600 bench || rc=$?
        MODES=per_expert fused "${TEST_LIMIT:-900}" test || rc=$?
        return "$rc"
    } > "$S/out/fused.log" 2>&1
    run_stock_tests() { MODES=stock fused 600 test > "$S/out/fused-stock-tests.log" 2>&1; }
    run_step profile "profile: where each version's time goes (run.py --profile)"
    run_step kernel "kernel-level A/B"
    run_step emulated "H20 emulations"
    run_step rerun "kernel-level A/B again, concentrated routings (the bar's re-run)"
    run_step fused "fused op: build, A/B, FlashInfer's tests on the fix module"
    run_step stock_tests "the patch's test on the stock module (it must fail there)"
    clocks end
    echo "[$(date +%T)] done ($failed failed)"
    [ "$failed" -eq 0 ]
    ;;
wait)
    limit=${2:-500}
    for _ in $(seq 1 "$limit"); do
        grep -q "\] done" "$S/out/full.log" 2>/dev/null && break
        sleep 1
    done
    cat "$S/out/full.log" 2>/dev/null
    for f in profile kernel emulated-grid78 emulated-grid40 emulated-grid20 kernel-rerun fused; do
        [ -f "$S/out/$f.log" ] && { echo "--- $f.log"; tail -n 4 "$S/out/$f.log"; }
    done
    ;;
collect)
    OUT=$(realpath -m "${2:?output directory}")
    mkdir -p "$OUT"
    for part in profile kernel kernel-rerun fused emulated smoke; do
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
