"""Kernel-level A/B of FlashInfer's SM90 FP8 block-scale MoE GEMMs on one GPU, for every EP8
rank of DeepSeek-V4.1-Flash (see cases.py): stock, the average-only estimate (patch 0001), the
previous per-expert plan, the per-expert dispatch (0001 + 0002: fitted row tiles), and the
fitted tiles with a regular launch split off for the hottest experts.

One command on the GPU machine does everything and prints a short table last:

    python benchmarks/moe_dispatch/run.py --flashinfer .fi/flashinfer-0.7.2.post1-src.tar.xz \
        --out $OUT

1. builds three torch extensions from the FlashInfer sources' fp8_blockscale_gemm.cu: stock,
   patched (patches/flashinfer applied by vllm_h20's applier), and patched plus hooks that
   switch its rule at run time (calib), with FlashInfer's JIT flags;
2. compiles the DeepGEMM kernels every case needs in parallel processes (their run-time nvcc
   builds, cached in TRTLLM_DG_CACHE_DIR, stay out of the timings);
3. checks every rank/case: every version's output against an fp32 reference and the others;
4. times FC1 + FC2 per rank in CUDA graphs (5 warm-ups, 24 samples; per sample the slowest
   rank, then the median, as the seed did); a case where the fix is under 0.98x stock is run
   again and both runs kept; the weights-read roofline against a copy measured in the same run;
5. the same cases dispatched as an H20 would (78-SM tiles and threshold 64) on all SMs, and
   on as few SMs as match an H20's FP8 rate (`--emulate`); regular vs swap-A/B vs fitted at
   forced rows per expert (the model's calibration).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import cases  # noqa: E402
from expected_m import fit_n, per_expert_expected_m, swap_threshold  # noqa: E402
from harness import (  # noqa: E402
    graph_of,
    log,
    loop_time,
    measure_copy_bandwidth,
    measure_fp8_tflops,
    rel,
    time_graphs,
    trace_graph,
    trace_summary,
    unpack_flashinfer,
    weight_bytes,
    write_json,
)

from vllm_h20.moe.build import find_cublas_include  # noqa: E402
from vllm_h20.moe.patchfile import apply_file, read_patch  # noqa: E402

VARIANTS = ("stock", "patched", "calib")
# FlashInfer 0.7.2.post1's JIT flags for its SM90 fused-MoE module (from its build.ninja),
# minus include paths; fp8_blockscale_gemm.cu is one of that module's sources.
NVCC_FLAGS = [
    "-std=c++17", "--expt-relaxed-constexpr", "-static-global-template-stub=false",
    "-use_fast_math", "-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a",
    "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
    "-DFLASHINFER_ENABLE_FP8_E5M2", "-DFLASHINFER_ENABLE_FP8_E8M0", "-DFLASHINFER_ENABLE_FP4_E2M1",
    "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DCOMPILE_HOPPER_TMA_GEMMS",
    "-DCOMPILE_HOPPER_TMA_GROUPED_GEMMS", "-DENABLE_BF16", "-DENABLE_FP8",
    "-DENABLE_FP8_BLOCK_SCALE", "-DENABLE_FP4", "-DUSING_OSS_CUTLASS_MOE_GEMM",
    "-DCUTLASS_ENABLE_GDC_FOR_SM90=1", "-DCUTLASS_MIXED_GEMM_FP4_FP8_PREPROCESSED_SIGNS=1",
    # torch's extension builder disables the half/bf16 conversions FlashInfer relies on
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
]  # fmt: skip
KERNEL_CUH = (
    "tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm_kernel.cuh"
)
FP8_GEMM_CUH = "tensorrt_llm/deep_gemm/fp8_gemm.cuh"
GEMM_CU = "tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu"
SMS_LINE = "static int kNumDeviceSMs = -1;"
PLAN_LINE = "  LaunchPlan plan = plan_launches(max_m_per_problem, split_rows_for(num_device_sms));"
SINGLE_LAUNCH_HOOK = (
    "  if (max_m_per_problem == 0) {",
    "  if (max_m_per_problem == 0 || vllm_h20_single_launch()) {",
)
FORCE_BRANCH_HOOK = (
    "    if (expected_m >= m_per_expert_threshold) {",
    "    if (vllm_h20_force_branch != 0 ? vllm_h20_force_branch > 0\n"
    "                                   : expected_m >= m_per_expert_threshold) {",
)
SMS_HOOK = (SMS_LINE, "static int kNumDeviceSMs = vllm_h20_num_sms_override();")
# The calibration build's hooks into the patched grouped_gemm_dispatch (deepgemm_setup.cu defines
# them): (line in the patched source, what replaces it). Each line must occur exactly once.
# The series shipped until 2026-12-03 (candidates/estimated-row-classes: row classes from an
# estimate, plan_row_classes(expected_m, max_m, threshold); kind "shipped"): one launch from
# expected_m (the average-only fix), forced branches, the SM count.
SHIPPED_HOOKS = (SINGLE_LAUNCH_HOOK, FORCE_BRANCH_HOOK, SMS_HOOK)
# That series' plan ("prev"), run from a later series' row-class launches (the calibration
# build's rule mode 3).
PREV_PLAN = (
    "  if (vllm_h20_prev_plan()) {\n"
    "    unsigned cold_m, boundary, hot_m;\n"
    "    vllm_h20_prev_row_classes(expected_m, max_m_per_problem, m_per_expert_threshold,\n"
    "                              cold_m, boundary, hot_m);\n"
    "    if (max_m_per_problem <= boundary) {\n"
    "      run_swap_ab(cold_m, {});\n"
    "    } else {\n"
    "      run_swap_ab(cold_m, {1, boundary});\n"
    "      run_regular(hot_m, {boundary + 1, deep_gemm::kAnyRows}, /*overlap=*/true);\n"
    "    }\n"
    "    return;\n"
    "  }\n"
)  # fmt: skip
# The fitted-row-tile candidate (plan_launches): those, a forced fitted launch, the previous plan
# (the shipped series' rule, run from this build's row classes) and a split.
FITTED_HOOKS = (
    (SINGLE_LAUNCH_HOOK[0],
     SINGLE_LAUNCH_HOOK[1] + "\n"
     "    if (vllm_h20_force_branch == 2) {\n"
     "      run_fitted(std::min<uint32_t>(kMaxFitN, (std::max<uint32_t>(expected_m, 1) + 15) / 16"
     " * 16), {});\n"
     "      return;\n"
     "    }"),
    FORCE_BRANCH_HOOK,
    (PLAN_LINE,
     PREV_PLAN + "  LaunchPlan plan = plan_launches(\n"
     "      max_m_per_problem, vllm_h20_split_rows(split_rows_for(num_device_sms)));"),
    SMS_HOOK,
)  # fmt: skip
# The two-class series (candidates/whole-expert-tiles, kind "classes", and the shipped one, kind
# "hot_first": plan_row_classes with the GPU's ridge): those hooks and the previous plan in front
# of their own.
CLASS_PLAN_LINE = "  uint32_t const busiest = busiest_balanced_rows(expected_m);"
# ... and alternatives to its two-class split, for --explore (rule modes 6, 7 and 8): the hot
# class launched first with the cold one overlapping its tail (with concentrated routing the
# cold launch is the empty one); one swap-A/B launch sized for max_m up to 128 rows (below an
# H200's ridge a wide row tile costs little MMA time); and candidates/hot-first's rule (one
# swap-A/B launch up to 32 rows, one regular launch up to 64 where 64 rows are under the ridge,
# else the hot class first).
CLASS_SPLIT = (
    "    run_swap_ab(plan.cold_m, {1, plan.boundary});\n"
    "    run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows}, /*overlap=*/true);\n"
)
CLASS_SPLIT_HOOK = (
    "    if (vllm_h20_rule_mode == 8 && max_m_per_problem <= 32) {\n"
    "      run_swap_ab(max_m_per_problem, {});\n"
    "    } else if (vllm_h20_rule_mode == 8 && max_m_per_problem <= 64 &&\n"
    "               64 <= ridge_rows(num_device_sms)) {\n"
    "      run_regular(max_m_per_problem, {});\n"
    "    } else if (vllm_h20_rule_mode == 6 || vllm_h20_rule_mode == 8) {\n"
    "      run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows});\n"
    "      run_swap_ab(plan.cold_m, {1, plan.boundary}, /*overlap=*/true);\n"
    "    } else if (vllm_h20_rule_mode == 7 && max_m_per_problem <= 128) {\n"
    "      run_swap_ab(max_m_per_problem, {});\n"
    "    } else {\n" + CLASS_SPLIT.replace("    run", "      run") + "    }\n"
)
CLASS_HOOKS = (*SHIPPED_HOOKS, (CLASS_PLAN_LINE, PREV_PLAN + CLASS_PLAN_LINE),
               (CLASS_SPLIT, CLASS_SPLIT_HOOK))  # fmt: skip
# The shipped series has its split in the other order already: none of those rules to hook.
HOT_FIRST_HOOKS = CLASS_HOOKS[:-1]
# --explore on the shipped series (rule modes 10-15): what its split's second launch costs, and
# other ways to run the two classes. 10 = the hot launch alone (a diagnostic: its output misses
# the cold experts' rows wherever there are some), 11 = both launches, the cold one without the
# overlap (no programmatic dependent launch), 12 / 13 = the classes on two branches of a forked
# stream joined after them (parallel nodes in a CUDA graph), the hot launch issued first /
# second. vllm_h20_fork / vllm_h20_join: deepgemm_setup.cu.
HOT_FIRST_SPLIT = (
    "    run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows});\n"
    "    run_swap_ab(plan.cold_m, {1, plan.boundary}, /*overlap=*/true);\n"
)
HOT_FIRST_SPLIT_HOOK = (
    "    // --explore, modes 29-32: both class kernels with switches (SEARCH_HOOKS) in the hot\n"
    "    // class's upper bound and in the top byte of the cold class's lower bound.\n"
    "    constexpr uint32_t kSwitches[] = {48, 32, 8, 16};\n"
    "    if (vllm_h20_rule_mode == 10) {\n"
    "      run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows});\n"
    "    } else if (vllm_h20_rule_mode == 14) {\n"
    "      run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows - 1});\n"
    "    } else if (vllm_h20_rule_mode == 15) {\n"
    "      run_regular(plan.hot_m, {1, deep_gemm::kAnyRows});\n"
    "    } else if (vllm_h20_rule_mode >= 29 && vllm_h20_rule_mode <= 32) {\n"
    "      uint32_t const bits = kSwitches[vllm_h20_rule_mode - 29];\n"
    "      run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows - bits});\n"
    "      run_swap_ab(plan.cold_m, {(bits << 24) | 1u, plan.boundary}, /*overlap=*/true);\n"
    "    } else if (vllm_h20_rule_mode == 11) {\n"
    "      run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows});\n"
    "      run_swap_ab(plan.cold_m, {1, plan.boundary});\n"
    "    } else if (vllm_h20_rule_mode == 12 || vllm_h20_rule_mode == 13) {\n"
    "      cudaStream_t const main_stream = stream, side = vllm_h20_fork(stream);\n"
    "      auto hot = [&] {\n"
    "        stream = main_stream;\n"
    "        run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows});\n"
    "      };\n"
    "      auto cold = [&] {\n"
    "        stream = side;\n"
    "        run_swap_ab(plan.cold_m, {1, plan.boundary});\n"
    "      };\n"
    "      if (vllm_h20_rule_mode == 12) {\n"
    "        hot();\n"
    "        cold();\n"
    "      } else {\n"
    "        cold();\n"
    "        hot();\n"
    "      }\n"
    "      stream = main_stream;\n"
    "      vllm_h20_join(main_stream, side);\n"
    "    } else {\n" + HOT_FIRST_SPLIT.replace("    run", "      run") + "    }\n"
)
HOT_FIRST_EXPLORE_HOOKS = (*HOT_FIRST_HOOKS, (HOT_FIRST_SPLIT, HOT_FIRST_SPLIT_HOOK))
# ... and what the row-class kernels' parts cost, one at a time. 14 = the hot class without the
# first-tile search (a diagnostic like 10: its CTAs walk the groups from the first, as
# FlashInfer's do, to the last group), 15 = the row-class kernel with its search on every expert
# with rows (class 1-any: FlashInfer's tiles, the row-class machinery). 29-32 = the shipped split
# with both class kernels switched (whole versions): 29 = as shipped until 2026-12-06 (every
# CTA starts at its tile and walks to the last group after its last tile), 30 = stopping at the
# launch's last tile, every CTA starting at its tile, 31 = stopping there, every CTA walking
# from the first group, 32 = the series' start rule (at the tile within one wave, else the
# walk) without the stop. Modes 16-28 were switches on the series before the stop
# (kernel-split-h100, explore_split2) and are gone with it.
# The calib headers only (SEARCH_HOOKS) read a class bounded by kAnyRows - k, k = 1..63, as
# switches: bit 0 no search, bit 1 no PDL instructions, bit 2 no class check, bit 3 walk from the
# first group, bit 4 no stop at the launch's last tile, bit 5 start at the tile (each its own
# cache name, _class<min>-<kAnyRows - k>); such a bound admits any real row count. The cold
# class is 1..boundary, so its switches are the top byte of its lower bound (rows_in_class masks
# it off).
SEARCH_FLAG_LINE = "  static constexpr bool kRowClass = kMinRows > 0 || kMaxRows != kAnyRows;"
HAS_ROW_CLASS = (
    "__device__ __host__ constexpr bool has_row_class() {\n"
    "  if constexpr (SchedulerType::gemm_type == GemmType::GroupedWithOffset) {\n"
    "    return SchedulerType::kRowClass;\n"
    "  } else {\n"
    "    return false;\n"
    "  }\n"
    "}\n"
)
SEARCHES = (
    "\n// vllm-h20 --explore (modes 14, 29-32): a row class bounded by kAnyRows - k switches\n"
    "// parts of the row-class kernel (run.py SEARCH_HOOKS).\n"
    "template <typename SchedulerType>\n"
    "__device__ __host__ constexpr bool vllm_h20_searches() {\n"
    "  if constexpr (has_row_class<SchedulerType>()) {\n"
    "    return !SchedulerType::kNoSearch;\n"
    "  } else {\n"
    "    return false;\n"
    "  }\n"
    "}\n"
    "template <typename SchedulerType>\n"
    "__device__ __host__ constexpr bool vllm_h20_pdl() {\n"
    "  if constexpr (has_row_class<SchedulerType>()) {\n"
    "    return !SchedulerType::kNoPdl;\n"
    "  } else {\n"
    "    return false;\n"
    "  }\n"
    "}\n"
)
DIAG_FLAGS = (
    "\n  static constexpr uint32_t kDiag =\n"
    "      (kMaxRows != kAnyRows && kMaxRows >= kAnyRows - 63 ? kAnyRows - kMaxRows : 0) |\n"
    "      (kMinRows >> 24);\n"
    "  static constexpr bool kNoSearch = kDiag & 1, kNoPdl = kDiag & 2, kNoCheck = kDiag & 4,\n"
    "                        kWalk = kDiag & 8, kNoStop = kDiag & 16, kJump = kDiag & 32;"
)
PDL_WAIT = 'asm volatile("griddepcontrol.wait;" ::: "memory");'
PDL_TRIGGER = 'asm volatile("griddepcontrol.launch_dependents;");'
PDL_IF = "if constexpr (vllm_h20_pdl<SchedulerType>()) "
SEARCH_HOOKS = {
    "tensorrt_llm/deep_gemm/scheduler.cuh": (
        (SEARCH_FLAG_LINE, 2, SEARCH_FLAG_LINE + DIAG_FLAGS),
        (HAS_ROW_CLASS, 1, HAS_ROW_CLASS + SEARCHES),
        ("    if (first.tiles <= gridDim.x) {\n", 2,
         "    if (!kWalk && (kJump || first.tiles <= gridDim.x)) {\n"),
        ("    end_block_idx = first.tiles;\n", 2,
         "    if constexpr (!kNoStop) end_block_idx = first.tiles;\n"),
        ("    return rows >= static_cast<int64_t>(kMinRows) && rows <=", 1,
         "    return rows >= static_cast<int64_t>(kMinRows & 0xffffffu) && rows <="),
        ("rows_in_class<kMinRows, kMaxRows>(m) ? ceil_div(m,", 1,
         "(kNoCheck || rows_in_class<kMinRows, kMaxRows>(m)) ? ceil_div(m,"),
        ("rows_in_class<kMinRows, kMaxRows>(n) ? ceil_div(n,", 1,
         "(kNoCheck || rows_in_class<kMinRows, kMaxRows>(n)) ? ceil_div(n,"),
    ),
    "tensorrt_llm/deep_gemm/fp8_gemm_impl.cuh": (
        ("  if constexpr (has_row_class<SchedulerType>()) {\n    first_tile = ", 2,
         "  if constexpr (vllm_h20_searches<SchedulerType>()) {\n    first_tile = "),
        ("  if constexpr (has_row_class<SchedulerType>()) {\n    scheduler.start_at(", 2,
         "  if constexpr (vllm_h20_searches<SchedulerType>()) {\n    scheduler.start_at("),
        (f"    {PDL_TRIGGER}\n    if (!first_tile.found) {{\n      {PDL_WAIT}", 2,
         f"    {PDL_IF}{PDL_TRIGGER}\n    if (!first_tile.found) {{\n      {PDL_IF}{PDL_WAIT}"),
        (f"      if constexpr (has_row_class<SchedulerType>()) {{\n        {PDL_WAIT}", 2,
         f"      if constexpr (vllm_h20_pdl<SchedulerType>()) {{\n        {PDL_WAIT}"),
    ),
}  # fmt: skip
# candidates/one-launch (0003: both classes in one dual-kernel launch): rule mode 9 turns the dual
# launch off, which leaves the shipped series' hot-first dispatch (two launches): its `prev`.
ONE_LAUNCH_GUARD = "    if (!one_launch_fits(hot, cold, num_device_sms)) return false;"
ONE_LAUNCH_HOOKS = (*HOT_FIRST_HOOKS,
                    (ONE_LAUNCH_GUARD, "    if (vllm_h20_rule_mode == 9) return false;\n"
                     + ONE_LAUNCH_GUARD))  # fmt: skip
# candidates/graph-branches (0003: under CUDA-graph capture the two classes on parallel branches
# of a forked stream): rule mode 9 keeps them on the caller's stream, which leaves the shipped
# series' dispatch (the cold launch overlapping the hot one): its `prev`.
BRANCHES_GUARD = (
    "  } else if (RowClassBranches* branches = RowClassBranches::when_capturing(stream)) {"
)
BRANCHES_HOOKS = (*HOT_FIRST_HOOKS,
                  (BRANCHES_GUARD, "  } else if (RowClassBranches* branches =\n"
                   "                 vllm_h20_rule_mode == 9 ? nullptr\n"
                   "                                         : RowClassBranches::when_capturing("
                   "stream)) {"))  # fmt: skip
# candidates/overlap-quantize (0003: the hot launch overlaps the kernel before it, the grouped
# quantization of the activations): rule mode 9 makes it without programmatic dependent launch,
# which leaves the shipped series' dispatch (its kernels wait first, a no-op then): its `prev`.
OVERLAP_QUANTIZE_LINE = (
    "    run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows}, /*overlap=*/true);"
)
OVERLAP_QUANTIZE_HOOKS = (*HOT_FIRST_HOOKS,
                          (OVERLAP_QUANTIZE_LINE,
                           "    run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows},\n"
                           "                /*overlap=*/vllm_h20_rule_mode != 9);"))  # fmt: skip
SHIPPED_TWO_LAUNCH = (9, 0)
CANDIDATE = "candidates/fitted-row-tiles"


def series_kind(kernel_cuh: str) -> str:
    """Which dispatch a patched fp8_blockscale_gemm_kernel.cuh has: "fitted" (fitted row tiles),
    "hot_first" (the shipped series since 2026-12-04: row classes, single launches up to 32/64
    rows, the hot class first), "classes" (candidates/whole-expert-tiles: row classes bounded by
    the GPU's ridge, cold class first), "one_launch" (candidates/one-launch: hot_first with both
    classes in one launch), "branches" (candidates/graph-branches: hot_first with the classes on
    parallel branches of a CUDA graph), "overlap_quantize" (candidates/overlap-quantize: hot_first
    with the hot launch overlapping the kernel before it) or "shipped"
    (candidates/estimated-row-classes, shipped until 2026-12-03; the name kept for the published
    runs)."""
    if "plan_launches(" in kernel_cuh:
        return "fitted"
    if "run_both(" in kernel_cuh:
        return "one_launch"
    if "RowClassBranches" in kernel_cuh:
        return "branches"
    if "kNarrowRegularRows" in kernel_cuh:  # the quantization lets the hot launch overlap it
        return (
            "overlap_quantize" if "griddepcontrol.launch_dependents" in kernel_cuh else "hot_first"
        )
    return "classes" if "ridge_rows(" in kernel_cuh else "shipped"


# The kinds with two row classes, measured with the same versions and hooks.
CLASS_KINDS = ("classes", "hot_first", "one_launch", "branches", "overlap_quantize")


CALIB_DECLS = (
    "extern int vllm_h20_force_branch;\nextern int vllm_h20_rule_mode;\n"
    "int vllm_h20_num_sms_override();\n"
    "bool vllm_h20_single_launch();\nbool vllm_h20_prev_plan();\n"
    "unsigned vllm_h20_split_rows(unsigned);\n"
    "void vllm_h20_prev_row_classes(unsigned, unsigned, unsigned, unsigned&, unsigned&,\n"
    "                               unsigned&);\n"
    "struct CUstream_st;\nCUstream_st* vllm_h20_fork(CUstream_st*);\n"
    "void vllm_h20_join(CUstream_st*, CUstream_st*);\n"
)
# ... and into DeepGEMM's host launchers: the grid a persistent kernel gets (VLLM_H20_GRID_SMS).
GRID_LINE = "  config.gridDim = num_sms;"
GRID_HOOK = (
    "  if (vllm_h20_carveout()) {\n"
    "    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);\n"
    "  }\n"
    "  config.gridDim = vllm_h20_grid(num_sms);"
)


# ----------------------------------------------------------------------------- sources


def series_patches(series: str = "") -> list[Path]:
    """The patch files of a series under patches/flashinfer/ ("": the shipped one)."""
    files = sorted((REPO / "patches" / "flashinfer" / series).glob("*.patch"))
    if not files:
        hint = " (a candidate: check out the tag experiments/2026-12-06)" if series else ""
        raise SystemExit(f"no patches in patches/flashinfer/{series}{hint}")
    return files


def build_inputs(series: str = "") -> list[Path]:
    """The files a run's builds are made from besides FlashInfer's sources: the series' patches,
    this file (the calibration hooks) and the extension's sources."""
    ext = sorted(f for f in (HERE / "ext").iterdir() if f.is_file())
    return [*series_patches(series), Path(__file__).resolve(), *ext]


