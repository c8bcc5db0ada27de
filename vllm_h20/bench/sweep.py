"""`vllm-h20 bench sweep`: every target x tier x run of a spec, one GuideLLM run each.

Layout of the output directory (each run file is written once, complete, when its run ends;
`--resume` skips runs whose file says `ok`):

    sweep.json                               spec, tokenizer, targets and served models
    runs/<target>/c<conc>-r<run>.json        our summary: server counters + GuideLLM numbers
    runs/<target>/c<conc>-r<run>.guidellm.json.gz   GuideLLM's full report
    runs/<target>/c<conc>-r<run>.log         GuideLLM's console output
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from .._io import write_json_atomic
from . import counters
from .guidellm_run import STALLED, RunArgs, command, run, summarize
from .spec import SweepSpec, fingerprint
from .targets import Target, TargetError, served, server_version, tokenizer_fingerprint

MANIFEST = "sweep.json"
SOURCES = ("server", "guidellm")


class SweepError(ValueError):
    """A sweep that must not start (or continue) as asked; nothing has been written."""


@dataclass(frozen=True)
class RunKey:
    target: str
    concurrency: int
    run: int

    @property
    def stem(self) -> str:
        return f"c{self.concurrency}-r{self.run}"

    def label(self, runs: int) -> str:
        return f"{self.target} c{self.concurrency} run {self.run + 1}/{runs}"


def plan(spec: SweepSpec, targets: list[Target], tiers: Sequence[int] = ()) -> list[RunKey]:
    """Run-major, then tier, then target: a drift in time hits every target alike. `tiers`:
    only these of the spec's (a lease too short for the whole sweep runs some now, the rest
    later with --resume, each complete)."""
    unknown = sorted(set(tiers) - set(spec.concurrency))
    if unknown:
        raise SweepError(
            f"--concurrency {', '.join(map(str, unknown))}: not a tier of sweep {spec.name} "
            f"({', '.join(map(str, spec.concurrency))})"
        )
    conc = [c for c in spec.concurrency if not tiers or c in tiers]
    return [RunKey(t.name, c, r) for r in range(spec.runs) for c in conc for t in targets]


def run_path(out: Path, key: RunKey) -> Path:
    return out / "runs" / key.target / f"{key.stem}.json"


def read_run(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def manifest(
    spec: SweepSpec, tokenizer: Path, targets: list[Target], models: dict[str, str], source: str
) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        gl = version("guidellm")
    except PackageNotFoundError:
        gl = None
    return {
        "spec": {**spec.as_dict(), "fingerprint": fingerprint(spec)},
        "tokenizer": {"path": str(tokenizer), "fingerprint": tokenizer_fingerprint(tokenizer)},
        "targets": {
            t.name: {
                "url": t.url,
                "metrics_urls": list(t.metrics_urls),
                "model": models[t.name],
                "server_version": server_version(t),
            }
            for t in targets
        },
        "throughput_source": source,
        "versions": {"vllm_h20": __version__, "guidellm": gl},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def check_compatible(old: dict[str, Any], new: dict[str, Any], where: Path) -> None:
    """Refuse to mix runs measured with another method, model or tokenizer."""
    if old["spec"]["fingerprint"] != new["spec"]["fingerprint"]:
        raise SweepError(
            f"{where}: was measured with another spec ({old['spec'].get('path')}); results "
            "with different methods do not mix: choose another --out"
        )
    if old["tokenizer"]["fingerprint"] != new["tokenizer"]["fingerprint"]:
        raise SweepError(
            f"{where}: was measured with another tokenizer ({old['tokenizer']['path']}); "
            "choose another --out or pass that --tokenizer"
        )
    if old.get("throughput_source") != new["throughput_source"]:
        raise SweepError(
            f"{where}: used --throughput-source {old.get('throughput_source')}; pass the same"
        )
    for name, t in new["targets"].items():
        prev = old["targets"].get(name)
        if prev and prev["model"] != t["model"]:
            raise SweepError(
                f"{where}: target {name} served `{prev['model']}` there, now `{t['model']}`; "
                "name the new deployment differently or choose another --out"
            )


def prepare(
    out: Path,
    spec: SweepSpec,
    targets: list[Target],
    tokenizer: Path,
    source: str,
    resume: bool,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Check every target answers and the output directory fits; write sweep.json (not on
    a dry run, which writes nothing)."""
    models = {t.name: served(t).model for t in targets}
    if source == "server":
        for t in targets:
            try:
                counters.scrape_all(t.metrics_urls)
            except counters.CountersError as e:
                raise TargetError(
                    f"target {t.name}: {e}; pass --metrics-url {t.name}=URL if the metrics are "
                    "elsewhere, or --throughput-source guidellm for client-side counts"
                ) from None
    new = manifest(spec, tokenizer, targets, models, source)
    mpath = out / MANIFEST
    if mpath.exists():
        if not resume:
            raise SweepError(
                f"{out}: already holds a sweep; pass --resume to continue it, "
                "or choose another --out"
            )
        old = read_run(mpath)
        if old is None:
            raise SweepError(f"{mpath}: unreadable; move it away or choose another --out")
        check_compatible(old, new, out)
        old["targets"].update(new["targets"])
        new = {**old, "targets": old["targets"]}
    elif out.exists() and any(out.iterdir()):
        raise SweepError(f"{out}: exists and is not a sweep directory; choose another --out")
    if dry_run:
        return new
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(mpath, new)
    return new


