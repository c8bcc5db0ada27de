"""Publish a serve_h200 run (CPU side): the tarball `h200.sh collect` wrote -> a results folder
with `vllm-h20 bench report` for each sweep, the probes' JSON, filtered server logs, the run
files, and summary.md: the module each server loaded, the MoE kernels that ran and their share
of GPU time per decode step, the correctness comparison and the decode-step routing.

    python benchmarks/serve_h200/report.py RUN.tar.gz benchmarks/results/serve_h200
"""

from __future__ import annotations

import argparse
import collections
import gzip
import importlib.util
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# vLLM's access log and metrics scrapes: thousands of lines that say nothing about the run.
_NOISE = re.compile(r"POST /v1/|GET /metrics|GET /health|GET /v1/models|POST /(start|stop)_prof")
# The profiler's schedule in h200.sh: 12 engine iterations after 8 skipped.
PROFILED_STEPS = 12
# The servers h200.sh starts, in the order the summary lists them.
# The journey's (benchmarks/journey_h200/): the release on Humming, the conversion with and
# without the fix, and on vLLM's Triton FP8 MoE.
SERVERS = ("fix", "stock", "triton", "deepgemm", "v4hum", "v4fix", "v4stock", "v4triton")
TITLE = "Serving on one {gpu}: stock vs per-expert (vLLM 0.26.0, FlashInfer CUTLASS MoE)"


def gpu_of(smi: Path) -> str | None:
    """The GPU model of the lease from `collect`'s nvidia-smi.txt ("H200", "H100"): a lease
    asked for an H200 may get an H100, and the heading must say which ran."""
    m = re.search(r"NVIDIA (H\d+)", smi.read_text(errors="replace")) if smi.is_file() else None
    return m.group(1) if m else None


def kernel_class(name: str) -> str:
    """What a GPU kernel of a vLLM DeepSeek step is, for the time split."""
    if "fp8_gemm_kernel_swapAB" in name:
        return "MoE GEMM: DeepGEMM swap-A/B"
    if "deep_gemm::fp8_gemm_kernel" in name:
        return "MoE GEMM: DeepGEMM regular"
    if name.startswith("fused_moe_kernel"):
        return "MoE GEMM: Triton fused_moe"
    if "deep_gemm::sm90_fp8_gemm" in name:  # vLLM's vendored DeepGEMM (--moe-backend deep_gemm)
        return "MoE GEMM: vLLM DeepGEMM grouped"
    moe = ("Moe", "moe_", "expandInputRows", "scale_1x128", "doActivation", "moe::",
           "ep_scatter", "ep_gather", "silu_mul", "act_and_mul")  # fmt: skip
    if any(m in name for m in moe):
        return "MoE other (routing, permute, act quant, finalize)"
    if "cutlass_3x_gemm_fp8_blockwise" in name:
        return "dense FP8 GEMMs (attention, shared expert, dense layer)"
    if "flash" in name.lower():
        return "attention"
    if "distribution_elementwise" in name or "sbtopk" in name or "sort" in name.lower():
        return "sampling and top-k (router, sampler)"
    return "other"


