"""Kernel-level A/B of FlashInfer's SM90 FP8 block-scale MoE GEMMs: stock vs per-expert
expected_m, on one GPU, for every EP8 rank of DeepSeek-V4.1-Flash (see cases.py).

One command on the GPU machine does everything and prints a short table last:

    python benchmarks/moe_dispatch/run.py --flashinfer .fi/flashinfer-0.7.2.post1-src.tar.xz \
        --out $OUT

1. builds three torch extensions from the FlashInfer sources' fp8_blockscale_gemm.cu: stock,
   patched (patches/flashinfer applied by vllm_h20's applier), and patched plus a one-line
   branch override (crossover calibration only), with FlashInfer's JIT flags;
2. compiles the DeepGEMM kernels every case needs in parallel processes (their run-time nvcc
   builds, cached in TRTLLM_DG_CACHE_DIR, stay out of the timings);
3. checks every rank/case: stock and patched outputs against an fp32 reference and each other;
4. times FC1 + FC2 per rank in CUDA graphs (5 warm-ups, 24 samples; per sample the slowest
   rank, then the median, as the seed did), the weights-read roofline against a copy measured
   in the same run, and regular vs swap-A/B at forced expected_m for the crossover.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import cases  # noqa: E402

from vllm_h20.moe.build import find_cublas_include  # noqa: E402
from vllm_h20.moe.expected_m import per_expert_expected_m, swap_threshold  # noqa: E402
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
GEMM_CU = "tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu"
SMS_LINE = "static int kNumDeviceSMs = -1;"
PLAN_LINE = (
    "  RowClassPlan plan = plan_row_classes(expected_m, max_m_per_problem, m_per_expert_threshold);"
)
# The calibration build's hooks into the patched grouped_gemm_dispatch (deepgemm_setup.cu defines
# them): (line in the patched source, what replaces it). Each line must occur exactly once.
CALIB_HOOKS = (
    ("  if (max_m_per_problem == 0) {",
     "  if (max_m_per_problem == 0 || vllm_h20_single_launch()) {"),
    ("    if (expected_m >= m_per_expert_threshold) {",
     "    if (vllm_h20_force_branch != 0 ? vllm_h20_force_branch > 0\n"
     "                                   : expected_m >= m_per_expert_threshold) {"),
    (PLAN_LINE,
     PLAN_LINE + "\n"
     "  vllm_h20_override_plan(expected_m, max_m_per_problem, m_per_expert_threshold,\n"
     "                         plan.cold_m, plan.boundary, plan.hot_m);"),
    ("    run_swap_ab(plan.cold_m, {1, plan.boundary});\n"
     "    run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows}, /*overlap=*/true);",
     "    if (!vllm_h20_hot_first) run_swap_ab(plan.cold_m, {1, plan.boundary});\n"
     "    run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows},\n"
     "                !vllm_h20_hot_first && vllm_h20_overlap);\n"
     "    if (vllm_h20_hot_first) run_swap_ab(plan.cold_m, {1, plan.boundary}, vllm_h20_overlap);"),
    (SMS_LINE, "static int kNumDeviceSMs = vllm_h20_num_sms_override();"),
)  # fmt: skip
CALIB_DECLS = (
    "extern int vllm_h20_force_branch;\nextern int vllm_h20_hot_first, vllm_h20_overlap;\n"
    "int vllm_h20_num_sms_override();\nbool vllm_h20_single_launch();\n"
    "void vllm_h20_override_plan(unsigned, unsigned, unsigned, unsigned&, unsigned&, unsigned&);\n"
)
WARMUPS, SAMPLES = 5, 24


def write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- sources


def unpack_flashinfer(archive: Path, work: Path) -> Path:
    """FlashInfer's data dir (csrc/, include/, cutlass/, spdlog/) from a tarball or a dir."""
    if archive.is_dir():
        return archive
    dest = work / "flashinfer-data"
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
        (dest / ".complete").write_text(archive.name)
    return dest


