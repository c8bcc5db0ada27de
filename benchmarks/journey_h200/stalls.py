"""Which sweep cells had kernels compiled while they ran: a JIT compile stops the compiling
server's engine for seconds, so a cell with one measures the compiler, not the kernels.

The servers share their JIT caches, so a compile cannot be pinned on one server: it is counted in
the cell whose time span (warm-up to last request, `started`..`finished` in the cell's record)
holds the moment the compiled kernel was written, which is when its compile ended (a compile
that ends just after a cell also stalled it: read a neighbour's count as a warning). The times
come from the cache listings `h200.sh collect` writes: vLLM's DeepGEMM kernels
(`logs/vllm-deepgemm-kernels.txt`, `deepgemm_precompile.py --list`) and Triton's
(`logs/triton-cache.txt`), both in UTC as the machine's clock:

    python benchmarks/journey_h200/stalls.py RUNS/decode-v4 --logs LOGS [--markdown]
"""

from __future__ import annotations

import argparse
import calendar
import json
import sys
import time
from pathlib import Path


def _epoch(stamp: str) -> float:
    """'YYYY-MM-DD HH:MM:SS[.ffff]' in UTC -> seconds since the epoch."""
    whole, _, frac = stamp.partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%d %H:%M:%S")) + float(f"0.{frac or 0}")


def compile_times(logs: Path) -> dict[str, list[float]]:
    """When each kernel was compiled, per JIT compiler, from collect's listings (a listing that
    is missing gives no times: older leases did not write it)."""
    out: dict[str, list[float]] = {"deepgemm": [], "triton": []}
    dg = logs / "vllm-deepgemm-kernels.txt"
    if dg.is_file():
        for line in dg.read_text().splitlines():
            day, clock, *_ = line.split(" ", 2)
            out["deepgemm"].append(_epoch(f"{day} {clock}"))
    tr = logs / "triton-cache.txt"  # `date time size path` of each kernel's metadata JSON
    if tr.is_file():
        for line in tr.read_text().splitlines():
            day, clock, _size, _path = line.split(" ", 3)
            out["triton"].append(_epoch(f"{day} {clock}"))
    return out


def cells(runs: Path) -> list[dict]:
    """Each finished cell of a sweep folder (`runs/<target>/c<N>-r<i>.json`), oldest first."""
    rows = []
    for f in sorted((runs / "runs").glob("*/c*-r*.json")):
        try:
            r = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{f}: not a run record ({e}); re-collect it or remove it") from None
        if "started" in r and "finished" in r:
            rows.append(r)
    return sorted(rows, key=lambda r: r["started"])


def table(runs: Path, logs: Path) -> list[dict]:
    times = compile_times(logs)
    out = []
    for r in cells(runs):
        span = (r["started"], r["finished"])
        row = {
            "started": time.strftime("%H:%M:%S", time.gmtime(r["started"])),
            "target": r["target"],
            "concurrency": r["concurrency"],
            "run": r["run"] + 1,
            "status": r["status"],
            "throughput": r.get("throughput"),
            "retry": r.get("attempt", 0),  # 0: first attempt (sweep.py counts from 0)
        }
        for jit, ts in times.items():
            row[jit] = sum(span[0] <= t <= span[1] for t in ts)
        out.append(row)
    return out


def render(rows: list[dict], markdown: bool) -> str:
    head = ["started (UTC)", "server", "tier", "run", "retry", "tok/s", "DeepGEMM", "Triton"]
    body = [
        [
            r["started"],
            r["target"],
            f"c{r['concurrency']}",
            str(r["run"]),
            str(r["retry"]),
            "-" if r["throughput"] is None else f"{r['throughput']:,.0f}",
            str(r["deepgemm"]),
            str(r["triton"]),
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *body]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("runs", type=Path, help="a sweep's output folder (sweep.json, runs/)")
    ap.add_argument("--logs", type=Path, required=True, help="collect's logs/ folder")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table")
    a = ap.parse_args(argv)
    if not (a.runs / "runs").is_dir():
        raise SystemExit(f"stalls: {a.runs} has no runs/ folder (not a sweep's output)")
    if not any((a.logs / n).is_file() for n in ("vllm-deepgemm-kernels.txt", "triton-cache.txt")):
        raise SystemExit(
            f"stalls: {a.logs} has neither vllm-deepgemm-kernels.txt nor "
            "triton-cache.txt (h200.sh collect writes them)"
        )
    rows = table(a.runs, a.logs)
    print(render(rows, a.markdown))
    hit = [r for r in rows if r["deepgemm"] or r["triton"]]
    print(f"\n{len(hit)} of {len(rows)} cells had a kernel compiled while they ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