def split(profile: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in profile["kernels"]:
        c = kernel_class(k["name"])
        out[c] = out.get(c, 0.0) + k["total_us"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def moe_kernels(profile: dict) -> list[dict]:
    return [k for k in profile["kernels"] if kernel_class(k["name"]).startswith("MoE GEMM")]


def _short(name: str) -> str:
    """`fp8_gemm_kernel_swapAB<N, K, BM, BN, BK, groups, stages, ...>` -> its first 7 args."""
    m = re.search(r"(fp8_gemm_kernel(?:_swapAB)?)<([^>]*?),\s*deep_gemm::(\w+)<([^>]*)>", name)
    if not m:
        return name[:80]
    args = [a.strip().rstrip("u") for a in m.group(2).split(",")]
    sched = [a.strip().rstrip("u") for a in m.group(4).split(",")]
    n, k, bm, bn, _bk, groups, stages = args[:7]
    rows = f", rows {sched[-2]}..{sched[-1]}" if len(sched) >= 9 else ""
    return (f"{m.group(1)} N={n} K={k} BLOCK_M={bm} BLOCK_N={bn} groups={groups} "
            f"stages={stages} ({m.group(3)}{rows})")  # fmt: skip


def summary(root: Path, reports: dict[str, Path], title: str, baseline: str = "stock") -> str:
    chk = root / "check"
    logs = {n: root / "logs" / f"{n}.log" for n in SERVERS}
    lines = [f"# {title}", ""]
    lines += _loaded(logs)
    lines += _memory(logs)
    lines += _profiles(chk, logs)
    lines += _correctness(chk)
    lines += _routing(chk)
    lines += _steptimes(root)
    steps = _read_steps(root / "steps")
    lines += _step_intervals(steps)
    lines += _sweeps(reports)
    lines += _sweep_steps(root, steps, baseline)
    lines += _mixed_steps(root, steps, baseline)
    lines += _window_clocks(root, baseline)
    return "\n".join(lines) + "\n"


def _loaded(logs: dict[str, Path]) -> list[str]:
    """What each server's log says it loaded: the plugin's lines and the MoE backend."""
    lines: list[str] = []
    lines += ["## What each server loaded (its own log lines)", ""]
    for n, p in logs.items():
        if not p.exists():
            continue
        text = p.read_text(errors="replace")
        picked = [ln.split("] ", 1)[-1] for ln in text.splitlines()
                  if "vllm-h20:" in ln and "EngineCore" in ln]  # fmt: skip
        # FP8 checkpoints log "Using X Fp8 MoE backend", MXFP4 ones "Using 'X' Mxfp4 MoE backend".
        backend = re.search(r"Using '?(\w+)'? (Fp8|Mxfp4) MoE backend", text)
        kind = f" {backend.group(2).upper()}" if backend and backend.group(2) != "Fp8" else ""
        lines.append(f"- **{n}** (MoE backend {backend.group(1) if backend else '?'}{kind}):")
        lines += [f"  - `{x[:300]}`" for x in dict.fromkeys(picked)]
        if backend and backend.group(1) != "FLASHINFER_CUTLASS":
            lines.append("  - the plugin is loaded, but this MoE backend never calls FlashInfer's "
                         "fused MoE: neither dispatch applies")  # fmt: skip
    lines.append("")
    return lines


# vLLM's start-up lines that size what a server can hold: weights, the KV cache it allocated,
# how many full-length requests that cache holds, and how long the engine took to start.
_START_UP = {
    "weights GiB": r"Model loading took ([\d.]+) GiB",
    "KV cache tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "requests of max length": r"Maximum concurrency for ([\d,]+ tokens) per request: ([\d.]+x)",
    "init engine s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}


_ENGINE_START = "Initializing a V1 LLM engine"


def start_up(log: Path) -> dict[str, str]:
    """_START_UP's values from a server log, the last start's where it started more than once
    (a start that died before its KV cache line leaves that cell empty, not the earlier one's)."""
    text = log.read_text(errors="replace")
    text = text[max(0, text.rfind(_ENGINE_START)) :]
    out = {}
    for col, pat in _START_UP.items():
        found = re.findall(pat, text)
        if found:
            last = found[-1]
            out[col] = f"{last[1]} at {last[0]}" if isinstance(last, tuple) else last
    return out


def _memory(logs: dict[str, Path]) -> list[str]:
    """start_up per server as a table (issue 1/4: KV capacity from each server's log)."""
    rows = {n: start_up(p) for n, p in logs.items() if p.exists()}
    rows = {n: r for n, r in rows.items() if r}
    if not rows:
        return []
    head = "| server | " + " | ".join(_START_UP) + " |"
    rule = "|---|" + "---:|" * len(_START_UP)
    lines = ["## Memory and start-up (each server's log)", "", head, rule]
    for n, r in rows.items():
        lines.append(f"| {n} | " + " | ".join(r.get(c, "n/a") for c in _START_UP) + " |")
    return [*lines, ""]


def _profiles(chk: Path, logs: dict[str, Path]) -> list[str]:
    """GPU time per decode step by kernel class, and the MoE GEMM kernels, per server."""
    lines: list[str] = []
    order = ("stock", "fix", "triton", "deepgemm", "v4hum", "v4stock", "v4fix", "v4triton")
    found = [n for n in order if (chk / f"profile_{n}.json").exists()]
    profs = {n: json.loads((chk / f"profile_{n}.json").read_text()) for n in found}
    if profs:
        conc = next(iter(profs.values()))["concurrency"]
        title = f"## GPU time per decode step at c{conc} (torch profiler, {PROFILED_STEPS} steps)"
        lines += [title, "", "| kernels | " + " | ".join(profs) + " |",
                  "|---|" + "---:|" * len(profs)]  # fmt: skip
        splits = {n: split(p) for n, p in profs.items()}
        classes = list(dict.fromkeys(c for s in splits.values() for c in s))
        for c in classes:
            cells = []
            for n in profs:
                us = splits[n].get(c, 0.0)
                share = us / profs[n]["kernel_us_total"]
                cells.append(f"{us / PROFILED_STEPS / 1e3:.3f} ms ({share:.0%})")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("| **all kernels** | " + " | ".join(
            f"**{p['kernel_us_total'] / PROFILED_STEPS / 1e3:.3f} ms**" for p in profs.values()
        ) + " |")  # fmt: skip
        if all("gpu_busy_us" in p for p in profs.values()):  # probes since round 4
            lines.append("| **GPU busy (overlapping kernels once)** | " + " | ".join(
                f"**{p['gpu_busy_us'] / PROFILED_STEPS / 1e3:.3f} ms**" for p in profs.values()
            ) + " |")  # fmt: skip
        ran = [n for n in SERVERS if logs[n].exists()]
        if missing := [n for n in ran if n not in profs]:
            lines += ["", f"No profile from {', '.join(missing)} (see the README for why)."]
        lines += ["", "MoE GEMM kernels that ran (per call = per MoE layer and step):", ""]
        for n, p in profs.items():
            for k in moe_kernels(p):
                lines.append(f"- {n}: {k['calls']}x, {k['total_us'] / k['calls']:.1f} us per "
                             f"call: `{_short(k['name'])}`")  # fmt: skip
        lines.append("")
    return lines


def _correctness(chk: Path) -> list[str]:
    """Greedy outputs and first-token logprobs of each compared pair of servers."""
    lines: list[str] = []
    # compare.json: round 2's single pair; compare_A-B.json: one per pair since round 3.
    for cp in sorted(chk.glob("compare*.json")):
        c = json.loads(cp.read_text())
        a, b = c["servers"]
        rows = c["rows"]
        same = sum(r["identical_tokens"] for r in rows)
        total = sum(len(r["tokens"][0]) for r in rows)
        diffs = [r["first_token_max_abs_logprob_diff"] for r in rows
                 if r["first_token_max_abs_logprob_diff"] is not None]  # fmt: skip
        lp = rows[0]["first_token_logprob"][0]
        lines += [f"## Correctness: {a} vs {b} (greedy, {len(rows)} fixed prompts)", "",
                  f"- first-token top-{c['top_logprobs']} logprobs: max |difference| "
                  f"{max(diffs):.3g} over the tokens both list;",
                  f"- first {c['max_tokens']} greedy tokens: {same} of {total} identical; "
                  f"identical prefixes {min(r['identical_prefix'] for r in rows)}-"
                  f"{max(r['identical_prefix'] for r in rows)} tokens;",
                  f"- the first token's logprob is {lp:.4f} (a flat distribution over the "
                  f"1,024-token vocabulary would give {-math.log(1024):.4f})."]  # fmt: skip
        if abs(lp + math.log(1024)) < 0.01:
            lines.append(
                "- the logits are flat (dummy weights), so this shows identical bits, "
                "not that the two paths agree on a model with real logits."
            )
        lines.append("")
    return lines


def _routing(chk: Path) -> list[str]:
    """Routed rows per step and per expert, from vLLM's routed-experts capture."""
    lines: list[str] = []
    for rt in sorted(chk.glob("routing_*.json")):
        r = json.loads(rt.read_text())
        who = "" if rt.stem == "routing_fix" else f", {rt.stem.removeprefix('routing_')}"
        lines += [f"## Routing in single decode steps (vLLM's routed-experts capture{who})", ""]
        for t in r["tiers"]:
            moe = t.get("varied_layers", t.get("moe_layers"))
            lines.append(f"- c{t['concurrency']}: {t['rows_per_step']} routed rows per step "
                         f"({t['mean_rows_per_expert']:.1f} per expert on average); layers whose "
                         f"tokens chose different experts: {moe or 'none'}; uniform random "
                         f"routing would leave {t['uniform_random']['zero']:.0f} experts idle "
                         f"with the busiest at {t['uniform_random']['max']:.1f} rows.")  # fmt: skip
        head = "Rows per expert in the last recorded decode step (histogram: `rows: experts`):"
        lines += ["", head, ""]
        for t in r["tiers"]:
            step = t["counts"][-1]
            for layer in t.get("varied_layers") or []:
                hist = collections.Counter(step[layer])
                cells = " ".join(f"{k}:{hist[k]}" for k in sorted(hist))
                lines.append(f"- c{t['concurrency']} layer {layer}: {cells}")
        lines.append("")
    return lines


def _steptimes(root: Path) -> list[str]:
    """Step time per shape and arm (steptime.py), each arm against the first with a 95 % CI:
    from the wall clock, and from the engines' own GPU step times where they were logged."""
    lines: list[str] = []
    # The main run first, then the extra runs in their own folders.
    for f in sorted((root / "steptime").glob("**/steptime.json"), key=lambda f: (len(f.parts), f)):
        res = json.loads(f.read_text())
        what = ("identical prompts, greedy: every token of a step routes to the same experts"
                if res["config"].get("identical") else "unique prompts, greedy")  # fmt: skip
        lines += [f"## Step time: {what} ([`{f.relative_to(root)}`]({f.relative_to(root)}))", "",
                  f"`{res['command']}`", ""]  # fmt: skip
        if any("gpu_step_ms" in s for s in res["samples"]):
            lines += ["GPU time per step (the engines' CUDA events; decode: the median over the "
                      "steps that ran exactly the batch; prefill: the long batch's GPU time "
                      "minus the short one's):", ""]  # fmt: skip
            lines += _ratio_table(res, "gpu_step_ms", 1.0)
            lines += ["Wall clock (two batches' difference):", ""]
        lines += _ratio_table(res, "step_s", 1e3)
    return lines


def _read_steps(steps_dir: Path) -> dict[str, list[dict]]:
    """{server: its engine steps in time order} from the published step logs
    (`steps/SERVER.jsonl.gz`, written by _keep_step_logs), read once for every table."""
    logs = sorted(steps_dir.glob("*.jsonl.gz")) if steps_dir.exists() else []
    return {log.name.removesuffix(".jsonl.gz"):
            [json.loads(x) for x in gzip.decompress(log.read_bytes()).splitlines()]
            for log in logs}  # fmt: skip


def _ci_cell(ci) -> str:
    """A ratio with its 95 % CI, marked when the CI spans 1."""
    return f"{ci.ratio:.3f} ({ci.low:.3f}-{ci.high:.3f}{'' if ci.resolved else ', not resolved'})"


def _step_intervals(
    steps: dict[str, list[dict]], batches: tuple[int, ...] = (64, 128, 256)
) -> list[str]:
    """Where a decode step's time goes, from the engines' step logs: per server and batch, the
    interval between consecutive steps that both ran exactly B requests (under 0.5 s apart: the
    same batch), beside the GPU's and the host's time of a step (medians, 10-90 % range)."""
    if not steps:
        return []
    lines = ["## Step interval, GPU and host time per decode step (`steps/*.jsonl.gz`)", "",
             "Every decode step of the lease that ran exactly B requests and was followed by "
             "another within 0.5 s: the interval between their starts, the GPU's time (forward "
             "to sampled tokens) and the host's time in execute_model + sample_tokens; median "
             "(10-90 %), over every run of the lease (the identical-prompt steps are the short "
             "GPU ones). An interval well above the GPU time: the host sets the pace.", "",
             "| server | batch | steps | interval | GPU | host |",
             "|---|---:|---:|---|---|---|"]  # fmt: skip

    def spread(v: list[float]) -> str:
        q = statistics.quantiles(v, n=10)
        return f"{statistics.median(v):.2f} ms ({q[0]:.2f}-{q[-1]:.2f})"

    for server, log in steps.items():
        for b in batches:
            pairs = _decode_pairs(log, b, -math.inf, math.inf)
            if len(pairs) < 2:
                continue
            iv = [(c["t"] - a["t"]) * 1e3 for a, c in pairs]
            lines.append(f"| {server} | {b} | {len(pairs)} | "
                         f"{spread(iv)} | {spread([a['gpu_ms'] for a, _ in pairs])} | "
                         f"{spread([a['host_ms'] for a, _ in pairs])} |")  # fmt: skip
    return [*lines, ""]


def paired_by_repeat(res: dict, shape: str, key: str) -> dict[str, dict[int, float]]:
    """{arm: {repeat: value of `key`}} for one shape of a steptime.json, kept to the timed
    repeats every arm has (the pairing the ratios rest on)."""
    by: dict[str, dict[int, float]] = {a: {} for a in res["arms"]}
    for s in res["samples"]:
        if s["shape"] == shape and s["rep"] >= 0 and key in s:
            by[s["arm"]][s["rep"]] = s[key]
    common = set.intersection(*(set(v) for v in by.values()))
    return {a: {r: v[r] for r in sorted(common)} for a, v in by.items()}


def _ratio_table(res: dict, key: str, to_ms: float) -> list[str]:
    """Median of `key` per arm (n repeats, coefficient of variation), then each arm over the
    first arm, paired by repeat: geometric mean and 95 % CI."""
    from vllm_h20.bench.stats import paired_ratio_ci

    arms = res["arms"]
    ref, others = arms[0], arms[1:]
    lines = [f"Median step time per arm (n repeats, coefficient of variation); then each arm's "
             f"step time over {ref}'s, paired by repeat: geometric mean and 95 % CI (above 1: "
             f"{ref} is faster; a CI that spans 1 is not resolved).", "",
             "| shape | n | " + " | ".join(arms) + " | " +
             " | ".join(f"{a} / {ref}" for a in others) + " |",
             "|---|---:|" + "---:|" * (2 * len(arms) - 1)]  # fmt: skip
    for shape in dict.fromkeys(s["shape"] for s in res["samples"]):
        by = paired_by_repeat(res, shape, key)
        reps = sorted(by[ref])
        if not reps:
            continue
        cells = []
        for a in arms:
            v = [by[a][r] * to_ms for r in reps]
            cv = statistics.stdev(v) / statistics.fmean(v) if len(v) > 1 else float("nan")
            cells.append(f"{statistics.median(v):.2f} ms ({cv:.0%})")
        for a in others:
            try:
                ci = paired_ratio_ci([by[a][r] for r in reps], [by[ref][r] for r in reps])
            except ValueError:  # a difference of two walls that noise made <= 0
                cells.append("not resolved (a sample <= 0)")
                continue
            cells.append(_ci_cell(ci))
        lines.append(f"| {shape} | {len(reps)} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _sweeps(reports: dict[str, Path]) -> list[str]:
    lines: list[str] = []
    for name, rep in reports.items():
        head = (rep / "report.md").read_text().split("## Latency")[0]
        table = "\n".join(x for x in head.splitlines() if x.startswith("|"))
        lines += [f"## {name} sweep ([report]({rep.name}/report.md))", "", table, "",
                  f"![{name} throughput]({rep.name}/throughput.png)", ""]  # fmt: skip
    return lines


def _decode_pairs(steps: list[dict], batch: int, t0: float, t1: float) -> list[tuple[dict, dict]]:
    """Consecutive decode steps of exactly `batch` requests that started in [t0, t1] and less
    than 0.5 s apart (the same batch, no pause between them)."""
    return [(a, c) for a, c in zip(steps, steps[1:], strict=False)
            if t0 <= a["t"] and c["t"] <= t1
            and a["tokens"] == a["reqs"] == c["tokens"] == c["reqs"] == batch
            and c["t"] - a["t"] < 0.5]  # fmt: skip


def _within(rows: list[dict], key: str) -> list[float]:
    """Each run's `key` less its target's mean over the runs: the pooled within-arm
    deviations, so a correlation over them is not made by the gap between the arms."""
    means = {t: statistics.fmean(x[key] for x in rows if x["target"] == t)
             for t in {x["target"] for x in rows}}  # fmt: skip
    return [x[key] - means[x["target"]] for x in rows]


def _r(a: list[float], b: list[float]) -> str:
    """Pearson's r of two columns of deviations, or why there is none: a column that does not
    move (a step interval logged to 0.1 ms can be the same median in every run) has no r, and
    float rounding must not make one up."""
    if max(map(abs, a)) < 1e-9 or max(map(abs, b)) < 1e-9:
        return "r: none (a column has no spread)"
    return f"r = {statistics.correlation(a, b):.2f}"


def _window_runs(root: Path):
    """Each finished sweep run with a GuideLLM window: (sweep name, its run record, the
    window's start and end in Unix time)."""
    for f in sorted((root / "sweeps").glob("*/runs/*/c*-r*.json")):
        r = json.loads(f.read_text())
        window = (r.get("guidellm") or {}).get("window")
        if r.get("status") == "ok" and window:
            yield f.parents[2].name, r, window["start"], window["end"]


def _sweep_runs(root: Path, steps: dict[str, list[dict]]):
    """_window_runs of the targets that logged steps, each with the steps that started inside
    its window."""
    for sweep, r, t0, t1 in _window_runs(root) if steps else ():
        if r["target"] in steps:
            inside = [x for x in steps[r["target"]] if t0 <= x["t"] <= t1]
            yield sweep, r, t0, t1, inside


def _welch_cell(base: list[float], other: list[float]) -> str:
    """The baseline's runs over a target's: ratio of geometric means and its Welch 95 % CI,
    or "n < 2" when either side has fewer than two runs."""
    from vllm_h20.bench.stats import welch_ratio_ci

    if len(base) < 2 or len(other) < 2:
        return "n < 2"
    return _ci_cell(welch_ratio_ci(base, other))


# Scheduled-token bins of the mixed steps (a decode batch with prefill chunks riding along):
# above the recipe's 256-token CUDA graphs, where the forward runs eager.
MIXED_BINS = ((256, 512), (512, 768), (768, 1024), (1024, 1280))


def _mixed_steps(root: Path, steps: dict[str, list[dict]], baseline: str) -> list[str]:
    """The steps of each sweep run that carried prefill tokens beside the decode batch, binned
    by scheduled tokens: each run's median GPU and host time per bin, and the baseline's over
    each target's with a Welch 95 % CI over runs. It is the prefill-chunk A/B taken under load,
    where an eager forward's CUDA events time the GPU only if the host issued faster than the GPU
    ran (host below GPU in the table)."""
    cells: dict[tuple, dict[str, list[tuple[float, float, float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for sweep, r, _, _, inside in _sweep_runs(root, steps):
        for lo, hi in MIXED_BINS:
            got = [x for x in inside if x["tokens"] > x["reqs"] and lo <= x["tokens"] < hi
                   and "gpu_ms" in x]  # fmt: skip
            if len(got) >= 5:
                cells[(sweep, r["concurrency"], lo, hi)][r["target"]].append((
                    statistics.median(x["gpu_ms"] for x in got),
                    statistics.median(x["host_ms"] for x in got),
                    statistics.median(x["tokens"] for x in got)))  # fmt: skip
    if not cells:
        return []
    lines = ["## Mixed steps inside each sweep run's window (`steps/*.jsonl.gz`)", "",
             "Steps that carried prefill tokens beside the decode batch, by scheduled tokens "
             "(eager forward above the 256-token CUDA graphs), in runs with at least 5 such "
             "steps: the runs' mean of each run's median tokens, GPU and host time; then the "
             "baseline's GPU time over each target's, a Welch 95 % CI over runs (above 1: the "
             "target's step is shorter). Host time below GPU time: the GPU set the pace and its "
             "CUDA events time the kernels, not the host's issue rate.", "",
             "| sweep | concurrency | tokens | target | runs | median tokens | GPU | host "
             "| GPU ratio |",
             "|---|---:|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for (sweep, conc, lo, hi), by in sorted(cells.items()):
        base = [v[0] for v in by.get(baseline, [])]
        for target, vals in sorted(by.items(), key=lambda kv: kv[0] != baseline):
            gpu = [v[0] for v in vals]
            rel = "baseline" if target == baseline else _welch_cell(base, gpu)
            lines.append(f"| {sweep} | {conc} | {lo}-{hi - 1} | {target} | {len(vals)} | "
                         f"{statistics.fmean(v[2] for v in vals):.0f} | "
                         f"{statistics.fmean(gpu):.2f} ms | "
                         f"{statistics.fmean(v[1] for v in vals):.2f} ms | {rel} |")  # fmt: skip
    return [*lines, ""]


def _smi_samples(csv_path: Path) -> list[tuple[float, float, float]]:
    """(Unix time, SM clock MHz, power W) of each row `log_gpu` wrote. nvidia-smi prints the
    machine's local time, which is UTC on the lent machines (their windows line up with it)."""
    import datetime

    out = []
    for line in csv_path.read_text(errors="replace").splitlines():
        cells = [c.strip() for c in line.split(",")]
        try:
            when = datetime.datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f")
            clock, power = float(cells[1].split()[0]), float(cells[3].split()[0])
        except (ValueError, IndexError):  # the header, a cut last line, "[N/A]"
            continue
        out.append((when.replace(tzinfo=datetime.UTC).timestamp(), clock, power))
    return out


def window_clocks(root: Path) -> dict[tuple[str, int, str], list[tuple[float, ...]]]:
    """Per (sweep, concurrency, target), each run's (mean SM clock, lowest clock, mean power,
    highest power) over the nvidia-smi samples inside its GuideLLM window: a kernel that draws
    the board to its power cap runs at a lower clock, and that is part of any step-time
    difference measured on the same GPU."""
    rows: dict[tuple[str, int, str], list[tuple[float, ...]]] = collections.defaultdict(list)
    samples: dict[str, list[tuple[float, float, float]]] = {}  # each sweep's log, read once
    for sweep, r, t0, t1 in _window_runs(root):
        if sweep not in samples:
            csv_path = root / "sweeps" / f"nvidia-smi-{sweep}.csv"
            samples[sweep] = _smi_samples(csv_path) if csv_path.is_file() else []
        got = [(c, p) for t, c, p in samples[sweep] if t0 <= t <= t1]
        if len(got) < 5:
            continue
        rows[(sweep, r["concurrency"], r["target"])].append((
            statistics.fmean(c for c, _ in got), min(c for c, _ in got),
            statistics.fmean(p for _, p in got), max(p for _, p in got)))  # fmt: skip
    return rows


def _window_clocks(root: Path, baseline: str) -> list[str]:
    """window_clocks as a table, the baseline first in each cell."""
    rows = window_clocks(root)
    if not rows:
        return []
    lines = ["## Clocks and power inside each sweep run's window (`sweeps/nvidia-smi-*.csv`)", "",
             "nvidia-smi once a second: per run, the mean SM clock and board power over the "
             "samples inside its GuideLLM window; the range of those means over runs, the "
             "lowest clock and the highest power sampled in any of them.", "",
             "| sweep | concurrency | target | runs | SM clock, mean per run | lowest "
             "| power, mean per run | highest |",
             "|---|---:|---|---:|---|---:|---|---:|"]  # fmt: skip

    def span(xs: list[float], unit: str) -> str:
        lo, hi = min(xs), max(xs)
        return f"{lo:,.0f} {unit}" if round(lo) == round(hi) else f"{lo:,.0f}-{hi:,.0f} {unit}"

    for (sweep, conc, target), vals in sorted(rows.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] != baseline, kv[0][2])):  # fmt: skip
        clock, power = span([v[0] for v in vals], "MHz"), span([v[2] for v in vals], "W")
        lines.append(f"| {sweep} | {conc} | {target} | {len(vals)} | {clock} | "
                     f"{min(v[1] for v in vals):,.0f} MHz | {power} | "
                     f"{max(v[3] for v in vals):,.0f} W |")  # fmt: skip
    return [*lines, ""]


def _sweep_steps(root: Path, steps: dict[str, list[dict]], baseline: str) -> list[str]:
    """Each sweep run's engine steps, from the engines' step logs inside that run's GuideLLM
    window: the median interval between decode steps of the tier's full batch and their median
    GPU time; then the baseline's over each target's, a Welch 95 % CI over runs; then each
    run's counts, and how its throughput follows them. It says how much of a GPU-step change
    reaches the wall clock while the sweep measures, and what sets the runs' spread."""
    per_run = []
    for sweep, r, t0, t1, inside in _sweep_runs(root, steps):
        pairs = _decode_pairs(steps[r["target"]], r["concurrency"], t0, t1)
        if len(pairs) < 2:
            continue
        per_run.append({
            "cell": (sweep, r["concurrency"]), "target": r["target"],
            "run": r["run"], "started": r["started"], "throughput": r["throughput"],
            "steps": len(inside), "decode": sum(x["tokens"] == x["reqs"] for x in inside),
            "full": len(pairs),
            "interval": statistics.median((c["t"] - a["t"]) * 1e3 for a, c in pairs),
            "gpu": statistics.median(a["gpu_ms"] for a, _ in pairs)})  # fmt: skip
    if not per_run:
        return []
    cells: dict[tuple[str, int], dict[str, list[dict]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for x in per_run:
        cells[x["cell"]][x["target"]].append(x)
    lines = ["## Decode steps inside each sweep run's window (`steps/*.jsonl.gz`)", "",
             "Per run: the median interval between consecutive decode steps of the tier's full "
             "batch, and their median GPU time, over the steps that started inside the run's "
             "GuideLLM window; mean over runs. Then the baseline's over each target's (above 1: "
             "the target's step is shorter), ratio of geometric means with a Welch 95 % CI over "
             "runs. The interval is what the sweep's throughput sees; the GPU time, what the "
             "kernels changed.", "",
             "| sweep | concurrency | target | runs | interval | GPU "
             "| interval ratio | GPU ratio |",
             "|---|---:|---|---:|---:|---:|---|---|"]  # fmt: skip

    for (sweep, conc), by in sorted(cells.items()):
        base = by.get(baseline, [])
        for target, vals in sorted(by.items(), key=lambda kv: kv[0] != baseline):
            iv, gpu = [v["interval"] for v in vals], [v["gpu"] for v in vals]
            rel = ("baseline", "baseline") if target == baseline else (
                _welch_cell([b["interval"] for b in base], iv),
                _welch_cell([b["gpu"] for b in base], gpu))  # fmt: skip
            lines.append(f"| {sweep} | {conc} | {target} | {len(vals)} | "
                         f"{statistics.fmean(iv):.2f} ms | {statistics.fmean(gpu):.2f} ms | "
                         f"{rel[0]} | {rel[1]} |")  # fmt: skip
    lines += ["", "Each run, in the order it ran: its throughput (vLLM's counters), the engine "
              "steps that started inside its window, how many of them were pure decode "
              "(no prefill riding along), how many pairs of consecutive decode steps ran the "
              "full batch (the two columns after it are medians over those), and Pearson's r "
              "of the throughput with the steps and with the interval over all runs of the "
              "tier, each run taken from its target's mean (so r says what moves runs of one "
              "arm, not that the arms differ).", "",
              "| sweep | concurrency | target | run | output tok/s | steps | decode steps "
              "| full-batch pairs | interval | GPU |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (sweep, conc), by in sorted(cells.items()):
        rows = sorted((x for v in by.values() for x in v), key=lambda x: x["started"])
        for x in rows:
            lines.append(
                f"| {sweep} | {conc} | {x['target']} | r{x['run']} | {x['throughput']:,.0f} | "
                f"{x['steps']:,} | {x['decode']:,} | {x['full']:,} | {x['interval']:.2f} ms | "
                f"{x['gpu']:.2f} ms |"
            )
        if len(rows) - len(by) < 3:  # too few runs beside the arms' means for an r to say much
            continue
        thr = _within(rows, "throughput")
        lines += ["", f"{sweep}, concurrency {conc}: throughput against steps in the window "
                  f"{_r(thr, _within(rows, 'steps'))}, against the full-batch interval "
                  f"{_r(thr, _within(rows, 'interval'))} ({len(rows)} runs).", ""]  # fmt: skip
    return [*lines, ""]


def _keep_step_logs(src: Path, dst: Path) -> None:
    """Each server's per-step GPU log (every process's lines, in time order), gzipped: the raw
    evidence behind steptime.json's GPU columns."""
    from vllm_h20.serve.steptimes import read

    for d in sorted(p for p in src.glob("*") if p.is_dir()) if src.exists() else []:
        steps = read(d)
        if steps:
            dst.mkdir(parents=True, exist_ok=True)
            body = "".join(json.dumps(x) + "\n" for x in steps).encode()
            (dst / f"{d.name}.jsonl.gz").write_bytes(gzip.compress(body, mtime=0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tarball", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--baseline", default="stock")
    ap.add_argument(
        "--title",
        help="the summary's heading (default: the serving A/B's, naming the "
        "GPU in logs/nvidia-smi.txt; the journey passes its own)",
    )
    a = ap.parse_args(argv)
    # The step logs, the ratios and `bench report` come from the package; without it the run
    # would stop halfway with a traceback (round 7 did, in a venv without it installed).
    if importlib.util.find_spec("vllm_h20") is None:
        raise SystemExit(
            f"report: {sys.executable} cannot import vllm_h20: `pip install -e .` from the "
            "repository (or run report.py with the Python that has it)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with tarfile.open(a.tarball) as t:
            t.extractall(root, filter="data")
        # Before anything is written: a tarball that names no GPU leaves no half-made folder.
        title = a.title
        if title is None:
            gpu = gpu_of(root / "logs" / "nvidia-smi.txt")
            if gpu is None:
                raise SystemExit(
                    f"report: {a.tarball}: its logs/nvidia-smi.txt (written by `h200.sh "
                    "collect`) names no NVIDIA H-series GPU; pass --title"
                )
            title = TITLE.format(gpu=gpu)
        a.out.mkdir(parents=True, exist_ok=True)
        for sub in ("check", "sweeps", "steptime"):
            if (root / sub).exists():
                shutil.copytree(root / sub, a.out / sub, dirs_exist_ok=True)
        _keep_step_logs(root / "steps", a.out / "steps")
        (a.out / "logs").mkdir(exist_ok=True)
        for p in (root / "logs").iterdir():
            text = p.read_text(errors="replace")
            if p.suffix == ".log":
                text = "".join(ln for ln in text.splitlines(keepends=True) if not _NOISE.search(ln))
            (a.out / "logs" / p.name).write_text(text)
    reports = {}
    for spec in ("decode", "prefill"):
        # Relative to the results folder, so the reports name `sweeps/...`, not a temp dir.
        dirs = sorted(d.relative_to(a.out) for d in (a.out / "sweeps").glob(f"{spec}*")
                      if (d / "sweep.json").exists())  # fmt: skip
        if dirs:
            cmd = [sys.executable, "-m", "vllm_h20.cli", "bench", "report", *map(str, dirs),
                   "--baseline", a.baseline, "--out", spec]  # fmt: skip
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=a.out)
            reports[spec] = a.out / spec
    (a.out / "summary.md").write_text(summary(a.out, reports, title, a.baseline))
    print(f"wrote {a.out}/summary.md")


if __name__ == "__main__":
    main()