def prepare_sources(data: Path, work: Path, variant: str) -> Path:
    """A private copy of csrc/nv_internal for one variant (patched and calib get the patch)."""
    nv = work / variant / "nv_internal"
    if nv.exists():
        return nv
    shutil.copytree(data / "csrc" / "nv_internal", nv)
    if variant in ("patched", "calib"):
        for patch in sorted((REPO / "patches" / "flashinfer").glob("*.patch")):
            for diff in read_patch(patch).files:
                if diff.path.startswith("csrc/nv_internal/"):
                    f = nv / diff.path[len("csrc/nv_internal/") :]
                    f.write_text(apply_file(diff, f.read_text()))
    if variant == "calib":
        f = nv / KERNEL_CUH
        text = f.read_text()
        for line, hook in CALIB_HOOKS:
            assert text.count(line) == 1, f"grouped_gemm_dispatch changed: update {line!r}"
            text = text.replace(line, hook)
        f.write_text(CALIB_DECLS + text)
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
    the dispatch rule it is switched to (mode, sizing, boundary, hot_first, overlap; see
    set_rule)."""

    name: str
    variant: str  # stock | patched | calib
    kind: str  # stock: expected_m = tokens (FlashInfer's); fixed: the per-expert average
    rule: tuple[int, int, int, int, int] | None = None


AVG_ONLY = (1, 0, 0, 1, 1)  # one launch chosen from the per-expert average: the 0001 patch alone
# The run's columns: stock, the average-only fix (0001), the per-expert dispatch (0001 + 0002),
# and the latter again (A/A: the noise floor).
VERSIONS = (
    Version("stock", "stock", "stock"),
    Version("avg", "calib", "fixed", AVG_ONLY),
    Version("patched", "patched", "fixed"),
    Version("patched_again", "patched", "fixed"),
)
# --explore: row-class rules beside them (calib build), to choose the patch's rule from.
EXPLORE = (
    Version("s_hot_first", "calib", "fixed", (2, 2, -2, 1, 1)),
    Version("s_no_overlap", "calib", "fixed", (2, 2, -2, 0, 0)),
    Version("s_busy_128", "calib", "fixed", (2, 2, 128, 0, 1)),
    Version("s_busy_tab", "calib", "fixed", (2, 2, -1, 0, 1)),
)


def build_variant(data: Path, work: Path, variant: str):
    import torch.utils.cpp_extension as ext

    nv = prepare_sources(data, work, variant)
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
    data, work, variant = args
    t0 = time.time()
    build_variant(Path(data), Path(work), variant)
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


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def measure_copy_bandwidth(torch) -> float:
    """Device copy bandwidth, bytes read + written per second (eager SM copy, not a graph)."""
    n = 4 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


def measure_fp8_tflops(torch) -> float | None:
    """Dense FP8 GEMM rate (8192^3, torch._scaled_mm on random data): the model's tc scale."""
    try:
        n = 8192
        a = (torch.randn(n, n, device="cuda") * 8).to(torch.float8_e4m3fn)
        b = (torch.randn(n, n, device="cuda") * 8).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")

        def mm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        for _ in range(3):
            mm()
        times = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            mm()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        return 2 * n**3 / statistics.median(times) / 1e12
    except Exception as e:  # noqa: BLE001 - optional: the model falls back to the probe
        log(f"FP8 GEMM rate not measured: {e}")
        return None


def graph_of(torch, fn):
    fn()  # JIT-compiled kernels load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graphs(torch, graphs: list, samples: int = SAMPLES, warmups: int = WARMUPS):
    """[sample][i] seconds: every graph replayed once per sample. The order rotates from
    sample to sample so no graph is always the first after the synchronize (idle GPU)."""
    for _ in range(warmups):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    out = []
    for k in range(samples):
        events = {}
        for j in range(len(graphs)):
            i = (j + k) % len(graphs)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[i].replay()
            b.record()
            events[i] = (a, b)
        torch.cuda.synchronize()
        out.append([events[i][0].elapsed_time(events[i][1]) / 1e3 for i in range(len(graphs))])
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


