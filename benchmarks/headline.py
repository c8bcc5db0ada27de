"""README's headline numbers, each computed from a published results file, so none is typed by
hand: the table sits in README.md between the two markers below, and a test fails when it is not
what this renders from benchmarks/results/.

    python benchmarks/headline.py            # print the table
    python benchmarks/headline.py --write    # put it into README.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_h20.bench.stats import welch_ratio_ci  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"


@dataclass(frozen=True)
class Row:
    what: str  # what was measured, where
    source: str  # the results file the number comes from, relative to benchmarks/results
    cell: Callable[[Path], str]  # that file -> the number as README prints it
    link: str  # the README (or table) a reader follows for the method


def _json(p: Path):
    return json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text())


def convert_speed(p: Path) -> str:
    d = _json(p)
    run = max(d["runs"], key=lambda r: r["workers"])
    return (
        f"{d['bytes_in'] / 1e9:.1f} GB in {run['seconds']:.0f} s on {run['workers']} workers: "
        f"{run['ratio_vs_copy']:.2f}x the time of a plain copy of the same bytes"
    )


def convert_exact(p: Path) -> str:
    groups = [g for g in _json(p)["groups"].values() if g["op"] != "keep"]  # copied: no maths
    tensors = sum(g["tensors"] for g in groups)
    exact = sum(g["tensors"] for g in groups if g["inexact"] == 0)
    elements = sum(g["elements"] for g in groups)
    inexact = sum(g["inexact"] for g in groups)
    return (
        f"{exact:,} of {tensors:,} converted tensors bit-exact "
        f"({inexact:,} of {elements / 1e9:.1f} G elements inexact)"
    )


def kernel_bar(p: Path) -> str:
    doc = _json(p)
    lead = doc.get("spec", {}).get("lead")  # run.py's JSON: a speedup per version
    rows = [r | {"speedup": r["speedups"][lead]} if lead else r for r in doc["ab"]]
    worst = min(rows, key=lambda r: r["speedup"])
    ok = sum(r["speedup"] >= 0.98 for r in rows)
    return (
        f"{ok} of {len(rows)} cases >= 0.98x stock; worst {worst['speedup']:.3f}x "
        f"({worst['routing']}, {worst['tokens']:,} tokens); outputs checked: "
        f"{sum(r['ok'] for r in rows)} of {len(rows)}"
    )


def uniform_gain(p: Path) -> str:
    rows = [r for r in _json(p)["ab"] if r["routing"] == "uniform" and 128 <= r["tokens"] <= 2048]
    s = [r["speedup"] for r in rows]
    return f"{min(s):.2f}-{max(s):.2f}x stock at {len(s)} sizes"


def fused_identical(p: Path) -> str:
    rows = _json(p)["ab"]
    same = sum(r["bit_identical"] for r in rows)
    s = [r["speedup"] for r in rows]
    return f"{same} of {len(rows)} cases bit-identical to stock; {min(s):.2f}-{max(s):.2f}x"


def _sweep_runs(sweep: Path, target: str, tier: int) -> list[float]:
    out = []
    for f in sorted((sweep / "runs" / target).glob(f"c{tier}-r*.json")):
        r = _json(f)
        if r.get("status") == "ok" and r.get("throughput") is not None:
            out.append(r["throughput"])
    return out


def _change(sweep: Path, cand: str, base: str, tier: int) -> str:
    a, b = _sweep_runs(sweep, cand, tier), _sweep_runs(sweep, base, tier)
    ci = welch_ratio_ci(a, b)

    def pct(x: float) -> str:
        return f"{100 * (x - 1):+.1f} %"

    verdict = "" if ci.resolved else ", not resolved"
    return f"{pct(ci.ratio)} (95 % CI {pct(ci.low)} to {pct(ci.high)}, n {ci.n}{verdict})"


def serving_fix(p: Path) -> str:
    return f"c128 output tok/s {_change(p, 'fix', 'stock', 128)}"


def journey_decode(p: Path) -> str:
    cells = [f"c{c} {_change(p, 'v4fix', 'v4hum', c)}" for c in (64, 128, 256)]
    return "; ".join(cells)


def build_time(p: Path) -> str:
    d = _json(p)["per_expert"]
    return f"{d['seconds']:.0f} s for {d['objects']} objects on 16 cores"


ROWS = (
    Row("`convert`, 3.9 GB generated release, 2 CPU cores", "convert/convert_cpu2.json",
        convert_speed, "benchmarks/results/convert/convert_cpu2.md"),
    Row("`convert`, synthetic DeepSeek-V4 release (22 GB)",
        "journey_h200/v4-lease4-decode-clean/logs/conversion_report.json", convert_exact,
        "benchmarks/results/journey_h200/v4-lease4-decode-clean/README.md"),
    Row("Fix vs stock, grouped GEMMs, every EP rank, five shape families (V4.1-Flash and "
        "DeepSeek-V3 on EP8 and EP16, Kimi-K2-like EP8) x 5 routings x 12 sizes, one H100",
        "moe_dispatch/bar-five-families-h100/moe_dispatch.json.gz", kernel_bar,
        "benchmarks/results/moe_dispatch/bar-five-families-h100/README.md"),
    Row("Fix vs stock, uniform routing 128-2,048 tokens, one H200 (series before the last-tile "
        "stop)", "moe_dispatch/hot-first-h200/kernel_h200.json", uniform_gain,
        "benchmarks/results/moe_dispatch/hot-first-h200/README.md"),
    Row("Fix vs stock through FlashInfer's `cutlass_fused_moe`, one H100",
        "moe_dispatch/bar-five-families-h100/fused.json.gz", fused_identical,
        "benchmarks/results/moe_dispatch/bar-five-families-h100/NOTES.md"),
    Row("Serving, fix vs stock, vLLM 0.26 on one H200 (4 MoE layers, 60 s windows)",
        "serve_h200/round8-h200-l5-sweep/sweeps/decode-resolve", serving_fix,
        "benchmarks/results/serve_h200/round8-h200-l5-sweep/README.md"),
    Row("Serving, conversion + fix vs the release on Humming W4A8, one H200 (3 layers, 12 s "
        "windows)", "journey_h200/v4-lease4-decode-clean/sweeps/decode-v4", journey_decode,
        "benchmarks/results/journey_h200/v4-lease4-decode-clean/README.md"),
    Row("`kernels build` of the fix module, the H100 machine",
        "moe_dispatch/last-tile-h100/fused_build.json", build_time,
        "benchmarks/results/moe_dispatch/last-tile-h100/README.md"),
)  # fmt: skip


def render(results: Path = RESULTS) -> str:
    lines = ["| measured | result | evidence |", "|---|---|---|"]
    for r in ROWS:
        lines.append(f"| {r.what} | {r.cell(results / r.source)} | [README]({r.link}) |")
    return "\n".join(lines)


def block(text: str) -> str | None:
    """The table between the markers in README's text, or None without them."""
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace README.md's table")
    a = ap.parse_args(argv)
    table = render()
    if not a.write:
        print(table)
        return 0
    text = README.read_text()
    if block(text) is None:
        print(f"headline: {README} has no {START} ... {END} block", file=sys.stderr)
        return 2
    head, rest = text.split(START, 1)
    README.write_text(f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