def work_for(work: Path, series: str, flashinfer: str, inputs: list[Path] | None = None) -> Path:
    """The builds and DeepGEMM kernel cache of one series at one state of its inputs, under
    `work`. prepare_sources keeps a copy of the sources it finds, and DeepGEMM names a cached
    kernel by its template arguments only, so a work dir kept on the machine across a changed
    patch would time the patch as it was before (h200.sh keeps $S/work between its starts)."""
    digest = hashlib.sha256(flashinfer.encode())
    for f in build_inputs(series) if inputs is None else inputs:
        digest.update(f"\0{f.name}\0".encode() + f.read_bytes())
    return work / f"{series.replace('/', '-') or 'shipped'}-{digest.hexdigest()[:12]}"


def prepare_sources(data: Path, work: Path, variant: str, series: str = "") -> Path:
    """A private copy of csrc/nv_internal for one variant (patched and calib get the series)."""
    nv = work / variant / "nv_internal"
    if nv.exists():
        return nv
    shutil.copytree(data / "csrc" / "nv_internal", nv)
    if variant in ("patched", "calib"):
        for patch in series_patches(series):
            for diff in read_patch(patch).files:
                if diff.path.startswith("csrc/nv_internal/"):
                    f = nv / diff.path[len("csrc/nv_internal/") :]
                    f.write_text(apply_file(diff, f.read_text()))
    if variant == "calib":
        f = nv / KERNEL_CUH
        text = f.read_text()
        hooks = {
            "fitted": FITTED_HOOKS,
            "classes": CLASS_HOOKS,
            "hot_first": HOT_FIRST_EXPLORE_HOOKS,
            "one_launch": ONE_LAUNCH_HOOKS,
            "branches": BRANCHES_HOOKS,
            "overlap_quantize": OVERLAP_QUANTIZE_HOOKS,
            "shipped": SHIPPED_HOOKS,
        }[series_kind(text)]
        for line, hook in hooks:
            assert text.count(line) == 1, f"grouped_gemm_dispatch changed: update {line!r}"
            text = text.replace(line, hook)
        f.write_text(CALIB_DECLS + text)
        if hooks is HOT_FIRST_EXPLORE_HOOKS:
            for rel_path, edits in SEARCH_HOOKS.items():
                f = nv / rel_path
                text = f.read_text()
                for line, count, hook in edits:
                    assert text.count(line) == count, f"{rel_path} changed: update {line!r}"
                    text = text.replace(line, hook)
                f.write_text(text)
        f = nv / FP8_GEMM_CUH
        text = f.read_text()
        assert text.count(GRID_LINE) >= 2, f"DeepGEMM's launchers changed: update {GRID_LINE!r}"
        f.write_text("int vllm_h20_grid(int);\nbool vllm_h20_carveout();\n"
                     + text.replace(GRID_LINE, GRID_HOOK))  # fmt: skip
    return nv


