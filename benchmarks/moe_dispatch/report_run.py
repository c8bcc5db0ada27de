"""Render one run folder of the kernel-level A/B into its README.md and plot, from its files.

    python benchmarks/moe_dispatch/report_run.py benchmarks/results/moe_dispatch/<run> \\
        [--title "..."]

Reads the run's JSON (run.py's moe_dispatch.json; the runs before the spec was written into
it: kernel_<dev>.json) and, where present, a re-run of some cases (rerun_<dev>.json) and the
H20 emulations (emulated_<dev>.json, or inside the run's JSON). Version labels, families and
the bar's versions come from the JSON itself (its `spec`); a run without one gets its column
names as labels and the default family. Every number in the README is read from those files.
CPU only (numpy, matplotlib).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases  # noqa: E402

BAR, NEAR = 0.98, 0.97
TOKEN_BANDS = ((1, 127), (128, 2048), (2049, 1 << 30))
RESAMPLES = 2000


def read_json(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def first(folder: Path, *patterns: str) -> Path | None:
    for p in patterns:
        found = sorted(folder.glob(p))
        if found:
            return found[0]
    return None


class Run:
    """One run's rows and what the JSON says about them (with defaults for older runs)."""

    def __init__(self, doc: dict, name: str):
        self.doc, self.name = doc, name
        spec = doc.get("spec", {})
        self.rows = [r for r in doc.get("ab", []) if "speedups" in r]
        self.failed = [r for r in doc.get("ab", []) if "speedups" not in r]
        names = [v["name"] for v in spec.get("versions", [])] or list(doc.get("versions", {}))
        if not names and self.rows:
            names = [n[:-2] for n in self.rows[0] if n.endswith("_s") and n[:-2] + "_rank_median_s"
                     in self.rows[0]]  # fmt: skip
        self.versions = names
        self.labels = {v["name"]: v["label"] for v in spec.get("versions", [])}
        self.labels |= {n: n for n in names if n not in self.labels}
        self.lead = spec.get("lead", "fix")
        self.also = spec.get("also_beat", "avg")
        fams = {f["name"]: f for f in spec.get("families", [])}
        self.families = fams or {
            cases.V41_EP8.name: {**vars(cases.V41_EP8), "local": cases.V41_EP8.local}
        }
        default = next(iter(self.families))
        for r in self.rows + self.failed:
            r.setdefault("model", default)
            f = self.families[r["model"]]
            r.setdefault("rows_per_expert", r["tokens"] * f["top_k"] / f["slots"])

    def of(self, model: str) -> list[dict]:
        return [r for r in self.rows if r["model"] == model]


