"""EP with concurrent ranks: one process per GPU, each computing its own EP8 rank's 50 local
experts at the same time as the others, then the combine (finalize + NCCL all-reduce).

    python benchmarks/moe_dispatch/ep.py --flashinfer .fi/flashinfer-0.7.2.post1-src.tar.xz \
        --out $OUT                      # every visible GPU: 8 on an 8-GPU host = real EP8

With fewer than 8 GPUs the first N ranks of the EP8 layout run concurrently (the rest are
not simulated) and the result says so; the method is the 8-GPU one.

1. builds FlashInfer's fp8_blockscale_gemm.cu stock and patched (modules.py) and
   compiles every DeepGEMM kernel the cases launch, before any timing;
2. per rank and case: FC1 + FC2 through CutlassFp8BlockScaleGemmRunner (the grouped GEMMs the
   fused MoE issues) checked against an fp32 reference, then the combine: the rank's FC2 rows
   scattered back to their tokens with routing weights and all-reduced over all ranks,
   checked against the all-reduced fp32 reference;
3. times, per sample (5 warm-ups, 24 samples, all ranks released by one barrier): MoE compute
   = the rank's FC1 + FC2 CUDA graph; layer = compute + the combine (finalize + all-reduce,
   its own CUDA graph; eager if NCCL cannot be captured, recorded). Reported like
   the seed: median over samples of the slowest rank's compute; the combine is what the
   layer adds after the slowest rank's compute (the all-reduce waits for it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
import modules  # noqa: E402
import spec  # noqa: E402
from expected_m import per_expert_expected_m  # noqa: E402
from harness import SAMPLES, WARMUPS, graph_of, log, rel, unpack_flashinfer, write_json  # noqa: E402
from run import Gpu  # noqa: E402

# The builds (modules.py, spec.yaml's versions): stock and the shipped series.
VARIANTS = ("stock", "fix")
VERSIONS = VARIANTS


def builds() -> dict:
    """The Build of each variant, from the default spec."""
    return {k: v for k, v in modules.builds_of(spec.load()).items() if k in VARIANTS}


class RankCase:
    """One rank's FC1 + FC2 for one routing/token count in one build (stock or the fix)."""

    def __init__(self, gpu, module, tokens: int, counts: np.ndarray, expected_m: int, seed: int):
        import torch

        self.module, self.gpu, self.counts = module, gpu, counts
        self.rows = int(counts.sum())
        cap = max(tokens * cases.TOP_K, 4)
        self.off = torch.tensor(cases.offsets(counts), device="cuda")
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.a, self.out, self.gemms = {}, {}, {}
        for s in cases.SHAPES:
            self.a[s.name] = torch.randn(cap, s.k, generator=g, device="cuda").to(torch.bfloat16)
            self.out[s.name] = torch.full((cap, s.n), float("nan"), dtype=torch.bfloat16,
                                          device="cuda")  # fmt: skip
            self.gemms[s.name] = module.mod.GroupedGemm(tokens, s.n, s.k, cases.TOP_K,
                                                        cases.LOCAL, expected_m)  # fmt: skip
        ws = max(gg.workspace_bytes for gg in self.gemms.values())
        self.ws = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.module.enter()
        for s in cases.SHAPES:
            self.gemms[s.name].run(self.out[s.name], self.a[s.name], self.gpu.w[s.name],
                                   self.gpu.ws[s.name], self.off, self.ws)  # fmt: skip

    def check(self) -> dict[str, float]:
        errs = {}
        for s in cases.SHAPES:
            got = self.out[s.name][: self.rows]
            if self.rows:
                ref = self.gpu.reference(s, self.a[s.name][: self.rows], self.counts)
                errs[s.name] = rel(got, ref)
            else:
                errs[s.name] = 0.0
        return errs


def case_list(quick: bool) -> list[tuple[str, int]]:
    tokens = (1, 288, 2048) if quick else cases.TOKENS
    return [(r, t) for r in cases.ROUTINGS for t in tokens]