def deepgemm_dir(data: Path, work: Path, variant: str) -> str:
    """The include dir DeepGEMM's run-time compiles read for a variant: the patched variants'
    own copy (their scheduler has row classes), FlashInfer's for stock."""
    if variant == "stock":
        return str(data / "csrc" / "nv_internal" / "tensorrt_llm")
    return str(work / variant / "nv_internal" / "tensorrt_llm")


@dataclass(frozen=True)
class Version:
    """One column of the A/B: a build, the expected_m its runner gets, and (calib build only)
    the rule it is switched to: (mode, split_rows), see set_rule in deepgemm_setup.cu."""

    name: str
    variant: str  # stock | patched | calib
    kind: str  # stock: expected_m = tokens (FlashInfer's); fixed: the per-expert average
    rule: tuple[int, int] | None = None


AVG_ONLY = (1, 0)  # one launch chosen from the per-expert average: the 0001 patch alone
PREV = (3, 0)  # the shipped 0002's plan, in the candidate's build: two row classes
SPLIT = (0, 128)  # fitted tiles + a regular launch for experts with > 128 rows above 128 tokens
# The run's columns: stock, the average-only fix (0001), the per-expert dispatch of the series
# (0001 + 0002), the latter again (A/A: the noise floor); for the fitted-row-tile candidate also
# the shipped series' plan (prev) and the split.
VERSIONS = (
    Version("stock", "stock", "stock"),
    Version("avg", "calib", "fixed", AVG_ONLY),
    Version("fix", "patched", "fixed"),
    Version("fix_again", "patched", "fixed"),
)
CANDIDATE_VERSIONS = (
    Version("stock", "stock", "stock"),
    Version("avg", "calib", "fixed", AVG_ONLY),
    Version("prev", "calib", "fixed", PREV),
    Version("fix", "patched", "fixed"),
    Version("fix_again", "patched", "fixed"),
    Version("split", "calib", "fixed", SPLIT),
)
# The whole-expert-tile candidate: the same, without the split (a fitted-tile rule).
CLASS_VERSIONS = tuple(v for v in CANDIDATE_VERSIONS if v.name != "split")
# --explore: does the second launch cost less when no kernel changes the shared-memory carveout?
EXPLORE = (
    Version("stock", "stock", "stock"),
    Version("avg", "calib", "fixed", AVG_ONLY),
    Version("prev", "calib", "fixed", PREV),
    Version("prev_co", "calib", "fixed", (4, 0)),
    Version("fix", "patched", "fixed"),
    Version("split", "calib", "fixed", SPLIT),
    Version("split_co", "calib", "fixed", (5, 128)),
)
# The columns every two-class --explore run starts with: stock, the average-only fix, the series.
EXPLORE_BASE = (
    Version("stock", "stock", "stock"),
    Version("avg", "calib", "fixed", AVG_ONLY),
    Version("fix", "patched", "fixed"),
)
# --explore on the shipped series: its two-class split against the hot class first (mode 6), one
# swap-A/B launch sized for max_m up to 128 rows (mode 7) and candidates/hot-first's rule (mode
# 8), every output checked as usual.
CLASS_EXPLORE = (
    *EXPLORE_BASE,
    Version("hot_first", "calib", "fixed", (6, 0)),
    Version("one_swap", "calib", "fixed", (7, 0)),
    Version("hot_first_r64", "calib", "fixed", (8, 0)),
)
# --explore on the shipped series: the rule modes 10-15 and 29-32 (HOT_FIRST_SPLIT_HOOK) beside
# the series (`fix`) and the calibration build's copy of it (`fix_calib`, mode 0: same launches,
# so what the build alone changes). `hot_only` and `hot_no_search` are diagnostics (DIAGNOSTIC):
# their output is incomplete wherever the cold class has rows, not counted as a failed check.
HOT_FIRST_EXPLORE = (
    *EXPLORE_BASE,
    Version("fix_calib", "calib", "fixed", (0, 0)),
    Version("hot_only", "calib", "fixed", (10, 0)),
    Version("no_overlap", "calib", "fixed", (11, 0)),
    Version("branches", "calib", "fixed", (12, 0)),
    Version("branches_cold_first", "calib", "fixed", (13, 0)),
    Version("hot_no_search", "calib", "fixed", (14, 0)),
    Version("every_class", "calib", "fixed", (15, 0)),
    Version("before_stop", "calib", "fixed", (29, 0)),
    Version("always_jump", "calib", "fixed", (30, 0)),
    Version("always_walk", "calib", "fixed", (31, 0)),
    Version("no_stop", "calib", "fixed", (32, 0)),
)
DIAGNOSTIC = frozenset({"hot_only", "hot_no_search"})
# The emulations' columns, all from the calib build (one module per process).
EMU_VERSIONS = (
    Version("stock", "calib", "stock", AVG_ONLY),
    Version("avg", "calib", "fixed", AVG_ONLY),
    Version("fix", "calib", "fixed", (0, 0)),
)
CLASS_EMU_VERSIONS = (*EMU_VERSIONS[:2], Version("prev", "calib", "fixed", PREV), EMU_VERSIONS[2])


