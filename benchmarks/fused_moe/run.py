"""FlashInfer's own `cutlass_fused_moe` on one GPU, reduced stock module vs reduced fix module.

DeepSeek-V4.1-Flash MoE shapes (benchmarks/moe_dispatch/cases.py: hidden 5,120, expert
intermediate 2,304, 400 slots over EP8 = 50 local experts, top-6), FP8 128x128 block-scale
weights, bf16 activations: `flashinfer.fused_moe.cutlass_fused_moe(...,
use_deepseek_fp8_block_scale=True, ep_size=8, ep_rank=r)` for every rank r, i.e. permute, FC1,
SwiGLU + requantize, FC2 and finalize, as vLLM's FlashInfer CUTLASS path calls it.

Both modules are vllm-h20's reduced build (`vllm-h20 kernels build --dispatch both`), so the two
sides differ only by the patch. The op is FlashInfer's public function; which module it runs on
is chosen by pointing `flashinfer.fused_moe.core.get_cutlass_fused_moe_module` at the
stock or the fix module's FlashInfer wrapper before each capture (what vllm-h20's router does
for vLLM, once per process).

    python3 benchmarks/fused_moe/run.py --out $OUT            # on the GPU machine, ~5 min

Per case: every rank's output checked against an fp32 reference (the same FP8 weights,
1x128-quantized activations, SwiGLU, 1x128-requantized FC2 input, routing weights); then all
ranks of stock, fix and fix again (A/A) captured as CUDA graphs and replayed interleaved, 5
warm-ups + 24 samples; per sample the slowest rank; the median of those.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KERNEL_LEVEL = REPO / "benchmarks" / "moe_dispatch"
sys.path.insert(0, str(KERNEL_LEVEL))
sys.path.insert(0, str(REPO))

import cases  # noqa: E402
from expected_m import per_expert_expected_m, swap_threshold  # noqa: E402

# The timing method (CUDA graphs, rotated replay order), copy bandwidth, error and JSON writer
# of the kernel-level benchmark.
from harness import graph_of, log, rel, time_graphs, weight_bytes, write_json  # noqa: E402
from harness import measure_copy_bandwidth as copy_bandwidth  # noqa: E402

VERSIONS = ("stock", "fix", "fix_again")  # the third is the A/A repeat of the second
TOLERANCE = 2e-2  # relative L2 error vs the fp32 reference (the patch's own test uses it)
AGREEMENT = 1e-2  # relative L2 difference between the fix's and the stock module's outputs


# ----------------------------------------------------------------------------- modules


def load_modules() -> dict:
    """{"stock": namespace, "fix": namespace}: FlashInfer's SM90 wrappers around the two
    reduced modules (built already by `vllm-h20 kernels build --dispatch both`)."""
    import flashinfer.fused_moe.core as core
    from flashinfer.jit import fused_moe as jit_fused_moe

    from vllm_h20.moe import call_routing, dispatch

    out = {}
    # The fix last: should the two modules share DeepGEMM's include list (one process), the
    # overlay's headers win, and they compile the stock module's kernels as its own would.
    for name, mode in (("stock", "stock"), ("fix", "per_expert")):
        decision = dispatch.decide(
            env={dispatch.ENV: mode, dispatch.MODULE_ENV: "reduced", dispatch.STRICT_ENV: "1"}
        )
        assert decision.route == ("fix" if name == "fix" else "stock"), decision.message

        def make_spec(ufb, decision=decision):
            return dispatch.reduced_spec(decision, jit_fused_moe.gen_cutlass_fused_moe_sm90_module)

        out[name] = call_routing.load_namespace(core, make_spec)
    return out


class Select:
    """Point FlashInfer's module lookup at one of the namespaces."""

    def __init__(self, namespaces: dict):
        import flashinfer.fused_moe.core as core

        self.core, self.ns, self.current = core, namespaces, None
        core.get_cutlass_fused_moe_module = self._get

    def _get(self, backend: str = "100", use_fast_build: bool = False):
        assert backend == "90", f"this benchmark needs an SM90 GPU, not SM{backend}"
        return self.ns[self.current]

    def __call__(self, version: str) -> None:
        self.current = "stock" if version == "stock" else "fix"


# ----------------------------------------------------------------------------- data


