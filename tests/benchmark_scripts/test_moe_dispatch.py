"""The CPU-side parts of the kernel-level A/B (benchmarks/moe_dispatch/): the calibration
build's hooks still find their lines in the patched sources, the cases, and the published
report being rendered from its own data."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "moe_dispatch"
RESULTS = ROOT / "benchmarks" / "results"
# The previous series' 44-case run, explorations and fused op (report.py's published files).
ESTIMATED = RESULTS / "moe_dispatch" / "estimated-row-classes-h200"
sys.path.insert(0, str(HERE))

import cases  # noqa: E402

from tests.benchmark_scripts import load_script  # noqa: E402


def _run_py():
    return load_script(HERE / "run.py", "moe_dispatch_run")


def _flashinfer_data(tmp_path: Path, *subs: str):
    """The installed FlashInfer and a copy of its data directory's `subs` laid out as run.py
    unpacks its source tarball (csrc/nv_internal always), for the tests that prepare or compile
    run.py's variants; skips where FlashInfer is not installed."""
    import importlib.util

    from vllm_h20.moe import flashinfer_src

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("FlashInfer is not installed (CI installs it with vLLM 0.34.0)")
    installed_fi = flashinfer_src.installed()
    data = tmp_path / "data"
    for sub in ("csrc/nv_internal", *subs):
        shutil.copytree(installed_fi.root / sub, data / sub, symlinks=True)
    return installed_fi, data


def test_calibration_hooks_apply_to_the_patched_sources(tmp_path):
    """run.py rewrites lines of the patched grouped_gemm_dispatch for its calibration build; a
    patch that moves them must fail here, not on the GPU machine."""
    installed_fi, data = _flashinfer_data(tmp_path)
    run = _run_py()
    # The shipped series alone: the candidates' kinds are run from the tag that keeps them
    # (experiments/2026-12-06).
    kinds = (("", "hot_first"),)
    for series, kind in kinds:
        work = tmp_path / (series.replace("/", "-") or "shipped")
        for variant in run.VARIANTS:
            nv = run.prepare_sources(data, work, variant, series)
            text = (nv / run.KERNEL_CUH).read_text()
            assert run.series_kind(text) == (kind if variant != "stock" else "shipped")
            assert ("plan_row_classes(" in text or "plan_launches(" in text) is (variant != "stock")
            assert ("vllm_h20_single_launch()) {" in text) is (variant == "calib")
            has_prev = variant == "calib" and kind != "shipped"
            assert ("if (vllm_h20_prev_plan()) {" in text) is has_prev
            # --explore's alternatives to the cold-first split (rule modes 6, 7 and 8; not for
            # the shipped series, whose split is already in the other order)
            explores = variant == "calib" and kind == "classes"
            assert ("if (vllm_h20_rule_mode == 8 && " in text) is explores
            # --explore on the shipped series: its hot launch alone, no overlap, two branches
            assert ("if (vllm_h20_rule_mode == 10) {" in text) is (
                variant == "calib" and kind == "hot_first"
            )
            # one-launch: rule mode 9 turns its dual launch off (the shipped two launches);
            # graph-branches: it keeps the classes on the caller's stream (the same)
            assert ("if (vllm_h20_rule_mode == 9) return false;" in text) is (
                variant == "calib" and kind == "one_launch"
            )
            assert ("vllm_h20_rule_mode == 9 ? nullptr" in text) is (
                variant == "calib" and kind == "branches"
            )
            # overlap-quantize: rule mode 9 makes its hot launch without PDL (the same)
            assert ("/*overlap=*/vllm_h20_rule_mode != 9);" in text) is (
                variant == "calib" and kind == "overlap_quantize"
            )
            # --explore on the shipped series, modes 14/15: the hot class without the first-tile
            # search (its calib headers skip it for a class bounded by kAnyRows - 1), and the
            # row-class kernel on every expert
            explores_search = variant == "calib" and kind == "hot_first"
            assert ("{plan.boundary + 1, deep_gemm::kAnyRows - 1}" in text) is explores_search
            dg = nv / "tensorrt_llm" / "deep_gemm"
            impl, sched = (dg / "fp8_gemm_impl.cuh").read_text(), (dg / "scheduler.cuh").read_text()
            assert impl.count("if constexpr (vllm_h20_searches<SchedulerType>())") == (
                4 if explores_search else 0
            )
            # ... and modes 29-32 (kAnyRows - k: bit 0 no search, 1 no PDL instructions, 2 no
            # class check, 3 walk from the first group, 4 no stop, 5 start at the tile): every
            # PDL instruction of both kernels, both walks' checks, both schedulers' start and stop
            assert impl.count("if constexpr (vllm_h20_pdl<SchedulerType>())") == (
                6 if explores_search else 0
            )
            if explores_search:  # the six are all the kernels have
                assert impl.count("griddepcontrol") == 6
            assert sched.count("(kNoCheck || rows_in_class<") == (2 if explores_search else 0)
            assert ("kNoSearch = kDiag & 1, kNoPdl = kDiag & 2" in sched) is explores_search
            assert ("kWalk = kDiag & 8, kNoStop = kDiag & 16, kJump = kDiag & 32;" in sched) is (
                explores_search
            )
            assert sched.count("if (!kWalk && (kJump || first.tiles <= gridDim.x)) {") == (
                2 if explores_search else 0
            )
            assert sched.count("if constexpr (!kNoStop) end_block_idx = first.tiles;") == (
                2 if explores_search else 0
            )
            # the shipped 0002's start and stop, in the patched variants of the series built on
            # it (one-launch keeps the 0002 before the stop)
            stops = variant != "stock" and kind in ("hot_first", "branches", "overlap_quantize")
            assert sched.count("end_block_idx = first.tiles;") == (2 if stops else 0)
            assert ("static_cast<int64_t>(kMinRows & 0xffffffu)" in sched) is explores_search
            assert ("deep_gemm::kAnyRows - bits}" in text) is explores_search
            launchers = (nv / run.FP8_GEMM_CUH).read_text()
            assert ("vllm_h20_grid(num_sms)" in launchers) is (variant == "calib")
            assert run.deepgemm_dir(data, work, variant).endswith("tensorrt_llm")


