"""Compile the fix's DeepGEMM kernels before serving, so that no request waits for one.

The per-expert dispatch (patch 0004) picks its DeepGEMM kernels from the step's token count and
the GPU: the swap-A/B tile and the row-class boundary are template arguments. DeepGEMM compiles
each new kernel with nvcc when it is first launched (~2.3 s each on the H200 machine, the engine
waiting): a fix server compiled 32 of them in its first 4 minutes of serving
(benchmarks/results/serve_h200/round3-four-moe-paths). Which kernels a step launches depends
only on the GEMM shapes, the expert slots, the SM count and the step's token count, so the
whole set can be compiled ahead, in parallel, into the cache DeepGEMM reads.

The launch plan is not re-implemented here: a small host program is compiled against the
overlay's patched headers, with the patch's own `plan_row_classes` (and its helpers) and
kernel-name expression cut out of them, and writes every kernel's source with the patched
`generateKernel`. Its main() makes the calls grouped_gemm_dispatch makes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from . import build, paths

KERNEL_CUH = (
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/"
    "fp8_blockscale_gemm_kernel.cuh"
)
COMPILER_CUH = "nv_internal/tensorrt_llm/deep_gemm/compiler.cuh"
# DeepGEMM's nvcc flags (Compiler::build in compiler.cuh, nvcc mode); `flags_drift` checks them
# against the headers in use.
NVCC_FLAGS = (
    "-std=c++17",
    "--gpu-architecture=sm_90a",
    "--ptxas-options=-allow-expensive-optimizations=true",
    "--ptxas-options=--register-usage-level=10",
    "--diag-suppress=161,174,177,940",
    "-D__FORCE_INCLUDE_CUDA_FP16_HPP_FROM_FP16_H__=1",
    "-D__FORCE_INCLUDE_CUDA_BF16_HPP_FROM_BF16_H__=1",
    "-O3",
    "-cubin",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--compiler-options=-fPIC,-O3,-Wno-deprecated-declarations,-Wno-abi",
)
# The shipped plan's entry point (patch 0004), which the planner's main() calls.
SHIPPED_PLAN = re.compile(
    r"plan_row_classes\(uint32_t busiest,\s*uint32_t swap_tile,\s*"
    r"uint32_t max_m,\s*uint32_t ridge\)"
)
SHIPPED_BOUNDS = ("kOneLaunchRows", "kNarrowRegularRows", "kWideRegularRows", "kSwapTileStep")
CUBIN = "nvcc_kernel.cubin"  # kKernelName in runtime.cuh (nvcc mode, the only one it uses)
# Beside a cubin this wrote: the fingerprint of what it was compiled from. DeepGEMM names a
# kernel by its template arguments only, so a cubin built from other headers (another patch
# series, an earlier vllm-h20, FlashInfer's own, DeepGEMM's run-time build) has the same name
# and would be loaded in its place.
STAMP = "vllm-h20-sources"

PLANNER = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include "tensorrt_llm/deep_gemm/compiler.cuh"

using namespace deep_gemm;       // GemmType, kAnyRows
using namespace deep_gemm::jit;  // RowClass, gemm_type_to_string, as inside Compiler::build

// Cut from the patched fp8_blockscale_gemm_kernel.cuh.
%(plan)s

// The cache name Compiler::build gives a kernel, its expression cut from compiler.cuh.
static std::string cache_name(uint32_t const shape_n, uint32_t const shape_k,
                              uint32_t const block_m, uint32_t const block_n,
                              uint32_t const block_k, uint32_t const num_groups,
                              uint32_t const num_stages, uint32_t const num_tma_multicast,
                              GemmType const gemm_type, bool swapAB, RowClass const rows) {
  %(name)s
  return name;
}

static std::set<std::string> seen;

// One kernel a launch compiles, written once: its cache name and generateKernel's source, for
// a config get_best_gemm_config chose.
static void write_kernel(char const* out, uint32_t n, uint32_t k, uint32_t groups,
                         deep_gemm::jit::GemmConfig const& config, bool swap, RowClass rows) {
  auto const [bm, bn, stages, multicast, smem] = config;
  (void)smem;
  std::string name = cache_name(n, k, bm, bn, 128, groups, stages, multicast,
                                GemmType::GroupedWithOffset, swap, rows);
  if (!seen.insert(name).second) return;
  std::ofstream(std::string(out) + "/" + name + ".cu")
      << deep_gemm::jit::generateKernel(n, k, bm, bn, 128, groups, stages, multicast,
                                        GemmType::GroupedWithOffset, swap, rows);
  std::printf("%%s\n", name.c_str());
}

static void emit(char const* out, uint32_t n, uint32_t k, uint32_t groups, int sms, uint32_t m,
                 bool swap, RowClass rows) {
  write_kernel(out, n, k, groups,
               swap ? deep_gemm::jit::get_best_gemm_config(n, m, k, groups, sms, false, true)
                    : deep_gemm::jit::get_best_gemm_config(m, n, k, groups, sms),
               swap, rows);
}


// argv: out_dir n k groups expert_slots sms top_k min_tokens max_tokens
// As grouped_gemm_dispatch does for the MoE runner (max_m_per_problem = num_rows), for every
// step of min_tokens..max_tokens tokens: its branches in its order.
int main(int argc, char** argv) {
  if (argc != 10) return 2;
  char const* out = argv[1];
  uint32_t n = std::atoi(argv[2]), k = std::atoi(argv[3]), groups = std::atoi(argv[4]);
  uint64_t slots = std::atoi(argv[5]);
  int sms = std::atoi(argv[6]);
  uint64_t top_k = std::atoi(argv[7]);
  uint32_t min_tokens = std::atoi(argv[8]), max_tokens = std::atoi(argv[9]);
  for (uint32_t rows = min_tokens; rows <= max_tokens; ++rows) {
    uint32_t expected_m = std::max<uint64_t>(1, (rows * top_k + slots - 1) / slots);
    uint32_t const busiest = busiest_balanced_rows(expected_m);
    auto const swap_config =
        deep_gemm::jit::get_best_gemm_config(n, busiest, k, groups, sms, false, true);
    uint32_t const swap_tile = static_cast<uint32_t>(std::get<1>(swap_config));
    uint32_t const ridge = ridge_rows(sms);
    RowClassPlan plan = plan_row_classes(busiest, swap_tile, rows, ridge);
    if (rows <= plan.boundary) {
      emit(out, n, k, groups, sms, plan.cold_m, true, {});
    } else if (rows <= kOneLaunchRows) {
      emit(out, n, k, groups, sms, rows, true, {});
    } else if (rows <= kNarrowRegularRows && kNarrowRegularRows <= ridge) {
      emit(out, n, k, groups, sms, rows, false, {});
    } else if (swap_tile + kSwapTileStep >= kWideRegularRows) {
      emit(out, n, k, groups, sms, rows, false, {});
    } else {
      emit(out, n, k, groups, sms, plan.hot_m, false, {plan.boundary + 1, deep_gemm::kAnyRows});
      emit(out, n, k, groups, sms, plan.cold_m, true, {1, plan.boundary});
    }
  }
  return 0;
}
"""


