"""`vllm-h20 bench report`: sweep directories -> Markdown, CSV, JSON and PNG plots.

The table has the seed write-up's form: per tier, baseline mean +- sample std, candidate
mean +- std, change in percent, here with its 95 % CI ("not resolved" when it spans 0);
every number comes from the run files, nothing is typed in.
"""

from __future__ import annotations

import csv
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._io import write_json_atomic
from .stats import Summary, change_pct, summarize, welch_ratio_ci
from .sweep import MANIFEST, read_run

RUN_FILE = re.compile(r"^c\d+-r\d+\.json$")


class ReportError(ValueError):
    """Sweep directories that cannot be reported together; the message names them."""


@dataclass
class Sweeps:
    spec: dict[str, Any]
    tokenizer: dict[str, Any]
    source: str
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)


def load(dirs: list[Path]) -> Sweeps:
    acc: Sweeps | None = None
    for d in dirs:
        man = read_run(d / MANIFEST)
        if man is None:
            raise ReportError(f"{d}: no {MANIFEST}; not a `vllm-h20 bench sweep` directory")
        if acc is None:
            acc = Sweeps(man["spec"], man["tokenizer"], man.get("throughput_source", "server"))
        elif man["spec"]["fingerprint"] != acc.spec["fingerprint"]:
            raise ReportError(f"{d}: measured with another spec than {acc.dirs[0]}; not comparable")
        elif man["tokenizer"]["fingerprint"] != acc.tokenizer["fingerprint"]:
            raise ReportError(f"{d}: measured with another tokenizer than {acc.dirs[0]}")
        elif man.get("throughput_source", "server") != acc.source:
            raise ReportError(f"{d}: throughput from another source than {acc.dirs[0]}")
        for name, t in man["targets"].items():
            if name in acc.targets:
                raise ReportError(f"{d}: target {name} also in {acc.targets[name]['dir']}")
            acc.targets[name] = {**t, "dir": str(d)}
        acc.dirs.append(str(d))
        for p in sorted((d / "runs").glob("*/c*-r*.json")):
            if not RUN_FILE.match(p.name):  # e.g. GuideLLM's own report of a cut-off run
                continue
            rec = read_run(p)
            if rec is None:
                raise ReportError(f"{p}: unreadable run file")
            (acc.runs if rec.get("status") == "ok" else acc.failed).append(rec)
    assert acc is not None
    if not acc.runs:
        raise ReportError(f"{', '.join(map(str, dirs))}: no finished run to report")
    return acc


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


@dataclass
class Cell:
    """One target at one tier, over its finished runs."""

    throughput: Summary
    guidellm: float | None
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    errored: int
    incomplete: int
    prefix_cache_hits: float | None
    prompt_tokens: float | None  # per request, as the server reported it to GuideLLM
    values: list[float]


def cells(s: Sweeps) -> dict[str, dict[int, Cell]]:
    unit = s.spec["throughput"]
    out: dict[str, dict[int, Cell]] = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in s.runs:
        groups.setdefault((r["target"], r["concurrency"]), []).append(r)
    for (name, conc), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["run"])
        vals = [r["throughput"] for r in rs]
        gl = [r["guidellm"] for r in rs]
        hits = [r.get("server", {}).get("prefix_cache_hits") for r in rs]
        out.setdefault(name, {})[conc] = Cell(
            throughput=summarize(vals),
            guidellm=_mean([g[f"{unit}_tok_s"] for g in gl]),
            ttft_ms={p: _mean([g["ttft_ms"][p] for g in gl]) for p in ("p50", "p90", "p99")},
            itl_ms={p: _mean([g["itl_ms"][p] for g in gl]) for p in ("p50", "p90", "p99")},
            errored=sum(g["requests"]["errored"] for g in gl),
            incomplete=sum(g["requests"]["incomplete"] for g in gl),
            prefix_cache_hits=None if all(h is None for h in hits) else sum(h or 0 for h in hits),
            prompt_tokens=_mean([g.get("prompt_tokens_per_request") for g in gl]),
            values=vals,
        )
    return out


def _fmt(s: Summary | None) -> str:
    if s is None:
        return "—"
    if s.std is None:
        return f"{s.mean:,.0f} (1 run)"
    return f"{s.mean:,.0f} ± {s.std:,.0f}"


def _pct(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:+.1f}%".replace("-", "−")