def gm(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def near(r: dict, lead: str, also: str) -> float:
    """The lead's speedup over max(baseline, also_beat): the bar's second half."""
    return r["speedups"][lead] / max(1.0, r["speedups"].get(also, 1.0))


def bar_table(run: Run, reruns: dict) -> list[str]:
    """Per family: cases, the lead at >= 0.98x, within 3 % of the best of baseline and
    also_beat, its worst case, uniform 128-2,048 tokens, every check."""
    lead, also = run.lead, run.also
    out = [
        f"| family | cases | {lead} >= {BAR}x | within 3 % of max(baseline, {also}) | "
        f"worst {lead} (case) | uniform 128-2,048 | checks |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in run.families:
        rows = run.of(model)
        if not rows or lead not in rows[0]["speedups"]:
            continue
        worst = min(rows, key=lambda r: r["speedups"][lead])
        uni = [r["speedups"][lead] for r in rows
               if r["routing"] == "uniform" and 128 <= r["tokens"] <= 2048]  # fmt: skip
        ok = sum(r["ok"] for r in rows)
        under = [r for r in rows if r["speedups"][lead] < BAR]
        again = sum(reruns.get((model, r["routing"], r["tokens"]), 0) >= BAR for r in under)
        out.append(f"| {model} | {len(rows)} | {len(rows) - len(under)}"
                   + (f" (+{again} on a re-run)" if again else "")
                   + f" | {sum(near(r, lead, also) >= NEAR for r in rows)} | "
                   f"{worst['speedups'][lead]:.3f}x ({worst['routing']} {worst['tokens']}) | "
                   + (f"{min(uni):.2f}-{max(uni):.2f}x" if uni else "-")
                   + f" | {ok}/{len(rows)}{'' if ok == len(rows) else ' FAILED'} |")  # fmt: skip
    return out


def paired_ci(rows: list[dict], lead: str, also: str, seed: int = 0) -> tuple[float, ...]:
    """Geometric mean over `rows` of also's median time / lead's (> 1: lead faster), with a
    95 % two-level bootstrap CI: each case's samples of both versions, then the cases."""
    rng = np.random.default_rng(seed)
    point, boot = [], np.empty((len(rows), RESAMPLES))
    for i, r in enumerate(rows):
        a, b = (np.asarray(r[f"{v}_samples_slowest_s"]) for v in (also, lead))
        point.append(math.log(np.median(a) / np.median(b)))
        boot[i] = np.log(np.median(rng.choice(a, (RESAMPLES, len(a))), axis=1)
                         / np.median(rng.choice(b, (RESAMPLES, len(b))), axis=1))  # fmt: skip
    cs = rng.integers(0, len(rows), (RESAMPLES, len(rows)))
    stats = boot[cs, np.arange(RESAMPLES)[:, None]].mean(axis=1)
    lo, hi = np.exp(np.percentile(stats, [2.5, 97.5]))
    return math.exp(np.mean(point)), float(lo), float(hi)


def paired_table(run: Run) -> list[str]:
    """The lead against also_beat where both were timed in this run, per family and routing
    class: a difference whose CI holds 1 is not resolved."""
    lead, also = run.lead, run.also
    if not run.rows or f"{also}_samples_slowest_s" not in run.rows[0]:
        return []
    out = ["", f"## `{lead}` against `{also}`, same run", "",
           f"Geometric mean over the cases of `{also}`'s median time / `{lead}`'s (> 1: `{lead}`"
           f" faster), 95 % CI from a two-level bootstrap ({RESAMPLES} resamples of each case's "
           "samples, then of the cases).", "",
           f"| family | routing | cases | {also} / {lead} | 95 % CI | |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for model in run.families:
        for cls, members in (("balanced", cases.BALANCED), ("concentrated", cases.CONCENTRATED),
                             ("every case", cases.ALL_ROUTINGS)):  # fmt: skip
            sel = [r for r in run.of(model) if r["routing"] in members]
            if sel:
                g, lo, hi = paired_ci(sel, lead, also)
                verdict = "not resolved" if lo <= 1 <= hi else ("faster" if g > 1 else "slower")
                out.append(f"| {model} | {cls} | {len(sel)} | {g:.4f} | {lo:.4f}-{hi:.4f} | "
                           f"{verdict} |")  # fmt: skip
    under = [r for r in run.rows if min(r["speedups"][lead], r["speedups"][also]) < BAR]
    if under:
        out += ["", f"Cases where either is under {BAR}x of `{run.versions[0]}` (CI from the "
                "case's samples):", "", f"| case | {lead} | {also} | {also} / {lead} | 95 % CI |",
                "|---|---|---|---|---|"]  # fmt: skip
        for r in under:
            g, lo, hi = paired_ci([r], lead, also)
            sp = r["speedups"]
            out.append(f"| {r['model']} {r['routing']} {r['tokens']} | {sp[lead]:.3f}x | "
                       f"{sp[also]:.3f}x | {g:.4f} | {lo:.4f}-{hi:.4f} |")  # fmt: skip
    return out


def class_table(run: Run, model: str) -> list[str]:
    """Geometric mean speedup over the baseline per routing class and token band."""
    rows = run.of(model)
    cols = [v for v in run.versions[1:] if v in rows[0]["speedups"]]
    out = [
        "| routing | tokens | cases | " + " | ".join(run.labels[v] for v in cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    for cls, members in (("balanced", cases.BALANCED), ("concentrated", cases.CONCENTRATED)):
        for lo, hi in TOKEN_BANDS:
            sel = [r for r in rows if r["routing"] in members and lo <= r["tokens"] <= hi]
            if sel:
                band = f"{lo:,}-{hi:,}" if hi < 1 << 30 else f">= {lo:,}"
                out.append(f"| {cls} | {band} | {len(sel)} | "
                           + " | ".join(f"{gm(r['speedups'][v] for r in sel):.3f}x" for v in cols)
                           + " |")  # fmt: skip
    return out


def case_table(run: Run, model: str) -> list[str]:
    rows = run.of(model)
    cols = [v for v in run.versions[1:] if v in rows[0]["speedups"]]
    base = run.versions[0]
    out = [f"| routing | tokens | rows/expert | {base} ms | "
           + " | ".join(f"{v}" for v in cols) + " | roofline ms | max err | check |",
           "|---|---|---|---|" + "---|" * len(cols) + "---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['routing']} | {r['tokens']} | {r['rows_per_expert']:.1f} | "
                   f"{r[base + '_s'] * 1e3:.3f} | "
                   + " | ".join(f"{r['speedups'][v]:.3f}x" for v in cols)
                   + f" | {r['roofline_s'] * 1e3:.3f} | {r['max_rel_err']:.1e} | "
                   f"{'ok' if r['ok'] else 'FAIL'} |")  # fmt: skip
    return out


def misses(run: Run, reruns: dict) -> list[str]:
    """Every case where the lead is under the bar, with its first run and re-run."""
    out = []
    for r in run.rows:
        s = r["speedups"].get(run.lead)
        if s is None or s >= BAR:
            continue
        before = r.get("first_run", {}).get("speedups", {}).get(run.lead)
        later = reruns.get((r["model"], r["routing"], r["tokens"]))
        out.append(f"- {r['model']} {r['routing']} {r['tokens']} tokens "
                   f"({r['rows_per_expert']:.1f} rows per expert): {s:.4f}x"
                   + (f" (first run {before:.3f}x)" if before else "")
                   + (f"; the re-run file: {later:.3f}x" if later else ""))  # fmt: skip
    return out or [f"- none: {run.lead} is at or above {BAR}x in every case"]


def calib_table(calib: list[dict]) -> list[str]:
    out = [
        "| model | GEMM | rows per expert | regular us | swap-A/B us | swap / regular |",
        "|---|---|---|---|---|---|",
    ]
    for c in calib:
        out.append(f"| {c.get('model', cases.V41_EP8.name)} | {c['gemm']} | {c['m']} | "
                   f"{c['regular_s'] * 1e6:.1f} | {c['swap_ab_s'] * 1e6:.1f} | "
                   f"{c['swap_ab_s'] / c['regular_s']:.3f} |")  # fmt: skip
    return out


def profile_lines(run: Run) -> list[str]:
    traced = [r for r in run.rows if r.get("profile", {}).get("versions")]
    if not traced:
        return []
    out = ["", "## Where the time goes (`--profile`, us at the slowest rank)", "",
           "| model | routing | tokens | version | event | span | busy | idle | kernels |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in traced:
        for v, s in r["profile"]["versions"].items():
            if "span_us" not in s:
                continue
            ks = ", ".join(f"{k} {x['us']:.1f}" for k, x in s["kernels"].items())
            out.append(f"| {r['model']} | {r['routing']} | {r['tokens']} | {v} | "
                       f"{s['event_us']:.1f} | {s['span_us']:.1f} | {s['busy_us']:.1f} | "
                       f"{s['idle_us']:.1f} | {ks} |")  # fmt: skip
    return out


def emulations(main: dict, folder: Path) -> dict[str, dict]:
    """The H20 emulations: runs of their own (emulated_<name>.json, run.py with spec-h20.yaml)
    or, in the runs before it, inside the run's JSON or one emulated_<dev>.json."""
    found = {k: v for k, v in main.items() if k.startswith("emulated_") and isinstance(v, dict)}
    for f in sorted(folder.glob("emulated_*.json*")):
        doc = read_json(f)
        nested = {k: v for k, v in doc.items() if k.startswith("emulated_")}
        found |= nested or {f.name.split(".")[0]: doc}
    return found


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in run.families if run.of(m)]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = run.of(model)
        for routing in dict.fromkeys(r["routing"] for r in rows):
            sel = sorted((r for r in rows if r["routing"] == routing), key=lambda r: r["tokens"])
            ax.plot([r["rows_per_expert"] for r in sel], [r["speedups"][run.lead] for r in sel],
                    marker="o", ms=3, label=routing)  # fmt: skip
        ax.axhline(BAR, color="k", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_title(model)
        ax.set_xlabel("average rows per expert")
        ax.set_ylabel(f"{run.lead} / {run.versions[0]} (speedup)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_run(folder: Path) -> Run:
    """The folder's run (run.py's moe_dispatch.json, or an older kernel_<dev>.json), refused in
    one line when there is none or it measured nothing."""
    f = first(folder, "moe_dispatch.json", "moe_dispatch.json.gz", "kernel_*.json",
              "kernel_*.json.gz")  # fmt: skip
    if f is None:
        raise SystemExit(f"report_run: {folder}: no moe_dispatch.json or kernel_<dev>.json "
                         "(what run.py writes to --out)")  # fmt: skip
    run = Run(read_json(f), f.name)
    if not run.rows:
        raise SystemExit(f"report_run: {f}: no measured case in it")
    return run


def render(folder: Path, title: str = "", run: Run | None = None) -> str:
    run = run or read_run(folder)
    f = folder / run.name
    tag = f.name.split(".")[0].split("_")[-1] if f.name.startswith("kernel_") else "run"
    reruns: dict = {}
    rf = first(folder, "rerun.json", "rerun.json.gz", f"rerun_{tag}.json", f"rerun_{tag}.json.gz")
    if rf:
        again = Run(read_json(rf), rf.name)
        reruns = {(r["model"], r["routing"], r["tokens"]): r["speedups"].get(run.lead, 0)
                  for r in again.rows}  # fmt: skip
    dev = run.doc.get("device", {})
    lines = [f"# {title or 'Kernel-level A/B of the MoE dispatch'}", "",
             "Generated by `python benchmarks/moe_dispatch/report_run.py` from "
             f"`{f.name}`" + (f" and `{rf.name}`" if rf else "") + "; every number is read "
             "from those files.", "",
             f"- device: {dev.get('nvidia_smi', dev.get('name', '?'))}, {dev.get('sms', '?')} "
             f"SMs; torch {dev.get('torch', '?')}, CUDA {dev.get('cuda', '?')}; FlashInfer "
             f"sources {dev.get('flashinfer_sources', '?')}",
             f"- command: `{run.doc.get('command', '?')}`",
             "- versions: " + "; ".join(f"`{v}` = {run.labels[v]}" for v in run.versions),
             f"- the bar: `{run.lead}` >= {BAR}x of `{run.versions[0]}` (median of the "
             f"slowest rank over the samples; under it the case is run again), within 3 % of "
             f"max(`{run.versions[0]}`, `{run.also}`)"]  # fmt: skip
    if run.doc.get("patches"):
        lines.append("- patch files (sha256, 16 digits): " + ", ".join(
            f"`{Path(p).name}` {h}" for p, h in run.doc["patches"].items()))  # fmt: skip
    if "copy_bandwidth_Bps" in run.doc:
        lines.append(
            f"- copy bandwidth measured in the run: "
            f"{run.doc['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write)"
        )
    lines += ["", "## The bar, per family", "", *bar_table(run, reruns), "",
              "Cases under the bar:", "", *misses(run, reruns), *paired_table(run)]  # fmt: skip
    for model in run.families:
        if not run.of(model):
            continue
        fam = run.families[model]
        lines += [
            "",
            f"## {fam.get('label') or model}",
            "",
            f"{fam['slots']} slots ({fam['experts']} experts), top-{fam['top_k']}, EP"
            f"{fam['ep']}: {fam['local']} per rank; hidden {fam['hidden']:,}, moe "
            f"intermediate {fam['inter']:,}. Geometric means:",
            "",
            *class_table(run, model),
            "",
            "Every case:",
            "",
            *case_table(run, model),
        ]
    for name, emu in emulations(run.doc, folder).items():
        erun = Run(emu, name)
        env = emu.get("env", {})
        sms, grid = emu.get("sms", env.get("VLLM_H20_NUM_SMS")), emu.get("grid", env.get(
            "VLLM_H20_GRID_SMS", env.get("VLLM_H20_NUM_SMS")))  # fmt: skip
        if erun.rows:
            lines += ["", f"## {name}: {sms} SMs planned, {grid} CTAs", "",
                      *bar_table(erun, {}), "", *misses(erun, {})]  # fmt: skip
    calib = run.doc.get("calibration") or []
    if calib:
        lines += ["", "## Regular vs swap-A/B at forced rows per expert", "",
                  *calib_table(calib)]  # fmt: skip
    lines += profile_lines(run)
    if run.failed:
        lines += ["", "## Failed cases", ""] + [
            f"- {r['model']} {r['routing']} {r['tokens']}: {r.get('error', '?')[:300]}"
            for r in run.failed]  # fmt: skip
    phases = run.doc.get("phases", {})
    if phases.get("total_s"):
        lines += ["", f"Run time: {phases['total_s']:.0f} s (build "
                  f"{phases.get('build_s', 0):.0f} s, kernels "
                  f"{phases.get('deepgemm_jit_s', 0):.0f} s)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder", type=Path, help="a run folder under benchmarks/results/moe_dispatch")
    ap.add_argument("--title", default="", help="the README's title")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"report_run: {args.folder}: not a folder")
    run = read_run(args.folder)
    (args.folder / "README.md").write_text(render(args.folder, args.title, run))
    if not args.no_plot:
        plot(run, args.folder / "speedup.png")
    print(f"report_run: wrote {args.folder / 'README.md'}"
          + ("" if args.no_plot else " and speedup.png"))  # fmt: skip


if __name__ == "__main__":
    main()
