"""The user's decision (issue 1/4) as data: per workload, tier and arm the mean throughput with
its 95 % CI, and each FP8 arm against the release on Humming W4A8 (and the fix against stock),
paired run by run within a lease, from the sweeps of one or more published lease folders.

    python benchmarks/journey_h200/decision.py benchmarks/results/journey_h200/<lease>... \\
        --out benchmarks/results/journey_h200/<folder>

Each lease folder is what `serve_h200/report.py` rendered from a lease's tarball: `sweeps/<name>/`
(a `bench sweep` output of `decision-decode.yaml` or `decision-prefill.yaml`), `logs/` (the JIT
cache listings and `nvidia-smi.txt`). A run counts when its status is ok and no kernel was
compiled while it ran (`stalls.py`: such a run measured the compiler); the others are listed.
Arms are paired by (lease, run index): inside a lease every arm ran run r of a tier back to back,
so the pair shares the machine and its drift, and leases on other machines pool as blocks.
Writes `decision.json` (a list of `{workload, concurrency, arm, n, mean, ci_low, ci_high, unit}`
with the GPU and leases beside), `ratios.json` (each paired ratio with its CI and verdict, and
the runs left out) and `decision.md` (the table, beside the seed's 8xH20 numbers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import stalls  # noqa: E402

from vllm_h20._io import write_json_atomic  # noqa: E402
from vllm_h20.bench.stats import paired_ratio_ci, summarize, t975  # noqa: E402

# The journey's servers (servers.sh) and the arm each one is in the decision.
ARMS = {
    "v4hum": "humming_w4a8",
    "v4fix": "fp8_fix",
    "v4stock": "fp8_stock",
    "v4triton": "fp8_triton",
}
LABELS = {
    "humming_w4a8": "release, Humming W4A8",
    "fp8_fix": "conversion, FlashInfer CUTLASS + fix",
    "fp8_stock": "conversion, FlashInfer CUTLASS stock",
    "fp8_triton": "conversion, vLLM Triton FP8",
}
# (candidate, baseline) pairs the table reports.
RATIOS = (
    ("fp8_fix", "humming_w4a8"),
    ("fp8_stock", "humming_w4a8"),
    ("fp8_triton", "humming_w4a8"),
    ("fp8_fix", "fp8_stock"),
    ("fp8_triton", "fp8_fix"),
)
WORKLOADS = {"decision-decode": "decode", "decision-prefill": "prefill"}
UNITS = {"output": "output tok/s", "input": "input tok/s"}
# The seed's 8xH20 table (vLLM 0.30, GuideLLM 0.7.4, 3 runs per tier, whole recipe against whole
# recipe): Humming W4A8 -> tuned FP8 throughput, for the comparison column.
SEED = {
    ("decode", 1): (259, 235),
    ("decode", 8): (934, 1192),
    ("decode", 32): (1776, 2826),
    ("decode", 64): (2507, 4214),
    ("decode", 128): (3840, 5769),
    ("decode", 256): (4725, 6459),
    ("prefill", 1): (7675, 7123),
    ("prefill", 8): (9526, 13277),
    ("prefill", 32): (9845, 15060),
    ("prefill", 64): (9875, 15048),
}


class DecisionError(ValueError):
    """Input that cannot make a decision table; the message names the file."""


def _serve_report():
    """benchmarks/serve_h200/report.py, which renders the lease folders (loaded under its own
    name: other benchmark folders have a report.py too)."""
    spec = importlib.util.spec_from_file_location(
        "serve_h200_report", HERE.parent / "serve_h200" / "report.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_of(lease: Path) -> str:
    """The lease's GPU model as report.py reads it from collect's nvidia-smi.txt."""
    return _serve_report().gpu_of(lease / "logs" / "nvidia-smi.txt") or "unknown GPU"


def lease_runs(lease: Path) -> tuple[list[dict], list[dict]]:
    """(kept, excluded) runs of every decision sweep in one lease folder."""
    sweeps = lease / "sweeps"
    found = sorted(sweeps.glob("*/sweep.json")) if sweeps.is_dir() else []
    kept, excluded = [], []
    logs = lease / "logs"
    times = stalls.compile_times(logs)
    for manifest in found:
        try:
            spec = json.loads(manifest.read_text())["spec"]
            workload = WORKLOADS.get(spec["name"])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise DecisionError(f"{manifest}: not a sweep manifest ({e!r})") from None
        if workload is None:
            continue
        try:
            records = stalls.cells(manifest.parent)
        except ValueError as e:  # stalls names the run record
            raise DecisionError(str(e)) from None
        for r in records:
            arm = ARMS.get(r["target"])
            if arm is None:
                raise DecisionError(
                    f"{manifest.parent}: server {r['target']!r} is no arm of the decision "
                    f"({', '.join(ARMS)})"
                )
            row = {
                "lease": lease.name,
                "gpu": gpu_of(lease),
                "workload": workload,
                "unit": UNITS[spec["throughput"]],
                "concurrency": r["concurrency"],
                "arm": arm,
                "run": r["run"],
                "throughput": r.get("throughput"),
            }
            compiled = sum(r["started"] <= t <= r["finished"] for ts in times.values() for t in ts)
            if r["status"] != "ok" or row["throughput"] is None:
                excluded.append({**row, "why": f"status {r['status']}"})
            elif compiled:
                excluded.append({**row, "why": f"{compiled} kernel(s) compiled while it ran"})
            else:
                kept.append(row)
    if not found:
        raise DecisionError(f"{lease}: no sweeps/*/sweep.json (a lease folder report.py wrote)")
    return kept, excluded


def _mean_ci(values: list[float]) -> tuple[float, float | None, float | None]:
    s = summarize(values)
    if s.n < 2:
        return s.mean, None, None
    half = t975(s.n - 1) * (s.std or 0.0) / math.sqrt(s.n)
    return s.mean, s.mean - half, s.mean + half


def decide(rows: list[dict]) -> dict:
    """The decision's rows from kept runs: per (workload, tier, arm) n, mean and 95 % CI; per
    (workload, tier, pair of arms) the paired ratio with its CI; one GPU model per tier."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["workload"], r["concurrency"], r["arm"])].append(r)
    for (w, c, _arm), rs in cells.items():
        gpus = sorted({r["gpu"] for r in rs})
        if len(gpus) > 1:
            raise DecisionError(f"{w} c{c}: runs from {' and '.join(gpus)} do not pool")
    arms_out = []
    for (w, c, arm), rs in sorted(cells.items()):
        mean, lo, hi = _mean_ci([r["throughput"] for r in rs])
        arms_out.append({
            "workload": w, "concurrency": c, "arm": arm, "n": len(rs), "mean": mean,
            "ci_low": lo, "ci_high": hi, "unit": rs[0]["unit"], "gpu": rs[0]["gpu"],
            "leases": sorted({r["lease"] for r in rs}),
        })  # fmt: skip
    ratios = []
    tiers = sorted({(w, c) for (w, c, _a) in cells})
    for w, c in tiers:
        for cand, base in RATIOS:
            a = {(r["lease"], r["run"]): r["throughput"] for r in cells.get((w, c, cand), [])}
            b = {(r["lease"], r["run"]): r["throughput"] for r in cells.get((w, c, base), [])}
            keys = sorted(set(a) & set(b))
            if len(keys) < 2:
                continue
            ci = paired_ratio_ci([a[k] for k in keys], [b[k] for k in keys])
            ratios.append({
                "workload": w, "concurrency": c, "arm": cand, "baseline": base, "n": ci.n,
                "ratio": ci.ratio, "ci_low": ci.low, "ci_high": ci.high,
                "verdict": verdict(ci.low, ci.high, cand, base),
            })  # fmt: skip
    return {"arms": arms_out, "ratios": ratios}