def rows_of(slots: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rank's routed rows in the MoE runner's layout (by local expert, then token):
    per-expert counts, each row's token, each row's top-k position."""
    tok, pos = np.nonzero((slots >= rank * cases.LOCAL) & (slots < (rank + 1) * cases.LOCAL))
    expert = slots[tok, pos] - rank * cases.LOCAL
    order = np.lexsort((tok, expert))
    counts = np.bincount(expert, minlength=cases.LOCAL).astype(np.int64)
    return counts, tok[order], pos[order]


def slowest_median(per_rank: list[list[float]]) -> float:
    """per_rank[rank][sample] -> median over samples of the slowest rank (the seed's statistic)."""
    return statistics.median(max(col) for col in zip(*per_rank, strict=True))


def exposed(layer: list[list[float]], compute: list[list[float]]) -> float:
    """Median over samples of (slowest rank's layer time - slowest rank's compute time)."""
    return statistics.median(
        max(lc) - max(cc)
        for lc, cc in zip(zip(*layer, strict=True), zip(*compute, strict=True), strict=True)
    )


def warm_jobs() -> list[tuple]:
    """modules.compile_kernels' jobs for every DeepGEMM kernel the cases use."""
    jobs = set()
    for t in cases.TOKENS:
        for si in range(len(cases.SHAPES)):
            fix_m = per_expert_expected_m(t, cases.TOP_K, cases.LOCAL, cases.EP)
            jobs |= {(v, False, cases.V41_EP8.name, si, t, m, 0)
                     for v, m in (("stock", t), ("fix", fix_m))}  # fmt: skip
    return sorted(jobs)


def time_interleaved(graphs: dict, combine: dict, finalize) -> dict:
    """Per build, the compute (its graph) and layer (graph + combine) times of every sample,
    the builds interleaved and the first one rotated, all ranks in step (a barrier each)."""
    import torch
    import torch.distributed as dist

    names = list(graphs)
    t = {v: {"compute": [], "layer": []} for v in names}
    for k in range(WARMUPS + SAMPLES):
        for j in range(len(names)):
            v = names[(j + k) % len(names)]  # rotate which build goes first
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            dist.barrier()
            torch.cuda.synchronize()
            e0.record()
            graphs[v].replay()
            e1.record()
            if combine:
                combine[v].replay()
            else:
                finalize(v)
            e2.record()
            torch.cuda.synchronize()
            if k >= WARMUPS:
                t[v]["compute"].append(e0.elapsed_time(e1) / 1e3)
                t[v]["layer"].append(e0.elapsed_time(e2) / 1e3)
    return t


def run_case(gpu, mods, routing: str, tokens: int, rank: int) -> dict:
    """One routing/token case on this rank: check both builds, then time them interleaved."""
    import torch
    import torch.distributed as dist

    fc2 = cases.SHAPES[1]
    slots = cases.route(routing, tokens)
    counts, tok, pos = rows_of(slots, rank)
    gen = np.random.default_rng(tokens)  # the same routing weights on every rank
    weights = gen.random((tokens, cases.TOP_K)).astype(np.float32)
    weights /= weights.sum(1, keepdims=True)
    row_tok = torch.tensor(tok, device="cuda", dtype=torch.long)
    row_w = torch.tensor(weights[tok, pos], device="cuda").unsqueeze(1)
    fixed = per_expert_expected_m(tokens, cases.TOP_K, cases.LOCAL, cases.EP)
    rc = {
        "stock": RankCase(gpu, mods["stock"], tokens, counts, tokens, seed=rank),
        "fix": RankCase(gpu, mods["fix"], tokens, counts, fixed, seed=rank),
    }
    nrows = int(counts.sum())
    outs = {v: torch.empty(tokens, fc2.n, dtype=torch.bfloat16, device="cuda") for v in rc}

    def finalize(v: str) -> None:
        """FlashInfer's finalize (rows -> tokens, routing-weighted), then the EP combine."""
        out = outs[v]
        out.zero_()
        if nrows:
            y = rc[v].out[fc2.name][:nrows].float() * row_w
            out.index_add_(0, row_tok, y.to(out.dtype))
        dist.all_reduce(out)

    for v in rc:
        rc[v]()
    torch.cuda.synchronize()
    errs = {v: rc[v].check() for v in rc}
    combined = {}
    for v in rc:
        finalize(v)
        combined[v] = outs[v].float().clone()
    ref = torch.zeros(tokens, fc2.n, device="cuda")
    if nrows:
        r2 = gpu.reference(fc2, rc["stock"].a[fc2.name][:nrows], counts) * row_w
        ref.index_add_(0, row_tok, r2)
    dist.all_reduce(ref)
    graphs = {v: graph_of(torch, rc[v]) for v in rc}
    # The combine in a CUDA graph too, as vLLM runs decode: an eager launch of its kernels
    # would add host latency that the short cases cannot hide.
    combine, mode = {}, "cuda_graph"
    try:
        for v in rc:
            combine[v] = graph_of(torch, lambda v=v: finalize(v))
    except RuntimeError as e:
        combine, mode = {}, f"eager ({str(e).splitlines()[0][:200]})"
        torch.cuda.synchronize()
    t = time_interleaved(graphs, combine, finalize)
    return {
        "routing": routing, "tokens": tokens, "rank": rank, "rows": nrows,
        "max_rows_per_expert": int(counts.max()),
        "expected_m": {"stock": tokens, "fix": fixed}, "rel_err": errs,
        "combined_rel_err": {v: rel(combined[v], ref) for v in rc},
        "combined_agreement": rel(combined["fix"], combined["stock"]),
        "combine_mode": mode,
        "times": t,
    }  # fmt: skip


def rank_main(rank: int, world: int, args, port: int, results: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    data = unpack_flashinfer(args.flashinfer, args.work)
    mods = modules.load_modules(data, args.work, builds())  # its builds are named as versions
    gpu = Gpu(torch, cases.V41_EP8, seed=rank)
    rows_out = []
    for routing, tokens in case_list(args.quick):
        rows_out.append(run_case(gpu, mods, routing, tokens, rank))
        torch.cuda.empty_cache()
        if rank == 0:
            r = rows_out[-1]["times"]
            log(f"{routing:8s} {tokens:5d}: rank 0 compute stock "
                       f"{statistics.median(r['stock']['compute']) * 1e3:.3f} ms, fix "
                       f"{statistics.median(r['fix']['compute']) * 1e3:.3f} ms")  # fmt: skip
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(rows_out, gathered, dst=0)
    if rank == 0:  # a file, not a queue: a full pipe would block the child the parent joins
        write_json(Path(results), gathered)
    dist.destroy_process_group()


def aggregate(per_rank: list[list[dict]], world: int) -> list[dict]:
    rows = []
    for i, first in enumerate(per_rank[0]):
        rr = [per_rank[r][i] for r in range(world)]
        row = {"routing": first["routing"], "tokens": first["tokens"],
               "expected_m": first["expected_m"], "ranks": rr}  # fmt: skip
        for v in VERSIONS:
            comp = [x["times"][v]["compute"] for x in rr]
            layer = [x["times"][v]["layer"] for x in rr]
            row[f"{v}_compute_s"] = slowest_median(comp)
            row[f"{v}_layer_s"] = slowest_median(layer)
            row[f"{v}_combine_s"] = exposed(layer, comp)
            row[f"{v}_rank_compute_median_s"] = [statistics.median(c) for c in comp]
        row["compute_speedup"] = row["stock_compute_s"] / row["fix_compute_s"]
        row["layer_speedup"] = row["stock_layer_s"] / row["fix_layer_s"]
        row["max_rel_err"] = max(max(x["rel_err"][v].values()) for x in rr for v in VERSIONS)
        row["max_combined_rel_err"] = max(max(x["combined_rel_err"].values()) for x in rr)
        row["combine_mode"] = sorted({x["combine_mode"] for x in rr})
        row["ok"] = row["max_rel_err"] < 1e-2 and row["max_combined_rel_err"] < 1e-2
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    """The published table: per case, compute and combine of both builds (slowest rank)."""
    dev, epi = result["device"], result["ep"]
    links = ", ".join(sorted(set(re.findall(r"\bNV\d+\b", dev["topology"])))) or "not NVLink"
    nccl = ".".join(re.findall(r"\d+", dev["nccl"]))
    ranks = epi["ranks_run"]
    lines = [
        f"# MoE dispatch A/B with concurrent EP ranks: {len(ranks)} x {dev['name']}",
        "",
        f"EP ranks {ranks} of the EP{epi['ep_size']} layout ran at the same time, one process "
        f"and GPU each (DeepSeek-V4.1-Flash: 400 slots, 50 local experts, top-6)."
        + (
            ""
            if epi["complete"]
            else f" **Not the full EP{epi['ep_size']} run**: ranks "
            f"{len(ranks)}-{epi['ep_size'] - 1} were not run, and the all-reduce spans "
            f"{len(ranks)} GPUs, not {epi['ep_size']}."
        ),
        "",
        f"Compute = FC1 + FC2 grouped GEMMs (FlashInfer {dev['flashinfer_sources']}'s "
        "`CutlassFp8BlockScaleGemmRunner`, CUDA graph); combine = finalize (rows to tokens, "
        "routing-weighted) + NCCL all-reduce, as a CUDA graph. 5 warm-ups, 24 samples, all "
        "ranks released by one barrier per sample; compute: median over samples of the slowest "
        "rank; combine: median of (slowest layer - slowest compute), i.e. what the combine "
        "adds after the slowest rank. Speedups are stock / fix.",
        "",
        "| routing | tokens | expected_m stock -> fix | stock compute ms | fix compute "
        "ms | compute x | stock combine ms | fix combine ms | layer x | check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["ab"]:
        m = r["expected_m"]
        lines.append(
            f"| {r['routing']} | {r['tokens']} | {m['stock']} -> {m['fix']} | "
            f"{r['stock_compute_s'] * 1e3:.3f} | {r['fix_compute_s'] * 1e3:.3f} | "
            f"{r['compute_speedup']:.2f} | {r['stock_combine_s'] * 1e3:.3f} | "
            f"{r['fix_combine_s'] * 1e3:.3f} | {r['layer_speedup']:.2f} | "
            f"{'ok' if r['ok'] else 'FAIL'} ({r['max_rel_err']:.1e}, "
            f"{r['max_combined_rel_err']:.1e}) |"
        )
    lines += [
        "",
        "check: relative L2 error of every rank's FC1/FC2 output against an fp32 reference, "
        "and of the all-reduced combine against the all-reduced fp32 reference (both < 1e-2).",
        "",
        f"Device: {dev['nvidia_smi'].replace(chr(10), '; ')}; GPU links: {links}; torch "
        f"{dev['torch']}, CUDA {dev['cuda']}, NCCL {nccl}, Python {dev['python']}. Phases (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in result["phases"].items()),
        "",
        f"Command: `{result['command']}` (on the GPU machine; this table: `python "
        "benchmarks/moe_dispatch/ep.py --render JSON`). The one-GPU run of all eight ranks in "
        "turn: [moe_dispatch_h200.md](moe_dispatch_h200.md).",
    ]
    return "\n".join(lines) + "\n"


def vocabulary(result: dict) -> dict:
    """A result in today's column names: runs before 2026-12-03 called the fix "patched"."""

    def fix(key: str) -> str:
        return "fix" + key[len("patched") :] if key.startswith("patched") else key

    for r in result["ab"]:
        for k in [k for k in r if k.startswith("patched")]:
            r[fix(k)] = r.pop(k)
        r["expected_m"] = {fix(k): v for k, v in r["expected_m"].items()}
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_record(torch, props, world: int, sources: str) -> dict:
    """The GPUs, their topology and the versions, for the result's "device"."""
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    return {
        "name": props.name, "sms": props.multi_processor_count, "gpus": world,
        "nvidia_smi": smi, "topology": topo, "torch": torch.__version__,
        "cuda": torch.version.cuda, "nccl": str(torch.cuda.nccl.version()),
        "python": platform.python_version(), "flashinfer_sources": sources,
    }  # fmt: skip


def print_table(rows: list[dict], world: int) -> None:
    modes = sorted({m for r in rows for m in r["combine_mode"]})
    print(f"\nEP ranks run concurrently: {world} of {cases.EP}; combine: {', '.join(modes)}")
    print("routing  tokens  stock ms (compute+combine)  fix ms (compute+combine)  "
          "compute x  layer x  check")  # fmt: skip
    for r in rows:
        print(f"{r['routing']:8s} {r['tokens']:6d}  "
              f"{r['stock_compute_s'] * 1e3:8.3f} + {r['stock_combine_s'] * 1e3:6.3f}"
              f"           {r['fix_compute_s'] * 1e3:8.3f} + "
              f"{r['fix_combine_s'] * 1e3:6.3f}"
              f"         {r['compute_speedup']:6.2f}  {r['layer_speedup']:6.2f}  "
              f"{'ok' if r['ok'] else 'FAIL'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flashinfer", type=Path, help="FlashInfer data tarball/dir")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=modules.REPO / ".build" / "moe_dispatch")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 8)
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU, max 8")
    ap.add_argument("--quick", action="store_true", help="3 token counts only (smoke test)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="CPU: write JSON's Markdown table beside it, then exit")  # fmt: skip
    args = ap.parse_args()
    if args.render:
        result = vocabulary(json.loads(args.render.read_text()))
        args.render.with_suffix(".md").write_text(markdown(result))
        return
    if not args.flashinfer or not args.out:
        ap.error("--flashinfer and --out are required")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work, data = modules.setup(args.work, modules.builds_of(spec.load()), args.flashinfer,
                                    args.jobs)  # fmt: skip
    t_start = time.time()
    result: dict = {"command": " ".join(sys.argv), "phases": {}}
    t0 = time.time()
    modules.build_all(data, args.work, list(builds().values()))
    result["phases"]["build_s"] = time.time() - t0
    log(f"built {VARIANTS} in {result['phases']['build_s']:.0f} s")

    import torch
    import torch.multiprocessing as mp

    world = min(args.gpus or torch.cuda.device_count(), cases.EP)
    jobs = warm_jobs()
    t0 = time.time()
    modules.compile_kernels(data, args.work, [cases.V41_EP8], builds(), jobs, args.jobs)
    result["phases"]["deepgemm_jit_s"] = time.time() - t0
    log(f"{len(jobs)} DeepGEMM kernels ready in {result['phases']['deepgemm_jit_s']:.0f} s")

    props = torch.cuda.get_device_properties(0)
    result["device"] = device_record(torch, props, world, args.flashinfer.name)
    result["ep"] = {"ep_size": cases.EP, "ranks_run": list(range(world)),
                    "complete": world == cases.EP}  # fmt: skip
    log(f"{world} GPU(s), EP ranks {list(range(world))} of {cases.EP} run concurrently")

    t0 = time.time()
    tmp = args.work / "ep_ranks.json"
    tmp.unlink(missing_ok=True)
    mp.spawn(rank_main, args=(world, args, free_port(), str(tmp)), nprocs=world, join=True)
    per_rank = json.loads(tmp.read_text())
    result["phases"]["run_s"] = time.time() - t0
    rows = aggregate(per_rank, world)
    result["ab"] = rows
    result["phases"]["total_s"] = time.time() - t_start
    name = f"moe_dispatch_ep{world}_{props.name.split()[-1].lower()}.json"
    write_json(args.out / name, result)

    print_table(rows, world)
    ok = all(r["ok"] for r in rows)
    print(f"all checks {'passed' if ok else 'FAILED'}; total {result['phases']['total_s']:.0f} s;"
          f" wrote {args.out / name}")  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