def ab_case(gpu: Gpu, versions: dict, routing: str, tokens: int, bw: float) -> dict:
    """Every rank of one routing/token case in every version: check, then time in graphs.

    versions: name -> (module, "stock" | "fixed", rule): which expected_m the runner is given
    and the calib build's rule (None: the build's own)."""
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
        errs = {v: rc[v].check() for v in rc}
        first, *others = list(rc)
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
    del graphs, keep
    skew = np.bincount(slots.ravel(), minlength=cases.SLOTS)
    row = {"routing": routing, "tokens": tokens, "stock_expected_m": tokens,
           "patched_expected_m": fixed_m, "hottest_over_mean": float(skew.max() / skew.mean()),
           "ranks": per_rank}  # fmt: skip
    for v in versions:
        slowest = [max(x) for x in samples[v]]
        row[f"{v}_s"] = statistics.median(slowest)
        row[f"{v}_rank_median_s"] = [statistics.median(x[r] for x in samples[v])
                                     for r in range(cases.EP)]  # fmt: skip
        row[f"{v}_samples_slowest_s"] = slowest
    names = list(versions)
    row["speedups"] = {v: row[f"{names[0]}_s"] / row[f"{v}_s"] for v in names[1:]}
    lead = "patched" if "patched" in versions else names[1]
    row["speedup"] = row["speedups"][lead]
    if "patched_again" in versions:
        row["aa_ratio"] = row["patched_again_s"] / row["patched_s"]
    worst = max(range(cases.EP), key=lambda r: row[f"{lead}_rank_median_s"][r])
    # A read-only stream can use the whole bandwidth the copy measured (read + write).
    row["roofline_s"] = per_rank[worst]["weight_bytes"] / bw
    row["max_rel_err"] = max(max(r["rel_err"][v].values()) for r in per_rank for v in r["rel_err"])
    row["max_disagreement"] = max(
        max(d.values()) for r in per_rank for d in r["agreement"].values()
    )
    row["ok"] = row["max_rel_err"] < 1e-2 and row["max_disagreement"] < 1e-2
    log(
        f"{routing:8s} {tokens:5d} tok: "
        + ", ".join(f"{v} {row[f'{v}_s'] * 1e3:.3f} ms" for v in versions)
        + ", "
        + " ".join(f"{v} x{s:.2f}" for v, s in row["speedups"].items())
        + f", err {row['max_rel_err']:.1e} {'ok' if row['ok'] else 'FAIL'}"
    )
    return row


EMULATED_CASES = (
    ("uniform", 1), ("uniform", 192), ("uniform", 288), ("uniform", 1024), ("uniform", 2048),
    ("uniform", 4096), ("zipf", 128), ("zipf", 288), ("zipf", 1024), ("zipf", 2048),
    ("hot", 288), ("hot", 1024), ("hot", 2048), ("eplb", 288), ("eplb", 1024), ("eplb", 4096),
)  # fmt: skip


def emulate_child(args) -> None:
    """Runs with VLLM_H20_NUM_SMS=78: the calibration build plans grids, tiles and the swap
    threshold for 78 SMs, so this H200 dispatches exactly as an H20 would (its speeds stay
    the H200's). Stock = expected_m tokens, fixed = the per-expert estimate."""
    import torch

    mod = load_built(args.work, "calib")
    data = unpack_flashinfer(args.flashinfer, args.work)
    gpu = Gpu({"calib": mod}, data, args.work)
    bw = measure_copy_bandwidth(torch)
    # stock: one launch from expected_m = tokens; fixed: one launch from the average (0001);
    # patched: the patch's row classes (0001 + 0002).
    versions = {"stock": (mod, "stock", AVG_ONLY), "fixed": (mod, "fixed", AVG_ONLY),
                "patched": (mod, "fixed", (0, 0, 0, 0, 1))}  # fmt: skip
    rows = [ab_case(gpu, versions, r, t, bw) for r, t in EMULATED_CASES]
    write_json(args.out / "emulated_78sm.json", {"sms": 78, "threshold": 64, "ab": rows})


def weight_bytes(counts: np.ndarray) -> int:
    active = int((counts > 0).sum())
    return sum(s.weight_bytes(active) for s in cases.SHAPES)


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


def calib_jobs() -> list[tuple]:
    return sorted(("calib", AVG_ONLY, si, 4 * cases.LOCAL, 1, m, force)
                  for m in cases.CALIB_M for si in range(len(cases.SHAPES))
                  for force in (1, -1))  # fmt: skip


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