def change(base: list[float], cand: list[float]) -> tuple[str, bool]:
    """The change of the mean against the baseline's, with the 95 % CI of the ratio of geometric
    means over runs (Welch); whether it is resolved (a CI that excludes 0). One run on either
    side gives no interval and is never resolved."""
    pct = _pct(change_pct(statistics.fmean(base), statistics.fmean(cand)))
    if len(base) < 2 or len(cand) < 2:
        return f"{pct} (n {len(base)}/{len(cand)}: no CI)", False
    ci = welch_ratio_ci(cand, base)
    lo, hi = _pct(100 * (ci.low - 1)), _pct(100 * (ci.high - 1))
    verdict = "" if ci.resolved else ", not resolved"
    return f"{pct} (CI {lo} to {hi}{verdict})", ci.resolved


def order(s: Sweeps, baseline: str | None) -> list[str]:
    names = list(s.targets)
    if baseline is None:
        return names
    if baseline not in names:
        raise ReportError(f"--baseline {baseline}: no such target (have: {', '.join(names)})")
    return [baseline] + [n for n in names if n != baseline]


def markdown(s: Sweeps, names: list[str], cs: dict[str, dict[int, Cell]], compare: bool) -> str:
    spec = s.spec
    unit = f"{spec['throughput']} tok/s"
    tiers = sorted({c for per in cs.values() for c in per})
    src = "the servers' Prometheus token counters" if s.source == "server" else "GuideLLM"
    lines = [
        f"# {spec['name']} sweep",
        "",
        *([spec["description"], ""] if spec.get("description") else []),
        f"Concurrency tiers {', '.join(map(str, spec['concurrency']))}; {spec['warmup_s']:g} s "
        f"warmup + {spec['measure_s']:g} s measured; {spec['runs']} run(s) per tier. "
        f"Throughput ({unit}) from {src} over each measurement window; values are the "
        f"mean ± sample std over runs. Changes: of the mean, against the first target, with "
        f"the 95 % CI of the ratio over runs (Welch t on log throughput); a CI that spans 0 "
        f"is not resolved, and one run gives none.",
        "",
        *_throughput_table(names, cs, tiers, unit, compare),
        "",
        "## Latency (GuideLLM, successful requests, mean of the runs' percentiles)",
        "",
        *_latency_table(names, cs, tiers),
        "",
        "## Run health and cross-check",
        "",
        *_health_table(names, cs, tiers, unit),
    ]
    notes = _notes(s, names, cs, tiers)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += [
        "",
        "## Targets",
        "",
        "| Target | Model | URL | Sweep directory |",
        "|---|---|---|---|",
    ]
    for n in names:
        t = s.targets[n]
        lines.append(f"| {n} | {t['model']} | {t['url']} | {t['dir']} |")
    lines += ["", f"Tokenizer: {s.tokenizer['path']} (fingerprint {s.tokenizer['fingerprint']})."]
    return "\n".join(lines) + "\n"


