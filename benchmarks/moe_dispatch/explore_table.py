"""The versions of `run.py --explore` runs side by side (CPU): each case's speedup over the same
run's stock kernel, median over the runs (with their range), per routing class the geometric
mean, and how many cases reach 0.98x.

    python benchmarks/moe_dispatch/explore_table.py run1.json run2.json ... [--out README.md]

`--compose NAME=A@T,B` adds a rule composed from measured columns: version A up to T tokens,
B above (a candidate's predicted table, every cell a measurement of its own version)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
from compare_runs import load  # noqa: E402

BAR = 0.98


def table(runs: list[dict], compose: dict[str, tuple[str, int, str]]) -> tuple[list[str], dict]:
    """Rows of the per-case table and, per version, case -> median speedup over the runs."""
    versions = [v for v in runs[0]["ab"][0]["speedups"] if v != "fix_again"]
    per: dict[str, dict[tuple[str, int], list[float]]] = {v: {} for v in versions}
    for run in runs:
        if [v for v in run["ab"][0]["speedups"] if v != "fix_again"] != versions:
            raise SystemExit("explore_table: the runs have different versions")
        for r in run["ab"]:
            for v in versions:
                per[v].setdefault((r["routing"], r["tokens"]), []).append(r["speedups"][v])
    med = {v: {k: statistics.median(x) for k, x in d.items()} for v, d in per.items()}
    for name, (low, upto, high) in compose.items():
        if unknown := {low, high} - set(med):
            raise SystemExit(f"explore_table: --compose {name}: no version {', '.join(unknown)} "
                             f"(the runs have {', '.join(versions)})")  # fmt: skip
        med[name] = {k: med[low][k] if k[1] <= upto else med[high][k] for k in med[low]}
    cols = versions + list(compose)
    lines = ["| routing | tokens | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for k in med[versions[0]]:
        cells = []
        for v in cols:
            x = med[v][k]
            spread = (f" ({min(per[v][k]):.3f}-{max(per[v][k]):.3f})"
                      if v in per and len(per[v][k]) > 1 else "")  # fmt: skip
            cell = f"{x:.3f}{spread}"
            cells.append(f"**{cell}**" if x < BAR else cell)
        lines.append(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")
    return lines, med


def _gm(d: dict, routings) -> float:
    xs = [x for (r, _), x in d.items() if r in routings]
    return statistics.geometric_mean(xs) if xs else float("nan")


def summary(med: dict) -> list[str]:
    lines = ["| version | worst | cases >= 0.98x | geo. mean, balanced | geo. mean, concentrated |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for v, d in med.items():
        worst = min(d, key=d.get)
        means = f"{_gm(d, cases.BALANCED):.3f} | {_gm(d, cases.CONCENTRATED):.3f}"
        lines.append(f"| {v} | {d[worst]:.3f} ({worst[0]} {worst[1]}) | "
                     f"{sum(x >= BAR for x in d.values())} of {len(d)} | {means} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--compose", action="append", default=[], metavar="NAME=A@T,B")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    compose = {}
    for c in a.compose:
        name, _, rule = c.partition("=")
        low, _, rest = rule.partition("@")
        upto, _, high = rest.partition(",")
        if not (name and low and upto.isdigit() and high):
            raise SystemExit(f"explore_table: --compose {c!r}: expected NAME=A@TOKENS,B")
        compose[name] = (low, int(upto), high)
    runs = [load(p) for p in a.runs]
    rows, med = table(runs, compose)
    cmd = "python benchmarks/moe_dispatch/explore_table.py " + " ".join(
        [p.name for p in a.runs] + [f"--compose {c}" for c in a.compose])  # fmt: skip
    head = f"Speedup over stock, median of {len(runs)} runs (min-max); in bold under {BAR}x."
    text = "\n".join([f"`{cmd}`", "", head, "", *summary(med), "", *rows, ""])
    if a.out:
        a.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
