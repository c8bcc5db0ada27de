"""One GuideLLM 0.8 run (one target, one concurrency tier) through its own CLI, and the
numbers we keep from its JSON report.

The CLI runs in a child process so an interrupted sweep stops it cleanly and a GuideLLM
crash is a recorded failure of one run, not of the sweep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import SweepSpec

PERCENTILES = ("p50", "p90", "p95", "p99")
STALLED = 124  # `run`'s exit code for a GuideLLM that did not finish in time


@dataclass(frozen=True)
class RunArgs:
    url: str
    model: str
    concurrency: int
    seed: int
    tokenizer: Path
    output: Path


def command(spec: SweepSpec, a: RunArgs) -> list[str]:
    """The `guidellm run` command line, in the form GuideLLM 0.8.1's own parser accepts (the
    bench tests run it against `guidellm mock-server`)."""
    backend = [
        "kind=openai_http",
        f"target={a.url}",
        f"model={a.model}",
        f"request_format={spec.request.format}",
    ]
    if spec.request.temperature is not None:
        backend.append(f"extras.body.temperature={spec.request.temperature:g}")
    data = [
        "kind=synthetic_text",
        f"prompt_tokens={spec.request.prompt_tokens}",
        f"output_tokens={spec.request.output_tokens}",
    ]
    return [
        sys.executable, "-m", "guidellm", "run",
        "--backend", ",".join(backend),
        "--profile",
        f"kind=concurrent,streams={a.concurrency},warmup.value={spec.warmup_s:g},"
        "warmup.mode=duration",
        "--constraint", f"kind=max_duration,seconds={spec.warmup_s + spec.measure_s:g}",
        "--data", ",".join(data),
        "--seed", f"kind=static,value={a.seed}",
        "--tokenizer", f"kind=huggingface_auto,model={a.tokenizer}",
        "--output", f"kind=json,path={a.output}",
        "--metrics", "kind=generative,sample_size=0",
        "--disable-console-interactive",
    ]  # fmt: skip


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, str]:
    """Run GuideLLM with its output in `log`; returns (exit code, last log line).

    Ctrl-C reaches GuideLLM through the shared process group; we wait for it to stop before
    the interrupt propagates, so no orphaned load generator keeps hitting the server."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(p)
            return STALLED, f"GuideLLM did not finish within {timeout:.0f} s"
        except BaseException:
            _stop(p)
            raise
    return code, last_line(log)


def _stop(p: subprocess.Popen) -> None:
    """Ctrl-C first (GuideLLM cancels its requests), a kill if it does not stop in 30 s."""
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _dist(d: Any, scale: float = 1.0) -> dict[str, float | None]:
    s = d.successful
    if s is None or not s.count:
        return {"mean": None, **{p: None for p in PERCENTILES}}
    pct = s.percentiles
    return {"mean": s.mean * scale, **{p: getattr(pct, p) * scale for p in PERCENTILES}}


def summarize(report_json: Path) -> dict[str, Any]:
    """The numbers of GuideLLM's report we keep beside the server counters."""
    from guidellm.benchmark import GenerativeBenchmarksReport

    rep = GenerativeBenchmarksReport.load_file(report_json)
    if len(rep.benchmarks) != 1:
        raise ValueError(f"{report_json}: expected one benchmark, found {len(rep.benchmarks)}")
    b = rep.benchmarks[0]
    m = b.metrics
    sm = b.scheduler_metrics
    totals = m.request_totals
    return {
        "guidellm_version": getattr(rep.metadata, "guidellm_version", None),
        "window": {"start": sm.measure_start_time, "end": sm.measure_end_time},
        "requests": {
            "successful": totals.successful,
            "errored": totals.errored,
            "incomplete": totals.incomplete,
        },
        "input_tok_s": m.prompt_tokens_per_second.total.mean,
        "output_tok_s": m.output_tokens_per_second.total.mean,
        "prompt_tokens_per_request": _dist(m.prompt_token_count)["mean"],
        "output_tokens_per_request": _dist(m.output_token_count)["mean"],
        "ttft_ms": _dist(m.time_to_first_token_ms),
        "itl_ms": _dist(m.inter_token_latency_ms),
        "request_latency_s": _dist(m.request_latency),
        "errors": _first_errors(b),
    }


def _first_errors(b: Any, n: int = 3) -> list[str]:
    errored = getattr(b.requests, "errored", None) or []
    out: list[str] = []
    for r in errored:
        msg = getattr(r.info, "error", None)
        if msg and msg not in out:
            out.append(str(msg)[:300])
        if len(out) >= n:
            break
    return out