def _throughput_table(
    names: list[str], cs: dict[str, dict[int, Cell]], tiers: list[int], unit: str, compare: bool
) -> list[str]:
    """Throughput per tier and target; with compare, each target's change against the first."""
    base = names[0]
    head = ["Concurrency"] + [f"{n} {unit}" for n in names]
    if compare:
        head += [f"{n} vs {base}" for n in names[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in tiers:
        row = [str(c)] + [_fmt(cs.get(n, {}).get(c) and cs[n][c].throughput) for n in names]
        if compare:
            b = cs.get(base, {}).get(c)
            for n in names[1:]:
                x = cs.get(n, {}).get(c)
                row.append(change(b.values, x.values)[0] if b and x else "—")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _latency_table(names: list[str], cs: dict[str, dict[int, Cell]], tiers: list[int]) -> list[str]:
    lines = [
        "| Concurrency | Target | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for c in tiers:
        for n in names:
            x = cs.get(n, {}).get(c)
            if x:
                f = [x.ttft_ms["p50"], x.ttft_ms["p99"], x.itl_ms["p50"], x.itl_ms["p99"]]
                lines.append(
                    f"| {c} | {n} | "
                    + " | ".join("—" if v is None else f"{v:,.1f}" for v in f)
                    + " |"
                )
    return lines


def _health_table(
    names: list[str], cs: dict[str, dict[int, Cell]], tiers: list[int], unit: str
) -> list[str]:
    """Each cell's runs, GuideLLM's own figure beside the counters', errors, cache hits."""
    lines = [
        f"| Concurrency | Target | Runs | {unit} per run | GuideLLM {unit} | Prompt tokens "
        "per request | Errored | Incomplete | Prefix-cache hits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in tiers:
        for n in names:
            x = cs.get(n, {}).get(c)
            if x:
                hits = "n/a" if x.prefix_cache_hits is None else f"{x.prefix_cache_hits:,.0f}"
                gl = "—" if x.guidellm is None else f"{x.guidellm:,.0f}"
                per = ", ".join(f"{v:,.0f}" for v in x.values)
                pt = "—" if x.prompt_tokens is None else f"{x.prompt_tokens:,.1f}"
                lines.append(
                    f"| {c} | {n} | {x.throughput.n} | {per} | {gl} | {pt} | {x.errored} | "
                    f"{x.incomplete} | {hits} |"
                )
    return lines


def _notes(
    s: Sweeps, names: list[str], cs: dict[str, dict[int, Cell]], tiers: list[int]
) -> list[str]:
    """What a reader must know before trusting a cell: errors, cache hits, missing runs."""
    spec = s.spec
    notes = []
    bad = [(n, c) for n in names for c, x in cs.get(n, {}).items() if x.errored]
    if bad:
        notes.append(
            "Request errors in: " + ", ".join(f"{n} c{c}" for n, c in bad) + " (the seed had none)."
        )
    hit = [(n, c) for n in names for c, x in cs.get(n, {}).items() if x.prefix_cache_hits]
    if hit:
        notes.append(
            "Prefix-cache hits in: "
            + ", ".join(f"{n} c{c}" for n, c in hit)
            + " (the seed had none)."
        )
    for n in names:
        short = [c for c in tiers if c in cs.get(n, {}) and cs[n][c].throughput.n < spec["runs"]]
        if short:
            notes.append(
                f"{n}: fewer than {spec['runs']} finished runs at c{', c'.join(map(str, short))}."
            )
    for r in s.failed:
        notes.append(
            f"Failed run {r['target']} c{r['concurrency']} run {r['run'] + 1}: {r['error']}"
        )
    return notes


def _rows(names: list[str], cs: dict[str, dict[int, Cell]], unit: str) -> list[dict[str, Any]]:
    rows = []
    for n in names:
        for c, x in sorted(cs.get(n, {}).items()):
            rows.append({
                "target": n,
                "concurrency": c,
                "runs": x.throughput.n,
                f"{unit}_tok_s_mean": x.throughput.mean,
                f"{unit}_tok_s_std": x.throughput.std,
                f"guidellm_{unit}_tok_s_mean": x.guidellm,
                "ttft_ms_p50": x.ttft_ms["p50"],
                "ttft_ms_p90": x.ttft_ms["p90"],
                "ttft_ms_p99": x.ttft_ms["p99"],
                "itl_ms_p50": x.itl_ms["p50"],
                "itl_ms_p90": x.itl_ms["p90"],
                "itl_ms_p99": x.itl_ms["p99"],
                "errored": x.errored,
                "incomplete": x.incomplete,
                "prefix_cache_hits": x.prefix_cache_hits,
                "prompt_tokens_per_request": x.prompt_tokens,
            })  # fmt: skip
    return rows


def plots(out: Path, s: Sweeps, names: list[str], cs: dict[str, dict[int, Cell]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    return [_throughput_plot(out, s, names, cs), _latency_plot(out, s, names, cs)]


def _throughput_plot(
    out: Path, s: Sweeps, names: list[str], cs: dict[str, dict[int, Cell]]
) -> Path:
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    unit = f"{s.spec['throughput']} tok/s"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=150)
    for n in names:
        xs = sorted(cs.get(n, {}))
        ax.errorbar(
            xs,
            [cs[n][c].throughput.mean for c in xs],
            yerr=[cs[n][c].throughput.std or 0 for c in xs],
            marker="o",
            capsize=4,
            label=n,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(s.spec["concurrency"], [str(c) for c in s.spec["concurrency"]])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("concurrency (streams)")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    if len(names) > 1:
        _change_labels(ax, names, cs)
    ax.set_title(f"{s.spec['name']}: {unit} vs concurrency (mean ± sample std)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _change_labels(ax, names: list[str], cs: dict[str, dict[int, Cell]]) -> None:
    """Each candidate's change vs the baseline, one line per candidate in a block above each
    tier (in its colour), with head-room so no label touches a point or another label."""
    line = 0.05
    top = max((cell.throughput.mean or 0) + (cell.throughput.std or 0)
              for n in names for cell in cs.get(n, {}).values())  # fmt: skip
    ax.set_ylim(0, top / (1 - 0.04 - line * len(names)) if top else 1)
    tiers = sorted({c for n in names for c in cs.get(n, {})})
    # The outer tiers' blocks lean inwards, clear of the axis labels.
    align = {c: "left" if c == tiers[0] else "right" if c == tiers[-1] else "center"
             for c in tiers}  # fmt: skip
    if len(tiers) == 1:
        align[tiers[0]] = "center"
    base = cs.get(names[0], {})
    for c in tiers:
        ax.text(c, 0.98, f"vs {names[0]}:", ha=align[c], va="top", fontsize=7, color="0.4",
                transform=ax.get_xaxis_transform())  # fmt: skip
    for i, n in enumerate(names[1:], start=1):
        for c, cell in cs.get(n, {}).items():
            b = base.get(c)
            if b is None or not b.throughput.mean or cell.throughput.mean is None:
                continue
            rel = cell.throughput.mean / b.throughput.mean - 1
            mark = "" if change(b.values, cell.values)[1] else " (n.r.)"
            ax.text(c, 0.98 - line * i, f"{n} {_pct(100 * rel)}{mark}", ha=align[c],
                    va="top", fontsize=7, color=f"C{i}",
                    transform=ax.get_xaxis_transform())  # fmt: skip


def _latency_plot(out: Path, s: Sweeps, names: list[str], cs: dict[str, dict[int, Cell]]) -> Path:
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=150)
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for i, n in enumerate(names):
            xs = sorted(cs.get(n, {}))
            color = f"C{i}"
            for p, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                ys = [getattr(cs[n][c], key)[p] for c in xs]
                pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True), style, marker="o", color=color, label=f"{n} {p}"
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # Plain milliseconds on the log axis (not 1.8x10^2).
        plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.set_xticks(s.spec["concurrency"], [str(c) for c in s.spec["concurrency"]])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("concurrency (streams)")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} percentiles per tier")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:  # a prefill sweep (1 output token) has no ITL
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="0.5")
    fig.tight_layout()
    path = out / "latency.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def write(dirs: list[Path], out: Path, baseline: str | None) -> list[Path]:
    s = load(dirs)
    names = order(s, baseline)
    cs = cells(s)
    unit = s.spec["throughput"]
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(markdown(s, names, cs, compare=len(names) > 1))
    rows = _rows(names, cs, unit)
    csv_path = out / "report.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    runs_csv = out / "runs.csv"
    with open(runs_csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["target", "concurrency", "run", "status", f"{unit}_tok_s",
                    f"guidellm_{unit}_tok_s", "window_s", "successful", "errored", "incomplete",
                    "prefix_cache_hits", "seed", "error"])  # fmt: skip
        for r in sorted(s.runs + s.failed, key=lambda r: (r["target"], r["concurrency"], r["run"])):
            gl = r.get("guidellm") or {}
            req = gl.get("requests") or {}
            w.writerow([r["target"], r["concurrency"], r["run"], r["status"],
                        r.get("throughput"), gl.get(f"{unit}_tok_s"), r.get("window_s"),
                        req.get("successful"), req.get("errored"), req.get("incomplete"),
                        (r.get("server") or {}).get("prefix_cache_hits"), r.get("seed"),
                        r.get("error") or ""])  # fmt: skip
    js = out / "report.json"
    write_json_atomic(js, {
        "spec": s.spec,
        "tokenizer": s.tokenizer,
        "throughput_source": s.source,
        "baseline": names[0] if len(names) > 1 else None,
        "targets": s.targets,
        "rows": rows,
        "failed_runs": [
            {k: r.get(k) for k in ("target", "concurrency", "run", "error")} for r in s.failed
        ],
    })  # fmt: skip
    return [md, csv_path, runs_csv, js, *plots(out, s, names, cs)]


def headline(path: Path) -> str:
    """The Markdown table of a written report, for the terminal."""
    text = path.read_text()
    return text.split("## Latency")[0]
