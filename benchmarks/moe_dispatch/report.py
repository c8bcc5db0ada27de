"""Turn run.py's JSON into the published tables, the plot and the H20 model.

    python benchmarks/moe_dispatch/report.py benchmarks/results/moe_dispatch_h200.json

writes moe_dispatch_h200.md, moe_dispatch_h200.png and moe_dispatch_h20_model.md beside the
JSON. Runs on the CPU (numpy, matplotlib)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import cases  # noqa: E402
import model  # noqa: E402

# The seed write-up's H20 measurements (8 x H20, EP8, its fused-MoE operator test).
SEED = [
    ("uniform", 288, 3.21),
    ("uniform", 192, 3.24),
    ("uniform", 2048, 2.65),
    ("skewed (its routing unpublished)", None, "1.99 and 1.05"),
    ("uniform", 1, "unchanged"),
]


def ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def ab_table(res: dict) -> list[str]:
    bw = res["copy_bandwidth_Bps"]
    out = [
        "| routing | tokens | expected_m stock -> fixed | kernel stock -> fixed | stock ms | "
        "patched ms | speedup | A/A | weights read (slowest rank) | roofline % | max rel err "
        "| check |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    th = res["device"]["threshold"]
    for r in res["ab"]:
        k = lambda m: "regular" if m >= th else "swap-A/B"  # noqa: E731
        worst = max(range(cases.EP), key=lambda i: r["patched_rank_median_s"][i])
        wb = r["ranks"][worst]["weight_bytes"]
        out.append(
            f"| {r['routing']} | {r['tokens']} | {r['stock_expected_m']} -> "
            f"{r['patched_expected_m']} | {k(r['stock_expected_m'])} -> "
            f"{k(r['patched_expected_m'])} | {ms(r['stock_s'])} | {ms(r['patched_s'])} | "
            f"{r['speedup']:.2f}x | {r.get('aa_ratio', float('nan')):.3f} | {wb / 1e9:.2f} GB | "
            f"{100 * wb / bw / r['patched_s']:.0f} | {r['max_rel_err']:.1e} | "
            f"{'ok' if r['ok'] else 'FAIL'} |"
        )
    return out


def calib_table(res: dict) -> tuple[list[str], dict]:
    out = [
        "| GEMM | rows per expert | regular us | swap-A/B us | faster |",
        "|---|---:|---:|---:|---|",
    ]
    crossover = {}
    for c in res["calibration"]:
        faster = "swap-A/B" if c["swap_ab_s"] < c["regular_s"] else "regular"
        out.append(
            f"| {c['gemm']} | {c['m']} | {c['regular_s'] * 1e6:.1f} | {c['swap_ab_s'] * 1e6:.1f} | "
            f"{faster} |"
        )
    for g in {c["gemm"] for c in res["calibration"]}:
        rows = sorted((c for c in res["calibration"] if c["gemm"] == g), key=lambda c: c["m"])
        swap_wins = [c["m"] for c in rows if c["swap_ab_s"] < c["regular_s"]]
        reg_wins = [c["m"] for c in rows if c["swap_ab_s"] >= c["regular_s"]]
        # smallest m from which regular wins at every larger measured m
        first = next(
            (
                c["m"]
                for i, c in enumerate(rows)
                if all(x["swap_ab_s"] >= x["regular_s"] for x in rows[i:])
            ),
            None,
        )
        crossover[g] = {"regular_from": first, "swap_wins": swap_wins, "regular_wins": reg_wins}
    return out, crossover


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for routing, color in zip(cases.ROUTINGS, ("C0", "C1", "C2"), strict=True):
        rows = [r for r in res["ab"] if r["routing"] == routing]
        t = [r["tokens"] for r in rows]
        for v, style in (("stock", "--"), ("patched", "-")):
            q = (
                np.array([np.percentile(r[f"{v}_samples_slowest_s"], [25, 50, 75]) for r in rows])
                * 1e3
            )
            axes[0].errorbar(t, q[:, 1], yerr=[q[:, 1] - q[:, 0], q[:, 2] - q[:, 1]], fmt=style,
                             color=color, marker="o", ms=3, label=f"{routing} {v}")  # fmt: skip
        axes[1].plot(t, [r["speedup"] for r in rows], marker="o", color=color, label=routing)
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per step (all ranks see all tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("FC1 + FC2 ms, slowest of 8 ranks (median, IQR)")
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].axhline(1, color="k", lw=0.8)
    axes[1].set_ylabel("speedup, stock / per-expert")
    axes[1].legend(fontsize=8)
    for g, marker in (("fc1", "o"), ("fc2", "s")):
        rows = sorted((c for c in res["calibration"] if c["gemm"] == g), key=lambda c: c["m"])
        m = [c["m"] for c in rows]
        axes[2].plot(m, [c["regular_s"] * 1e6 for c in rows], marker=marker, label=f"{g} regular")
        axes[2].plot(m, [c["swap_ab_s"] * 1e6 for c in rows], marker=marker, ls="--",
                     label=f"{g} swap-A/B")  # fmt: skip
    axes[2].axvline(res["device"]["threshold"], color="k", lw=0.8, ls=":")
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("rows per expert (50 experts, forced kernel)")
    axes[2].set_ylabel("us per grouped GEMM")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    name = res["device"]["name"]
    fig.suptitle(f"FlashInfer SM90 FP8 block-scale MoE GEMMs, {name}, EP8 ranks of "
                 "DeepSeek-V4.1-Flash (50 local experts, top-6)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def model_samples(res: dict, sms: int):
    """(path, terms, seconds) for every H200 measurement: per-rank A/B medians and the
    single-GEMM calibration points."""
    out = []
    for r in res["ab"]:
        slots = cases.route(r["routing"], r["tokens"])
        for v in ("stock", "patched"):
            version = "stock" if v == "stock" else "fixed"
            for rank in range(cases.EP):
                counts = cases.rank_counts(slots, rank)
                path, terms = model.rank_terms(counts, r["tokens"], version, sms)
                out.append((path, terms, r[f"{v}_rank_median_s"][rank], r, v, rank))
    for c in res["calibration"]:
        shape = next(s for s in cases.SHAPES if s.name == c["gemm"])
        counts = np.full(cases.LOCAL, c["m"])
        for path in ("regular", "swap_ab"):
            terms = [model.gemm_terms(counts, shape, c["m"], path, sms)]
            out.append((path, terms, c[f"{path}_s"], c, path, None))
    return out


def h20_model(res: dict) -> tuple[list[str], dict]:
    sms = res["device"]["sms"]
    samples = model_samples(res, sms)
    fits = {
        p: model.fit([(t, s) for q, t, s, *_ in samples if q == p]) for p in ("regular", "swap_ab")
    }
    errs = {p: [] for p in fits}
    for p, terms, s, *_ in samples:
        errs[p].append(fits[p].predict(terms) / s - 1)
    h200_peak_bw = res["copy_bandwidth_Bps"]  # read + written bytes per second of the copy
    fp8_peak = res.get("fp8_tflops_measured", 1487.0) * 1e12
    lines = [
        "# What H20 would do: a performance model fitted on H200",
        "",
        "Fitted on every H200 measurement in `moe_dispatch_h200.json` "
        f"({len(samples)} points: each "
        "rank's median FC1+FC2 time, stock and patched, plus the single-GEMM crossover points) "
        "with `benchmarks/moe_dispatch/model.py`:",
        "",
        "    t(GEMM) = c0 + max(weight_bytes / bw, padded_mma_flops / tc)",
        "",
        "weight_bytes: FP8 weights + scales of the experts that received rows; padded_mma_flops: "
        "2·N·K·Σ rows rounded up to the kernel's tile (block_m for the regular kernel, the row "
        "tile block_n for swap-A/B), the tile taken from a Python port of DeepGEMM's "
        "`get_best_gemm_config` for the device's SM count.",
        "",
        "| kernel | bw (TB/s) | tc (TFLOP/s, padded work) | r (re-reads reaching HBM) | "
        "c0 (us) | fit error, median abs | worst |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p, f in fits.items():
        e = np.abs(errs[p])
        lines.append(
            f"| {p} | {f.bw / 1e12:.2f} | {f.tc / 1e12:.0f} | {f.r:.2f} | {f.c0 * 1e6:.1f} | "
            f"{100 * np.median(e):.0f} % | {100 * e.max():.0f} % |"
        )
    h20 = model.H20
    scale_bw = h20.hbm_tbps * 1e12 / h200_peak_bw
    scale_tc = h20.fp8_tflops * 1e12 / fp8_peak
    h20_fits = {
        p: dataclasses.replace(f, bw=f.bw * scale_bw, tc=f.tc * scale_tc) for p, f in fits.items()
    }
    # Sensitivity: H20 is built to be tensor-bound; if its kernels reach 85 % of the datasheet
    # FP8 rate on padded work (rather than the H200's fraction), stock gets faster.
    h20_hi = {
        p: dataclasses.replace(f, tc=0.85 * h20.fp8_tflops * 1e12) for p, f in h20_fits.items()
    }
    lines += [
        "",
        "## Carried to H20 (assumptions)",
        "",
        f"- Bandwidth: the fitted bw is {100 * fits['regular'].bw / h200_peak_bw:.0f} % (regular) "
        f"and {100 * fits['swap_ab'].bw / h200_peak_bw:.0f} % (swap-A/B) of the H200 copy "
        f"bandwidth measured in the same run ({h200_peak_bw / 1e12:.2f} TB/s, read + write); "
        "H20 gets the same fractions of "
        f"{h20.hbm_tbps} TB/s (datasheet; not measured here).",
        f"- Tensor throughput: the fitted tc is taken as a fraction of the H200's dense FP8 rate "
        f"({fp8_peak / 1e12:.0f} TFLOP/s, "
        + ("measured in the same run" if "fp8_tflops_measured" in res else "the DESIGN.md probe")
        + f"); H20 gets the same fraction of {h20.fp8_tflops:.0f} TFLOP/s (datasheet dense FP8).",
        "- c0 (launch, pipeline fill) unchanged; 78 SMs: swap-A/B threshold 64, tiles from "
        "get_best_gemm_config with 78 SMs.",
        "- Not modelled: wave quantization beyond the tile choice, L2 effects, the fused MoE's "
        "other "
        "kernels (permute, activation, finalize), which the seed's operator times include and "
        "ours do not.",
        "",
        "## Predictions for the seed's cases (H20, EP8, 50 local experts, top-6)",
        "",
        "| case | stock ms (pred.) | fixed ms (pred.) | predicted speedup | speedup if H20 "
        "reaches 85 % of its FP8 peak | seed measured on H20 |",
        "|---|---:|---:|---:|---:|---|",
    ]
    preds = {}
    for routing, tokens, seed in [
        ("uniform", 288, "3.21x (1.808 -> 0.564 ms)"),
        ("uniform", 192, "3.24x"),
        ("uniform", 2048, "2.65x"),
        ("zipf", 288, "skewed: 1.99x / 1.05x (routing not published)"),
        ("hot", 288, "skewed: 1.99x / 1.05x (routing not published)"),
        ("uniform", 1, "unchanged"),
    ]:
        t = _slowest(h20_fits, routing, tokens, h20.sms)
        hi = _slowest(h20_hi, routing, tokens, h20.sms)
        preds[f"{routing}-{tokens}"] = t
        lines.append(
            f"| {routing} {tokens} tokens | {ms(t['stock'])} | {ms(t['fixed'])} | "
            f"{t['stock'] / t['fixed']:.2f}x | {hi['stock'] / hi['fixed']:.2f}x | {seed} |"
        )
    lines += [
        "",
        "Model check on H200 (every A/B case, slowest rank): predicted vs measured speedup",
        "",
        "| routing | tokens | measured | predicted |",
        "|---|---:|---:|---:|",
    ]
    for r in res["ab"]:
        t = _slowest(fits, r["routing"], r["tokens"], sms)
        lines.append(
            f"| {r['routing']} | {r['tokens']} | {r['speedup']:.2f}x | "
            f"{t['stock'] / t['fixed']:.2f}x |"
        )
    emu = res.get("emulated_78sm")
    if emu:
        # Same H200, kernels planned for 78 SMs: compute scales with the SMs used.
        emu_fits = {p: dataclasses.replace(f, tc=f.tc * 78 / sms) for p, f in fits.items()}
        lines += [
            "",
            "Out-of-sample check: the same H200 with FlashInfer's kernels planned for 78 SMs "
            "(`VLLM_H20_NUM_SMS=78`: an H20's grid, tiles and swap threshold 64, at H200 speeds; "
            "the model scales tc by 78/132 and keeps bw):",
            "",
            "| routing | tokens | stock ms | fixed ms | measured | predicted |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in emu["ab"]:
            t = _slowest(emu_fits, r["routing"], r["tokens"], 78)
            lines.append(
                f"| {r['routing']} | {r['tokens']} | {ms(r['stock_s'])} | {ms(r['fixed_s'])} | "
                f"{r['speedup']:.2f}x | {t['stock'] / t['fixed']:.2f}x |"
            )
    u288 = preds.get("uniform-288")
    emu288 = next(
        (r for r in (emu or {}).get("ab", []) if r["routing"] == "uniform" and r["tokens"] == 288),
        None,
    )
    lines += [
        "",
        "## Assessment",
        "",
        "- On H200 the model follows the measured speedups, including the skewed-routing "
        "regressions at 1,024-2,048 tokens (the weight re-read term).",
    ]
    if u288:
        lines.append(
            f"- The fixed path on H20 is bandwidth-bound: predicted {ms(u288['fixed'])} ms for "
            "uniform 288 tokens against the seed's measured 0.564 ms (the datasheet 4.0 TB/s "
            "is likely optimistic for H20's achievable copy bandwidth)."
        )
    lines.append(
        "- The stock path on H20 is compute-bound, and the model's tensor rate for it is the "
        "weakest assumption: scaling the H200 fit by the devices' peak ratio predicts ~5x for "
        "uniform 192/288 tokens, assuming 85 % of H20's datasheet rate predicts ~3.8x; the seed "
        "measured 3.2x. The predicted speedups are upper bounds of the right order, not "
        "forecasts to two digits."
    )
    if emu288:
        lines.append(
            "- The 78-SM emulation (H200 speeds, H20 dispatch) measured "
            f"{emu288['speedup']:.2f}x at uniform 288 tokens where the model, scaling tensor "
            "throughput with the SM count, predicts more: with fewer SMs each SM gets more "
            "memory bandwidth, so the stock path does not slow down in proportion. This is the "
            "same direction of error as against the seed."
        )
    return lines, {"fits": {p: vars(f) for p, f in fits.items()}, "h20": preds}


def _slowest(fits, routing: str, tokens: int, sms: int) -> dict:
    """Predicted time of the slowest of the 8 ranks, stock and fixed."""
    slots = cases.route(routing, tokens)
    out = {}
    for version in ("stock", "fixed"):
        out[version] = max(
            fits[p].predict(terms)
            for p, terms in (
                model.rank_terms(cases.rank_counts(slots, k), tokens, version, sms)
                for k in range(cases.EP)
            )
        )
    return out


FUSED_MOE_NOTE = [
    "## Full fused-MoE A/B: not run",
    "",
    "`cutlass_fused_moe(..., use_deepseek_fp8_block_scale=True, ep_size=8)` stock vs patched "
    "needs FlashInfer's whole SM90 fused-MoE JIT module built twice. It is 248 objects, "
    "~38,000 core-seconds: ~40 min on the one-GPU machine's 16 cores and ~20 min on the "
    "two-GPU kind's 32, per build, against a 30-minute device budget per session and 10 "
    "minutes per command. A reduced module that instantiates only the DeepSeek FP8 path means "
    "rewriting FlashInfer's instantiation and binding sources, which we did not do. The "
    "kernel-level A/B above runs the same runner class, the same `getWorkspaceSize()` call and "
    "the same grouped GEMMs; what it leaves out are the fused MoE's permute, activation "
    "(SwiGLU + FP8 requantize) and finalize kernels, which the fix does not change. The 8-GPU "
    "issue (6/6) builds the full module on 128 cores.",
]


def findings(res: dict, crossover: dict) -> list[str]:
    ab = res["ab"]
    aa = [abs(r.get("aa_ratio", 1) - 1) for r in ab]
    uni = [r for r in ab if r["routing"] == "uniform"]
    best = max(uni, key=lambda r: r["speedup"])
    worse = [r for r in ab if r["speedup"] < 1 - 3 * max(max(aa), 0.005)]
    out = [
        "## Findings",
        "",
        f"- Noise floor: the patched build timed twice in the same interleaved run differs by at "
        f"most {100 * max(aa):.1f} % (column A/A).",
        f"- Uniform routing: the fix helps from 128 to 512 tokens, best {best['speedup']:.2f}x at "
        f"{best['tokens']} tokens ({ms(best['stock_s'])} -> {ms(best['patched_s'])} ms); there "
        "the patched kernels read the rank's expert weights at "
        f"{100 * best['roofline_s'] / best['patched_s']:.0f} % of the copy bandwidth. On H200 "
        "the stock path's padded tiles are cheap (its tensor throughput is ~5x an H20's), so "
        "the gain is the tile choice, far smaller than the seed's 3.2x on H20.",
    ]
    if worse:
        out.append(
            "- Regressions beyond noise: "
            + ", ".join(f"{r['routing']} {r['tokens']} ({r['speedup']:.2f}x)" for r in worse)
            + ". With skewed routing a hot expert gets hundreds to thousands of rows while "
            "the average is 16-62; the estimate then picks swap-A/B (or small tiles), which "
            "stream that expert's weights once per small row tile. The per-expert average "
            "is a poor estimate when the load is this uneven; the seed saw no regression on "
            "H20 (its skewed cases: 1.99x and 1.05x), where the stock path is compute-bound."
        )
    out.append(
        "- Crossover (forced kernels, equal rows per expert): regular and swap-A/B stay within "
        "a few per cent of each other from 1 to 256 rows; no threshold beats the hard-coded 32 "
        "by more than the noise on every measured size, so the plugin keeps FlashInfer's "
        "threshold (no per-device calibration)."
    )
    emu = res.get("emulated_78sm")
    if emu:
        r288 = next(
            (r for r in emu["ab"] if r["routing"] == "uniform" and r["tokens"] == 288), None
        )
        if r288:
            out.append(
                f"- Dispatching as an H20 would (78-SM grids and tiles, threshold 64) on this "
                f"H200: uniform 288 tokens {ms(r288['stock_s'])} -> {ms(r288['fixed_s'])} ms "
                f"({r288['speedup']:.2f}x); see moe_dispatch_h20_model.md."
            )
    out += [
        "",
        "**What differs from H20.** H20 has the same Hopper SM and a similar memory system "
        "(4.0 TB/s) but about a fifth of H200's FP8 tensor throughput (296 vs ~1,440 TFLOP/s "
        "dense, measured here) on 78 instead of 132 SMs, and FlashInfer uses threshold 64 there. "
        "The stock path's waste is MMA work on padded 128-row tiles; H200 absorbs it behind the "
        "weight stream, H20 cannot (the seed's stock 288-token case runs ~453 GFLOP of padded "
        "work in 1.8 ms), so the same fix that gives ~1.15x here gave 3.2x there. "
        "moe_dispatch_h20_model.md carries these measurements to H20 with a fitted model.",
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json", type=Path)
    args = ap.parse_args()
    res = json.loads(args.json.read_text())
    d = res["device"]
    table = ab_table(res)
    calib, crossover = calib_table(res)
    head = [
        f"# FlashInfer SM90 FP8 MoE dispatch: stock vs per-expert expected_m on {d['name']}",
        "",
        f"- Device: {d['nvidia_smi']}; {d['sms']} SMs (swap-A/B threshold {d['threshold']}); "
        f"torch {d['torch']}, CUDA {d['cuda']}, Python {d['python']}",
        f"- Kernels: `fp8_blockscale_gemm.cu` from {d['flashinfer_sources']} (FlashInfer "
        "0.7.2.post1, vLLM 0.33.0's pin), built stock and with `patches/flashinfer/0001-*.patch`, "
        "FlashInfer's JIT flags for its SM90 fused-MoE module.",
        f"- Command: `{res['command']}` (then `python benchmarks/moe_dispatch/report.py "
        "benchmarks/results/moe_dispatch_h200.json`)",
        f"- Copy bandwidth measured in the same run: {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s "
        "(bytes read + written, eager device copy); roofline = the slowest rank's expert weights "
        "read once at that rate.",
        f"- Build {res['phases']['build_s']:.0f} s, DeepGEMM run-time compiles "
        f"{res['phases']['deepgemm_jit_s']:.0f} s ({res['phases']['deepgemm_kernels']} kernels, "
        "outside the timings), total "
        f"{res['phases'].get('total_s', 0):.0f} s.",
        "",
        "Each row: DeepSeek-V4.1-Flash FC1 (N 4608, K 5120) + FC2 (N 5120, K 2304) grouped GEMMs "
        "as the fused MoE issues them on one EP8 rank (50 of 400 expert slots, top-6, every rank "
        "sees every token), for all 8 ranks on the same routing, one after another on one GPU; "
        "CUDA graphs, 5 warm-ups, 24 samples; per sample the slowest rank, then the median (the "
        "seed's method). Correctness: every rank's output of both builds against an fp32 "
        "reference on the same FP8 inputs (threshold 1e-2 relative L2), and against each other.",
        "",
    ]
    body = table + [""] + findings(res, crossover)
    body += ["", "## Crossover: regular vs swap-A/B at forced expected_m", ""] + calib
    body += ["", "Where regular starts to win at every larger measured size: " + ", ".join(
        f"{g}: {v['regular_from']}" for g, v in sorted(crossover.items())) + "."]  # fmt: skip
    body += ["", *FUSED_MOE_NOTE]
    (args.json.with_suffix(".md")).write_text("\n".join(head + body) + "\n")
    plot(res, args.json.with_suffix(".png"))
    lines, summary = h20_model(res)
    (args.json.parent / "moe_dispatch_h20_model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(table))
    print(json.dumps({"crossover": crossover, **summary}, indent=1, default=float)[:3000])


if __name__ == "__main__":
    main()
