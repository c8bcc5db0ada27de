"""Compare two patch series measured in alternating kernel-level runs of one lease (A B B A ...).

    python benchmarks/moe_dispatch/compare_runs.py new=run1.json old=run2.json old=run3.json \
        new=run4.json [--column fix] [--out repeats.md]

Each argument is LABEL=FILE, a run.py result (moe_dispatch_h200.json, plain or .gz), in the
order the runs were made; exactly two labels. Every run has its own stock column, so each case's
speedup is against the stock kernel timed in the same run; the series are compared on those.
The effect per routing class is the geometric mean over its cases of (median speedup of A /
median speedup of B), with a 95 % CI from a two-level bootstrap (runs of each label resampled,
then cases), so that a lease-wide drift between runs widens the interval instead of hiding in it.
A CI that contains 1 is "not resolved". CPU only."""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases  # noqa: E402

CLASSES = (
    ("balanced", cases.BALANCED, 1, 128),
    ("balanced", cases.BALANCED, 129, 4096),
    ("concentrated", cases.CONCENTRATED, 1, 128),
    ("concentrated", cases.CONCENTRATED, 129, 4096),
    ("every case", cases.ALL_ROUTINGS, 1, 4096),
)
RESAMPLES = 4000


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def speedups(run: dict, column: str) -> dict[tuple[str, int], float]:
    """Each case's speedup of `column` over the same run's stock kernel."""
    return {(r["routing"], r["tokens"]): r["speedups"][column] for r in run["ab"]}