def test_a_changed_patch_gets_its_own_builds_and_kernel_cache(tmp_path):
    """run.py keys its work dir (sources copied once, DeepGEMM's cache by template arguments) by
    what the builds are made from: the same inputs find the same dir, a one-byte change to a
    patch, another series or another FlashInfer tarball a new one."""
    run = _run_py()
    inputs = run.build_inputs("")
    assert inputs[: len(run.series_patches(""))] == run.series_patches("")
    assert HERE / "run.py" in inputs and HERE / "ext" / "deepgemm_setup.cu" in inputs
    copies = [tmp_path / f.name for f in inputs]
    for f, c in zip(inputs, copies, strict=True):
        shutil.copy(f, c)
    work = tmp_path / "work"
    fi = "flashinfer-0.7.2.post1-src.tar.xz"
    shipped = run.work_for(work, "", fi, copies)
    assert shipped == run.work_for(work, "", fi) and shipped.parent == work
    assert shipped.name.startswith("shipped-")
    copies[1].write_bytes(copies[1].read_bytes() + b"\n")
    assert run.work_for(work, "", fi, copies) != shipped
    assert run.work_for(work, "", "flashinfer-0.7.4-src.tar.xz") != shipped


@pytest.mark.parametrize(
    "args, msg",
    [(["--routings", "uniform,zipff"], "unknown routing(s) zipff: choose from"),
     (["--emulate", "emulated_78sm,emulated_h20"], "unknown emulation(s) emulated_h20: choose")],
)  # fmt: skip
def test_run_refuses_unknown_routings_and_emulations_in_one_line(tmp_path, args, msg):
    cmd = [sys.executable, str(HERE / "run.py"), "--flashinfer", str(tmp_path / "none.tar.xz"),
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_calibration_builds_dispatch_compiles(tmp_path):
    """run.py's calibration build (every rule mode's hooks in grouped_gemm_dispatch, the explore
    switches in the headers) is compiled on the GPU machine, first thing in a lease: compiled
    here too (-c, the shipped series, FlashInfer's sources as installed, run.py's nvcc flags), so
    that a hook which does not compile fails in CI."""
    from tests.moe import deepgemm_kernels as dk
    from vllm_h20.moe import build

    _, data = _flashinfer_data(tmp_path, "include", "cutlass/include",
                               "cutlass/tools/util/include", "spdlog/include")  # fmt: skip
    nvcc = dk.nvcc()
    run = _run_py()
    nv = run.prepare_sources(data, tmp_path / "work", "calib", "")
    assert "vllm_h20_rule_mode <= 32" in (nv / run.KERNEL_CUH).read_text()
    includes = [nv, nv / "include", nv / "tensorrt_llm/cutlass_extensions/include",
                nv / "tensorrt_llm/kernels/cutlass_kernels/include",
                nv / "tensorrt_llm/kernels/cutlass_kernels", data / "include", data / "csrc",
                data / "cutlass/include", data / "cutlass/tools/util/include",
                data / "spdlog/include"]  # fmt: skip
    cublas = build.find_cublas_include(build.find_cuda_home())  # None: the toolkit has it
    cmd = [nvcc, "-c", str(nv / run.GEMM_CU), "-o", str(tmp_path / "gemm.o"), *run.NVCC_FLAGS,
           "-DVLLM_H20_PATCHED", "-DVLLM_H20_FORCE_HOOK", *(f"-I{i}" for i in includes),
           *(["-isystem", cublas] if cublas else [])]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]