def with_shipped_as_prev(versions: tuple[Version, ...], kind: str) -> tuple[Version, ...]:
    """For candidates/one-launch, graph-branches and overlap-quantize, `prev` is the shipped
    series' dispatch (rule mode 9: two launches on the caller's stream, the cold one overlapping
    the hot one, the hot one not overlapping what comes before it)."""
    if kind not in ("one_launch", "branches", "overlap_quantize"):
        return versions
    return tuple(Version(v.name, v.variant, v.kind, SHIPPED_TWO_LAUNCH) if v.name == "prev" else v
                 for v in versions)  # fmt: skip


def emu_versions(kind: str) -> tuple[Version, ...]:
    """The emulations' columns for a series kind (see series_kind)."""
    return with_shipped_as_prev(CLASS_EMU_VERSIONS if kind in CLASS_KINDS else EMU_VERSIONS, kind)


# H20 emulations: (name, SMs the kernels plan for, CTAs they run on). FP8 tensor rate scales with
# the SMs used: 40 of 132 is what the issue asks (296 / 989 TFLOP/s, 989 being H200's dense BF16);
# 20 matches the FP8 datasheet peaks (296 / 1,979), at a bandwidth 20 SMs cannot fill.
EMULATIONS = (("emulated_78sm", 78, 78), ("emulated_h20_40sm", 78, 40),
              ("emulated_h20_20sm", 78, 20))  # fmt: skip


def build_variant(data: Path, work: Path, variant: str, series: str = ""):
    import torch.utils.cpp_extension as ext

    nv = prepare_sources(data, work, variant, series)
    build = work / variant / "build"
    build.mkdir(parents=True, exist_ok=True)
    defines = {"stock": [], "patched": ["-DVLLM_H20_PATCHED"],
               "calib": ["-DVLLM_H20_PATCHED", "-DVLLM_H20_FORCE_HOOK"]}[variant]  # fmt: skip
    includes = [
        nv, nv / "include", nv / "tensorrt_llm/cutlass_extensions/include",
        nv / "tensorrt_llm/kernels/cutlass_kernels/include",
        nv / "tensorrt_llm/kernels/cutlass_kernels",
        data / "include", data / "csrc", data / "cutlass/include",
        data / "cutlass/tools/util/include", data / "spdlog/include",
    ]  # fmt: skip
    # -isystem, after nvcc's own headers: a pip CUDA include dir may carry other crt/ headers
    cublas = find_cublas_include(ext.CUDA_HOME)  # None when the toolkit has cuBLAS
    system = ["-isystem", cublas] if cublas else []
    common = nv / "cpp/common"
    sources = [HERE / "ext/grouped_gemm.cpp", HERE / "ext/deepgemm_setup.cu", nv / GEMM_CU] + [
        common / f for f in ("logger.cpp", "stringUtils.cpp", "tllmException.cpp", "envUtils.cpp")
    ]
    return ext.load(
        name=f"vllm_h20_grouped_gemm_{variant}",
        sources=[str(s) for s in sources],
        extra_include_paths=[str(i) for i in includes],
        extra_cflags=["-O3", "-std=c++20", *defines, *system],
        extra_cuda_cflags=NVCC_FLAGS + defines + system,
        extra_ldflags=[f"-L{ext.CUDA_HOME}/lib64/stubs", "-lcuda", "-lnvrtc"],
        build_directory=str(build),
        verbose=False,
    )