def print_explore(rows: list[dict]) -> None:
    """Speedup over stock of every version, per case; then each version's worst case and its
    shortfall against the better of stock and the average-only fix (the issue's goals)."""
    names = list(rows[0]["speedups"])
    print("\nrouting  tokens " + " ".join(f"{n[:11]:>11s}" for n in names))
    for r in rows:
        print(f"{r['routing']:8s} {r['tokens']:6d} "
              + " ".join(f"{r['speedups'][n]:11.3f}" for n in names))  # fmt: skip
    print("worst   " + " " * 7 + " ".join(
        f"{min(r['speedups'][n] for r in rows):11.3f}" for n in names))  # fmt: skip
    print("vs best " + " " * 7 + " ".join(
        f"{min(r['speedups'][n] / max(1.0, r['speedups']['avg']) for r in rows):11.3f}"
        for n in names))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flashinfer", type=Path, required=True, help="FlashInfer data tarball/dir")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=REPO / ".build" / "moe_dispatch")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 8)
    ap.add_argument("--quick", action="store_true", help="a few cases only (smoke test)")
    ap.add_argument("--explore", action="store_true",
                    help="time the calib build's row-class rules beside the three versions "
                         "(no emulation, no calibration)")  # fmt: skip
    ap.add_argument("--emulate-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.emulate_child:
        os.environ.setdefault("TRTLLM_DG_CACHE_DIR", str(args.work / "deepgemm"))
        os.environ.setdefault("TRTLLM_DG_NVCC_COMPILER", shutil.which("nvcc") or "nvcc")
        return emulate_child(args)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRTLLM_DG_CACHE_DIR", str(args.work / "deepgemm"))
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    os.environ.setdefault("TRTLLM_DG_NVCC_COMPILER", nvcc)
    os.environ.setdefault("MAX_JOBS", str(args.jobs))
    t_start = time.time()
    result: dict = {"command": " ".join(sys.argv), "phases": {}}

    data = unpack_flashinfer(args.flashinfer, args.work)
    log(f"building {', '.join(VARIANTS)} from {args.flashinfer.name}")
    t0 = time.time()
    with cf.ProcessPoolExecutor(len(VARIANTS)) as pool:
        built = dict(pool.map(_build_in_child, [(str(data), str(args.work), v) for v in VARIANTS]))
    result["phases"]["build_s"] = time.time() - t0
    log(f"built in {result['phases']['build_s']:.0f} s: {built}")

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
         "--format=csv,noheader"], capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    result["device"] = {
        "name": props.name, "sms": num_sms, "nvidia_smi": smi, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "flashinfer_sources": args.flashinfer.name, "threshold": swap_threshold(num_sms),
    }  # fmt: skip
    log(f"device: {smi}; {num_sms} SMs; threshold {swap_threshold(num_sms)}")

    token_list = cases.TOKENS if not args.quick else (1, 288, 2048)
    run_versions = VERSIONS + (EXPLORE if args.explore else ())
    jobs = warm_jobs(run_versions, token_list) + ([] if args.explore else calib_jobs())
    log(f"compiling {len(jobs)} DeepGEMM kernels in {min(args.jobs, 16)} processes")
    t0 = time.time()
    chunks = [jobs[i :: min(args.jobs, 16)] for i in range(min(args.jobs, 16))]
    ctx = __import__("multiprocessing").get_context("spawn")
    with cf.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        parts = pool.map(_warm_child, [(str(data), str(args.work), c) for c in chunks])
        warm = [x for part in parts
                for x in part]  # fmt: skip
    result["phases"]["deepgemm_jit_s"] = time.time() - t0
    kernels = sorted(p.name for p in (Path(os.environ["TRTLLM_DG_CACHE_DIR"]) / "cache").iterdir())
    result["phases"]["deepgemm_kernels"] = len(kernels)
    # The row-class kernels exist only where the patched headers compiled them (their names
    # and their schedulers' template arguments carry the class).
    result["row_class_kernels"] = [k for k in kernels if "_rows" in k]
    log(f"DeepGEMM kernels ready in {result['phases']['deepgemm_jit_s']:.0f} s")

    mods = {v: load_built(args.work, v) for v in VARIANTS}
    assert not mods["stock"].patched() and mods["patched"].patched()
    gpu = Gpu(mods, data, args.work)
    bw = measure_copy_bandwidth(torch)
    result["copy_bandwidth_Bps"] = bw
    tf = measure_fp8_tflops(torch)
    if tf:
        result["fp8_tflops_measured"] = tf
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); FP8 8192^3 GEMM {tf} TFLOP/s")

    # --- A/B per routing x tokens: every rank, stock and patched (patched timed twice: the
    #     A/A difference is the noise floor) ----------------------------------------------------
    versions = {v.name: (mods[v.variant], v.kind, v.rule) for v in run_versions}
    result["versions"] = {v.name: {"variant": v.variant, "expected_m": v.kind, "rule": v.rule}
                          for v in run_versions}  # fmt: skip
    rows = []
    for routing in cases.ROUTINGS:
        for tokens in token_list:
            rows.append(ab_case(gpu, versions, routing, tokens, bw))
            write_json(args.out / "moe_dispatch_h200.json", result | {"ab": rows})
    result["ab"] = rows

    if args.explore:
        result["phases"]["total_s"] = time.time() - t_start
        write_json(args.out / "moe_dispatch_h200.json", result)
        print_explore(rows)
        sys.exit(0 if all(r["ok"] for r in rows) else 1)

    # --- the same cases as an H20 would dispatch them: 78-SM grids, tiles and threshold 64 ----
    emu = subprocess.run(
        [sys.executable, __file__, "--flashinfer", str(args.flashinfer), "--out", str(args.out),
         "--work", str(args.work), "--emulate-child"],
        env=dict(os.environ, VLLM_H20_NUM_SMS="78"), capture_output=True, text=True,
    )  # fmt: skip
    emu_file = args.out / "emulated_78sm.json"
    if emu.returncode == 0 and emu_file.exists():
        result["emulated_78sm"] = json.loads(emu_file.read_text())
        emu_file.unlink()
        log("78-SM emulation done")
    else:
        result["emulated_78sm_error"] = (emu.stderr or emu.stdout)[-2000:]
        log(f"78-SM emulation failed: {result['emulated_78sm_error'][-300:]}")

    # --- crossover: regular vs swap-A/B at forced expected_m, uniform rows per expert -------
    calib = []
    mod = mods["calib"]
    for s in cases.SHAPES:
        for m in cases.CALIB_M if not args.quick else (4, 64):
            counts = np.full(cases.LOCAL, m)
            rows_ = int(counts.sum())
            a = torch.randn(rows_, s.k, device="cuda").to(torch.bfloat16)
            out = torch.empty(rows_, s.n, dtype=torch.bfloat16, device="cuda")
            off = torch.tensor(cases.offsets(counts), device="cuda")
            gg = mod.GroupedGemm(rows_, s.n, s.k, 1, cases.LOCAL, m)
            ws = torch.empty(max(gg.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
            ts = {}
            for name, force in (("regular", 1), ("swap_ab", -1)):
                mod.force_branch(force)
                g = graph_of(torch, lambda gg=gg, a=a, out=out, off=off, ws=ws, s=s: gg.run(
                    out, a, gpu.w[s.name], gpu.ws[s.name], off, ws))  # fmt: skip
                ts[name] = statistics.median(x[0] for x in time_graphs(torch, [g]))
                ref = gpu.reference(s, a, counts)
                assert rel(out, ref) < 1e-2, (s.name, m, name, rel(out, ref))
            mod.force_branch(0)
            calib.append({"gemm": s.name, "m": m, **{f"{k}_s": v for k, v in ts.items()},
                          "weight_bytes": s.weight_bytes(cases.LOCAL)})  # fmt: skip
            log(
                f"calib {s.name} m={m:4d}: regular {ts['regular'] * 1e6:7.1f} us, swap "
                f"{ts['swap_ab'] * 1e6:7.1f} us"
            )
    result["calibration"] = calib
    result["warm"] = warm
    result["phases"]["total_s"] = time.time() - t_start
    write_json(args.out / "moe_dispatch_h200.json", result)

    print(
        "\nrouting  tokens  m(stock->fixed)  stock ms  avg-only  per-expert  roofline%  A/A  check"
    )
    for r in rows:
        m = f"{r['stock_expected_m']:5d} -> {r['patched_expected_m']:<5d}"
        print(f"{r['routing']:8s} {r['tokens']:6d}  {m}  {r['stock_s'] * 1e3:8.3f}"
              f"  {r['speedups']['avg']:7.2f}x  {r['speedup']:9.2f}x"
              f"  {100 * r['roofline_s'] / r['patched_s']:8.0f}  {r['aa_ratio']:5.2f}"
              f"  {'ok' if r['ok'] else 'FAIL'}")  # fmt: skip
    ok = all(r["ok"] for r in rows)
    print(f"all checks {'passed' if ok else 'FAILED'}; total {result['phases']['total_s']:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