def test_explore_hot_kernels_compile_from_the_calibration_headers(tmp_path):
    """--explore's class kernels switched by a class bound of kAnyRows - k (run.py
    SEARCH_HOOKS) are compiled on the GPU machine, at run time, from the calibration build's
    headers: a hook that leaves those headers uncompilable must fail here, not after a lease's
    build. Bits 0 (no search), 1 (no PDL instructions), 2 (no class check), 3 (walk from the
    first group), 4 (no stop at the last tile) and 5 (start at the tile), as modes 14 and 29-32
    use them, and a cold kernel with them in its lower bound's top byte (modes 29-32), each
    compiled with DeepGEMM's flags."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.moe import deepgemm_kernels as dk
    from tests.moe.deepgemm_kernels import GEN
    from vllm_h20.moe import overlay

    installed_fi, data = _flashinfer_data(tmp_path)
    dk.nvcc()
    run = _run_py()
    nv = run.prepare_sources(data, tmp_path / "work", "calib", "")
    csrc = dk.overlay_csrc(installed_fi, overlay.shipped_patches(installed_fi.version),
                           tmp_path / "overlay")  # fmt: skip
    any_rows = 0xFFFFFFFF
    ks = (1, 6, 48, 8)  # every bit at least once; 48 / 8: modes 29 and 31's hot kernels
    sources = {f"k{k}": ["regular", "17", str(any_rows - k)] for k in ks}
    # ... and mode 29's cold kernel: swap-A/B, 1..16 rows, its switches in the top byte
    cold_stop = (48 << 24) | 1
    sources["kcold"] = ["swap", str(cold_stop), "16"]
    generated = dk.generate(GEN, sources, csrc, installed_fi, tmp_path)
    assert [generated[f"k{k}_tag"] for k in ks] == [f"_class17-{any_rows - k}" for k in ks]
    assert generated["kcold_tag"] == f"_class{cold_stop}-16"
    ks = (*ks, "cold")

    def compile_one(k):
        return dk.compile_kernel(generated[f"k{k}"], nv / "tensorrt_llm", tmp_path, f"k{k}")

    with ThreadPoolExecutor(2) as pool:
        for k, r in zip(ks, pool.map(compile_one, ks), strict=True):
            assert r.returncode == 0, f"k={k}: " + r.stderr[-3000:]
            assert (tmp_path / f"k{k}.cubin").stat().st_size > 10_000


def test_run_without_the_flashinfer_sources_says_how_to_make_them(tmp_path):
    cmd = [sys.executable, str(HERE / "run.py"), "--flashinfer", str(tmp_path / "none.tar.xz"),
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (
        f"no FlashInfer sources at {tmp_path / 'none.tar.xz'}: make them with "
        "`python benchmarks/moe_dispatch/fetch_sources.py` (and carry .fi)"
    )


def _full(tmp_path: Path, steps: str) -> subprocess.CompletedProcess:
    """`h200.sh full` in a session whose repository copy lacks .fi (as a lease without it in
    `carry` would), so that every step's run.py fails at once, on this machine."""
    session = tmp_path / "session"
    (session / "repo").mkdir(parents=True)
    for name in ("benchmarks", "vllm_h20", "patches"):
        (session / "repo" / name).symlink_to(ROOT / name)
    env = {**os.environ, "MOE_SESSION": str(session), "STEPS": steps}
    return subprocess.run(["bash", str(HERE / "h200.sh"), "full"], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip


def test_full_logs_each_step_s_own_exit_status(tmp_path):
    """The session log's "exit N" is the step's status: it was always 0 until 2026-12-05, `$?`
    being read after the `$(date)` of the same line. A failed step leaves the others running and
    the whole run failing; STEPS picks the steps."""
    r = _full(tmp_path, "kernel rerun")
    lines = [re.sub(r"^\[[0-9:]+\] ", "", line) for line in r.stdout.splitlines()]
    assert lines == [
        "kernel-level A/B",
        "kernel-level A/B: exit 1",
        "kernel-level A/B again, concentrated routings (the bar's re-run)",
        "kernel-level A/B again, concentrated routings (the bar's re-run): exit 1",
        "done (2 failed)",
    ], r.stdout
    assert r.returncode == 1
    log = (tmp_path / "session" / "out" / "kernel.log").read_text()
    assert log.strip().splitlines()[-1] == (
        "no FlashInfer sources at .fi/flashinfer-0.7.2.post1-src.tar.xz: make them with "
        "`python benchmarks/moe_dispatch/fetch_sources.py` (and carry .fi)"
    )


def test_full_refuses_an_unknown_step_before_running_any(tmp_path):
    r = _full(tmp_path, "kernel fussed")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        "h200.sh full: unknown step 'fussed' in STEPS (explore profile kernel emulated rerun "
        "fused stock_tests)"
    )


def _harness():
    return load_script(HERE / "harness.py", "moe_dispatch_harness")


REGULAR = "void deep_gemm::fp8_gemm_kernel<128u, 5120u, 128u>(float*, int)"
SWAP = "void deep_gemm::fp8_gemm_kernel_swapAB<128u, 24u>(float*, int)"