class Experts:
    """One rank's 50 experts (the same weights serve every rank: only routing differs)."""

    def __init__(self, seed: int = 0, reference: bool = True):
        import torch

        self.torch = torch
        self.keep_reference = reference  # the fp32 copies (7 GB) only where outputs are checked
        g = torch.Generator(device="cuda").manual_seed(seed)
        h, i, n = cases.HIDDEN, cases.INTER, cases.LOCAL
        self.w31, self.s31, self.d31 = self._block_fp8(n, 2 * i, h, g)
        self.w2, self.s2, self.d2 = self._block_fp8(n, h, i, g)

    def _block_fp8(self, e: int, rows: int, cols: int, g):
        """FP8 weights, float32 128x128 scales, and their fp32 dequantization."""
        torch = self.torch
        w = torch.empty(e, rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
        deq = torch.empty(e if self.keep_reference else 0, rows, cols, device="cuda")
        sc = (
            torch.rand(e, rows // 128, cols // 128, generator=g, device="cuda") * 1.5 + 0.5
        ) * 2e-3
        for x in range(e):
            w[x] = (
                (torch.randn(rows, cols, generator=g, device="cuda") * 64)
                .clamp(-448, 448)
                .to(torch.float8_e4m3fn)
            )
            if self.keep_reference:
                deq[x] = w[x].float() * sc[x].repeat_interleave(128, 0).repeat_interleave(128, 1)
        return w, sc.contiguous(), deq


def quant_1x128(torch, a):
    """FP8 per 1x128 group and back: what the op does to its FC1 and FC2 inputs."""
    g = a.float().view(a.shape[0], a.shape[1] // 128, 128)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-10)
    return ((g * (448.0 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448.0)).view(a.shape)


def reference(ex: Experts, x, slots, weights, rank: int):
    """This rank's experts' output (the op's EP contract: other ranks add the rest), in fp32
    from the same FP8 values the op multiplies, rounded where the op stores bf16: the FC1 and
    FC2 outputs. The op's FP8 requantization of the SwiGLU output can still land one FP8 step
    (1/16 relative) away from ours on a few elements, which is what the tolerance covers."""
    torch = ex.torch
    import torch.nn.functional as F

    def bf16(t):
        return t.to(torch.bfloat16).float()

    xq = quant_1x128(torch, x)
    out = torch.zeros(x.shape[0], cases.HIDDEN, device="cuda")
    first = rank * cases.LOCAL
    for e in range(cases.LOCAL):
        tok, nth = torch.where(slots == first + e)
        if tok.numel() == 0:
            continue
        up, gate = torch.chunk(ex.d31[e], 2, dim=0)  # FlashInfer's w31 = [w3 (up); w1 (gate)]
        h = quant_1x128(torch, F.silu(bf16(xq[tok] @ gate.t())) * bf16(xq[tok] @ up.t()))
        out.index_add_(0, tok, weights[tok, nth, None] * bf16(h @ ex.d2[e].t()))
    return out


# ----------------------------------------------------------------------------- cases


def inputs(torch, routing: str, tokens: int):
    slots = torch.tensor(cases.route(routing, tokens), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, cases.HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.softmax(torch.randn(tokens, cases.TOP_K, generator=g, device="cuda"), dim=1)
    return slots, x, w


def op_call(ex: Experts, x, slots, w, rank: int, out):
    import flashinfer.fused_moe as fused_moe

    def call():
        fused_moe.cutlass_fused_moe(
            x, slots, w, ex.w31, ex.w2, ex.torch.bfloat16,
            quant_scales=[ex.s31, ex.s2], ep_size=cases.EP, ep_rank=rank,
            use_deepseek_fp8_block_scale=True, output=out,
        )  # fmt: skip

    return call


def ab_case(ex: Experts, select: Select, routing: str, tokens: int, bw: float) -> dict:
    torch = ex.torch
    slots, x, w = inputs(torch, routing, tokens)
    slots_np = slots.cpu().numpy()
    graphs = {v: [] for v in VERSIONS}
    keep, per_rank = [], []
    for rank in range(cases.EP):
        counts = cases.rank_counts(slots_np, rank)
        ref = reference(ex, x, slots, w, rank)
        errs, outs = {}, {}
        for v in VERSIONS:
            out = torch.full_like(x, float("nan"))
            select(v)
            call = op_call(ex, x, slots, w, rank, out)
            call()
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(out).all())
            errs[v] = rel(out, ref) if finite else float("inf")
            outs[v] = out.clone()
            graphs[v].append(graph_of(torch, call))  # captured with this version selected
            keep.append(out)
        # Both modules compute the same sums in other tile orders: they agree to bf16 rounding
        # (and have been bit-identical: every output element's dot products run in the same
        # k order in both kernels).
        agree = rel(outs["fix"], outs["stock"]) if ref.norm() > 0 else 0.0
        identical = bool(torch.equal(outs["fix"], outs["stock"]))
        per_rank.append({"rank": rank, "rows": int(counts.sum()),
                         "max_rows_per_expert": int(counts.max()),
                         "active_experts": int((counts > 0).sum()),
                         "weight_bytes": weight_bytes(counts), "rel_err": errs,
                         "fix_vs_stock": agree, "bit_identical": identical})  # fmt: skip
    order = [(v, i) for i in range(cases.EP) for v in VERSIONS]
    raw = time_graphs(torch, [graphs[v][i] for v, i in order])
    row = {"routing": routing, "tokens": tokens, "stock_expected_m": tokens,
           "fix_expected_m": per_expert_expected_m(tokens, cases.TOP_K, cases.LOCAL, cases.EP),
           "ranks": per_rank}  # fmt: skip
    for v in VERSIONS:
        samples = [[s[order.index((v, i))] for i in range(cases.EP)] for s in raw]
        slowest = [max(s) for s in samples]
        row[f"{v}_s"] = statistics.median(slowest)
        row[f"{v}_rank_median_s"] = [statistics.median(s[r] for s in samples)
                                     for r in range(cases.EP)]  # fmt: skip
        row[f"{v}_samples_slowest_s"] = slowest
    row["speedup"] = row["stock_s"] / row["fix_s"]
    row["aa_ratio"] = row["fix_again_s"] / row["fix_s"]
    worst = max(range(cases.EP), key=lambda r: row["fix_rank_median_s"][r])
    row["roofline_s"] = per_rank[worst]["weight_bytes"] / bw
    row["max_rel_err"] = max(max(r["rel_err"].values()) for r in per_rank)
    row["max_rel_err_by_version"] = {v: max(r["rel_err"][v] for r in per_rank) for v in VERSIONS}
    row["max_fix_vs_stock"] = max(r["fix_vs_stock"] for r in per_rank)
    row["bit_identical"] = all(r["bit_identical"] for r in per_rank)
    row["check"] = check(row["max_rel_err_by_version"], row["max_fix_vs_stock"])
    row["ok"] = row["check"] != "FAIL"
    del graphs, keep
    log(f"{routing:12s} {tokens:5d} tok: stock {row['stock_s'] * 1e3:.3f} ms, fix "
        f"{row['fix_s'] * 1e3:.3f} ms, x{row['speedup']:.2f}, A/A {row['aa_ratio']:.3f}, "
        f"err {row['max_rel_err']:.1e}, fix vs stock {row['max_fix_vs_stock']:.1e} "
        f"{row['check']}")  # fmt: skip
    return row


def check(err_by_version: dict[str, float], fix_vs_stock: float) -> str:
    """What the case says about the fix, which only reorders the stock kernel's tiles: "FAIL"
    when the fix's output leaves the stock module's or is further from the fp32 reference;
    "ok (reference)" when the reference's tolerance misses both modules alike (its FP8
    requantization, not the kernel choice: zipf2 8 in bar-five-families-h100); else "ok"."""
    fix, stock = err_by_version["fix"], err_by_version["stock"]
    if not fix_vs_stock < AGREEMENT or not fix <= max(stock, TOLERANCE):
        return "FAIL"
    return "ok" if fix < TOLERANCE else "ok (reference)"


# ----------------------------------------------------------------------------- warm-up


def _warm_child(jobs: list[tuple[str, int]]) -> list[tuple[str, int, float]]:
    """Runs each (version, tokens) once (uniform routing, rank 0), so DeepGEMM JIT-compiles
    the kernels that choice selects into the shared TRTLLM_DG_CACHE_DIR."""
    import torch

    select = Select(load_modules())
    ex = Experts(reference=False)
    done = []
    for version, tokens in jobs:
        slots, x, w = inputs(torch, "uniform", tokens)
        out = torch.empty_like(x)
        select(version)
        t0 = time.time()
        op_call(ex, x, slots, w, 0, out)()
        torch.cuda.synchronize()
        done.append((version, tokens, time.time() - t0))
    return done


def warm(tokens: tuple[int, ...], procs: int) -> list:
    jobs = [(v, t) for t in tokens for v in ("stock", "fix")]
    chunks = [c for c in (jobs[i::procs] for i in range(procs)) if c]
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        return [x for part in pool.map(_warm_child, chunks) for x in part]


# ----------------------------------------------------------------------------- main


def build_modules(jobs: int) -> dict:
    """`vllm-h20 kernels build` for the fix module, then the stock one; wall time of each."""
    out = {}
    for mode in ("per_expert", "stock"):
        cmd = [sys.executable, "-m", "vllm_h20.cli", "kernels", "build", "--dispatch", mode,
               "-j", str(jobs), "--json"]  # fmt: skip
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        took = time.time() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        info = json.loads(proc.stdout)[0]
        out[mode] = info | {"wall_s": round(took, 1), "command": " ".join(cmd[1:])}
        log(f"built {info['module']} in {took:.0f} s (-j {jobs})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 8)
    ap.add_argument("--quick", action="store_true", help="three cases only (smoke test)")
    ap.add_argument("--work", type=Path, default=REPO / ".build" / "fused_moe",
                    help="kept between runs: build record, DeepGEMM kernel cache")  # fmt: skip
    step = ap.add_mutually_exclusive_group()
    step.add_argument("--build-only", action="store_true", help="build both modules, then stop")
    step.add_argument("--skip-build", action="store_true", help="the modules are built already")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRTLLM_DG_CACHE_DIR", str(args.work / "deepgemm"))
    os.environ.setdefault("TRTLLM_DG_NVCC_COMPILER", shutil.which("nvcc") or "nvcc")
    os.environ.setdefault("MAX_JOBS", str(args.jobs))
    t_start = time.time()
    result: dict = {"command": " ".join(sys.argv), "phases": {}}
    record = args.work / "build.json"
    if args.skip_build:
        if record.is_file():
            result["build"] = json.loads(record.read_text())
    else:
        result["build"] = build_modules(args.jobs)
        write_json(record, result["build"])
        write_json(args.out / "fused_moe_build.json", result["build"])
        if args.build_only:
            return

    import flashinfer
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    result["device"] = {
        "name": props.name, "sms": props.multi_processor_count, "nvidia_smi": smi,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "flashinfer": flashinfer.__version__,
        "threshold": swap_threshold(props.multi_processor_count),
    }  # fmt: skip
    log(f"device: {smi}; FlashInfer {flashinfer.__version__}; torch {torch.__version__}")

    token_list = cases.TOKENS if not args.quick else (1, 288, 2048)
    t0 = time.time()
    result["warm"] = warm(token_list, min(args.jobs, 16))
    result["phases"]["deepgemm_jit_s"] = time.time() - t0
    log(f"DeepGEMM kernels ready in {result['phases']['deepgemm_jit_s']:.0f} s")

    select = Select(load_modules())
    ex = Experts()
    bw = copy_bandwidth(torch)
    result["copy_bandwidth_Bps"] = bw
    rows = []
    for routing in cases.ALL_ROUTINGS if not args.quick else ("uniform", "same_rank"):
        for tokens in token_list:
            rows.append(ab_case(ex, select, routing, tokens, bw))
            write_json(args.out / "fused_moe_h200.json", result | {"ab": rows})
    result["ab"] = rows
    result["phases"]["total_s"] = time.time() - t_start
    write_json(args.out / "fused_moe_h200.json", result)

    print("\nrouting      tokens  stock ms  fix ms  speedup  roofline%  A/A  same bits  check")
    for r in rows:
        print(f"{r['routing']:12s} {r['tokens']:6d}  {r['stock_s'] * 1e3:8.3f}"
              f"  {r['fix_s'] * 1e3:6.3f}  {r['speedup']:7.2f}"
              f"  {100 * r['roofline_s'] / r['fix_s']:8.0f}  {r['aa_ratio']:5.3f}"
              f"  {'yes' if r['bit_identical'] else 'no':>9s}"
              f"  {r['check']}")  # fmt: skip
    ok = all(r["ok"] for r in rows)
    print(f"all checks {'passed' if ok else 'FAILED'}; total {result['phases']['total_s']:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