def load_built(work: Path, variant: str):
    """Import a variant that build_variant already compiled (no rebuild check, no lock)."""
    import importlib.util

    import torch  # noqa: F401 - the extension links against torch's libraries

    name = f"vllm_h20_grouped_gemm_{variant}"
    spec = importlib.util.spec_from_file_location(name, work / variant / "build" / f"{name}.so")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build_in_child(args) -> tuple[str, float]:
    data, work, variant, *series = args
    t0 = time.time()
    build_variant(Path(data), Path(work), variant, *series)
    return variant, time.time() - t0


# ----------------------------------------------------------------------------- GPU work


class Gpu:
    """Tensors shared by all cases: one rank's 50 experts' FC1/FC2 weights and references."""

    def __init__(self, mods: dict, data: Path, work: Path, seed: int = 0):
        import torch

        self.torch = torch
        self.mods = mods
        # Stock last-but-not-least: if the modules share DeepGEMM's static include list (one
        # process, same inline function), the patched headers win; they compile every kernel
        # without a row class exactly as the stock ones do.
        for v in sorted(mods, key=lambda v: v != "stock"):
            mods[v].set_include_dirs([deepgemm_dir(data, work, v)])
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.w, self.ws, self.wref = {}, {}, {}
        for s in cases.SHAPES:
            w = torch.empty(cases.LOCAL, s.n, s.k, dtype=torch.float8_e4m3fn, device="cuda")
            deq = torch.empty(cases.LOCAL, s.n, s.k, dtype=torch.float32, device="cuda")
            sc = torch.rand(cases.LOCAL, s.n // 128, s.k // 128, generator=g, device="cuda")
            sc = (sc * 1.5 + 0.5) * 2e-3
            for e in range(cases.LOCAL):
                raw = torch.randn(s.n, s.k, generator=g, device="cuda") * 64
                w[e] = raw.clamp(-448, 448).to(torch.float8_e4m3fn)
                deq[e] = w[e].float() * sc[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            self.w[s.name], self.ws[s.name], self.wref[s.name] = w, sc.contiguous(), deq

    def quant_1x128(self, a):
        """The activation as the kernel sees it: FP8 per 1x128 group, dequantized."""
        torch = self.torch
        g = a.float().view(a.shape[0], a.shape[1] // 128, 128)
        amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-10)
        q = (g * (448.0 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448.0)
        return q.view_as(a.float())

    def reference(self, shape, a, counts):
        out = self.torch.zeros(a.shape[0], shape.n, device="cuda")
        aq = self.quant_1x128(a)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                out[start : start + c] = aq[start : start + c] @ self.wref[shape.name][e].T
            start += c
        return out


class RankCase:
    """One rank's FC1 + FC2 for one routing/token count, in one build (stock or patched)."""

    def __init__(self, gpu: Gpu, mod, tokens: int, counts: np.ndarray, expected_m: int, seed: int,
                 rule: tuple[int, ...] | None = None):  # fmt: skip
        torch = gpu.torch
        self.mod, self.rule = mod, rule
        self.rows = int(counts.sum())
        cap = max(tokens * cases.TOP_K, 4)
        self.off = torch.tensor(cases.offsets(counts), device="cuda")
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.a, self.out, self.gemms = {}, {}, {}
        ws = 0
        for s in cases.SHAPES:
            self.a[s.name] = torch.randn(cap, s.k, generator=g, device="cuda").to(torch.bfloat16)
            self.out[s.name] = torch.full((cap, s.n), float("nan"), dtype=torch.bfloat16,
                                          device="cuda")  # fmt: skip
            gg = mod.GroupedGemm(tokens, s.n, s.k, cases.TOP_K, cases.LOCAL, expected_m)
            self.gemms[s.name] = gg
            ws = max(ws, gg.workspace_bytes)
        self.ws = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
        self.gpu, self.counts = gpu, counts

    def __call__(self):
        if self.rule is not None:  # the kernel choice is made here, at launch (or capture)
            self.mod.set_rule(*self.rule)
        for s in cases.SHAPES:
            self.gemms[s.name].run(self.out[s.name], self.a[s.name], self.gpu.w[s.name],
                                   self.gpu.ws[s.name], self.off, self.ws)  # fmt: skip

    def check(self) -> dict[str, float]:
        errs = {}
        for s in cases.SHAPES:
            if not self.rows:
                errs[s.name] = 0.0
                continue
            got = self.out[s.name][: self.rows]
            assert bool(self.gpu.torch.isfinite(got).all()), f"{s.name}: non-finite or unwritten"
            ref = self.gpu.reference(s, self.a[s.name][: self.rows], self.counts)
            errs[s.name] = rel(got, ref)
        return errs


def diagnostic_check(case: RankCase) -> dict[str, float]:
    """A diagnostic version's check: an incomplete output (rows it does not write by design)
    is recorded as an infinite error, not raised."""
    try:
        return case.check()
    except AssertionError:
        return {s.name: float("inf") for s in cases.SHAPES}


def ab_case(gpu: Gpu, versions: dict, routing: str, tokens: int, bw: float,
            profile: bool = False) -> dict:  # fmt: skip
    """Every rank of one routing/token case in every version: check, then time in graphs.

    versions: name -> (module, "stock" | "fixed", rule): which expected_m the runner is given
    and the calib build's rule (None: the build's own). profile: then trace each version's
    graph at the slowest rank (profile_rank)."""
    torch = gpu.torch
    slots = cases.route(routing, tokens)
    fixed_m = per_expert_expected_m(tokens, cases.TOP_K, cases.LOCAL, cases.EP)
    m_of = {"stock": tokens, "fixed": fixed_m}
    per_rank, graphs, keep = [], {v: [] for v in versions}, []
    for rank in range(cases.EP):
        counts = cases.rank_counts(slots, rank)
        rc = {v: RankCase(gpu, mod, tokens, counts, m_of[kind], seed=rank, rule=rule)
              for v, (mod, kind, rule) in versions.items()}  # fmt: skip
        for v in rc:
            rc[v]()
        torch.cuda.synchronize()
        errs = {v: diagnostic_check(rc[v]) if v in DIAGNOSTIC else rc[v].check() for v in rc}
        first, *others = [v for v in rc if v not in DIAGNOSTIC]
        agree = {
            f"{o}_vs_{first}": {
                s.name: rel(rc[o].out[s.name][: rc[o].rows], rc[first].out[s.name][: rc[o].rows])
                if rc[first].rows else 0.0 for s in cases.SHAPES
            }
            for o in others
        }  # fmt: skip
        for v in rc:
            graphs[v].append(graph_of(torch, rc[v]))
        per_rank.append({"rank": rank, "rows": int(counts.sum()),
                         "max_rows_per_expert": int(counts.max()),
                         "active_experts": int((counts > 0).sum()),
                         "weight_bytes": weight_bytes(counts), "rel_err": errs,
                         "agreement": agree})  # fmt: skip
        keep.append(rc)  # the graphs replay into these tensors
    # Interleave versions sample by sample so that drift hits all of them alike.
    order = [(v, i) for i in range(cases.EP) for v in versions]
    raw = time_graphs(torch, [graphs[v][i] for v, i in order])
    samples = {v: [[row[order.index((v, i))] for i in range(cases.EP)] for row in raw]
               for v in versions}  # fmt: skip
    traced = None
    if profile:
        try:
            traced = profile_rank(graphs, samples, torch)
        except Exception as e:  # noqa: BLE001 - a lost trace must not fail the A/B's own row
            log(f"{routing} {tokens} tok: profile failed: {e}")
            traced = {"error": str(e)[:500]}
    del graphs, keep
    skew = np.bincount(slots.ravel(), minlength=cases.SLOTS)
    row = {"routing": routing, "tokens": tokens, "stock_expected_m": tokens,
           "fixed_expected_m": fixed_m, "fit_n": fit_n(tokens),
           "hottest_over_mean": float(skew.max() / skew.mean()), "ranks": per_rank}  # fmt: skip
    for v in versions:
        slowest = [max(x) for x in samples[v]]
        row[f"{v}_s"] = statistics.median(slowest)
        row[f"{v}_rank_median_s"] = [statistics.median(x[r] for x in samples[v])
                                     for r in range(cases.EP)]  # fmt: skip
        row[f"{v}_samples_slowest_s"] = slowest
    names = list(versions)
    row["speedups"] = {v: row[f"{names[0]}_s"] / row[f"{v}_s"] for v in names[1:]}
    lead = "fix" if "fix" in versions else names[1]
    row["speedup"] = row["speedups"][lead]
    if "fix_again" in versions:
        row["aa_ratio"] = row["fix_again_s"] / row["fix_s"]
    if "avg" in versions:
        # The bar: within 3 % of the better of stock and the average-only estimate.
        row["vs_best"] = row["speedup"] / max(1.0, row["speedups"]["avg"])
    worst = max(range(cases.EP), key=lambda r: row[f"{lead}_rank_median_s"][r])
    # A read-only stream can use the whole bandwidth the copy measured (read + write).
    row["roofline_s"] = per_rank[worst]["weight_bytes"] / bw
    row["max_rel_err"] = max(max(r["rel_err"][v].values()) for r in per_rank
                             for v in r["rel_err"] if v not in DIAGNOSTIC)  # fmt: skip
    if DIAGNOSTIC & set(versions):  # whether each diagnostic version's output was complete
        row["diagnostic_rel_err"] = {
            v: max(max(r["rel_err"][v].values()) for r in per_rank)
            for v in DIAGNOSTIC & set(versions)
        }
    row["max_disagreement"] = max(
        max(d.values()) for r in per_rank for d in r["agreement"].values()
    )
    row["ok"] = row["max_rel_err"] < 1e-2 and row["max_disagreement"] < 1e-2
    if traced:
        row["profile"] = traced
    log(
        f"{routing:8s} {tokens:5d} tok: "
        + ", ".join(f"{v} {row[f'{v}_s'] * 1e3:.3f} ms" for v in versions)
        + ", "
        + " ".join(f"{v} x{s:.2f}" for v, s in row["speedups"].items())
        + f", err {row['max_rel_err']:.1e} {'ok' if row['ok'] else 'FAIL'}"
    )
    return row


PROFILE_REPLAYS = 20


def profile_rank(graphs: dict, samples: dict, torch) -> dict:
    """Where each version's time goes at the rank the series is slowest on (`fix`, else the
    second version): its kernels as the profiler saw them over PROFILE_REPLAYS replays
    (trace_summary: span, busy, idle, each kernel), and the rate of as many back-to-back
    replays (loop_us: the next replay's launch hidden). The CUDA-event median beside them is
    the A/B's own time for that rank."""
    names = list(samples)
    lead = "fix" if "fix" in samples else names[1]
    rank = max(range(cases.EP), key=lambda r: statistics.median(x[r] for x in samples[lead]))
    out: dict = {"rank": rank, "replays": PROFILE_REPLAYS, "versions": {}}
    for v in names:
        g = graphs[v][rank]
        trace = trace_summary(trace_graph(torch, g, PROFILE_REPLAYS), PROFILE_REPLAYS)
        out["versions"][v] = trace | {
            "event_us": statistics.median(x[rank] for x in samples[v]) * 1e6,
            "loop_us": statistics.median(loop_time(torch, g, PROFILE_REPLAYS)) * 1e6,
        }
    return out


def checked_case(gpu: Gpu, versions: dict, routing: str, tokens: int, bw: float,
                 profile: bool = False) -> dict:  # fmt: skip
    """ab_case, with a failure recorded as a failed row (the run goes on, unless CUDA's context
    is lost, which the row says)."""
    try:
        return ab_case(gpu, versions, routing, tokens, bw, profile)
    except Exception as e:  # noqa: BLE001 - a wrong or unwritten output is a result here
        log(f"{routing} {tokens} tok: FAILED: {e}")
        row = {"routing": routing, "tokens": tokens, "ok": False, "error": str(e)[:2000]}
        if "CUDA" in str(e) or "cuda" in type(e).__name__.lower():
            row["cuda_error"] = True
        return row


# The emulations' cases: every routing at the token counts where the choices differ most.
EMULATED_TOKENS = (1, 64, 128, 288, 1024, 4096)
EMU_CALIB_M = (1, 4, 16, 32, 64, 128, 256)


def emulate_child(args) -> None:
    """Runs with VLLM_H20_NUM_SMS=78 (and VLLM_H20_GRID_SMS for the compute-matched runs): the
    calibration build plans tiles and the swap threshold for 78 SMs, so this H200 dispatches as
    an H20 would, on all its SMs or on as many as match an H20's tensor rate. Stock = expected_m
    tokens, avg = the per-expert average (0001), fix = the patch's plan."""
    import torch

    mod = load_built(args.work, "calib")
    data = unpack_flashinfer(args.flashinfer, args.work)
    gpu = Gpu({"calib": mod}, data, args.work)
    bw = measure_copy_bandwidth(torch)
    kind = series_kind((args.work / "calib" / "nv_internal" / KERNEL_CUH).read_text())
    versions = {v.name: (mod, v.kind, v.rule) for v in emu_versions(kind)}
    rows = []
    for routing in cases.ALL_ROUTINGS:
        for tokens in EMULATED_TOKENS:
            rows.append(checked_case(gpu, versions, routing, tokens, bw))
            write_json(args.out / f"{args.emulate_child}.json", {
                "sms": int(os.environ["VLLM_H20_NUM_SMS"]),
                "grid": int(os.environ.get("VLLM_H20_GRID_SMS", os.environ["VLLM_H20_NUM_SMS"])),
                "threshold": 64, "ab": rows})  # fmt: skip
    calib = calibrate(gpu, mod, EMU_CALIB_M, kind == "fitted")
    doc = json.loads((args.out / f"{args.emulate_child}.json").read_text())
    write_json(args.out / f"{args.emulate_child}.json", doc | {"calibration": calib})


def calibrate(gpu: Gpu, mod, ms: tuple[int, ...], fitted: bool) -> list[dict]:
    """Regular vs swap-A/B (vs fitted swap-A/B, in the candidate's build) at forced rows per
    expert (every expert m rows, one launch): the single-GEMM points the model is fitted on."""
    torch = gpu.torch
    out_rows = []
    for s in cases.SHAPES:
        for m in ms:
            counts = np.full(cases.LOCAL, m)
            rows_ = int(counts.sum())
            a = torch.randn(rows_, s.k, device="cuda").to(torch.bfloat16)
            out = torch.empty(rows_, s.n, dtype=torch.bfloat16, device="cuda")
            off = torch.tensor(cases.offsets(counts), device="cuda")
            gg = mod.GroupedGemm(rows_, s.n, s.k, 1, cases.LOCAL, m)
            ws = torch.empty(max(gg.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
            ts = {}
            kinds = (("regular", 1), ("swap_ab", -1), ("fitted", 2))
            for name, force in kinds if fitted else kinds[:2]:
                mod.force_branch(force)
                g = graph_of(torch, lambda gg=gg, a=a, out=out, off=off, ws=ws, s=s: gg.run(
                    out, a, gpu.w[s.name], gpu.ws[s.name], off, ws))  # fmt: skip
                ts[name] = statistics.median(x[0] for x in time_graphs(torch, [g]))
                ref = gpu.reference(s, a, counts)
                assert rel(out, ref) < 1e-2, (s.name, m, name, rel(out, ref))
            mod.force_branch(0)
            out_rows.append({"gemm": s.name, "m": m, **{f"{k}_s": v for k, v in ts.items()},
                             "weight_bytes": s.weight_bytes(cases.LOCAL)})  # fmt: skip
            log(f"calib {s.name} m={m:4d}: " + ", ".join(
                f"{k} {v * 1e6:7.1f} us" for k, v in ts.items()))  # fmt: skip
    return out_rows


# ----------------------------------------------------------------------------- phases


def warm_jobs(versions, token_list) -> list[tuple]:
    """(variant, rule, shape index, num_rows, top_k, expected_m, force) for every DeepGEMM kernel
    the run will launch: the kernel choice is made on the host from these alone (never from the
    routed rows), so a small grouped GEMM with the same arguments compiles the same kernels."""
    jobs = set()
    for v in versions:
        for t in token_list:
            m = (
                t
                if v.kind == "stock"
                else per_expert_expected_m(t, cases.TOP_K, cases.LOCAL, cases.EP)
            )
            for si in range(len(cases.SHAPES)):
                jobs.add((v.variant, v.rule, si, t, cases.TOP_K, m, 0))
    return sorted(jobs, key=repr)


def calib_jobs(ms=cases.CALIB_M, forces=(1, -1)) -> list[tuple]:
    return sorted(("calib", AVG_ONLY, si, 4 * cases.LOCAL, 1, m, force)
                  for m in ms for si in range(len(cases.SHAPES))
                  for force in forces)  # fmt: skip


def compile_kernels(data: Path, work: Path, jobs: list[tuple], procs: int, env: dict) -> list:
    """Run the warm jobs in `procs` spawned processes with `env` added to theirs (the calib
    build reads VLLM_H20_NUM_SMS when it loads): DeepGEMM compiles what they launch."""
    chunks = [c for c in (jobs[i::procs] for i in range(procs)) if c]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ctx = __import__("multiprocessing").get_context("spawn")
        with cf.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
            parts = pool.map(_warm_child, [(str(data), str(work), c) for c in chunks])
            return [x for part in parts for x in part]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def warm_gemm(mod, si: int, num_rows: int, top_k: int, expected_m: int):
    """A small grouped GEMM (at most 4 rows per expert, never more rows than the runner is
    sized for) sized as the runner would size one for `num_rows` tokens with `expected_m`;
    calling the result runs it once, so DeepGEMM JIT-compiles the kernels that choice selects."""
    import torch

    s = cases.SHAPES[si]
    rows = min(4 * cases.LOCAL, num_rows * top_k)
    counts = np.full(cases.LOCAL, rows // cases.LOCAL)
    counts[: rows % cases.LOCAL] += 1
    a = torch.randn(rows, s.k, device="cuda").to(torch.bfloat16)
    # Contents do not matter here, only shapes (16 of these processes share the GPU's memory).
    w = torch.zeros(cases.LOCAL, s.n, s.k, dtype=torch.float8_e4m3fn, device="cuda")
    sc = torch.ones(cases.LOCAL, s.n // 128, s.k // 128, device="cuda")
    off = torch.tensor(cases.offsets(counts), device="cuda")
    gg = mod.GroupedGemm(num_rows, s.n, s.k, top_k, cases.LOCAL, expected_m)
    ws = torch.empty(max(gg.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
    out = torch.empty(rows, s.n, dtype=torch.bfloat16, device="cuda")
    return lambda: gg.run(out, a, w, sc, off, ws)


def _warm_child(args) -> list[tuple]:
    data, work, jobs = args
    import torch

    mods = {}
    done = []
    for variant, rule, si, num_rows, top_k, m, force in jobs:
        if variant not in mods:
            mods[variant] = load_built(Path(work), variant)
        mod = mods[variant]
        mod.set_include_dirs([deepgemm_dir(Path(data), Path(work), variant)])
        if rule is not None:
            mod.set_rule(*rule)
        if variant == "calib":
            mod.force_branch(force)
        gemm = warm_gemm(mod, si, num_rows, top_k, m)
        t0 = time.time()
        gemm()
        torch.cuda.synchronize()
        del gemm
        torch.cuda.empty_cache()
        done.append((variant, rule, si, num_rows, m, force, time.time() - t0))
    return done


def print_table(rows: list[dict]) -> None:
    """Speedup over stock of every version, per case; then each version's worst case and its
    shortfall against the better of stock and the average-only fix (the issue's goals)."""
    failed = [r for r in rows if "speedups" not in r]
    for r in failed:
        print(f"{r['routing']:12s} {r['tokens']:6d} FAILED: {r.get('error', '?')[:200]}")
    rows = [r for r in rows if "speedups" in r]
    if not rows:
        return
    names = list(rows[0]["speedups"])
    print("\nrouting      tokens " + " ".join(f"{n[:9]:>9s}" for n in names) + "    A/A  check")
    for r in rows:
        aa = r.get("aa_ratio", float("nan"))
        print(f"{r['routing']:12s} {r['tokens']:6d} "
              + " ".join(f"{r['speedups'][n]:9.3f}" for n in names)
              + f"  {aa:5.3f}  {'ok' if r['ok'] else 'FAIL'}")  # fmt: skip
    print("worst               " + " ".join(
        f"{min(r['speedups'][n] for r in rows):9.3f}" for n in names))  # fmt: skip
    if "avg" in names:
        print("vs best             " + " ".join(
            f"{min(r['speedups'][n] / max(1.0, r['speedups']['avg']) for r in rows):9.3f}"
            for n in names))  # fmt: skip


def print_profile(rows: list[dict]) -> None:
    """--profile's table: per case and version, at the slowest rank, the A/B's CUDA-event median
    (event), back-to-back replays (loop), and the profiler's span, busy and idle time, and each
    kernel's duration (us)."""
    traced = [r for r in rows if r.get("profile", {}).get("versions")]
    if not traced:
        return
    print("\nwhere the time goes (us; event: the A/B's median at that rank; loop: back-to-back "
          "replays; span = busy + idle: the profiler's)")  # fmt: skip
    print("routing      tokens rank version               event    loop    span    busy    idle"
          "  kernels")  # fmt: skip
    for r in traced:
        pr = r["profile"]
        for v, s in pr["versions"].items():
            if s.get("uneven"):
                times = f"{'':>7s} {'':>7s} {'':>7s}  {s['kernels_seen']} kernels, uneven"
            else:
                times = f"{s['span_us']:7.1f} {s['busy_us']:7.1f} {s['idle_us']:7.1f}  " + " ".join(
                    f"{k} {x['us']:.1f}" for k, x in s["kernels"].items()
                )
            print(f"{r['routing']:12s} {r['tokens']:6d} {pr['rank']:4d} {v:20s} "
                  f"{s['event_us']:7.1f} {s['loop_us']:7.1f} {times}")  # fmt: skip


def emulate(args, name: str, sms: int, grid: int) -> dict:
    """One H20 emulation in a child process (the calib build reads the SM count at load)."""
    env = dict(os.environ, VLLM_H20_NUM_SMS=str(sms), VLLM_H20_GRID_SMS=str(grid))
    emu = subprocess.run(
        [sys.executable, __file__, "--flashinfer", str(args.flashinfer), "--out", str(args.out),
         "--work", str(args.work), "--emulate-child", name],  # args.work: the series' own
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    f = args.out / f"{name}.json"
    if emu.returncode == 0 and f.exists():
        doc = json.loads(f.read_text())
        f.unlink()
        log(f"{name}: done ({len(doc['ab'])} cases)")
        return doc
    err = (emu.stderr or emu.stdout)[-3000:]
    log(f"{name} failed: {err[-400:]}")
    partial = json.loads(f.read_text()) if f.exists() else {}
    return partial | {"error": err}


def device_info(torch) -> dict:
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
         "--format=csv,noheader"], capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return {
        "name": props.name, "sms": props.multi_processor_count, "nvidia_smi": smi,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "threshold": swap_threshold(props.multi_processor_count),
    }  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flashinfer", type=Path, required=True, help="FlashInfer data tarball/dir")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=REPO / ".build" / "moe_dispatch")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 8)
    ap.add_argument("--quick", action="store_true", help="a few cases only (smoke test)")
    ap.add_argument("--routings", default=",".join(cases.ALL_ROUTINGS),
                    help="comma-separated routings to run (default: all)")  # fmt: skip
    ap.add_argument(
        "--no-main",
        action="store_true",
        help="skip the A/B at the device's own SM count (emulations only)",
    )
    ap.add_argument("--emulate", default="",
                    help="comma-separated H20 emulations to run after the A/B: "
                         + ", ".join(e[0] for e in EMULATIONS) + ", or 'all'")  # fmt: skip
    ap.add_argument("--no-calibration", action="store_true", help="skip the forced-kernel sweep")
    ap.add_argument("--tokens", default="", help="comma-separated token counts (default: all)")
    ap.add_argument("--series", default="",
                    help="patch series under patches/flashinfer/ to build (default: the shipped "
                         "one; the candidates that lost, e.g. candidates/fitted-row-tiles, from a "
                         "checkout of the tag experiments/2026-12-06)")  # fmt: skip
    ap.add_argument("--explore", action="store_true",
                    help="other versions: on the shipped series, its hot launch alone (a "
                         "diagnostic), its split without the overlap, the split on two "
                         "CUDA-graph branches in either order, and its class kernels with parts "
                         "switched (the stop at the last tile, the start rule); with --series "
                         "candidates/whole-expert-tiles, its split with the hot class first, one "
                         "swap-A/B launch up to 128 rows and the hot-first rule; with the "
                         "fitted-tile series, the previous plan and the split with the largest "
                         "carveout for every kernel")  # fmt: skip
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after each case's timing, trace every version's graph at the rank the "
        "series is slowest on (torch's profiler, 20 replays: each kernel's "
        "duration and the idle time between kernels) and time 20 back-to-back "
        "replays; the tables then say where a version's extra time goes",
    )
    ap.add_argument("--emulate-child", default="", help=argparse.SUPPRESS)
    return ap.parse_args()


def selection(args) -> tuple[list[str], list[tuple[str, int, int]]]:
    """The routings and emulations asked for; a misspelt one is refused in one line (it would
    otherwise run none of them, silently, on a lease)."""
    routings = [r for r in args.routings.split(",") if r]
    unknown = sorted(set(routings) - set(cases.ALL_ROUTINGS))
    if unknown:
        raise SystemExit(f"unknown routing(s) {', '.join(unknown)}: "
                         f"choose from {', '.join(cases.ALL_ROUTINGS)}")  # fmt: skip
    wanted = [e for e in args.emulate.split(",") if e and e != "all"]
    unknown = sorted(set(wanted) - {e[0] for e in EMULATIONS})
    if unknown:
        raise SystemExit(f"unknown emulation(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(e[0] for e in EMULATIONS)}, or all")  # fmt: skip
    return routings, [e for e in EMULATIONS if args.emulate == "all" or e[0] in wanted]


def build_variants(args, series: str, result: dict) -> tuple[Path, str]:
    """Unpack FlashInfer's sources and build every variant; (data dir, the series' kind)."""
    data = unpack_flashinfer(args.flashinfer, args.work)
    log(f"building {', '.join(VARIANTS)} from {args.flashinfer.name}")
    t0 = time.time()
    with cf.ProcessPoolExecutor(len(VARIANTS)) as pool:
        jobs = [(str(data), str(args.work), v, series) for v in VARIANTS]
        built = dict(pool.map(_build_in_child, jobs))
    kind = series_kind((args.work / "patched" / "nv_internal" / KERNEL_CUH).read_text())
    result["series_kind"] = kind
    result["phases"]["build_s"] = time.time() - t0
    log(f"built in {result['phases']['build_s']:.0f} s: {built}")
    return data, kind


def run_versions_of(args, kind: str) -> tuple[Version, ...]:
    """The versions the A/B times for a series kind (--explore: the alternatives)."""
    candidate = kind == "fitted"
    if args.explore and kind not in ("fitted", "classes", "hot_first"):
        raise SystemExit(
            f"--explore has no rule modes for this series ({kind}): run it on "
            f"the shipped series, candidates/whole-expert-tiles or {CANDIDATE}"
        )
    if args.explore:
        return {"fitted": EXPLORE, "classes": CLASS_EXPLORE, "hot_first": HOT_FIRST_EXPLORE}[kind]
    return with_shipped_as_prev(
        CANDIDATE_VERSIONS if candidate else CLASS_VERSIONS if kind in CLASS_KINDS else VERSIONS,
        kind,
    )


def compile_all(args, data: Path, kind: str, run_versions, token_list, emulations,
                result: dict) -> None:  # fmt: skip
    """Every DeepGEMM kernel the run will launch, compiled ahead (none compiles while timed)."""
    procs = min(args.jobs, 16)
    jobs = [] if args.no_main else warm_jobs(run_versions, token_list)
    forces = (1, -1, 2) if kind == "fitted" else (1, -1)
    jobs += [] if args.no_calibration else calib_jobs(cases.CALIB_M, forces)
    log(f"compiling {len(jobs)} DeepGEMM kernel choices in {procs} processes")
    t0 = time.time()
    warm = compile_kernels(data, args.work, jobs, procs, {}) if jobs else []
    if emulations:
        emu_jobs = warm_jobs(emu_versions(kind), EMULATED_TOKENS) + calib_jobs(EMU_CALIB_M, forces)
        warm += compile_kernels(data, args.work, emu_jobs, procs, {"VLLM_H20_NUM_SMS": "78"})
    result["phases"]["deepgemm_jit_s"] = time.time() - t0
    kernels = sorted(p.name for p in (Path(os.environ["TRTLLM_DG_CACHE_DIR"]) / "cache").iterdir())
    result["phases"]["deepgemm_kernels"] = len(kernels)
    result["kernels"] = kernels
    result["warm"] = warm
    log(f"{len(kernels)} DeepGEMM kernels ready in {result['phases']['deepgemm_jit_s']:.0f} s")


def ab_cases(gpu, versions: dict, routings, token_list, bw: float, out_json: Path,
             result: dict, profile: bool = False) -> list[dict]:  # fmt: skip
    """The A/B per routing x tokens, every rank, every version; written as it goes."""
    rows: list[dict] = []
    for routing in routings:
        for tokens in token_list:
            row = checked_case(gpu, versions, routing, tokens, bw, profile)
            if row.get("speedup", 1.0) < 0.98:
                # Under 0.98x stock: run it again; both runs are kept (the second decides).
                again = checked_case(gpu, versions, routing, tokens, bw, profile)
                row = again | {"first_run": {k: row[k] for k in row if k != "ranks"}}
            rows.append(row)
            write_json(out_json, result | {"ab": rows})
            if "cuda_error" in row:
                return rows  # the context is gone: nothing after this would run
    return rows


def main() -> None:
    args = parse_args()
    series = args.series.strip("/")
    if not args.emulate_child:  # a child is given its parent's work dir
        args.work = work_for(args.work, series, args.flashinfer.name)
    os.environ.setdefault("TRTLLM_DG_CACHE_DIR", str(args.work / "deepgemm"))
    os.environ.setdefault("TRTLLM_DG_NVCC_COMPILER", shutil.which("nvcc") or "nvcc")
    if args.emulate_child:
        return emulate_child(args)
    log(f"builds and DeepGEMM kernels in {args.work}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(args.jobs))
    t_start = time.time()
    result: dict = {"command": " ".join(sys.argv), "phases": {}, "series": series or "shipped"}
    out_json = args.out / "moe_dispatch_h200.json"
    routings, emulations = selection(args)
    data, kind = build_variants(args, series, result)

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    result["device"] = device_info(torch) | {"flashinfer_sources": args.flashinfer.name}
    log(f"device: {result['device']['nvidia_smi']}; {result['device']['sms']} SMs")
    token_list = cases.TOKENS if not args.quick else (1, 128, 2048)
    if args.tokens:
        token_list = tuple(int(x) for x in args.tokens.split(","))
    run_versions = run_versions_of(args, kind)
    compile_all(args, data, kind, run_versions, token_list, emulations, result)

    mods = {v: load_built(args.work, v) for v in VARIANTS}
    assert not mods["stock"].patched() and mods["patched"].patched()
    gpu = Gpu(mods, data, args.work)
    bw = measure_copy_bandwidth(torch)
    result["copy_bandwidth_Bps"] = bw
    tf = measure_fp8_tflops(torch)
    if tf:
        result["fp8_tflops_measured"] = tf
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); FP8 8192^3 GEMM {tf} TFLOP/s")
    versions = {v.name: (mods[v.variant], v.kind, v.rule) for v in run_versions}
    result["versions"] = {v.name: {"variant": v.variant, "expected_m": v.kind, "rule": v.rule}
                          for v in run_versions}  # fmt: skip
    rows = [] if args.no_main else ab_cases(gpu, versions, routings, token_list, bw, out_json,
                                            result, args.profile)  # fmt: skip
    result["ab"] = rows
    result["phases"]["ab_s"] = time.time() - t_start
    if not args.no_calibration:
        result["calibration"] = calibrate(gpu, mods["calib"], cases.CALIB_M, kind == "fitted")
        write_json(out_json, result)
    del gpu
    torch.cuda.empty_cache()

    # --- the same cases as an H20 would dispatch them -------------------------------------
    for name, sms, grid in emulations:
        result[name] = emulate(args, name, sms, grid)
        write_json(out_json, result)
    result["phases"]["total_s"] = time.time() - t_start
    write_json(out_json, result)
    sys.exit(0 if report(rows, emulations, result) else 1)


def report(rows: list[dict], emulations, result: dict) -> bool:
    """Print the tables; whether every output of every case checked out."""
    if rows:
        print_table(rows)
        print_profile(rows)
    for name, *_ in emulations:
        if result[name].get("ab"):
            print(f"\n{name}:")
            print_table(result[name]["ab"])
    ok = all(r["ok"] for r in rows) and all(
        r["ok"] for n, *_ in emulations for r in result[n].get("ab", [])
    )
    print(f"all checks {'passed' if ok else 'FAILED'}; total {result['phases']['total_s']:.0f} s")
    return ok


if __name__ == "__main__":
    main()