def verdict(low: float, high: float, cand: str, base: str) -> str:
    """Which arm a user should pick on this evidence: the faster one when the 95 % CI of the
    ratio excludes 1, else "not resolved"."""
    if low > 1.0:
        return cand
    if high < 1.0:
        return base
    return "not resolved"


def _pct(x: float) -> str:
    return f"{100 * (x - 1):+.1f} %"


def render(dec: dict, excluded: list[dict]) -> str:
    """decision.md: per workload the seed's table shape (Humming W4A8 -> FP8 + fix, change) with
    this run's CIs, the seed's 8xH20 numbers beside them, and the pick."""
    arms = {(a["workload"], a["concurrency"], a["arm"]): a for a in dec["arms"]}
    ratios = {(r["workload"], r["concurrency"], r["arm"], r["baseline"]): r for r in dec["ratios"]}
    out = []
    for w in ("decode", "prefill"):
        tiers = sorted({c for (ww, c, _a) in arms if ww == w})
        if not tiers:
            continue
        unit = next(a["unit"] for a in dec["arms"] if a["workload"] == w)
        out += [
            f"### {w.capitalize()} ({unit}, mean and 95 % CI of n runs)",
            "",
            "| tier | humming_w4a8 | fp8_fix | fix vs Humming (95 % CI) | fp8_stock "
            "| fix vs stock (95 % CI) | seed 8xH20: Humming -> FP8 | pick |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in tiers:
            cell = []
            for arm in ("humming_w4a8", "fp8_fix"):
                cell.append(_arm_cell(arms.get((w, c, arm))))
            fh = ratios.get((w, c, "fp8_fix", "humming_w4a8"))
            cell.append(_ratio_cell(fh))
            cell.append(_arm_cell(arms.get((w, c, "fp8_stock"))))
            cell.append(_ratio_cell(ratios.get((w, c, "fp8_fix", "fp8_stock"))))
            seed = SEED.get((w, c))
            cell.append(f"{seed[0]:,} -> {seed[1]:,} ({_pct(seed[1] / seed[0])})" if seed else "-")
            cell.append(fh["verdict"] if fh else "not measured")
            out.append(f"| c{c} | " + " | ".join(cell) + " |")
        out.append("")
    tri = [r for r in dec["ratios"] if r["arm"] == "fp8_triton"]
    if tri:
        out += ["### vLLM's Triton FP8 MoE on the conversion", "",
                "| workload | tier | against | n | ratio (95 % CI) | faster |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for r in tri:
            out.append(
                f"| {r['workload']} | c{r['concurrency']} | {r['baseline']} | {r['n']} | "
                f"{_ratio_cell(r)} | {r['verdict']} |"
            )
        out.append("")
    if excluded:
        out += ["### Runs left out", "", "| lease | workload | tier | arm | run | why |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for e in excluded:
            out.append(
                f"| {e['lease']} | {e['workload']} | c{e['concurrency']} | {e['arm']} | "
                f"{e['run'] + 1} | {e['why']} |"
            )
        out.append("")
    return "\n".join(out)


def _arm_cell(a: dict | None) -> str:
    if a is None:
        return "not run"
    if a["ci_low"] is None:
        return f"{a['mean']:,.0f} (n 1)"
    return f"{a['mean']:,.0f} [{a['ci_low']:,.0f}, {a['ci_high']:,.0f}] (n {a['n']})"


def _ratio_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{_pct(r['ratio'])} [{_pct(r['ci_low'])}, {_pct(r['ci_high'])}] (n {r['n']})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("leases", type=Path, nargs="+", help="lease folders report.py rendered")
    ap.add_argument("--out", type=Path, required=True, help="where decision.json/.md go")
    a = ap.parse_args(argv)
    rows, excluded = [], []
    try:
        for lease in a.leases:
            k, e = lease_runs(lease)
            rows += k
            excluded += e
        if not rows:
            raise DecisionError(
                f"no kept run in {', '.join(map(str, a.leases))}: nothing to decide from"
            )
        dec = decide(rows)
    except DecisionError as e:
        print(f"decision: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.out / "decision.json", dec["arms"])
    write_json_atomic(
        a.out / "ratios.json",
        {"ratios": dec["ratios"], "excluded": excluded, "leases": [p.name for p in a.leases]},
    )
    md = render(dec, excluded)
    (a.out / "decision.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
