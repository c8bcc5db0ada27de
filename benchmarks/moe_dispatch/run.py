"""Kernel-level A/B of FlashInfer's SM90 FP8 block-scale MoE GEMMs on one GPU: every EP rank of
each model family in spec.yaml, in every version the spec names (stock, the average-only fix,
the shipped series, an A/A copy; a candidate is one more version there, with its patch files).

One command on the GPU machine does everything and prints a short table last:

    python benchmarks/moe_dispatch/run.py --flashinfer .fi/flashinfer-0.7.2.post1-src.tar.xz \\
        --out $OUT [--families dsv3-ep8,kimi-k2-ep8] [--routings ...] [--tokens ...]

1. builds one torch extension per distinct set of patch files in the spec from FlashInfer's
   fp8_blockscale_gemm.cu (vllm_h20's applier, FlashInfer's JIT flags); a version with
   `calib: true` also gets calib.patch, the switches the H20 emulations and the forced-kernel
   sweep need; the builds share one DeepGEMM kernel cache and include list (modules.py);
2. compiles the DeepGEMM kernels every case needs in parallel processes (their run-time nvcc
   builds stay out of the timings);
3. checks every rank of every case: each version's output against an fp32 reference and the
   baseline's;
4. times FC1 + FC2 per rank in CUDA graphs (5 warm-ups, 24 samples, versions and ranks
   interleaved; per sample the slowest rank, then the median); a case where the lead is under
   0.98x of the baseline is run again and both runs kept; the weights-read roofline against a
   copy measured in the same run;
5. with --calibrate, regular vs swap-A/B at forced rows per expert (the performance model's
   points) on the lead version's build (a calib one).

The H20 emulations are this run with spec-h20.yaml (every version on the calibration build)
and VLLM_H20_NUM_SMS=78 (the dispatch plans for an H20's 78 SMs), VLLM_H20_GRID_SMS=40 or 20
(the kernels run on as many CTAs as match an H20's FP8 rate): h200.sh's `emulated` step.

The JSON (moe_dispatch.json) holds the spec it ran, labels included: report_run.py renders it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
import spec as specs  # noqa: E402
from expected_m import per_expert_expected_m, swap_threshold  # noqa: E402
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
    write_json,
)
from modules import (  # noqa: E402
    REPO,
    Module,
    build_all,
    builds_of,
    compile_kernels,
    load_modules,
    setup,
    shared_headers,
)

BAR = 0.98  # the lead at >= 0.98x of the baseline, else the case is run again


# ----------------------------------------------------------------------------- GPU work


@dataclass(frozen=True)
class Column:
    """One timed column: a module, the expected_m its runner gets, the calibration build's
    switches (single: one launch chosen from expected_m)."""

    name: str
    build: str
    expected_m: str
    single: bool = False


def columns_of(spec: specs.Spec) -> list[Column]:
    builds = builds_of(spec)
    return [Column(v.name, builds[v.name].name, v.expected_m, v.single) for v in spec.versions]


class Gpu:
    """One family's weights on one rank (FP8 + block scales) and their dequantized copies."""

    def __init__(self, torch, fam: cases.Family, seed: int = 0):
        self.torch, self.fam = torch, fam
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.w, self.ws, self.wref = {}, {}, {}
        for s in fam.shapes:
            w = torch.empty(fam.local, s.n, s.k, dtype=torch.float8_e4m3fn, device="cuda")
            deq = torch.empty(fam.local, s.n, s.k, dtype=torch.float32, device="cuda")
            sc = (torch.rand(fam.local, s.n // 128, s.k // 128, generator=g, device="cuda")
                  * 1.5 + 0.5) * 2e-3  # fmt: skip
            for e in range(fam.local):
                raw = torch.randn(s.n, s.k, generator=g, device="cuda") * 64
                w[e] = raw.clamp(-448, 448).to(torch.float8_e4m3fn)
                deq[e] = w[e].float() * sc[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            self.w[s.name], self.ws[s.name], self.wref[s.name] = w, sc.contiguous(), deq

    def reference(self, shape, a, counts):
        """fp32 rows x N of the activation as the kernel sees it (FP8 per 1x128 group)."""
        torch = self.torch
        g = a.float().view(a.shape[0], a.shape[1] // 128, 128)
        amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-10)
        aq = ((g * (448.0 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448.0)).view(
            a.shape[0], a.shape[1])  # fmt: skip
        out = torch.zeros(a.shape[0], shape.n, device="cuda")
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                out[start : start + c] = aq[start : start + c] @ self.wref[shape.name][e].T
            start += c
        return out


def weight_bytes(fam: cases.Family, counts: np.ndarray) -> int:
    return sum(s.weight_bytes(int((counts > 0).sum())) for s in fam.shapes)


def ab_case(gpu: Gpu, mods: dict, cols: list[Column], routing: str, tokens: int, bw: float,
            profile: bool = False) -> dict:  # fmt: skip
    """Every rank of one routing/token case in every column: check, then time in graphs."""
    torch, fam = gpu.torch, gpu.fam
    slots = cases.route(routing, tokens, family=fam)
    avg_m = expected_m_of("average", tokens, fam)
    cap = max(tokens * fam.top_k, 4)  # the runner's rows, as the MoE layer sizes them
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    a = {s.name: torch.randn(cap, s.k, generator=gen, device="cuda").to(torch.bfloat16)
         for s in fam.shapes}  # fmt: skip
    out = {s.name: torch.empty(cap, s.n, dtype=torch.bfloat16, device="cuda") for s in fam.shapes}
    told = {c.name: expected_m_of(c.expected_m, tokens, fam) for c in cols}
    gemms = {c.name: {s.name: mods[c.build].mod.GroupedGemm(tokens, s.n, s.k, fam.top_k,
                                                            fam.local, told[c.name])
                      for s in fam.shapes} for c in cols}  # fmt: skip
    ws = torch.empty(max(1, *(g.workspace_bytes for gs in gemms.values() for g in gs.values())),
                     dtype=torch.uint8, device="cuda")  # fmt: skip

    def runner(c: Column, off, dest):
        def run():
            mods[c.build].enter(0, c.single)  # the kernel choice is made here, at capture
            for s in fam.shapes:
                gemms[c.name][s.name].run(dest[s.name], a[s.name], gpu.w[s.name],
                                          gpu.ws[s.name], off, ws)  # fmt: skip

        return run

    per_rank, graphs = [], {c.name: [] for c in cols}
    for rank in range(fam.ep):
        counts = cases.rank_counts(slots, rank, fam.local)
        rows = int(counts.sum())
        off = torch.tensor(cases.offsets(counts), device="cuda")
        errs, agree, first = {}, {}, None
        refs = {s.name: gpu.reference(s, a[s.name][:rows], counts) for s in fam.shapes if rows}
        for c in cols:
            dest = {s.name: torch.full((cap, s.n), float("nan"), dtype=torch.bfloat16,
                                       device="cuda") for s in fam.shapes}  # fmt: skip
            runner(c, off, dest)()
            torch.cuda.synchronize()
            errs[c.name], agree[c.name] = {}, {}
            for s in fam.shapes:
                got = dest[s.name][:rows]
                if rows and not bool(torch.isfinite(got).all()):
                    raise RuntimeError(f"{c.name} {s.name} rank {rank}: non-finite or unwritten")
                errs[c.name][s.name] = rel(got, refs[s.name]) if rows else 0.0
                base = first[s.name][:rows] if first else got
                agree[c.name][s.name] = rel(got, base) if rows else 0.0
            first = first or dest
        for c in cols:
            graphs[c.name].append(graph_of(torch, runner(c, off, out)))
        per_rank.append({"rank": rank, "rows": rows, "max_rows_per_expert": int(counts.max()),
                         "active_experts": int((counts > 0).sum()),
                         "weight_bytes": weight_bytes(fam, counts), "rel_err": errs,
                         "agreement": agree})  # fmt: skip
    # Interleave columns sample by sample so that drift hits all of them alike.
    order = [(c.name, i) for i in range(fam.ep) for c in cols]
    raw = time_graphs(torch, [graphs[v][i] for v, i in order])
    samples = {c.name: [[row[order.index((c.name, i))] for i in range(fam.ep)] for row in raw]
               for c in cols}  # fmt: skip
    row = {"model": fam.name, "ep": fam.ep, "routing": routing, "tokens": tokens,
           "rows_per_expert": fam.rows_per_expert(tokens), "stock_expected_m": tokens,
           "fixed_expected_m": avg_m, "hottest_over_mean": float(
               (h := np.bincount(slots.ravel(), minlength=fam.slots)).max() / h.mean()),
           "ranks": per_rank}  # fmt: skip
    for c in cols:
        slowest = [max(x) for x in samples[c.name]]
        row[f"{c.name}_s"] = statistics.median(slowest)
        row[f"{c.name}_rank_median_s"] = [statistics.median(x[r] for x in samples[c.name])
                                          for r in range(fam.ep)]  # fmt: skip
        row[f"{c.name}_samples_slowest_s"] = slowest
    if profile:
        row["profile"] = profile_rank(graphs, samples, torch)
    del graphs
    base = cols[0].name
    row["speedups"] = {c.name: row[f"{base}_s"] / row[f"{c.name}_s"] for c in cols[1:]}
    worst = max(range(fam.ep), key=lambda r: row[f"{cols[-1].name}_rank_median_s"][r])
    row["roofline_s"] = per_rank[worst]["weight_bytes"] / bw  # read-only: the copy's rate
    row["max_rel_err"] = max(e for r in per_rank for v in r["rel_err"].values() for e in v.values())
    row["max_disagreement"] = max(
        e for r in per_rank for v in r["agreement"].values() for e in v.values()
    )
    row["ok"] = row["max_rel_err"] < 1e-2 and row["max_disagreement"] < 1e-2
    log(f"{fam.name} {routing:11s} {tokens:5d} tok: "
        + ", ".join(f"{c.name} {row[f'{c.name}_s'] * 1e3:.3f} ms" for c in cols) + ", "
        + " ".join(f"{v} x{s:.3f}" for v, s in row["speedups"].items())
        + f", err {row['max_rel_err']:.1e} {'ok' if row['ok'] else 'FAIL'}")  # fmt: skip
    return row


PROFILE_REPLAYS = 20


def profile_rank(graphs: dict, samples: dict, torch) -> dict:
    """Where each column's time goes at the rank the last column is slowest on: its kernels as
    the profiler saw them over PROFILE_REPLAYS replays (span, busy, idle, each kernel), and the
    rate of as many back-to-back replays (loop_us). event_us: the A/B's own median there."""
    lead = list(samples)[-1]
    ranks = range(len(samples[lead][0]))
    rank = max(ranks, key=lambda r: statistics.median(x[r] for x in samples[lead]))
    out: dict = {"rank": rank, "replays": PROFILE_REPLAYS, "versions": {}}
    for v in samples:
        try:
            g = graphs[v][rank]
            out["versions"][v] = trace_summary(
                trace_graph(torch, g, PROFILE_REPLAYS), PROFILE_REPLAYS
            ) | {  # fmt: skip
                "event_us": statistics.median(x[rank] for x in samples[v]) * 1e6,
                "loop_us": statistics.median(loop_time(torch, g, PROFILE_REPLAYS)) * 1e6,
            }
        except Exception as e:  # noqa: BLE001 - a lost trace must not fail the A/B's own row
            out["versions"][v] = {"error": str(e)[:500]}
    return out


def checked_case(gpu, mods, cols, routing, tokens, bw, profile=False) -> dict:
    """ab_case, with a failure recorded as a failed row (the run goes on, unless CUDA's
    context is lost, which the row says)."""
    try:
        return ab_case(gpu, mods, cols, routing, tokens, bw, profile)
    except Exception as e:  # noqa: BLE001 - a wrong or unwritten output is a result here
        log(f"{gpu.fam.name} {routing} {tokens} tok: FAILED: {e}")
        row = {"model": gpu.fam.name, "ep": gpu.fam.ep, "routing": routing, "tokens": tokens,
               "ok": False, "error": str(e)[:2000]}  # fmt: skip
        if "CUDA" in str(e) or "cuda" in type(e).__name__.lower():
            row["cuda_error"] = True
        return row


def calibrate(gpu: Gpu, mod: Module, ms: tuple[int, ...]) -> list[dict]:
    """Regular vs swap-A/B at forced rows per expert (every expert m rows, one launch): the
    single-GEMM points the performance model (model.py) is fitted on."""
    torch, fam = gpu.torch, gpu.fam
    rows_out = []
    for s in fam.shapes:
        for m in ms:
            counts = np.full(fam.local, m)
            n_rows = int(counts.sum())
            a = torch.randn(n_rows, s.k, device="cuda").to(torch.bfloat16)
            out = torch.empty(n_rows, s.n, dtype=torch.bfloat16, device="cuda")
            off = torch.tensor(cases.offsets(counts), device="cuda")
            gg = mod.mod.GroupedGemm(n_rows, s.n, s.k, 1, fam.local, m)
            ws = torch.empty(max(gg.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
            ref = gpu.reference(s, a, counts)
            ts = {}
            for kind, force in (("regular", 1), ("swap_ab", -1)):

                def call(force=force, gg=gg, a=a, out=out, off=off, ws=ws, s=s):
                    mod.enter(force, True)
                    gg.run(out, a, gpu.w[s.name], gpu.ws[s.name], off, ws)

                g = graph_of(torch, call)
                ts[kind] = statistics.median(x[0] for x in time_graphs(torch, [g]))
                assert rel(out, ref) < 1e-2, (s.name, m, kind, rel(out, ref))
            mod.enter(0, False)
            rows_out.append({"model": fam.name, "gemm": s.name, "m": m,
                             **{f"{k}_s": v for k, v in ts.items()},
                             "weight_bytes": s.weight_bytes(fam.local)})  # fmt: skip
            log(f"calib {fam.name} {s.name} m={m:4d}: "
                + ", ".join(f"{k} {v * 1e6:7.1f} us" for k, v in ts.items()))  # fmt: skip
    return rows_out


# ----------------------------------------------------------------------------- phases


def expected_m_of(kind: str, tokens: int, fam: cases.Family) -> int:
    """What a column's runner is told: the token count (stock's bug) or the average rows per
    expert slot (the fix), as the C++ computes it."""
    if kind == "tokens":
        return tokens
    return per_expert_expected_m(tokens, fam.top_k, fam.local, fam.ep)


def warm_jobs(spec: specs.Spec, cols: list[Column], token_list) -> list[tuple]:
    """(build, single, family, shape index, tokens, expected_m, force) for every DeepGEMM
    kernel the run launches: the choice is made on the host from these alone (never from the
    routed rows), so a small grouped GEMM with the same arguments compiles the same kernels."""
    jobs = set()
    for fam in spec.families:
        for c in cols:
            for t in token_list:
                m = expected_m_of(c.expected_m, t, fam)
                jobs |= {(c.build, c.single, fam.name, si, t, m, 0) for si in range(2)}
    return sorted(jobs, key=repr)


def calib_jobs(spec: specs.Spec, build: str, ms) -> list[tuple]:
    return sorted((build, True, f.name, si, 4 * f.local, m, force) for f in spec.families
                  for m in ms for si in range(2) for force in (1, -1))  # fmt: skip


def ab_cases(gpu, mods, cols, spec, bw, out_json, result, profile=False) -> list[dict]:
    """The A/B per routing x tokens of one family; written as it goes."""
    rows: list[dict] = []
    lead = spec.lead
    for routing in spec.routings:
        if routing == "same_spread" and gpu.fam.top_k > gpu.fam.ep:
            continue
        for tokens in spec.tokens:
            row = checked_case(gpu, mods, cols, routing, tokens, bw, profile)
            if row.get("speedups", {}).get(lead, 1.0) < BAR:
                # Under the bar: run it again; both runs are kept (the second decides).
                again = checked_case(gpu, mods, cols, routing, tokens, bw, profile)
                row = again | {"first_run": {k: row[k] for k in row if k != "ranks"}}
            rows.append(row)
            write_json(out_json, result | {"ab": result["ab"] + rows})
            if "cuda_error" in row:
                break
    return rows


def device_info(torch) -> dict:
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
         "--format=csv,noheader"], capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return {"name": props.name, "sms": props.multi_processor_count, "nvidia_smi": smi,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "threshold": swap_threshold(props.multi_processor_count)}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--flashinfer",
        type=Path,
        required=True,
        help="FlashInfer's sources: the tarball fetch_sources.py makes, or a dir",
    )
    ap.add_argument("--out", type=Path, required=True, help="where moe_dispatch.json goes")
    ap.add_argument(
        "--spec",
        type=Path,
        default=specs.DEFAULT,
        help="families, routings, tokens and versions (default: spec.yaml here)",
    )
    ap.add_argument("--families", default="", help="comma-separated families of the spec")
    ap.add_argument("--routings", default="", help="comma-separated routings of the spec")
    ap.add_argument("--tokens", default="", help="comma-separated token counts")
    ap.add_argument("--work", type=Path, default=REPO / ".build" / "moe_dispatch")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 8)
    ap.add_argument("--no-main", action="store_true", help="skip the A/B (--calibrate only)")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="also regular vs swap-A/B at forced rows per expert (the model's fit)",
    )
    ap.add_argument("--profile", action="store_true",
                    help="after each case's timing, trace every column's graph at the rank the "
                    "last column is slowest on (each kernel's duration, the idle time between "
                    "them) and time 20 back-to-back replays")  # fmt: skip
    return ap.parse_args(argv)


def spec_of(args) -> specs.Spec:
    """The spec narrowed to the command line's selection; a bad one exits in one line."""
    try:
        spec = specs.select(specs.load(args.spec), args.families, args.routings, args.tokens)
    except specs.SpecError as e:
        raise SystemExit(f"run.py: {e}") from None
    if args.calibrate and not builds_of(spec)[spec.lead].calib:
        raise SystemExit(
            f"run.py: --calibrate forces kernels through calib.patch's switches: "
            f"the lead version ({spec.lead}) needs `calib: true` (spec-h20.yaml)"
        )
    return spec


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = spec_of(args)
    per_version = builds_of(spec)
    builds = {b.name: b for b in per_version.values()}
    args.work, data = setup(args.work, per_version, args.flashinfer, args.jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result: dict = {
        "command": " ".join(sys.argv), "spec": spec.to_json(), "phases": {}, "ab": [],
        "calibration": [], "builds": {v: b.name for v, b in per_version.items()},
        "patches": {str(p.relative_to(REPO)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
                    for b in builds.values() for p in b.patch_files()},
        # the emulations' settings (read by calib builds only)
        "env": {k: os.environ[k] for k in ("VLLM_H20_NUM_SMS", "VLLM_H20_GRID_SMS")
                if k in os.environ},
    }  # fmt: skip
    out_json = args.out / "moe_dispatch.json"
    log(f"building {', '.join(builds)} from {args.flashinfer.name} in {args.work}")
    built = build_all(data, args.work, list(builds.values()))
    result["phases"]["build_s"] = time.time() - t0
    log(f"built in {result['phases']['build_s']:.0f} s: {built}")
    result["kernel_headers"] = shared_headers(data, args.work, builds)  # refused here, not later

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    result["device"] = device_info(torch) | {"flashinfer_sources": args.flashinfer.name}
    log(f"device: {result['device']['nvidia_smi']}; {result['device']['sms']} SMs")
    cols = columns_of(spec)
    lead = per_version[spec.lead].name
    jobs = [] if args.no_main else warm_jobs(spec, cols, spec.tokens)
    jobs += calib_jobs(spec, lead, cases.CALIB_M) if args.calibrate else []
    t1 = time.time()
    result["warm"] = compile_kernels(data, args.work, spec.families, builds, jobs, args.jobs)
    result["phases"]["deepgemm_jit_s"] = time.time() - t1
    log(f"{len(jobs)} kernel choices compiled or cached in {time.time() - t1:.0f} s")

    mods = load_modules(data, args.work, builds, result["kernel_headers"])
    bw = measure_copy_bandwidth(torch)
    result["copy_bandwidth_Bps"] = bw
    result["fp8_tflops_measured"] = measure_fp8_tflops(torch)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    for fam in spec.families:
        gpu = Gpu(torch, fam)
        if not args.no_main:
            result["ab"] += ab_cases(gpu, mods, cols, spec, bw, out_json, result, args.profile)
        if args.calibrate:
            result["calibration"] += calibrate(gpu, mods[lead], cases.CALIB_M)
        write_json(out_json, result)
        del gpu
        torch.cuda.empty_cache()
        if any("cuda_error" in r for r in result["ab"]):
            break
    result["kernels"] = sorted(p.name for p in (args.work / "deepgemm" / "cache").glob("*"))
    result["phases"]["total_s"] = time.time() - t0
    write_json(out_json, result)
    sys.exit(0 if report(result) else 1)


def report(result: dict) -> bool:
    """Print the bar per family and the cases under it (report_run.py's tables); whether every
    output of every case checked out."""
    import report_run

    run = report_run.Run(result, "moe_dispatch.json")
    if run.rows:
        print("\n".join(["", *report_run.bar_table(run, {}), "", *report_run.misses(run, {})]))
    for r in run.failed:
        print(f"{r['model']} {r['routing']} {r['tokens']} FAILED: {r.get('error', '?')[:200]}")
    ok = all(r["ok"] for r in result["ab"])
    print(f"all checks {'passed' if ok else 'FAILED'}; total {result['phases']['total_s']:.0f} s")
    return ok


if __name__ == "__main__":
    main()