def test_trace_summary_splits_replays_and_counts_parallel_branches_once():
    """Two replays of a graph whose two branches start in either order: the kernels are
    known by kind and order of their kind, busy time counts overlapping kernels once, and the
    gaps between them are the idle time."""
    h = _harness()
    trace = [  # (name, start us, duration us)
        (REGULAR, 0.0, 20.0), (SWAP, 1.0, 2.0), (REGULAR, 25.0, 10.0), (SWAP, 26.0, 1.0),
        (SWAP, 100.0, 2.0), (REGULAR, 101.0, 22.0), (REGULAR, 128.0, 10.0), (SWAP, 129.0, 3.0),
    ]  # fmt: skip
    s = h.trace_summary(trace, replays=2)
    assert s["kernels_per_replay"] == 4
    assert s["span_us"] == pytest.approx((35.0 + 38.0) / 2)
    assert s["busy_us"] == pytest.approx((30.0 + 33.0) / 2)  # 20 + 10, then 23 + 10
    assert s["idle_us"] == pytest.approx(5.0)
    assert list(s["kernels"]) == ["regular#0", "swap_ab#0", "regular#1", "swap_ab#1"]
    assert s["kernels"]["regular#0"]["us"] == pytest.approx(21.0)
    assert s["kernels"]["swap_ab#0"]["start_us"] == pytest.approx(0.5)  # 1 after, 0 before
    assert all(k["replays"] == 2 for k in s["kernels"].values())
    assert s["kernels"]["swap_ab#1"]["name"] == SWAP  # which build ran: its template arguments


def test_trace_summary_refuses_a_trace_that_lost_kernels():
    h = _harness()
    assert h.trace_summary([(REGULAR, 0.0, 1.0)] * 3, replays=2) == {
        "kernels_seen": 3, "replays": 2, "uneven": True,
    }  # fmt: skip
    assert h.kernel_kind("void at::native::vectorized_elementwise_kernel<4, X>(int)") == (
        "at::native::vectorized_elementwise_kernel"
    )


def test_profile_table_prints_each_version_at_the_slowest_rank(capsys):
    run = _run_py()
    h = _harness()
    summary = h.trace_summary([(REGULAR, 0.0, 20.0), (REGULAR, 22.0, 18.0)], replays=1)
    row = {"routing": "same_spread", "tokens": 192, "profile": {"rank": 3, "replays": 1,
           "versions": {"stock": summary | {"event_us": 53.4, "loop_us": 41.0},
                        "branches": {"kernels_seen": 3, "replays": 1, "uneven": True,
                                     "event_us": 54.4, "loop_us": 42.0}}}}  # fmt: skip
    run.print_profile([row, {"routing": "uniform", "tokens": 64}])
    out = capsys.readouterr().out.splitlines()
    assert out[-2].split() == ["same_spread", "192", "3", "stock", "53.4", "41.0", "40.0", "38.0",
                               "2.0", "regular#0", "20.0", "regular#1", "18.0"]  # fmt: skip
    assert out[-1].split()[:6] == ["same_spread", "192", "3", "branches", "54.4", "42.0"]
    assert out[-1].endswith("3 kernels, uneven")


def test_eplb_routing_is_skewed_like_what_eplb_leaves():
    for tokens in (1024, 4096):
        counts = np.bincount(cases.route("eplb", tokens).ravel(), minlength=cases.SLOTS)
        assert 2.5 <= counts.max() / counts.mean() <= 5


@pytest.mark.parametrize("routing", cases.ALL_ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 8, 128, 4096])
def test_every_routing_gives_each_token_top_k_distinct_slots(routing, tokens):
    slots = cases.route(routing, tokens)
    assert slots.shape == (tokens, cases.TOP_K)
    assert ((slots >= 0) & (slots < cases.SLOTS)).all()
    assert all(len(set(row)) == cases.TOP_K for row in slots.tolist())
    assert sum(int(cases.rank_counts(slots, r).sum()) for r in range(cases.EP)) == tokens * 6


def test_concentrated_routings_concentrate_as_described():
    tokens = 512
    rows = {r: [cases.rank_counts(cases.route(r, tokens), k) for k in range(cases.EP)]
            for r in cases.CONCENTRATED}  # fmt: skip
    # Identical requests: six experts with every token, on one rank or one per rank.
    assert [int((c == tokens).sum()) for c in rows["same_rank"]] == [6] + [0] * 7
    assert sorted(int((c == tokens).sum()) for c in rows["same_spread"]) == [0, 0] + [1] * 6
    # A hot pool: every routed row lands on 8 (16) experts.
    for name, size in (("pool8", 8), ("pool16", 16)):
        assert sum(int((c > 0).sum()) for c in rows[name]) == size

    # Steeper than Zipf 1.2: the hottest expert holds more of the rows.
    def top_share(r):
        counts = np.bincount(cases.route(r, tokens).ravel(), minlength=cases.SLOTS)
        return counts.max() / counts.sum()

    assert top_share("zipf2") > top_share("zipf")
    # Shaped like the EPLB example's loads: skewed (cv ~0.6 of slot popularity), no pool.
    counts = np.bincount(cases.route("trained", 4096).ravel(), minlength=cases.SLOTS)
    assert 2 <= counts.max() / counts.mean() <= 5 and (counts > 0).sum() > 350