class PrecompileError(RuntimeError):
    """The kernels cannot be planned or compiled here; the message says what to do."""


@dataclass(frozen=True)
class MoeShape:
    """What the routed-expert GEMMs of one rank look like to FlashInfer's CUTLASS MoE."""

    hidden: int
    inter: int  # moe_intermediate_size (not split: experts are spread by EP, not TP)
    experts: int
    top_k: int
    ep_size: int = 1
    redundant: int = 0  # EPLB's extra expert copies, spread over the ranks too

    @property
    def groups(self) -> int:
        """Experts on one rank: the grouped GEMM's problems."""
        return -(-(self.experts + self.redundant) // self.ep_size)

    @property
    def slots(self) -> int:
        """Expert slots over all ranks: the runner's expected rows per expert divide by this."""
        return self.groups * self.ep_size

    def gemms(self) -> list[tuple[int, int]]:
        """(N, K) of FC1 (gate and up fused) and FC2."""
        return [(2 * self.inter, self.hidden), (self.hidden, self.inter)]


def auto_redundant(experts: int, ep: int) -> int:
    """vLLM 0.34's `ParallelConfig.compute_eplb_num_redundant_experts`: the fewest EPLB replicas
    that make experts + replicas divide by the EP size (`plan` and `serve` use it too)."""
    return (ep - experts % ep) % ep


def shape_from_config(config: Path, ep_size: int = 1, redundant: int | None = 0) -> MoeShape:
    """A DeepSeek V3/V4-style config.json -> the MoE shape (one-line errors). redundant None:
    EPLB's replica count left to vLLM 0.34, the fewest that spread the experts evenly."""
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise PrecompileError(f"{config}: cannot read it as JSON ({e})") from None
    cfg = cfg.get("text_config", cfg)
    keys = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
    missing = [k for k in keys if not isinstance(cfg.get(k), int)]
    if missing:
        raise PrecompileError(f"{config}: no integer {missing[0]}: not a DeepSeek-style MoE config")
    if redundant is None and ep_size >= 1:
        redundant = auto_redundant(cfg["n_routed_experts"], ep_size)
    redundant = redundant or 0
    shape = MoeShape(*(cfg[k] for k in keys), ep_size=ep_size, redundant=redundant)
    if ep_size < 1 or (shape.experts + redundant) % ep_size:
        raise PrecompileError(
            f"--ep-size {ep_size} does not divide {shape.experts + redundant} expert slots"
        )
    return shape


def nvcc() -> str:
    """The nvcc DeepGEMM would run (getNvccCompiler: TRTLLM_DG_NVCC_COMPILER, CUDA_HOME, PATH)."""
    home = os.environ.get("CUDA_HOME")
    for cand in (os.environ.get("TRTLLM_DG_NVCC_COMPILER"),
                 home and str(Path(home) / "bin" / "nvcc"), shutil.which("nvcc")):  # fmt: skip
        if cand and Path(cand).is_file():
            return cand
    raise PrecompileError("nvcc not found: set TRTLLM_DG_NVCC_COMPILER or CUDA_HOME")


def planner_source(csrc: Path) -> str:
    """The planner's C++ with the patch's plan and FlashInfer's kernel-name expression cut from
    the overlay's headers (so it plans exactly what the module will launch)."""
    kernel = (csrc / KERNEL_CUH).read_text()
    try:
        start = kernel.index("struct RowClassPlan {")
        plan = kernel[start : kernel.index("void grouped_gemm_dispatch(")]
        # The shipped plan's signature and single-launch bounds, which the planner's main() uses
        # (a candidate series has others).
        if not SHIPPED_PLAN.search(plan) or not all(c in plan for c in SHIPPED_BOUNDS):
            raise ValueError
    except ValueError:
        raise PrecompileError(
            f"{csrc / KERNEL_CUH}: no plan_row_classes; these headers are not the shipped "
            f"per-expert fix (kernels precompile plans the shipped series only)"
        ) from None
    compiler = (csrc / COMPILER_CUH).read_text()
    m = re.search(r"std::string name = .*?;\n", compiler, re.S)
    if m is None or "rows.tag()" not in m.group(0):
        raise PrecompileError(f"{csrc / COMPILER_CUH}: no row-class kernel name in Compiler::build")
    return PLANNER % {"plan": plan, "name": m.group(0).strip()}


def flags_drift(csrc: Path) -> list[str]:
    """NVCC_FLAGS entries the headers' Compiler::build no longer spells (empty: in step)."""
    text = (csrc / COMPILER_CUH).read_text()
    parts = [f for f in NVCC_FLAGS if not f.startswith("--compiler-options=")]
    parts += NVCC_FLAGS[-1].removeprefix("--compiler-options=").split(",")
    return [f for f in parts if f'"{f}"' not in text]


def _host_includes(csrc: Path, fi_root: Path) -> tuple[list[str], list[Path]]:
    """The planner's include flags and the few FlashInfer sources its headers need at link;
    fi_root: FlashInfer's data directory (its include/ beside csrc/)."""
    nv = csrc / "nv_internal"
    extra = build.find_cublas_include(build.find_cuda_home())  # nvrtc.h, when not in the toolkit
    flags = [f"-I{nv}", f"-I{nv / 'include'}", f"-I{csrc}", f"-I{fi_root / 'include'}",
             f"-I{fi_root}", *(["-isystem", extra] if extra else [])]  # fmt: skip
    common = [nv / "cpp" / "common" / f"{n}.cpp"
              for n in ("logger", "stringUtils", "tllmException", "envUtils")]  # fmt: skip
    return flags, common


def build_planner(csrc: Path, fi_root: Path, work: Path) -> Path:
    """Compile the planner once per header set (cached in work by the source's hash)."""
    src = planner_source(csrc)
    key = hashlib.sha256(src.encode()).hexdigest()[:12]
    exe = work / f"planner-{key}"
    if exe.is_file():
        return exe
    work.mkdir(parents=True, exist_ok=True)
    cu = work / f"planner-{key}.cu"
    cu.write_text(src)
    flags, common = _host_includes(csrc, fi_root)
    tmp = exe.with_name(exe.name + f".tmp-{os.getpid()}")
    # Only the headers' inline host code runs; driver-API symbols they mention stay unresolved.
    link = ["-Xlinker", "--unresolved-symbols=ignore-all"]
    cmd = [nvcc(), "-std=c++17", "--expt-relaxed-constexpr", *flags, str(cu),
           *map(str, common), "-o", str(tmp), *link]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise PrecompileError(
            f"the kernel planner did not compile against {csrc}: "
            + build.first_error(r.stderr + r.stdout)
        )
    os.replace(tmp, exe)
    return exe


@dataclass(frozen=True)
class Kernel:
    name: str  # DeepGEMM's cache name
    source: Path  # the .cu generateKernel wrote


def plan_kernels(
    planner: Path, shape: MoeShape, sms: int, max_tokens: int, out: Path, min_tokens: int = 1
) -> list[Kernel]:
    """Every kernel the fix launches for min_tokens..max_tokens tokens per step, FC1 and FC2."""
    out.mkdir(parents=True, exist_ok=True)
    kernels: list[Kernel] = []
    for n, k in shape.gemms():
        args = [str(planner), str(out), str(n), str(k), str(shape.groups), str(shape.slots),
                str(sms), str(shape.top_k), str(min_tokens), str(max_tokens)]  # fmt: skip
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise PrecompileError(f"the kernel planner failed for N={n} K={k}: {r.stderr.strip()}")
        kernels += [Kernel(name, out / f"{name}.cu") for name in r.stdout.split()]
    return kernels


def fingerprint(kern: Kernel, sources: str) -> str:
    """What a kernel's cubin is compiled from: the headers' key (`sources`: the overlay's, its
    FlashInfer release and patch series), the kernel's generated source and nvcc's flags."""
    digest = hashlib.sha256(sources.encode())
    digest.update(b"\0" + kern.source.read_bytes() + b"\0" + " ".join(NVCC_FLAGS).encode())
    return digest.hexdigest()[:32]


def current(entry: Path, stamp: str) -> bool:
    """Whether a cache entry holds a cubin compiled from what `stamp` fingerprints."""
    try:
        return (entry / CUBIN).is_file() and (entry / STAMP).read_text().strip() == stamp
    except OSError:
        return False


def compile_kernels(
    kernels: Iterable[Kernel],
    include: Path,
    cache: Path,
    jobs: int,
    on_done: Callable[[Kernel, str], None] = lambda k, status: None,
    sources: str = "",
) -> dict[str, list[str]]:
    """nvcc each kernel the cache lacks, or holds built from other sources (the STAMP beside its
    cubin), `jobs` at a time, each written into place atomically as DeepGEMM does (a tmp file
    renamed), so a cut run leaves no half cubin; its stamp follows it. Returns {"compiled":
    [...], "cached": [...], "failed": ["name: last error line", ...], "replaced": [...]}, the
    last the compiled ones whose cubin from other sources they replaced."""
    compiler = nvcc()
    done: dict[str, list[str]] = {"compiled": [], "cached": [], "failed": [], "replaced": []}
    todo = []
    stamps = {}
    for kern in kernels:
        stamps[kern.name] = fingerprint(kern, sources)
        if current(cache / kern.name, stamps[kern.name]):
            done["cached"].append(kern.name)
            on_done(kern, "cached")
        else:
            todo.append(kern)

    def one(kern: Kernel) -> str | None:
        target = cache / kern.name
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / f".{CUBIN}.tmp-{os.getpid()}"
        cmd = [compiler, str(kern.source), "-o", str(tmp), *NVCC_FLAGS, f"-I{include}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            if not any(target.iterdir()):
                target.rmdir()  # no empty entry left behind for this kernel
            return build.first_error(r.stderr + r.stdout)
        if (target / CUBIN).is_file():
            done["replaced"].append(kern.name)
        (target / STAMP).unlink(missing_ok=True)  # cut between the two renames: rebuilt next run
        os.replace(tmp, target / CUBIN)
        stamp_tmp = target / f".{STAMP}.tmp-{os.getpid()}"
        stamp_tmp.write_text(stamps[kern.name] + "\n")
        os.replace(stamp_tmp, target / STAMP)
        return None

    with ThreadPoolExecutor(max(1, jobs)) as ex:
        futs = {ex.submit(one, kern): kern for kern in todo}
        for f in as_completed(futs):
            kern, err = futs[f], f.result()
            if err is None:
                done["compiled"].append(kern.name)
                on_done(kern, "compiled")
            else:
                done["failed"].append(f"{kern.name}: {err}")
                on_done(kern, "failed")
    return done


def run(shape: MoeShape, num_sms: int, max_tokens: int, jobs: int | None, console,
        dry_run: bool = False) -> dict:  # fmt: skip
    """Plan and compile the fix's kernels for the installed FlashInfer (`kernels precompile`,
    and `serve` before it starts vLLM); raises PrecompileError, DispatchConfigError, PatchError.
    Returns what was planned, compiled, found cached and failed."""
    import dataclasses

    from ..console import step_progress
    from . import dispatch, overlay

    decision = dispatch.decide(env={dispatch.ENV: "per_expert", dispatch.MODULE_ENV: "reduced"})
    if decision.route != "fix" or decision.src is None or decision.assessment is None:
        raise PrecompileError(
            f"no fix module for this FlashInfer: {decision.message.split(': ', 1)[-1]}"
        )
    ov = overlay.build_overlay(
        decision.src, decision.assessment, overlay.overlay_for(decision.src, decision.patches)
    )
    if drift := flags_drift(ov.csrc_dir):
        raise PrecompileError(
            f"{ov.csrc_dir / COMPILER_CUH} no longer passes nvcc {drift[0]}: vllm-h20's copy of "
            "DeepGEMM's flags is out of date"
        )
    work = paths.precompile_dir(ov.key)
    planner = build_planner(ov.csrc_dir, decision.src.root, work)
    kernels = plan_kernels(planner, shape, num_sms, max_tokens, work / "src")
    cache = paths.deepgemm_cache_dir()
    include = ov.csrc_dir / "nv_internal" / "tensorrt_llm"  # what the module points DeepGEMM at
    result: dict = {"shape": dataclasses.asdict(shape), "num_sms": num_sms,
                    "max_num_batched_tokens": max_tokens, "cache_dir": str(cache),
                    "kernels": len(kernels)}  # fmt: skip
    if dry_run:
        cached = [k for k in kernels if current(cache / k.name, fingerprint(k, ov.key))]
        other = [k for k in kernels if k not in cached and (cache / k.name / CUBIN).is_file()]
        console.print(f"{len(kernels)} DeepGEMM kernels for the fix ({len(cached)} already in "
                      f"{cache}, {len(other)} there built from other sources); nothing compiled "
                      "(--dry-run)")  # fmt: skip
        return result | {"cached": len(cached), "other_sources": len(other),
                         "names": [k.name for k in kernels]}  # fmt: skip
    t0 = time.monotonic()
    with step_progress(console) as bar:
        task = bar.add_task("DeepGEMM kernels", total=len(kernels), current="")

        def on_done(k: Kernel, status: str) -> None:
            bar.update(task, advance=1, current=f"{status} {k.name}")

        out = compile_kernels(kernels, include, cache, jobs or os.cpu_count() or 1, on_done,
                              sources=ov.key)  # fmt: skip
    n = {k: len(v) for k, v in out.items()}
    seconds = round(time.monotonic() - t0, 1)
    replaced = (
        f" ({n['replaced']} replacing cubins built from other sources)" if n["replaced"] else ""
    )
    console.print(f"DeepGEMM kernels for the fix: {n['compiled']} compiled{replaced}, "
                  f"{n['cached']} already cached, {n['failed']} failed, in {seconds:.0f} s -> "
                  f"{cache}")  # fmt: skip
    for line in out["failed"][:3]:
        console.print(f"  failed: {line}")
    return result | n | {"failed_kernels": out["failed"], "seconds": seconds}