def pending(out: Path, keys: list[RunKey]) -> Iterator[RunKey]:
    for k in keys:
        doc = read_run(run_path(out, k))
        if not doc or doc.get("status") != "ok":
            yield k


def _gzip(raw: Path) -> None:
    """Keep GuideLLM's report (the evidence) compressed: it is mostly repeated JSON."""
    with open(raw, "rb") as src, gzip.open(raw.with_name(raw.name + ".gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def _server_window(rec: counters.Recorder, w0: float, w1: float) -> dict[str, Any]:
    """The engines' counters over GuideLLM's measurement window [w0, w1]."""
    win = counters.window(rec.samples, w0, w1)
    return {
        "t0": win.t0,
        "t1": win.t1,
        "seconds": win.seconds,
        "delta": win.delta,
        "input_tok_s": win.rate("prompt_tokens"),
        "output_tok_s": win.rate("generation_tokens"),
        "prefix_cache_hits": win.delta.get("prefix_cache_hits"),
        "scrapes": len(rec.samples),
        "scrape_errors": len(rec.errors),
    }


def measure(
    out: Path,
    spec: SweepSpec,
    target: Target,
    model: str,
    key: RunKey,
    tokenizer: Path,
    source: str,
    scrape_interval: float = 0.5,
    stall_timeout: float = 300.0,
) -> dict[str, Any]:
    """One run; returns the record written to its run file (status ok or error).

    GuideLLM gets warmup + measurement + `stall_timeout` seconds (its report of a long,
    high-concurrency run takes a while); past that the run is `stalled`."""
    path = run_path(out, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = path.with_name(f"{key.stem}.guidellm.json")
    log = path.with_name(f"{key.stem}.log")
    # A retried run gets new prompts: the failed attempt may have left them in the prefix cache.
    before = read_run(path) or {}
    attempt = before.get("attempt", -1) + 1
    seed = spec.run_seed(key.concurrency, key.run) + 10_000_000 * attempt
    args = RunArgs(target.url, model, key.concurrency, seed, tokenizer, raw)
    cmd = command(spec, args)
    rec: dict[str, Any] = {
        "status": "error",
        "error": None,
        "target": target.name,
        "url": target.url,
        "model": model,
        "concurrency": key.concurrency,
        "run": key.run,
        "seed": args.seed,
        "attempt": attempt,
        "previous_error": before.get("error"),
        "spec": spec.name,
        "throughput_source": source,
        "started": time.time(),
        "command": cmd[1:],
    }

    def done(error: str | None = None) -> dict[str, Any]:
        rec["status"] = "error" if error else "ok"
        rec["error"] = error
        rec["finished"] = time.time()
        write_json_atomic(path, rec)
        return rec

    try:
        now = served(target)
    except TargetError as e:
        return done(str(e))
    if now.model != model:
        return done(
            f"target {target.name} now serves `{now.model}`, the sweep began with `{model}`"
        )
    raw.unlink(missing_ok=True)
    timeout = spec.warmup_s + spec.measure_s + stall_timeout
    rec_ctx = (
        counters.Recorder(target.metrics_urls, scrape_interval) if source == "server" else None
    )
    try:
        with rec_ctx or nullcontext():
            code, last = run(cmd, log, timeout)
    except BaseException:  # interrupted: GuideLLM may have written a report of a cut-off run
        raw.unlink(missing_ok=True)
        raise
    if code == STALLED:
        rec["stalled"] = True
        return done(f"{last} (log: {log})")
    if code != 0 or not raw.is_file():
        return done(f"GuideLLM exited with code {code}: {last} (log: {log})")
    return done(_results(rec, raw, rec_ctx, spec))


def _results(
    rec: dict[str, Any], raw: Path, recorder: counters.Recorder | None, spec: SweepSpec
) -> str | None:
    """Fill a finished run's record from GuideLLM's report (gzipped once read) and, with a
    recorder, the servers' counters over GuideLLM's window; the error when it is unusable."""
    try:
        gl = summarize(raw)
    except Exception as e:  # GuideLLM's own loader: any failure means an unusable report
        return f"cannot read GuideLLM's report {raw}: {e}"
    _gzip(raw)
    rec["guidellm"] = gl
    req = gl["requests"]
    if not req["successful"]:
        first = "; ".join(gl["errors"]) or "no request finished"
        return f"no successful request ({req['errored']} errored): {first}"
    w0, w1 = gl["window"]["start"], gl["window"]["end"]
    rec["window_s"] = w1 - w0
    if recorder is None:
        rec["throughput"] = gl[f"{spec.throughput}_tok_s"]
        return None
    try:
        rec["server"] = _server_window(recorder, w0, w1)
    except counters.CountersError as e:
        extra = f" (scrape errors: {recorder.errors[0]})" if recorder.errors else ""
        return f"server counters: {e}{extra}"
    rec["throughput"] = rec["server"][f"{spec.throughput}_tok_s"]
    covered = rec["server"]["seconds"]
    if short_window(covered, w1 - w0, recorder.interval):
        rec["short_window"] = True
        extra = f"; scrape errors: {recorder.errors[0]}" if recorder.errors else ""
        return (f"server counters cover {covered:.1f} s of the {w1 - w0:.1f} s window, under "
                f"{MIN_COVERAGE:.0%} of what {recorder.interval:g} s scrapes can cover (a "
                f"scrape was late or failed{extra})")  # fmt: skip
    return None


# A run's throughput is the counters' change between the first and the last scrape inside
# GuideLLM's window, so the scrape grid alone leaves up to one interval uncovered at each end.
MIN_COVERAGE = 0.95


def short_window(covered: float, window: float, interval: float) -> bool:
    """Whether the counters saw too little of the window to stand for it: less than
    MIN_COVERAGE of the window less the two intervals the scrape grid may miss (round 3's
    fix c256 run: 8.3 of 12 s after a failed scrape, published as if it were the window)."""
    return covered < MIN_COVERAGE * max(0.0, window - 2 * interval)


@dataclass
class SweepResult:
    total: int
    skipped: int
    ok: int
    failed: list[dict[str, Any]]
    todo: list[RunKey] = field(default_factory=list)
    first_command: list[str] = field(default_factory=list)


def sweep(
    out: Path,
    spec: SweepSpec,
    targets: list[Target],
    tokenizer: Path,
    source: str = "server",
    resume: bool = False,
    on_run: Callable[[RunKey, dict[str, Any] | None], None] | None = None,
    scrape_interval: float = 0.5,
    on_plan: Callable[[int, int], None] | None = None,
    dry_run: bool = False,
    stall_timeout: float = 300.0,
    tiers: Sequence[int] = (),
) -> SweepResult:
    """Run what is missing; `on_plan(total, to_run)` once, then `on_run(key, None)` before
    and `on_run(key, record)` after each run.

    A run whose GuideLLM stalls is run once more at once, with new prompts: GuideLLM
    sometimes never finishes a benchmark that has ended (vllm-project/guidellm#431, #1152;
    seen here with 0.8.1, and a rerun completes). So is a run whose server counters cover too
    little of GuideLLM's window (short_window)."""
    if source not in SOURCES:
        raise SweepError(f"--throughput-source {source}: expected one of {SOURCES}")
    keys = plan(spec, targets, tiers)
    man = prepare(out, spec, targets, tokenizer, source, resume, dry_run)
    todo = list(pending(out, keys))
    by_name = {t.name: t for t in targets}
    res = SweepResult(total=len(keys), skipped=len(keys) - len(todo), ok=0, failed=[], todo=todo)
    if dry_run:
        if todo:
            k = todo[0]
            args = RunArgs(by_name[k.target].url, man["targets"][k.target]["model"],
                           k.concurrency, spec.run_seed(k.concurrency, k.run), tokenizer,
                           run_path(out, k).with_name(f"{k.stem}.guidellm.json"))  # fmt: skip
            res.first_command = command(spec, args)
        return res
    if on_plan:
        on_plan(len(keys), len(todo))
    for k in todo:
        if on_run:
            on_run(k, None)
        model = man["targets"][k.target]["model"]
        for _ in range(2):
            rec = measure(out, spec, by_name[k.target], model, k, tokenizer, source,
                          scrape_interval, stall_timeout)  # fmt: skip
            if not (rec.get("stalled") or rec.get("short_window")):
                break
        if rec["status"] == "ok":
            res.ok += 1
        else:
            res.failed.append(rec)
        if on_run:
            on_run(k, rec)
    return res
