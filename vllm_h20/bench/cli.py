"""`vllm-h20 bench sweep | report | gsm8k`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click

from ..console import make_console
from ..exits import EXIT_CHECK_FAILED, UserErrorGroup
from ..exits import fail as _fail

_EXTRA = "pip install 'vllm-h20[bench]'"


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        _fail(f"{', '.join(missing)} not installed; {_EXTRA}")


def _user_errors():
    from .gsm8k import GSM8KError
    from .report import ReportError
    from .spec import SpecError
    from .sweep import SweepError
    from .targets import TargetError

    return (GSM8KError, ReportError, SpecError, SweepError, TargetError)


@click.group(cls=UserErrorGroup, user_errors=_user_errors)
def bench() -> None:
    """Compare deployments: GuideLLM sweeps, reports with plots, the paired GSM8K check.

    \b
    vllm-h20 bench sweep decode --target humming=http://a:8000 --target fp8=http://b:8000 \\
        --tokenizer /models/DeepSeek-V4.1-Flash --out sweeps/decode
    vllm-h20 bench report sweeps/decode --baseline humming
    vllm-h20 bench gsm8k --target humming=http://a:8000 --target fp8=http://b:8000 \\
        --data gsm8k/test.jsonl --limit 500 --out runs/gsm8k
    """


_target_opt = click.option(
    "--target",
    "targets",
    multiple=True,
    metavar="NAME=URL",
    help="An OpenAI-compatible server to measure (repeatable); NAME labels its results.",
)


@bench.command("sweep")
@click.argument("spec")
@_target_opt
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Results directory.")
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path),
    default=None,
    metavar="DIR",
    help="The served model's tokenizer (a directory with tokenizer.json), used offline by "
    "GuideLLM to size prompts. Default: the model directory the server reports, if it "
    "exists on this machine.",
)
@click.option(
    "--throughput-source",
    type=click.Choice(["server", "guidellm"]),
    default="server",
    show_default=True,
    help="server: vLLM's Prometheus token counters over the measurement window (the seed's "
    "method); guidellm: GuideLLM's client-side counts (servers without /metrics).",
)
@click.option(
    "--metrics-url",
    multiple=True,
    metavar="NAME=URL",
    help="Where target NAME's Prometheus metrics are, if not at URL/metrics; repeat for a "
    "multi-node deployment (one per node: the counters are summed).",
)
@click.option("--resume", is_flag=True, help="Continue a sweep in --out; finished runs are kept.")
@click.option(
    "--concurrency",
    "tiers",
    type=int,
    multiple=True,
    metavar="N",
    help="Run only this tier of the spec (repeatable): a sweep too long for the time at hand "
    "runs some tiers now, each with all its runs, and the rest later with --resume.",
)
@click.option(
    "--scrape-interval",
    type=click.FloatRange(min=0.05),
    default=0.5,
    show_default=True,
    help="Seconds between counter reads during a run.",
)
@click.option(
    "--stall-timeout",
    type=click.FloatRange(min=10),
    default=300,
    show_default=True,
    help="Seconds GuideLLM may take beyond warmup + measurement (its report) before the run "
    "counts as stalled; a stalled run is retried once with new prompts.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check the spec, targets, metrics, tokenizer and --out; print the plan and the "
    "first GuideLLM command; write nothing.",
)
def sweep_cmd(spec, targets, out, tokenizer, throughput_source, metrics_url, resume, tiers,
              scrape_interval, stall_timeout, dry_run):  # fmt: skip
    """Run sweep SPEC (benchmarks/sweeps/NAME.yaml or a file) against every --target.

    One GuideLLM run per target, concurrency tier and repeat, ordered run by run so drift
    hits all targets alike. Each finished run is written at once to
    OUT/runs/TARGET/cCONC-rRUN.json with the server's token counters over GuideLLM's
    measurement window, GuideLLM's own numbers, errors, incomplete requests and prefix-cache
    hits. A server that stops answering fails that run (recorded) and the sweep goes on;
    exit 1 if any run failed (rerun with --resume to retry only those).
    """
    _need("guidellm", "prometheus_client")
    from rich.markup import escape

    from ..console import step_progress
    from . import spec as spec_mod
    from .sweep import sweep
    from .targets import find_tokenizer, parse_targets, served

    s = spec_mod.load(spec)
    ts = parse_targets(targets, metrics_url)
    tok = find_tokenizer(tokenizer, [served(t).root for t in ts] if tokenizer is None else [])
    console = make_console(stderr=True)
    bar = step_progress(console)
    state = {"task": None}

    def on_run(key, rec):
        if rec is None:
            bar.update(state["task"], current=key.label(s.runs))
            return
        if rec["status"] == "ok":
            gl = rec["guidellm"]
            console.print(
                f"ok   {key.label(s.runs)}: {rec['throughput']:,.0f} {s.unit} "
                f"(GuideLLM {gl[f'{s.throughput}_tok_s']:,.0f}); "
                f"errored {gl['requests']['errored']}, incomplete {gl['requests']['incomplete']}"
            )
        else:
            console.print(f"[red]FAIL[/] {key.label(s.runs)}: {escape(rec['error'])}")
        bar.advance(state["task"])

    n_tiers = len(set(tiers)) if tiers else len(s.concurrency)
    click.echo(
        f"sweep {s.name}: {len(ts)} target(s) x {n_tiers} tier(s) x {s.runs} run(s), "
        f"{s.warmup_s:g}+{s.measure_s:g} s each; tokenizer {tok}",
        err=True,
    )

    def on_plan(total, todo):
        if todo < total:
            console.print(f"resuming: {total - todo} of {total} runs already finished")
        bar.update(state["task"], total=todo)

    if dry_run:
        import shlex

        res = sweep(out, s, ts, tok, throughput_source, resume, dry_run=True, tiers=tiers)
        # + GuideLLM's start-up and report: 9-15 s per run on a 2-core client
        # (benchmarks/results/bench/guidellm_overhead_cpu2.md)
        minutes = len(res.todo) * (s.warmup_s + s.measure_s + 15) / 60
        click.echo(
            f"would run {len(res.todo)} of {res.total} runs (about {minutes:.0f} min); "
            "every target answers"
            + (" and exports vLLM's token counters" if throughput_source == "server" else "")
        )
        if res.first_command:
            click.echo("first run: " + shlex.join(res.first_command))
        sys.exit(0)
    with bar:
        state["task"] = bar.add_task(f"sweep {s.name}", total=None, current="")
        res = sweep(out, s, ts, tok, throughput_source, resume, on_run, scrape_interval, on_plan,
                    stall_timeout=stall_timeout, tiers=tiers)  # fmt: skip
    click.echo(
        f"{res.ok} run(s) finished now, {res.skipped} earlier, {len(res.failed)} failed; "
        f"results in {out} (next: vllm-h20 bench report {out})",
        err=True,
    )
    sys.exit(EXIT_CHECK_FAILED if res.failed else 0)


@bench.command("report")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--baseline",
    default=None,
    metavar="NAME",
    help="The target the others are compared to (default: the first).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to write report.{md,csv,json}, runs.csv and the plots (default: FIRST_DIR/report).",
)
def report_cmd(dirs, baseline, out):
    """Tables and plots from one or more sweep directories of the same spec.

    report.md holds the seed's table (tier, baseline mean ± sample std, candidate mean ±
    std, change %), TTFT/ITL percentiles and a run-health table (server vs GuideLLM
    throughput, errors, incomplete requests, prefix-cache hits); report.csv and report.json
    the same numbers, runs.csv every run; throughput.png (with error bars) and latency.png
    the plots. Sweeps measured with different specs or tokenizers are refused.
    """
    _need("matplotlib")
    from . import report

    out = out or dirs[0] / "report"
    paths = report.write(list(dirs), out, baseline)
    click.echo(report.headline(paths[0]))
    for p in paths:
        click.echo(f"wrote {p}")


@bench.command("gsm8k")
@_target_opt
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    metavar="JSONL",
    help="GSM8K test split (test.jsonl: one {question, answer} object per line).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="Questions, a seeded fixed subset.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the subset.")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Output ceiling; items where any target reaches it are excluded.",
)
@click.option(
    "--request-format",
    type=click.Choice(["/v1/chat/completions", "/v1/completions"]),
    default="/v1/chat/completions",
    show_default=True,
    help="chat applies the served model's chat template; completions sends raw text.",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Requests in flight per target.",
)
@click.option(
    "--baseline",
    default=None,
    metavar="NAME",
    help="Paired against every other target (default: the first).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("gsm8k-results"),
    show_default=True,
    help="Results directory (answers per target, the paired table).",
)
@click.option(
    "--resume", is_flag=True, help="Keep the answers already in --out; ask only the rest."
)
def gsm8k_cmd(targets, data, limit, seed, max_tokens, request_format, max_concurrency,
              baseline, out, resume):  # fmt: skip
    """Paired GSM8K check: the same questions to every --target, exact numeric match.

    Temperature 0; an item is excluded from the paired score when any target hit
    --max-tokens. With two or more targets, prints the paired table (both right / only A /
    only B / both wrong) and the exact McNemar p-value against the baseline. Answers are
    appended to OUT/TARGET.jsonl as they arrive; OUT/gsm8k.md and OUT/result.json hold the
    result, OUT/gsm8k.json the question set and settings. Exit 1 if some questions could
    not be asked (rerun with --resume).
    """
    from rich.progress import MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    from .._io import write_json_atomic
    from . import gsm8k as g
    from .targets import parse_targets, served

    if data is None:
        _fail(f"no --data; pass --data test.jsonl: the {g.SOURCE_HINT}")
    ts = parse_targets(targets)
    names = [t.name for t in ts]
    if baseline is not None:
        if baseline not in names:
            _fail(f"--baseline {baseline}: no such --target (have: {', '.join(names)})")
        ts.sort(key=lambda t: t.name != baseline)
        names = [t.name for t in ts]
    items = g.select(g.load(data), limit, seed)
    opts = g.Options(max_tokens=max_tokens, request_format=request_format,
                     max_concurrency=max_concurrency)  # fmt: skip
    models = {t.name: served(t).model for t in ts}
    man = g.prepare(out, g.manifest(data, items, seed, limit, opts), models, resume)
    console = make_console(stderr=True)
    results = {}
    with Progress(
        *Progress.get_default_columns()[:2],
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        for t in ts:
            path = out / f"{t.name}.jsonl"
            have = len(g.read_results(path))
            task = bar.add_task(f"gsm8k {t.name}", total=len(items), completed=have)
            results[t.name] = g.run_target(
                t, models[t.name], items, path, opts, lambda r, task=task: bar.advance(task)
            )
    indices = [it.index for it in items]
    kept, excluded, right = g.score(results, indices)
    pairs = [g.pair(results, names[0], n, kept) for n in names[1:]]
    missing = {n: len(indices) - len(r) for n, r in results.items() if len(r) < len(indices)}
    md = g.markdown(man, names, kept, excluded, right, pairs, missing)
    (out / "gsm8k.md").write_text(md)
    write_json_atomic(out / "result.json", {
        "targets": {n: man["targets"][n] for n in names},
        "scored": len(kept),
        "excluded": excluded,
        "correct": right,
        "pairs": [{**p.__dict__, "p_value": p.p_value} for p in pairs],
        "unanswered": missing,
    })  # fmt: skip
    click.echo(md)
    click.echo(f"wrote {out / 'gsm8k.md'} and {out / 'result.json'}")
    if missing:
        click.echo(f"error: unanswered questions {missing}; rerun with --resume", err=True)
        sys.exit(EXIT_CHECK_FAILED)