def log_ratios(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per case: log(median over A's runs / median over B's runs); a, b are runs x cases."""
    return np.log(np.median(a, axis=0)) - np.log(np.median(b, axis=0))


def bootstrap_ci(a: np.ndarray, b: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Geometric-mean ratio A/B over the cases (columns), and its 95 % two-level bootstrap CI."""
    rng = np.random.default_rng(seed)
    point = float(np.exp(log_ratios(a, b).mean()))
    stats = np.empty(RESAMPLES)
    for i in range(RESAMPLES):
        ra = a[rng.integers(0, len(a), len(a))]
        rb = b[rng.integers(0, len(b), len(b))]
        cols = rng.integers(0, a.shape[1], a.shape[1])
        stats[i] = log_ratios(ra[:, cols], rb[:, cols]).mean()
    lo, hi = np.exp(np.percentile(stats, [2.5, 97.5]))
    return point, float(lo), float(hi)


def matrices(runs: list[tuple[str, dict]], column: str):
    """The two labels (first seen first), the common cases, and a runs x cases matrix per label."""
    labels = list(dict.fromkeys(label for label, _ in runs))
    if len(labels) != 2:
        raise SystemExit(f"need runs of exactly two labels, got {labels or 'none'}")
    per_run = [(label, speedups(run, column)) for label, run in runs]
    keys = sorted(set.intersection(*(set(s) for _, s in per_run)), key=lambda k: (k[0], k[1]))
    if not keys:
        raise SystemExit("the runs have no case in common")
    mats = {
        label: np.array([[s[k] for k in keys] for lab, s in per_run if lab == label])
        for label in labels
    }
    return labels, keys, mats


def render(runs: list[tuple[str, dict, str]], column: str, command: str = "") -> str:
    labels, keys, mats = matrices([(label, run) for label, run, _ in runs], column)
    a, b = labels
    out = [f"Written by `{command}` (paths from the run folder).", ""] if command else []
    out += [
        f"Runs, in the order made (column `{column}`, each against its own run's stock):",
        "",
        "| # | series | file | cases >= 0.98x | worst |",
        "|---:|---|---|---:|---:|",
    ]
    for i, (label, run, name) in enumerate(runs, 1):
        s = speedups(run, column)
        worst = min(s, key=s.get)
        out.append(
            f"| {i} | {label} | `{name}` | {sum(v >= 0.98 for v in s.values())} of {len(s)} | "
            f"{s[worst]:.3f} ({worst[0]} {worst[1]}) |"
        )
    out += [
        "",
        f"{a} against {b}: geometric mean over the cases of the ratio of median speedups, with "
        f"a 95 % two-level bootstrap CI ({RESAMPLES} resamples of runs, then cases); each run's "
        "geometric mean beside it.",
        "",
        f"| routing class | tokens | cases | {a} runs | {b} runs | {a} / {b} | 95 % CI | |",
        "|---|---|---:|---|---|---:|---|---|",
    ]
    for name, routings, lo, hi in CLASSES:
        sel = [i for i, k in enumerate(keys) if k[0] in routings and lo <= k[1] <= hi]
        if not sel:
            continue
        point, cl, ch = bootstrap_ci(mats[a][:, sel], mats[b][:, sel])
        per_run = {
            lab: " ".join(f"{statistics.geometric_mean(row):.3f}" for row in mats[lab][:, sel])
            for lab in labels
        }
        verdict = "not resolved" if cl <= 1.0 <= ch else ("faster" if point > 1 else "slower")
        out.append(
            f"| {name} | {lo}-{hi} | {len(sel)} | {per_run[a]} | {per_run[b]} | {point:.4f} | "
            f"{cl:.4f}-{ch:.4f} | {verdict} |"
        )
    out += within_runs(runs, column, labels)
    out += [
        "",
        "Cases whose median speedup is under 0.98x in either series (median, then each run):",
        "",
        f"| routing | tokens | {a} | {b} | {a} / {b} | {a} runs | {b} runs |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    med = {lab: np.median(m, axis=0) for lab, m in mats.items()}
    for i, (routing, tokens) in enumerate(keys):
        if min(med[a][i], med[b][i]) < 0.98:
            runs_of = {lab: " ".join(f"{v:.3f}" for v in mats[lab][:, i]) for lab in labels}
            out.append(
                f"| {routing} | {tokens} | {med[a][i]:.3f} | {med[b][i]:.3f} | "
                f"{med[a][i] / med[b][i]:.3f} | {runs_of[a]} | {runs_of[b]} |"
            )
    return "\n".join(out) + "\n"


def within_runs(runs: list[tuple[str, dict, str]], column: str, labels: list[str]) -> list[str]:
    """Where every run also timed the previous plan (`prev`, same build): column / prev per
    routing class, each run's geometric mean, by label."""
    if column == "prev" or not all("prev" in run["ab"][0]["speedups"] for _, run, _ in runs):
        return []
    out = [
        "",
        f"Within each run, `{column}` / `prev` (the previous plan's rule, same build): geometric "
        "mean per routing class, each run.",
        "",
        "| routing class | tokens | " + " | ".join(f"{lab} runs" for lab in labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for name, routings, lo, hi in CLASSES[:-1]:
        cells = []
        for lab in labels:
            gms = []
            for label, run, _ in runs:
                if label != lab:
                    continue
                sel = [r["speedups"] for r in run["ab"]
                       if r["routing"] in routings and lo <= r["tokens"] <= hi]  # fmt: skip
                gms.append(statistics.geometric_mean(s[column] / s["prev"] for s in sel))
            cells.append(", ".join(f"{g:.3f}" for g in gms))
        out.append(f"| {name} | {lo}-{hi} | " + " | ".join(cells) + " |")
    return out


def parse(arg: str, family: str = cases.V41_EP8.name) -> tuple[str, dict, str]:
    label, sep, file = arg.partition("=")
    if not sep or not label or not file:
        raise SystemExit(f"{arg!r}: expected LABEL=FILE (e.g. new=run1/moe_dispatch_h200.json)")
    path = Path(file)
    if not path.is_file():
        raise SystemExit(f"{path}: no such run file")
    try:
        run = load(path)
    except (OSError, ValueError, EOFError) as e:
        raise SystemExit(f"{path}: not a run.py result ({e})") from None
    if not isinstance(run, dict) or not run.get("ab") or "speedups" not in run["ab"][0]:
        raise SystemExit(f"{path}: not a run.py result (no cases with speedups under 'ab')")
    # One family's cases (a run before the families has only V4.1-Flash EP8's, unlabelled).
    rows = [r for r in run["ab"] if r.get("model", cases.V41_EP8.name) == family]
    if not rows:
        raise SystemExit(f"{path}: no case of family {family!r}")
    return label, run | {"ab": rows}, path.name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=FILE, in the order the runs were made")
    ap.add_argument("--column", default="fix", help="the version compared (default: fix)")
    ap.add_argument("--family", default=cases.V41_EP8.name,
                    help=f"the shape family compared (default: {cases.V41_EP8.name})")  # fmt: skip
    ap.add_argument("--out", type=Path, help="write the Markdown here (default: stdout)")
    args = ap.parse_args(argv)
    runs = [parse(a, args.family) for a in args.runs]
    missing = [n for _, run, n in runs if args.column not in run["ab"][0]["speedups"]]
    if missing:
        raise SystemExit(f"{missing[0]}: has no column {args.column!r}")
    extra = [] if args.column == "fix" else ["--column", args.column]
    extra += [] if args.family == cases.V41_EP8.name else ["--family", args.family]
    text = render(runs, args.column, " ".join(["compare_runs.py", *args.runs, *extra]))
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
