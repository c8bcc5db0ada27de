"""Render one published run folder of the dispatch evidence into its README.md and plot.

    python benchmarks/moe_dispatch/report_run.py \
        benchmarks/results/moe_dispatch/concentrated-routing-h200

Reads what `h200.sh collect` brought back and was renamed into the folder, each file named for
the GPU it ran on (<dev>: h200, h100): kernel_<dev>.json (run.py: the A/B at 132 SMs and the
forced-kernel sweep), and where present emulated_<dev>.json (run.py --emulate),
explore_*_<dev>.json (run.py --explore), fused_<dev>.json with fused_tests_*.log
(benchmarks/fused_moe). Every number in the README comes from those files or
from the model fitted on them (model.py). CPU only (numpy, matplotlib)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import cases  # noqa: E402
import misses as why  # noqa: E402
import model  # noqa: E402
from expected_m import fit_n  # noqa: E402

# What each column of a run is, for the tables (run.py's version names).
NAMES = {
    "stock": "stock",
    "avg": "average-only (0001)",
    "prev": "shipped per-expert (0001 + 0002)",
    "fix": "fitted tiles (candidate)",
    "fix_again": "fitted tiles again (A/A)",
    "split": "fitted + regular split",
    "prev_co": "shipped, largest carveout",
    "split_co": "split, largest carveout",
}
# The candidate a run measured, by the series kind run.py records (fitted: the fitted-row-tile
# series, whose runs predate the record): its column names, series folder and title.
CANDIDATES = {
    "fitted": {
        "fix": NAMES["fix"],
        "fix_again": NAMES["fix_again"],
        "series": "candidates/fitted-row-tiles",
        "reproduce": "`SERIES=candidates/fitted-row-tiles bash benchmarks/moe_dispatch/h200.sh "
        "smoke` (then `wait`, `collect`)",
        "short": "fitted",
        "lead": "Fitted tiles",
        "prev_kernels": "same kernels, same launches",
        "title": "the shipped per-expert dispatch and the fitted-tile candidate",
    },
    "classes": {
        "fix": "whole-expert tiles (candidate)",
        "fix_again": "whole-expert tiles again (A/A)",
        "series": "candidates/whole-expert-tiles",
        "reproduce": "`SERIES=candidates/whole-expert-tiles bash benchmarks/moe_dispatch/h200.sh "
        "smoke` (then `wait`, `collect`): the series shipped on 2026-12-03 (run as the shipped "
        "one then); the plan shipped before it is `candidates/estimated-row-classes`",
        "short": "whole-expert tiles",
        "lead": "Whole-expert tiles",
        "prev_kernels": "same launches; its row-class kernels are this build's, with the "
        "warp-wide first-tile search and without the spills",
        "title": "the shipped per-expert dispatch and the whole-expert-tile candidate",
    },
    "hot_first": {
        "fix": "hot-first (candidate)",
        "fix_again": "hot-first again (A/A)",
        "series": "candidates/hot-first",  # what the run built; shipped since 2026-12-04
        "reproduce": "`EMULATE=emulated_78sm,emulated_h20_40sm bash "
        "benchmarks/moe_dispatch/h200.sh start` (then `wait`, `collect`; this run had "
        "`SERIES=candidates/hot-first` in front, the name the series had until it shipped)",
        "short": "hot-first",
        "lead": "Hot-first",
        "prev_kernels": "same launches; its row-class kernels are this build's",
        "title": "the previous per-expert plan and the hot-first candidate",
    },
    "one_launch": {
        "fix": "one launch (candidate)",
        "fix_again": "one launch again (A/A)",
        "series": "candidates/one-launch",
        "reproduce": "`SERIES=candidates/one-launch EMULATE=emulated_78sm,emulated_h20_40sm bash "
        "benchmarks/moe_dispatch/h200.sh start` (then `wait`, `collect`)",
        "short": "one launch",
        "lead": "One launch",
        "prev_kernels": "the shipped series' two launches, the candidate's build with the dual "
        "launch off (rule mode 9; those kernels are byte-identical to the shipped series')",
        "title": "the shipped per-expert dispatch and the one-launch candidate",
    },
    "branches": {
        "fix": "graph branches (candidate)",
        "fix_again": "graph branches again (A/A)",
        "series": "candidates/graph-branches",
        "reproduce": "`SERIES=candidates/graph-branches EMULATE=emulated_78sm,emulated_h20_40sm "
        'STEPS="explore kernel emulated rerun fused" '
        "EXPLORE_TOKENS=64,128,192,288,512,1024,2048 bash benchmarks/moe_dispatch/h200.sh start` "
        "(then `wait`, `collect`)",
        "short": "graph branches",
        "lead": "Graph branches",
        "prev_kernels": "the shipped series' dispatch, the candidate's build with the branches "
        "off (rule mode 9; the same kernels, 0003 changes none)",
        "title": "the shipped per-expert dispatch and the graph-branch candidate",
    },
    "overlap_quantize": {
        "fix": "hot launch overlapping (candidate)",
        "fix_again": "hot launch overlapping again (A/A)",
        "series": "candidates/overlap-quantize",
        "reproduce": "`SERIES=candidates/overlap-quantize STEPS=rerun RERUN_ROUTINGS=uniform,zipf,"
        "hot,eplb,same_rank,same_spread,pool8,pool16,zipf2,trained RERUN_TOKENS=128,192,288,2048 "
        "PROFILE=1 bash benchmarks/moe_dispatch/h200.sh start` (then `wait`, `collect`)",
        "short": "hot launch overlapping",
        "lead": "Hot launch overlapping",
        "prev_kernels": "the shipped series' dispatch, the candidate's build with the hot "
        "launch made without PDL (rule mode 9; its kernels wait first, a no-op then)",
        "title": "the shipped per-expert dispatch and the overlapping-hot-launch candidate",
    },
}
# Series whose runs predate run.py's name for their kind (recorded as "classes").
SERIES_KIND = {"candidates/hot-first": "hot_first"}
BALANCED = cases.BALANCED
# The seed write-up's H20 fused-op measurements (8 x H20, EP8, average-only fix).
SEED = (
    ("uniform", 288, 1.808e-3, 0.564e-3),
    ("uniform", 192, None, 3.24),
    ("uniform", 2048, None, 2.65),
)
H20_SMS = 78
# Datasheet memory bandwidth (TB/s) of the GPUs a run can come from and of H20: the fused op's
# other kernels (memory-bound) are carried to H20 in this ratio.
HBM_TBPS = {"h200": 4.8, "h100": 3.35}
H20_TBPS = 4.0
H20_OVER_H200_BW = H20_TBPS / HBM_TBPS["h200"]


def tag_of(folder: Path) -> str:
    """The GPU a run folder's files are named for (kernel_<tag>.json, or in a folder of explore
    runs only, explore_<name>_<tag>.json): h200 or h100."""
    found = sorted(folder.glob("kernel_*.json"))
    tags = [f.stem.removeprefix("kernel_") for f in found]
    if not found:
        found = sorted(folder.glob("explore_*_*.json"))
        tags = sorted({f.stem.rpartition("_")[2] for f in found})
    if len(tags) != 1 or tags[0] not in HBM_TBPS:
        names = ", ".join(f.name for f in found) or "none"
        raise SystemExit(f"{folder}: expected one kernel_<gpu>.json or explore runs of one gpu "
                         f"(gpu: {', '.join(HBM_TBPS)}), found {names}")  # fmt: skip
    return tags[0]


def gm(xs) -> float:
    return statistics.geometric_mean(list(xs))


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def misses(rows: list[dict], v: str) -> list[dict]:
    return [r for r in rows if r["speedups"][v] < 0.98]


def short_of_best(rows: list[dict], v: str) -> list[dict]:
    """Cases more than 3 % below the better of stock and the average-only estimate."""
    return [r for r in rows if r["speedups"][v] / max(1.0, r["speedups"]["avg"]) < 0.97]


def kind_of(res: dict) -> str:
    """run.py's series_kind of a run ("fitted", "classes", "hot_first"; by its series where run.py
    predates the kind; older runs: the fitted series). It is also the model's name for the
    candidate plan (model.predict's versions)."""
    return SERIES_KIND.get(res.get("series", ""), res.get("series_kind", "fitted"))


# A run of the shipped hot-first series itself (no --series): `fix` is that series, `prev` the
# plan shipped until 2026-12-03 (rule mode 3) on this build's kernels.
SHIPPED_HOT_FIRST = {
    "fix": "shipped per-expert (0001 + 0002)",
    "fix_again": "shipped again (A/A)",
    "prev": "plan shipped until 2026-12-03 (mode 3)",
    "series": "",
    "reproduce": '`STEPS="explore kernel emulated rerun fused" EXPLORE_ROUTINGS=same_spread,'
    "pool16,pool8,zipf2,uniform EXPLORE_TOKENS=128,192,288,1024 bash "
    "benchmarks/moe_dispatch/h200.sh start` (then `wait`, `collect`)",
    "short": "shipped per-expert",
    "lead": "Shipped per-expert",
    "title": "the shipped per-expert dispatch",
    "built": "The run built the shipped series (`patches/flashinfer/`), so `fix` is it; `prev` "
    "is the plan shipped until 2026-12-03, run from the calibration build (rule mode 3, the "
    "same kernels).",
    "emulated": "Stock, average-only, the plan shipped until 2026-12-03 and the shipped series.",
    "module": "shipped",
}


def candidate_of(res: dict) -> dict:
    """The CANDIDATES entry of a run (SHIPPED_HOT_FIRST for a run of the shipped series)."""
    if res.get("series") == "shipped" and res.get("series_kind") == "hot_first":
        return SHIPPED_HOT_FIRST
    return CANDIDATES[kind_of(res)]


def prev_plan(plan: str) -> str:
    """The model's name for a run's `prev` column: the shipped hot-first plan for the one-launch,
    graph-branch and overlap-quantize candidates (built beside them), else the per-expert plan
    shipped until 2026-12-03 (split)."""
    return "hot_first" if plan in ("one_launch", "branches", "overlap_quantize") else "split"


def labels(res: dict) -> dict[str, str]:
    """Column names of a run: NAMES with its candidate's."""
    c = candidate_of(res)
    return (
        NAMES
        | {"fix": c["fix"], "fix_again": c["fix_again"]}
        | ({"prev": c["prev"]} if "prev" in c else {})
    )


def names(rows):
    return ", ".join(f"{r['routing']} {r['tokens']}" for r in rows)


# ----------------------------------------------------------------------------- tables


def class_table(rows: list[dict], versions: list[str], label: dict = NAMES) -> list[str]:
    out = [
        "| routing class | tokens | " + " | ".join(label[v] for v in versions) + " |",
        "|---|---|" + "---:|" * len(versions),
    ]
    groups = (
        ("balanced (uniform, zipf, hot, eplb, trained)", BALANCED),
        ("concentrated (same, pool, zipf2)", cases.CONCENTRATED),
    )
    for label, routings in groups:
        for lo, hi in ((1, 128), (129, 4096)):
            sel = [r for r in rows if r["routing"] in routings and lo <= r["tokens"] <= hi]
            cells = [
                f"{gm(r['speedups'][v] for r in sel):.3f} "
                f"(min {min(r['speedups'][v] for r in sel):.2f})"
                for v in versions
            ]
            out.append(f"| {label} | {lo}-{hi} | " + " | ".join(cells) + " |")
    return out


def bars_table(rows: list[dict], versions: list[str], label: dict = NAMES) -> list[str]:
    uni = [r for r in rows if r["routing"] == "uniform" and 128 <= r["tokens"] <= 2048]
    out = [
        "| bar (issue 26) | " + " | ".join(label[v] for v in versions) + " |",
        "|---|" + "---:|" * len(versions),
    ]
    out.append(
        "| cases at or above 0.98x stock | "
        + " | ".join(f"{len(rows) - len(misses(rows, v))} of {len(rows)}" for v in versions)
        + " |"
    )
    out.append(
        "| worst case | "
        + " | ".join(f"{min(r['speedups'][v] for r in rows):.2f}x" for v in versions)
        + " |"
    )
    out.append(
        "| within 3 % of max(stock, average-only) | "
        + " | ".join(f"{len(rows) - len(short_of_best(rows, v))} of {len(rows)}" for v in versions)
        + " |"
    )
    out.append(
        "| uniform 128-2,048 tokens at or above 1.10x | "
        + " | ".join(
            f"{sum(r['speedups'][v] >= 1.10 for r in uni)} of {len(uni)}" for v in versions
        )
        + " |"
    )
    return out


def case_table(res: dict, versions: list[str]) -> list[str]:
    out = [
        "| routing | tokens | hottest / mean | most rows, one expert | stock ms | "
        + " | ".join(labels(res)[v] for v in versions)
        + f" | A/A | first run ({candidate_of(res)['short']}) | max rel err | check |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(versions) + "---:|---:|---:|---|",
    ]
    for r in res["ab"]:
        most = max(k["max_rows_per_expert"] for k in r["ranks"])
        first = f"{r['first_run']['speedup']:.2f}x" if "first_run" in r else ""
        out.append(
            f"| {r['routing']} | {r['tokens']} | {r['hottest_over_mean']:.1f} | {most} | "
            f"{r['stock_s'] * 1e3:.3f} | "
            + " | ".join(f"{r['speedups'][v]:.2f}x" for v in versions)
            + f" | {r.get('aa_ratio', float('nan')):.3f} | {first} | {r['max_rel_err']:.1e} | "
            f"{'ok' if r['ok'] else 'FAIL'} |"
        )
    return out


def calib_table(calib: list[dict]) -> list[str]:
    kinds = [k for k in ("regular", "swap_ab", "fitted") if f"{k}_s" in calib[0]]
    fitted = "fitted" in kinds
    ratio_heads = "fitted / regular | fitted / swap-A/B" if fitted else "swap-A/B / regular"
    out = [
        "| GEMM | rows per expert | "
        + " | ".join(f"{k} us" for k in kinds)
        + f" | {ratio_heads} |",
        "|---|---:|" + "---:|" * (len(kinds) + (2 if fitted else 1)),
    ]
    for c in calib:
        if fitted:
            f = c.get("fitted_s")
            ratios = f"{f / c['regular_s']:.3f} | {f / c['swap_ab_s']:.3f}" if f else ""
        else:
            ratios = f"{c['swap_ab_s'] / c['regular_s']:.3f}"
        out.append(
            f"| {c['gemm']} | {c['m']} | "
            + " | ".join(f"{c[f'{k}_s'] * 1e6:.1f}" for k in kinds)
            + f" | {ratios} |"
        )
    return out


def emulation_section(emu: dict) -> list[str]:
    cand = candidate_of(emu)
    short, lead = cand["short"], cand["lead"]
    out = []
    for key, label in (
        ("emulated_78sm", "78-SM tiles and threshold, all 132 SMs' speed"),
        ("emulated_h20_40sm", "78-SM tiles on 40 SMs (the issue's match)"),
        ("emulated_h20_20sm", "78-SM tiles on 20 SMs (FP8 datasheet match)"),
    ):
        e = emu.get(key)
        if not e or not e.get("ab"):
            continue
        rows = e["ab"]
        below = short_of_best(rows, "fix")
        prev = "prev" in rows[0]["speedups"]
        out += [
            f"### {label}: `{key}`",
            "",
            f"{len(rows)} cases, grid {e['grid']} CTAs per launch, tiles planned for {e['sms']} "
            f"SMs. {lead}: {len(rows) - len(misses(rows, 'fix'))} of {len(rows)} "
            f"cases at or above 0.98x stock (worst {min(r['speedup'] for r in rows):.2f}x); "
            f"{len(rows) - len(below)} of {len(rows)} within 3 % of max(stock, average-only).",
            "",
            "| routing | tokens | stock ms | average-only | "
            + (f"{cand.get('prev', 'shipped per-expert')} | " if prev else "")
            + f"{short} | {short} / max(1, average-only) |",
            "|---|---:|---:|---:|---:|---:|" + ("---:|" if prev else ""),
        ]
        for r in rows:
            out.append(
                f"| {r['routing']} | {r['tokens']} | {r['stock_s'] * 1e3:.3f} | "
                f"{r['speedups']['avg']:.2f}x | "
                + (f"{r['speedups']['prev']:.2f}x | " if prev else "")
                + f"{r['speedups']['fix']:.2f}x | {r['vs_best']:.2f} |"
            )
        if e.get("calibration"):
            out += [
                "",
                "Forced kernels in this emulation (every expert m rows, one launch):",
                "",
                *calib_table(e["calibration"]),
            ]
        out.append("")
    if kind_of(emu) == "hot_first":
        out += [*why.emulation_section(emu), ""]
    return out


# run.py --explore's rule modes on the whole-expert-tile series (CLASS_EXPLORE) and on the
# shipped hot-first series (HOT_FIRST_EXPLORE); modes 16-28 are those of the series before the
# stop at the last tile (2026-12-06), 29-32 those of the series with it.
EXPLORE_NAMES = {
    "hot_first": "hot class first (mode 6)",
    "one_swap": "one swap-A/B launch up to 128 rows (mode 7)",
    "hot_first_r64": "hot-first's rule (mode 8)",
    "fix_calib": "the same, calibration build (mode 0)",
    "hot_only": "hot launch alone (mode 10; diagnostic)",
    "no_overlap": "no overlap (mode 11)",
    "branches": "graph branches, hot first (mode 12)",
    "branches_cold_first": "graph branches, cold first (mode 13)",
    "hot_no_search": "hot launch alone, no first-tile search (mode 14; diagnostic)",
    "every_class": "row-class kernel on every expert (mode 15)",
    "hot_no_pdl": "hot launch alone, no PDL instructions (mode 16; diagnostic)",
    "hot_no_check": "hot launch alone, no class check in the walk (mode 17; diagnostic)",
    "hot_as_stock": "hot launch alone, FlashInfer's code (mode 18; diagnostic)",
    "branches_no_pdl": "graph branches, hot kernel without PDL instructions (mode 19)",
    "branches_no_search": "graph branches, hot kernel without PDL instructions or search (mode 20)",
    "hot_exit_search": "hot launch alone, search only to leave (mode 21; diagnostic)",
    "branches_exit_search": "graph branches, hot kernel searching only to leave (mode 22)",
    "fix_stop": "shipped split, hot kernel stops at its last tile (mode 23)",
    "branches_stop": "graph branches, hot kernel stops at its last tile (mode 24)",
    "fix_stop_both": "shipped split, both kernels stop at their last tile (mode 25)",
    "branches_stop_both": "graph branches, both kernels stop at their last tile (mode 26)",
    "branches_exit_stop": "graph branches, both stop, hot searching only to leave (mode 27)",
    "fix_exit_stop": "shipped split, both stop, hot searching only to leave (mode 28)",
    "before_stop": "class kernels as shipped until 2026-12-06: no stop, start at tile (mode 29)",
    "always_jump": "stop at the last tile, always start at the tile (mode 30)",
    "always_walk": "stop at the last tile, always walk from the first group (mode 31)",
    "no_stop": "the series' start rule without the stop (mode 32)",
}


def explore_labels(res: dict) -> dict[str, str]:
    """Column names of an --explore run (its `fix` is the series it was run on)."""
    label = NAMES | EXPLORE_NAMES
    if res.get("series") == "shipped" and res.get("series_kind") == "classes":
        label = label | {"fix": "shipped whole-expert tiles (0001 + 0002)"}
    if res.get("series") == "shipped" and res.get("series_kind") == "hot_first":
        label = label | {"fix": "shipped hot-first (0001 + 0002)"}
    return label


def explore_section(path: Path) -> list[str]:
    res = json.loads(path.read_text())
    vs = [v for v in res["ab"][0]["speedups"]]
    label = explore_labels(res)
    out = [
        f"`{res['command']}`",
        "",
        "| routing | tokens | " + " | ".join(label.get(v, v) for v in vs) + " |",
        "|---|---:|" + "---:|" * len(vs),
    ]
    for r in res["ab"]:
        # A diagnostic version's speedup where its output was incomplete times less work.
        short = {v for v, e in r.get("diagnostic_rel_err", {}).items() if not e < 1e-2}
        out.append(
            f"| {r['routing']} | {r['tokens']} | "
            + " | ".join("incomplete" if v in short else f"{r['speedups'][v]:.3f}" for v in vs)
            + " |"
        )
    if any("diagnostic_rel_err" in r for r in res["ab"]):
        out += ["", "Speedup over stock, each case's second run where it had one (under 0.98x "
                "for the series); \"incomplete\": the diagnostic's output missed rows (the cold "
                "class had some), so its time is not comparable."]  # fmt: skip
    return out


def kernel_key(key: str) -> str:
    """A profiled kernel's key (harness.kernel_kind + "#" + its order) with FlashInfer's grouped
    activation quantization (scale_1x128_kernel) called what it does."""
    kind, _, order = key.rpartition("#")
    return ("quantize" if "scale_1x128" in kind else kind) + "#" + order


PROFILE_HOW = (
    "At the rank the series is slowest on, in us: event = the A/B's CUDA-event median (each "
    "replay timed alone); loop = 20 replays back to back (the next replay's launch hidden); span "
    "= busy + idle, from torch's profiler over 20 replays: time some kernel runs, and the gaps "
    "between kernels inside the graph; each kernel by kind and order (regular#0: the first "
    "regular-kernel launch, FC1's; #1: FC2's)."
)


def profile_section(res: dict, label: dict[str, str]) -> list[str]:
    """run.py --profile's rows: per case and version, at the rank the series is slowest on, the
    A/B's CUDA-event median, back-to-back replays, and the profiler's span, busy and idle time
    and each kernel (us)."""
    out = [
        "| routing | tokens | rank | version | event | loop | span | busy | idle | kernels |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["ab"]:
        pr = r.get("profile") or {}
        for v, s in pr.get("versions", {}).items():
            if s.get("uneven"):
                trace = f"| | | | {s['kernels_seen']} kernels in {s['replays']} replays (uneven)"
            else:
                trace = (
                    f"| {s['span_us']:.1f} | {s['busy_us']:.1f} | {s['idle_us']:.1f} | "
                    + ", ".join(f"{kernel_key(k)} {x['us']:.1f}" for k, x in s["kernels"].items())
                )
            out.append(
                f"| {r['routing']} | {r['tokens']} | {pr['rank']} | {label.get(v, v)} | "
                f"{s['event_us']:.1f} | {s['loop_us']:.1f} {trace} |"
            )
    return out


def fused_section(folder: Path, cand: dict, tag: str) -> list[str]:
    """The fused-op A/B and FlashInfer's tests of the run's candidate module (cand: CANDIDATES;
    tag: the GPU the folder's files are named for)."""
    f = folder / f"fused_{tag}.json"
    if not f.exists():
        return []
    res = json.loads(f.read_text())
    rows = res["ab"]
    over = [r for r in rows if not r["ok"]]
    errs = ", ".join(f"{r['max_rel_err']:.1e}" for r in over)
    out = [
        f"FlashInfer {res['device']['flashinfer']}'s own `cutlass_fused_moe(..., "
        "use_deepseek_fp8_block_scale=True)` on every EP8 rank (permute, FC1, SwiGLU + FP8 "
        "requantization, FC2, finalize), the reduced module built from "
        + (
            f"the candidate series (`VLLM_H20_PATCH_SERIES={cand['series']}`)"
            if cand["series"]
            else "the shipped series"
        )
        + " against the one built from "
        "FlashInfer's own sources; same method as the kernel-level run.",
        "",
        f"- Outputs: the {cand['short']} module's are bit-identical to the unpatched module's in "
        f"{sum(r['bit_identical'] for r in rows)} of {len(rows)} cases (every rank).",
        f"- Against the fp32 reference (tolerance 2e-2, the patch test's): {len(rows) - len(over)} "
        f"of {len(rows)} cases pass"
        + (
            f"; {names(over)} exceeds it ({errs}) in both modules alike, their outputs being "
            "identical: the reference's FP8 requantization, not the kernel choice"
            if over
            else ""
        )
        + ".",
        f"- {cand['short'].capitalize()} over stock: {min(r['speedup'] for r in rows):.2f}x to "
        f"{max(r['speedup'] for r in rows):.2f}x; {len([r for r in rows if r['speedup'] < 0.98])} "
        "cases under 0.98x.",
    ]
    for log in sorted(folder.glob("fused_tests_*.log")):
        last = log.read_text().strip().splitlines()[-1].strip("= ")
        module = cand["short"] if "_per_expert_" in log.name else "stock"
        out.append(f"- `{log.name}` ({module} module): {last}")
    out += [
        "",
        f"| routing | tokens | stock ms | {cand['short']} ms | speedup | A/A | bit-identical | "
        "max rel err | check |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['routing']} | {r['tokens']} | {r['stock_s'] * 1e3:.3f} | "
            f"{r['fix_s'] * 1e3:.3f} | {r['speedup']:.2f}x | {r['aa_ratio']:.3f} | "
            f"{'yes' if r['bit_identical'] else 'no'} | {r['max_rel_err']:.1e} | "
            f"{'ok' if r['ok'] else 'over tolerance'} |"
        )
    return out


# ----------------------------------------------------------------------------- model


def fit_run(res: dict) -> tuple[dict, int]:
    """The model's kernel fits on a 132-SM run (H200 or H100): regular and swap-A/B from the
    single-launch versions (stock, average-only) and the forced sweep; for the fitted-tile
    candidate, fitted from its runs (its launches are single too)."""
    sms = res["device"]["sms"]
    fitted = kind_of(res) == "fitted"
    samples: dict[str, list] = {"regular": [], "swap_ab": [], "fitted": []}
    second = []  # the whole-expert plan's launches and times, for its second launch's c0
    second_prev = []  # one-launch, graph-branch runs: the shipped plan's (prev), on their own
    for r in res["ab"]:
        slots = cases.route(r["routing"], r["tokens"])
        for rank in range(cases.EP):
            counts = cases.rank_counts(slots, rank)
            for v, version in (("stock", "stock"), ("avg", "avg")):
                path, terms = model.rank_terms(counts, r["tokens"], version, sms)
                samples[path].append((terms, r[f"{v}_rank_median_s"][rank]))
            if fitted:
                ((path, terms),) = model.candidate_launches(counts, r["tokens"])
                samples[path].append((terms, r["fix_rank_median_s"][rank]))
            else:
                kind = kind_of(res)
                plan = model.row_class_launches(counts, r["tokens"], sms, kind != "classes",
                                                one_launch=kind == "one_launch",
                                                branch=kind == "branches")  # fmt: skip
                second.append((plan, r["fix_rank_median_s"][rank]))
                if kind in ("one_launch", "branches"):  # prev: the shipped series' launches
                    plan = model.row_class_launches(counts, r["tokens"], sms, True)
                    second_prev.append((plan, r["prev_rank_median_s"][rank]))
    for c in res["calibration"]:
        shape = next(s for s in cases.SHAPES if s.name == c["gemm"])
        counts = np.full(cases.LOCAL, c["m"])
        for path in ("regular", "swap_ab"):
            samples[path].append(
                ([model.gemm_terms(counts, shape, c["m"], path, sms)], c[f"{path}_s"])
            )
        if fitted:
            samples["fitted"].append(
                ([model.fitted_terms(counts, shape, fit_n(c["m"]))], c["fitted_s"])
            )
    fits = {p: model.fit(s) for p, s in samples.items() if s}
    if second:  # the second launch's fixed cost, from this series' own runs
        fits = model.fit_second(fits, second)
    if second_prev:
        fits = model.fit_second(fits, second_prev)
    return fits, sum(len(s) for s in samples.values())


def carried_to_h20(
    res: dict, folder: Path, fits: dict, tag: str
) -> tuple[float, float, float, float, dict]:
    """The run's fits carried to H20 and calibrated to the seed: the fused op's other kernels
    (permute, SwiGLU + requantization, finalize: the fused op's stock time over the kernel-level
    stock time at uniform 288 tokens, both on the run's GPU) on that GPU and on H20 (s), the
    tensor rate and bandwidth that reproduce the seed's uniform-288 times, and the H20 fits
    (tag: the GPU the folder's files are named for, tag_of)."""
    fused = json.loads((folder / f"fused_{tag}.json").read_text())
    f288 = next(r for r in fused["ab"] if (r["routing"], r["tokens"]) == ("uniform", 288))
    k288 = next(r for r in res["ab"] if (r["routing"], r["tokens"]) == ("uniform", 288))
    overhead_gpu = f288["stock_s"] - k288["stock_s"]
    overhead = overhead_gpu * HBM_TBPS[tag] / H20_TBPS
    tc, bw = model.calibrate_to_seed(fits, overhead, H20_SMS)
    return overhead_gpu, overhead, tc, bw, model.on_device(fits, tc, bw)


def model_section(res: dict, folder: Path, tag: str) -> list[str]:
    sms = res["device"]["sms"]
    fits, n = fit_run(res)
    ab = {(r["routing"], r["tokens"]): r for r in res["ab"]}
    plan = kind_of(res)
    err = {v: [] for v in ("stock", "avg", prev_plan(plan), plan)}
    column = {"stock": "stock", "avg": "avg", prev_plan(plan): "prev", plan: "fix"}
    for (routing, tokens), r in ab.items():
        for v in err:
            pred = model.slowest_rank(fits, routing, tokens, v, sms)
            err[v].append(pred / r[f"{column[v]}_s"] - 1)
    overhead_gpu, overhead, tc, bw, h20 = carried_to_h20(res, folder, fits, tag)
    out = [
        "Per grouped GEMM `t = c0 + max((weights + r * re-reads) / bw, padded MMA flops / tc)`, "
        "fitted per kernel on this run's single-launch measurements (each rank's median; "
        f"{n} points): regular and swap-A/B on stock, average-only and the forced sweep; "
        + (
            "fitted on the candidate's runs and its forced sweep. The shipped per-expert plan "
            "(two launches) is predicted out of sample."
            if plan == "fitted"
            else "the shipped hot-first plan (`prev`) and this series (`fix`) from those fits, "
            f"but for the fixed cost of the cold class's launch (`{model.SWAP_SECOND}`, fitted "
            "on `prev`'s runs) and of its share of the one launch "
            f"(`{model.IN_ONE_LAUNCH}`, fitted on `fix`'s runs)."
            if plan == "one_launch"
            else "the shipped hot-first plan (`prev`) and this series (`fix`) from those fits, "
            f"but for the fixed cost of the cold class's launch: behind the hot one "
            f"(`{model.SWAP_SECOND}`, fitted on `prev`'s runs) and on a parallel graph branch "
            f"(`{model.IN_BRANCH}`, fitted on `fix`'s runs)."
            if plan == "branches"
            else "the previous per-expert plan (`prev`, one or two launches per GEMM, each "
            "paying its c0) is predicted out of sample; this series' (`fix`) too, but for the "
            "fixed cost of its second launch (`"
            + (model.SWAP_SECOND if plan == "hot_first" else model.SECOND)
            + "`: that kernel's rates, its c0 fitted on this series' runs, where that launch "
            "overlaps the first)."
        ),
        "",
        "| kernel | bw (TB/s) | tc (TFLOP/s, padded work) | r | c0 (us) |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {p} | {f.bw / 1e12:.2f} | {f.tc / 1e12:.0f} | {f.r:.2f} | {f.c0 * 1e6:.1f} |"
            for p, f in fits.items()
        ],
        "",
        "Model against the 132-SM measurements (slowest rank, all cases), median |error| and the "
        "worst: "
        + "; ".join(
            f"{column[v]} {pct(float(np.median(np.abs(e))))} "
            f"(worst {pct(float(np.max(np.abs(e))))})"
            for v, e in err.items()
        )
        + ".",
        "",
        "### Carried to H20, calibrated to the seed",
        "",
        "H20 is built tensor-bound: every kernel is given one tensor rate `tc` and one bandwidth "
        "`bw` (each kernel's c0 and re-read share kept), and the fused op's other kernels cost "
        f"{overhead_gpu * 1e6:.0f} us on the {tag.upper()} (fused stock minus kernel-level stock "
        f"at uniform 288 tokens, this run's files), {overhead * 1e6:.0f} us on H20 (scaled by the "
        f"datasheet bandwidths, {HBM_TBPS[tag]} / {H20_TBPS} TB/s). `tc` and `bw` are the two "
        "values that reproduce the seed's uniform-288 stock (1.808 ms, compute-bound) and "
        "average-only (0.564 ms, bandwidth-bound) times on 78 SMs: "
        f"**tc {tc / 1e12:.0f} TFLOP/s ({100 * tc / 296e12:.0f} % of the 296 datasheet), bw "
        f"{bw / 1e12:.2f} TB/s ({100 * bw / 4.0e12:.0f} % of 4.0)**. The seed's two other numbers "
        "are then predictions:",
        "",
        "| case | stock ms | average-only ms | speedup predicted | seed (8xH20, fused op) | "
        "off by |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for routing, tokens, st, ratio in SEED:
        s = model.slowest_rank(h20, routing, tokens, "stock", H20_SMS) + overhead
        x = model.slowest_rank(h20, routing, tokens, "avg", H20_SMS) + overhead
        seed = 1.808 / 0.564 if st else ratio
        tag = " (fitted to)" if st else ""
        out.append(
            f"| {routing} {tokens} | {s * 1e3:.3f} | {x * 1e3:.3f} | {s / x:.2f}x | "
            f"{seed:.2f}x{tag} | {100 * (s / x / seed - 1):+.0f} % |"
        )
    out += ["", *h20_cases(res, h20, overhead), ""]
    if plan == "hot_first":
        out += [*why.model_section(h20, res, overhead), ""]
    out += ep16_section(h20, overhead, plan)
    return out


PLAN_LABELS = {
    "split": "shipped per-expert",
    "fitted": "fitted tiles",
    "classes": "whole-expert tiles",
    "hot_first": "hot-first",
    "one_launch": "one launch",
    "branches": "graph branches",
}
# Plans whose run calls the estimated-row-class plan (split) the previous one.
AFTER_SPLIT = ("classes", "hot_first")


def plan_names(plan: str) -> dict[str, str]:
    """PLAN_LABELS as a run of `plan` names the plans it is compared with."""
    if plan in ("one_launch", "branches"):
        return PLAN_LABELS | {"hot_first": "shipped hot-first"}
    return PLAN_LABELS | ({"split": "previous per-expert"} if plan in AFTER_SPLIT else {})


def h20_cases(res: dict, h20: dict, overhead: float) -> list[str]:
    """Every case of the run on the H20 model: each plan's speedup, the ones short of the best."""
    plan = kind_of(res)
    prev, names = prev_plan(plan), plan_names(plan)
    out = [
        "### Predicted on H20 (EP8, 50 local experts, fused op), every case",
        "",
        "Speedup over stock of each plan, and in bold where a plan is more than 2 % below "
        "max(stock, average-only):",
        "",
        f"| routing | tokens | stock ms | average-only | {names[prev]} | {names[plan]} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    below = {prev: [], plan: []}
    for r in res["ab"]:
        t = {
            v: model.slowest_rank(h20, r["routing"], r["tokens"], v, H20_SMS) + overhead
            for v in ("stock", "avg", prev, plan)
        }
        best = min(t["stock"], t["avg"])
        cells = []
        for v in ("avg", prev, plan):
            text = f"{t['stock'] / t[v]:.2f}x"
            if v != "avg" and best / t[v] < 0.98:
                below[v].append(f"{r['routing']} {r['tokens']}")
                text = f"**{text}**"
            cells.append(text)
        out.append(
            f"| {r['routing']} | {r['tokens']} | {t['stock'] * 1e3:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    out += [
        "",
        f"Below 0.98x of max(stock, average-only) on the model: {names[prev]} "
        f"{len(below[prev])} of {len(res['ab'])} cases ({', '.join(below[prev]) or 'none'}); "
        f"{names[plan]} {len(below[plan])} ({', '.join(below[plan]) or 'none'}).",
        "",
        "Not modelled: wave quantization beyond the tile choice, L2 hits of re-reads beyond the "
        "fitted share r, "
        + (
            "the fitted kernel's per-SM overhead that the compute-matched emulations "
            "show (it is fitted at 132 SMs, where it barely shows)."
            if plan == "fitted"
            else "a second launch overlapping the first (each launch is charged in full)."
        ),
    ]
    return out


def ep16_section(h20: dict, overhead: float, plan: str = "fitted") -> list[str]:
    """Two nodes (recipes/deepseek-v41-flash-fp8-2node-tp8dp2ep16.yaml) beside one, on the
    calibrated H20 model: EP16 puts 25 of the 400 slots on each rank, and the MoE layer of every
    rank sees both data-parallel replicas' tokens of a step (allgather_reducescatter), so a
    replica's step of S tokens is 2 S rows; the expected rows per expert stay 6 x rows / 400."""
    prev = prev_plan(plan)
    split = plan_names(plan)[prev]
    out = [
        "### Two nodes: EP16 beside EP8 (predicted on H20)",
        "",
        "One node = `deepseek-v41-flash-fp8-tp8ep8` (EP8, 50 slots per rank, the MoE layer sees "
        "the node's step); two nodes = `deepseek-v41-flash-fp8-2node-tp8dp2ep16` (EP16, 25 "
        "slots per rank, every rank sees both replicas' steps: 2 x the step's tokens). Slowest "
        "rank's FC1 + FC2 plus the fused op's other kernels; speedups over stock:",
        "",
        "| layout | routing | step tokens per replica | MoE rows | average rows per expert "
        f"| stock ms | average-only | {split} | {PLAN_LABELS[plan]} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, ep, dp in (("1 node, EP8", 8, 1), ("2 nodes, EP16", 16, 2)):
        for routing in ("uniform", "eplb", "trained", "same_spread"):
            for step in (64, 128, 256, 512):
                rows = step * dp
                t = {v: model.slowest_rank(h20, routing, rows, v, H20_SMS, ep) + overhead
                     for v in ("stock", "avg", prev, plan)}  # fmt: skip
                avg = max(1, -(-rows * cases.TOP_K // cases.SLOTS))
                out.append(f"| {label} | {routing} | {step} | {rows} | {avg} | "
                           f"{t['stock'] * 1e3:.3f} | "
                           + " | ".join(f"{t['stock'] / t[v]:.2f}x"
                                        for v in ("avg", prev, plan)) + " |")  # fmt: skip
    return out


# ----------------------------------------------------------------------------- plot


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    label = labels(res)
    routings = [r for r in cases.ALL_ROUTINGS if any(x["routing"] == r for x in res["ab"])]
    fig, axes = plt.subplots(
        2,
        (len(routings) + 1) // 2,
        figsize=(4 * ((len(routings) + 1) // 2), 7),
        sharey=True,
        squeeze=False,
    )
    for ax, routing in zip(axes.flat, routings, strict=False):
        rows = [r for r in res["ab"] if r["routing"] == routing]
        t = [r["tokens"] for r in rows]
        for v, style in (("avg", ":"), ("prev", "--"), ("fix", "-"), ("split", "-.")):
            if v in rows[0]["speedups"]:
                ax.plot(t, [r["speedups"][v] for r in rows], style, marker=".", label=label[v])
        ax.axhline(1, color="k", lw=0.8)
        ax.axhline(0.98, color="k", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(routing, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("speedup over stock")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        f"FC1 + FC2 grouped GEMMs, slowest of 8 EP ranks, {res['device']['name']}: "
        "tokens per step on x",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- main


def _header(res: dict, versions: list[str], tag: str) -> list[str]:
    """The run's title, device, command, columns, method and routings."""
    d = res["device"]
    cand, label = candidate_of(res), labels(res)
    aa_rows = [r for r in res["ab"] if "aa_ratio" in r]
    aa = [abs(r["aa_ratio"] - 1) for r in aa_rows]
    worst_aa = max(aa_rows, key=lambda r: abs(r["aa_ratio"] - 1))
    return [
        f"# Concentrated routing on one {tag.upper()}: {cand['title']}",
        "",
        f"- Device: {d['nvidia_smi']}; {d['sms']} SMs; torch {d['torch']}, CUDA {d['cuda']}; "
        f"DeepGEMM and `fp8_blockscale_gemm.cu` from {d['flashinfer_sources']}.",
        f"- Kernel-level command: `{res['command']}` (kernel_{tag}.json, kernel_{tag}.log); "
        f"copy bandwidth {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, FP8 8192^3 GEMM "
        f"{res['fp8_tflops_measured']:.0f} TFLOP/s, measured in the same run.",
        "- Columns: "
        + "; ".join(f"**{label[v]}** (`{v}`)" for v in ["stock", *versions])
        + ". "
        + cand.get(
            "built",
            f"The run built `patches/flashinfer/{cand.get('series')}` as the "
            "patched series (then the shipped one), so `fix` is the candidate and `prev` "
            "the shipped plan, run from the calibration build with the shipped rule "
            f"({cand.get('prev_kernels')}).",
        )
        + f" Reproduce: {cand['reproduce']}.",
        f"- Method: FC1 (N 4608, K 5120) + FC2 (N 5120, K 2304) of all 8 EP ranks of "
        "DeepSeek-V4.1-Flash (50 of 400 slots, top-6) on one GPU, CUDA graphs, 5 warm-ups and "
        f"24 samples, per sample the slowest rank, the median; {len(res['ab'])} cases "
        f"({len({r['routing'] for r in res['ab']})} routings x "
        f"{len({r['tokens'] for r in res['ab']})} token counts); every rank's "
        "output of every version checked against an fp32 reference (1e-2) and the others; a "
        "case where the candidate was under 0.98x stock was run again and the second run "
        "kept (the first in its own column). A/A (the candidate timed twice): median "
        f"{pct(statistics.median(aa))}, at most {pct(max(aa))} ({worst_aa['routing']} "
        f"{worst_aa['tokens']}, a {worst_aa['stock_s'] * 1e3:.3f} ms op).",
        "- Routings (benchmarks/moe_dispatch/cases.py): the original four (uniform, zipf s=1.2, "
        "hot, eplb) and the concentrated ones: same_rank / same_spread (every token on the same "
        "six experts, on one rank / one per rank: identical requests under greedy decoding), "
        "pool8 / pool16 (top-6 from a hot pool), zipf2 (s=2), trained (slot popularity drawn "
        "from the expert loads of DeepSeek's EPLB README example).",
        "",
    ]


def profiled(res: dict) -> bool:
    """Whether a run was made with --profile (some case has a traced version)."""
    return any((r.get("profile") or {}).get("versions") for r in res["ab"])


def explore_only(folder: Path, tag: str) -> str:
    """A folder of explore runs alone (no kernel-level A/B): each run's table and profile."""
    out = []
    for f in sorted(folder.glob(f"explore_*_{tag}.json")):
        res = json.loads(f.read_text())
        dev = res["device"]
        out += [f"## Explored: `{f.name}`", "",
                f"{dev['name']} ({dev['sms']} SMs; torch {dev['torch']}, CUDA {dev['cuda']}), "
                f"{dev['flashinfer_sources']}, series `{res['series']}`.", "",
                *explore_section(f), ""]  # fmt: skip
        if profiled(res):
            out += [f"### Where the time goes: `{f.name}` (--profile)", "", PROFILE_HOW, "",
                    *profile_section(res, explore_labels(res)), ""]  # fmt: skip
    return "\n".join(out)


def render(folder: Path, tag: str) -> str:
    if not (folder / f"kernel_{tag}.json").exists():
        return explore_only(folder, tag)
    res = json.loads((folder / f"kernel_{tag}.json").read_text())
    label = labels(res)
    versions = [v for v in ("avg", "prev", "fix", "split") if v in res["ab"][0]["speedups"]]
    out = [
        *_header(res, versions, tag),
        "## Summary",
        "",
        "Geometric mean of the speedup over stock (worst case in brackets):",
        "",
        *class_table(res["ab"], versions, label),
        "",
        *bars_table(res["ab"], versions, label),
        "",
        "## Every case",
        "",
        *case_table(res, versions),
        "",
        f"![speedups](kernel_{tag}.png)",
        "",
    ]
    if res.get("calibration"):
        out += [
            "## The kernels at forced rows per expert",
            "",
            "Every expert m rows, one launch of one kernel, tiles sized for m"
            + (
                " (fitted: widest tile m rounded up to 16, at most 128):"
                if "fitted_s" in res["calibration"][0]
                else ":"
            ),
            "",
            *calib_table(res["calibration"]),
            "",
        ]
    emu_file = folder / f"emulated_{tag}.json"
    if emu_file.exists():
        emu = json.loads(emu_file.read_text())
        out += [
            "## H20 emulations",
            "",
            f"`{emu['command']}` (emulated_{tag}.json): the calibration build plans tiles and "
            "the swap threshold for 78 SMs; its launches get 78, 40 or 20 CTAs. "
            + (
                candidate_of(emu)["emulated"]
                if "emulated" in candidate_of(emu)
                else "Stock, average-only, the shipped plan and the candidate."
                if any(
                    "prev" in e["ab"][0]["speedups"]
                    for e in emu.values()
                    if isinstance(e, dict) and e.get("ab")
                )
                else "Stock, average-only and the candidate only."
            ),
            "",
            *emulation_section(emu),
        ]
    for f in sorted(folder.glob(f"explore_*_{tag}.json")):
        out += [f"## Explored: `{f.name}`", "", *explore_section(f), ""]
    for f in [folder / f"kernel_{tag}.json", *sorted(folder.glob(f"explore_*_{tag}.json"))]:
        traced = json.loads(f.read_text())
        names = label if f.name.startswith("kernel_") else explore_labels(traced)
        if profiled(traced):
            out += [f"## Where the time goes: `{f.name}` (--profile)", "", PROFILE_HOW, "",
                    *profile_section(traced, names), ""]  # fmt: skip
    fused = fused_section(folder, candidate_of(res), tag)
    if fused:
        module = candidate_of(res).get("module", "candidate")
        out += [f"## Through FlashInfer's fused op ({module} module)", "", *fused, ""]
    if (folder / f"fused_{tag}.json").exists():
        out += ["## What H20 would do: the model", "", *model_section(res, folder, tag), ""]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    tag = tag_of(args.folder)
    text = render(args.folder, tag)
    head = args.folder / "NOTES.md"
    notes = head.read_text() if head.exists() else ""
    (args.folder / "README.md").write_text(notes + text)
    if not args.no_plot and (args.folder / f"kernel_{tag}.json").exists():
        plot(
            json.loads((args.folder / f"kernel_{tag}.json").read_text()),
            args.folder / f"kernel_{tag}.png",
        )
    print(f"wrote {args.folder / 'README.md'}")


if __name__ == "__main__":
    main()