def test_warm_jobs_cover_every_version_and_token_count():
    run = _run_py()
    for versions in (run.VERSIONS, run.CANDIDATE_VERSIONS, run.CLASS_VERSIONS, run.EXPLORE,
                     run.HOT_FIRST_EXPLORE,
                     run.EMU_VERSIONS, run.CLASS_EMU_VERSIONS):  # fmt: skip
        jobs = run.warm_jobs(versions, cases.TOKENS)
        for v in versions:
            for t in cases.TOKENS:
                assert any(j[0] == v.variant and j[1] == v.rule and j[3] == t for j in jobs)


def test_published_report_is_rendered_from_the_published_json(tmp_path):
    """moe_dispatch/estimated-row-classes-h200/moe_dispatch_h200.md (under benchmarks/results)
    and the H20 model: every number from the JSON."""
    pytest.importorskip("matplotlib")
    for f in ("moe_dispatch_h200.json", "moe_dispatch_explore_h200.json"):
        shutil.copy(ESTIMATED / f, tmp_path / f)
    cmd = [sys.executable, str(HERE / "report.py"), str(tmp_path / "moe_dispatch_h200.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    for md in ("moe_dispatch_h200.md", "moe_dispatch_h20_model.md"):
        assert (tmp_path / md).read_text() == (ESTIMATED / md).read_text(), md
    md = (ESTIMATED / "moe_dispatch_h200.md").read_text()
    assert "every one of the 44 cases is at or above 0.98x stock" in md


def _rerendered(src: Path, tmp_path: Path) -> str:
    """The README report_run.py writes for a copy of a published run folder without one, checked
    to be the published README, byte for byte, and to begin with the folder's NOTES.md."""
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    (dst / "README.md").unlink()
    cmd = [sys.executable, str(HERE / "report_run.py"), str(dst), "--no-plot"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    text = (dst / "README.md").read_text()
    assert text == (src / "README.md").read_text()
    assert text.startswith((src / "NOTES.md").read_text())
    return text


@pytest.mark.parametrize("folder", ["whole-expert-tiles-h200", "whole-expert-tiles-v2-h200"])
def test_whole_expert_run_readme_is_rendered_from_its_files(tmp_path, folder):
    """benchmarks/results/moe_dispatch/whole-expert-tiles*-h200/README.md: the notes, then the
    tables of the kernel-level run, the emulations and (v2) the fused op, from the folder's
    files; none of it names the fitted candidate's module or series."""
    src = RESULTS / "moe_dispatch" / folder
    text = _rerendered(src, tmp_path)
    tables = text.split("## Summary", 1)[1]
    assert "whole-expert tiles (candidate)" in tables and "fitted-row-tiles" not in tables
    assert "fitted module" not in tables and "fitted ms" not in tables


def test_hot_first_run_readme_is_rendered_from_its_files(tmp_path):
    """benchmarks/results/moe_dispatch/hot-first-h200/README.md (the shipped series' evidence):
    the notes, then the tables from the folder's files, its columns named for the series the run
    built (recorded as kind "classes" before run.py had a name for it)."""
    src = RESULTS / "moe_dispatch" / "hot-first-h200"
    text = _rerendered(src, tmp_path)
    tables = text.split("## Summary", 1)[1]
    assert "hot-first (candidate)" in tables and "whole-expert tiles (candidate)" not in tables
    assert "hot-first's rule (mode 8)" in tables and "swap_ab_second" in tables


def test_one_launch_run_readme_is_rendered_from_its_files(tmp_path):
    """benchmarks/results/moe_dispatch/one-launch-h100/README.md (the candidate measured on an
    H100, files named for it): the notes, then the tables from the folder's files, the columns
    named for the candidate, the model comparing it with the shipped hot-first plan (its `prev`)
    and carrying the H100's fused-op overhead to H20 by the H100's bandwidth."""
    src = RESULTS / "moe_dispatch" / "one-launch-h100"
    text = _rerendered(src, tmp_path)
    tables = text.split("## Summary", 1)[1]
    assert "one launch (candidate)" in tables and "hot-first (candidate)" not in tables
    assert "| swap_ab_in_one_launch |" in tables
    assert "| average-only | shipped hot-first | one launch |" in tables
    assert "previous per-expert" not in tables
    assert "on the H100 (fused stock minus" in tables and "3.35 / 4.0 TB/s" in tables
    rendered = text[len((src / "NOTES.md").read_text()) :]
    assert rendered.startswith("# Concentrated routing on one H100: ")
    assert "(kernel_h100.json, kernel_h100.log)" in rendered and "H200" not in rendered


def test_last_tile_run_readme_is_rendered_from_its_files(tmp_path):
    """benchmarks/results/moe_dispatch/last-tile-h100/README.md (a run of the shipped series
    itself, no --series): its columns named for the shipped series and for the plan shipped
    until 2026-12-03 (`prev`, rule mode 3), not for a candidate; the bar's counts as its notes
    quote them; the explore modes 29-32 by name."""
    src = RESULTS / "moe_dispatch" / "last-tile-h100"
    text = _rerendered(src, tmp_path)
    rendered = text[len((src / "NOTES.md").read_text()) :]
    assert rendered.startswith("# Concentrated routing on one H100: the shipped per-expert")
    assert "(candidate)" not in rendered and "candidate module" not in rendered
    assert "| plan shipped until 2026-12-03 (mode 3) | shipped per-expert (0001 + 0002) |" in text
    assert "| cases at or above 0.98x stock | 51 of 110 | 99 of 110 | 110 of 110 |" in text
    assert "| worst case | 0.33x | 0.48x | 0.98x |" in text
    assert "## Through FlashInfer's fused op (shipped module)" in text
    assert "bit-identical to the unpatched module's in 110 of 110 cases" in text
    assert "stop at the last tile, always walk from the first group (mode 31)" in text


def test_run_folder_without_one_kernel_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "kernel_h200.json").write_text("{}")
    (tmp_path / "kernel_h100.json").write_text("{}")
    cmd = [sys.executable, str(HERE / "report_run.py"), str(tmp_path), "--no-plot"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        f"{tmp_path}: expected one kernel_<gpu>.json or explore runs of one gpu (gpu: h200, "
        "h100), found kernel_h100.json, kernel_h200.json"
    )
    # ... and a folder of explore runs alone, from two GPUs (or none at all)
    for f in tmp_path.glob("kernel_*.json"):
        f.unlink()
    for name in ("explore_a_h200.json", "explore_b_h100.json"):
        (tmp_path / name).write_text("{}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().endswith("found explore_a_h200.json, explore_b_h100.json")


def _compare(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(HERE / "compare_runs.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_repeats_readme_is_rendered_from_the_six_runs():
    """whole-expert-tiles-v2-h200/repeats/README.md: the six alternating runs (v2 v1 v2 v1 v1 v2)
    compared by compare_runs.py, as its first line says."""
    folder = RESULTS / "moe_dispatch" / "whole-expert-tiles-v2-h200"
    want = (folder / "repeats" / "README.md").read_text()
    command = re.search(r"Written by `compare_runs.py ([^`]*)`", want).group(1).split()
    r = _compare(command, folder)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want
    assert "| every case | 1-4096 | 110 |" in want and "not resolved |" in want


def _synthetic_run(path: Path, scale: float, wobble: float, seed: int) -> str:
    rng = np.random.default_rng(seed)
    ab = [{"routing": r, "tokens": t,
           "speedups": {"fix": scale * (1.0 + wobble * rng.standard_normal())}}
          for r in cases.ALL_ROUTINGS for t in cases.TOKENS]  # fmt: skip
    path.write_text(json.dumps({"ab": ab}))
    return str(path)


def test_compare_runs_resolves_a_shift_and_not_noise(tmp_path):
    """A 5 % shift between two series is resolved with its sign; two draws of the same series
    (1 % noise per case and run) are "not resolved"; bad arguments get one line."""
    order = [("a", 1.05), ("b", 1.0), ("b", 1.0), ("a", 1.05)]
    runs = [f"{lab}={_synthetic_run(tmp_path / f'{i}.json', s, 0.01, i)}"
            for i, (lab, s) in enumerate(order)]  # fmt: skip
    r = _compare(runs, tmp_path)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("| every case"))
    ratio, ci, verdict = row.split(" | ")[5:8]
    lo, hi = map(float, ci.split("-"))
    assert verdict.strip(" |") == "faster" and 1.0 < lo < 1.05 < hi < 1.1, row
    same = [f"{lab}={_synthetic_run(tmp_path / f's{i}.json', 1.0, 0.01, 10 + i)}"
            for i, lab in enumerate("abba")]  # fmt: skip
    r = _compare(same, tmp_path)
    assert "| every case | 1-4096 | 110 |" in r.stdout
    assert all(line.endswith("not resolved |") for line in r.stdout.splitlines()
               if line.startswith(("| balanced", "| concentrated", "| every")))  # fmt: skip
    third = f"c={runs[1].split('=')[1]}"
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"ab": []}')
    for args, msg in (([f"a={tmp_path / 'none.json'}", runs[1]], "no such run file"),
                      (["a", runs[1]], "expected LABEL=FILE"),
                      ([runs[0], runs[1], third], "exactly two labels"),
                      ([f"a={tmp_path / 'bad.json'}", runs[1]], "not a run.py result"),
                      ([f"a={tmp_path / 'other.json'}", runs[1]], "no cases with speedups"),
                      ([*runs[:2], "--column", "nope"], "has no column 'nope'")):  # fmt: skip
        r = _compare(args, tmp_path)
        assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_run_folder_readme_is_rendered_from_its_files(tmp_path):
    """benchmarks/results/moe_dispatch/concentrated-routing-h200/README.md: the hand-written
    notes, then every table (and the H20 model calibrated to the seed) from the folder's JSONs
    and logs."""
    src = RESULTS / "moe_dispatch" / "concentrated-routing-h200"
    text = _rerendered(src, tmp_path)
    # The seed's two numbers the model was not calibrated on, within 15 %.
    offs = re.findall(r"\| uniform (?:192|2048) \|.*\| ([+-]\d+) % \|", text)
    assert len(offs) == 2 and all(abs(int(o)) <= 15 for o in offs), offs


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*").split(" ")[0] for c in line.strip().strip("|").split("|")]


def test_explore_table_is_rendered_from_the_three_runs(tmp_path):
    """explore-split-order-h200/table.md: explore_table.py on the folder's three runs, as its
    first line says; the composed rule takes each cell from the version it names."""
    folder = RESULTS / "moe_dispatch" / "explore-split-order-h200"
    want = (folder / "table.md").read_text()
    command = want.splitlines()[0].strip("`").split()[2:]
    out = tmp_path / "table.md"
    script = str(HERE / "explore_table.py")
    r = subprocess.run([sys.executable, script, *command, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=folder)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert out.read_text() == want
    lines = want.splitlines()
    head = _cells(next(ln for ln in lines if ln.startswith("| routing |")))
    one_swap, hot_first = head.index("one_swap"), head.index("hot_first")
    composed = head.index("hot_first+one_swap")
    rows = [_cells(ln) for ln in lines if re.match(r"\| [a-z_0-9]+ \| \d+ \|", ln)]
    assert len(rows) == 36
    for row in rows:
        src = one_swap if int(row[1]) <= 32 else hot_first
        assert row[composed] == row[src]
    bad = subprocess.run([sys.executable, script, "run1.json.gz", "--compose", "x=a,b"],
                         capture_output=True, text=True, cwd=folder)  # fmt: skip
    assert bad.returncode != 0 and "expected NAME=A@TOKENS,B" in bad.stderr
    typo = subprocess.run([sys.executable, script, "run1.json.gz", "--compose", "x=hot@32,fixx"],
                          capture_output=True, text=True, cwd=folder)  # fmt: skip
    assert typo.returncode != 0 and "no version " in typo.stderr and "Traceback" not in typo.stderr


def test_graph_branches_run_readme_is_rendered_from_its_files(tmp_path):
    """benchmarks/results/moe_dispatch/graph-branches-h200/README.md: the notes, then the tables
    from the folder's files: the candidate against the shipped hot-first plan (its `prev`, rule
    mode 9), the model with the cold launch's two fixed costs, and the explore on the shipped
    series with its diagnostic marked where its output was incomplete."""
    src = RESULTS / "moe_dispatch" / "graph-branches-h200"
    text = _rerendered(src, tmp_path)
    tables = text.split("## Summary", 1)[1]
    assert "graph branches (candidate)" in tables and "one launch (candidate)" not in tables
    assert "| swap_ab_branch |" in tables and "| swap_ab_second |" in tables
    assert "| average-only | shipped hot-first | graph branches |" in tables
    assert "## Explored: `explore_shipped_h200.json`" in tables
    assert "shipped hot-first (0001 + 0002)" in tables and "| incomplete |" in tables
    explored = json.loads((src / "explore_shipped_h200.json").read_text())
    assert explored["series"] == "shipped" and explored["series_kind"] == "hot_first"
    kernel = json.loads((src / "kernel_h200.json").read_text())
    assert kernel["series"] == "candidates/graph-branches" and kernel["series_kind"] == "branches"
    assert kernel["versions"]["prev"]["rule"] == [9, 0]


def test_kernel_profile_run_readme_is_rendered_from_its_files(tmp_path):
    """benchmarks/results/moe_dispatch/kernel-profile-h100/README.md: the overlap-quantize
    candidate against the shipped plan (its `prev`, rule mode 9) on an H100, and both runs'
    --profile tables, with the quantization kernel named as such and the explore's own labels."""
    src = RESULTS / "moe_dispatch" / "kernel-profile-h100"
    text = _rerendered(src, tmp_path)
    tables = text.split("## Summary", 1)[1]
    assert "hot launch overlapping (candidate)" in tables and "fitted tiles" not in tables
    assert "(10 routings x 4 token counts)" in text
    for name in ("kernel_h100.json", "explore_shipped_h100.json"):
        assert f"## Where the time goes: `{name}` (--profile)" in tables
    assert "| same_spread | 192 | 2 | hot launch alone (mode 10; diagnostic) | 57.1 |" in tables
    assert "quantize#0" in tables and "scale_1x128" not in tables
    kernel = json.loads((src / "kernel_h100.json").read_text())
    assert kernel["series_kind"] == "overlap_quantize" and kernel["versions"]["prev"]["rule"] == [
        9,
        0,
    ]
    assert all(r["ok"] and r["profile"]["versions"] for r in kernel["ab"])


def test_kernel_split_run_readme_is_rendered_from_its_explore_runs_alone(tmp_path):
    """benchmarks/results/moe_dispatch/kernel-split-h100/README.md: a folder of --explore
    --profile runs with no kernel-level A/B; each run's table and profile, the device from its
    JSON, and the kernel times its notes quote."""
    src = RESULTS / "moe_dispatch" / "kernel-split-h100"
    text = _rerendered(src, tmp_path)
    runs = sorted(src.glob("explore_*_h100.json"))
    assert runs and not list(src.glob("kernel_*.json"))
    for f in runs:
        assert f"## Explored: `{f.name}`" in text
        assert f"### Where the time goes: `{f.name}` (--profile)" in text
    assert "NVIDIA H100 80GB HBM3 (132 SMs; torch 2.11.0+cu130, CUDA 13.0)" in text
    assert "hot launch alone, no first-tile search (mode 14; diagnostic)" in text

    # the notes' first table is the profile's: stock, hot alone, no search at pool16 192, FC1
    def kernels(version: str) -> str:
        return text.split(f"| pool16 | 192 | 0 | {version} | ", 1)[1].split("\n", 1)[0]

    assert kernels("stock").startswith("105.5 |")
    assert "regular#0 53.6," in kernels("stock")
    assert "regular#0 56.3," in kernels("hot launch alone (mode 10; diagnostic)")
    assert "regular#0 54.0," in kernels(
        "hot launch alone, no first-tile search (mode 14; diagnostic)"
    )


def test_the_model_charges_the_graph_branch_as_its_own_second_launch():
    """model.row_class_launches(branch=True): the hot-first plan's launches, its split's cold
    launch named IN_BRANCH (its own fixed cost); single launches are the hot-first plan's. With
    both second launches' fits equal, the two plans predict the same time."""
    import dataclasses

    model = load_script(HERE / "model.py", "moe_dispatch_model")
    counts = np.zeros(cases.LOCAL, dtype=int)
    counts[[3, 17]] = 192  # identical requests: two experts with every token, the rest empty
    split = model.row_class_launches(counts, 192, 132, True, branch=True)
    assert [p for p, _ in split] == ["regular", model.IN_BRANCH] * len(cases.SHAPES)
    shipped = model.row_class_launches(counts, 192, 132, True)
    assert [t for _, t in split] == [t for _, t in shipped]
    assert [p for p, _ in shipped] == ["regular", model.SWAP_SECOND] * len(cases.SHAPES)
    for tokens in (8, 32, 64):  # one launch there, the same in both
        small = np.minimum(counts, tokens)
        assert model.row_class_launches(small, tokens, 132, True, branch=True) == \
            model.row_class_launches(small, tokens, 132, True)  # fmt: skip
    fit = model.Fit(bw=4e12, tc=8e14, r=0.5, c0=1e-5)
    fits = {"regular": fit, "swap_ab": fit, model.SWAP_SECOND: dataclasses.replace(fit, c0=2e-6),
            model.IN_BRANCH: dataclasses.replace(fit, c0=2e-6)}  # fmt: skip
    both = [model.predict(fits, counts, 192, v, 132) for v in ("hot_first", "branches")]
    assert both[0] == both[1] > 0
    fits[model.IN_BRANCH] = dataclasses.replace(fit, c0=0.0)
    assert model.predict(fits, counts, 192, "branches", 132) < both[0]


def test_profile_section_renders_each_traced_version_and_skips_untraced_cases():
    report = load_script(HERE / "report_run.py", "moe_dispatch_report_run")
    h = _harness()
    summary = h.trace_summary([(REGULAR, 0.0, 20.0), (SWAP, 1.0, 1.5), (REGULAR, 22.0, 18.0)], 1)
    rows = [
        {"routing": "uniform", "tokens": 64},
        {"routing": "same_spread", "tokens": 192, "profile": {"error": "CUPTI unavailable"}},
        {"routing": "same_spread", "tokens": 288, "profile": {"rank": 2, "replays": 1, "versions": {
            "stock": summary | {"event_us": 57.3, "loop_us": 45.0},
            "hot_only": {"kernels_seen": 5, "replays": 2, "uneven": True, "event_us": 59.3,
                         "loop_us": 47.0}}}},
    ]  # fmt: skip
    lines = report.profile_section({"ab": rows}, report.NAMES | report.EXPLORE_NAMES)
    assert lines[2:] == [
        "| same_spread | 288 | 2 | stock | 57.3 | 45.0 | 40.0 | 38.0 | 2.0 | "
        "regular#0 20.0, swap_ab#0 1.5, regular#1 18.0 |",
        "| same_spread | 288 | 2 | hot launch alone (mode 10; diagnostic) | 59.3 | 47.0 "
        "| | | | 5 kernels in 2 replays (uneven) |",
    ]
