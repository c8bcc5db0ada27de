"""`vllm-h20 convert`: plan, preflight, convert shards in worker processes, finish.

Crash safety: a shard is written to a hidden partial file and renamed only after fsync;
the manifest (``DST/.vllm-h20/manifest.json``, replaced atomically) lists finished shards.
``--resume`` skips those, deletes partial files and redoes the rest, so an interrupted run
ends byte-identical to an uninterrupted one. ``complete: true`` is written last.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from .. import __version__
from .._io import write_json_atomic
from ..console import byte_progress, make_console
from . import report as report_mod
from .blockscale import Stats
from .config import dumps as config_dumps
from .config import rewrite_config
from .plan import CONFIG, INDEX, Plan, PlanError, make_plan
from .report import human_bytes
from .rules import RuleSet
from .shard import ConvertError, ShardResult, convert_shard, partial_name

STATE_DIR = ".vllm-h20"
MANIFEST = "manifest.json"
DEFAULT_BAND_MIB = 32


@dataclass(frozen=True)
class Options:
    workers: int = max(1, min(os.cpu_count() or 1, 8))
    resume: bool = False
    overwrite: bool = False
    keep_unmatched: bool = False
    band_mib: int = DEFAULT_BAND_MIB
    progress: bool = True


def _fingerprint(plan: Plan, rules: RuleSet, opts: Options) -> dict:
    """What must be unchanged for a resumed run to produce the same bytes."""
    return {
        "tool": f"vllm-h20 {__version__}",
        "rules": str(rules.name),
        "rules_sha256": rules.digest,
        "keep_unmatched": opts.keep_unmatched,
        "band_mib": opts.band_mib,
        "source": {
            s: {"size": h.file_size, "mtime_ns": h.path.stat().st_mtime_ns}
            for s, h in plan.headers.items()
        },
    }


def _outputs(plan: Plan) -> list[str]:
    return [s.name for s in plan.shards] + plan.other_files + [CONFIG, INDEX, report_mod.REPORT]


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise PlanError(f"{dst}: DST must not be SRC or inside it (or contain it)")


def _prepare_dst(dst: Path, plan: Plan, fp: dict, opts: Options) -> dict:
    """Return the manifest to continue from, after checking DST's state."""
    state = dst / STATE_DIR
    mpath = state / MANIFEST
    entries = [p for p in dst.iterdir()] if dst.exists() else []
    if entries and not (opts.resume or opts.overwrite):
        raise PlanError(
            f"{dst}: not empty; pass --resume to continue an interrupted conversion or "
            "--overwrite to replace its output"
        )
    manifest = {"fingerprint": fp, "done": {}, "complete": False}
    if opts.resume and mpath.is_file():
        old = json.loads(mpath.read_text())
        if old.get("fingerprint") != fp:
            raise PlanError(
                f"{dst}: was converted from a different SRC, rules or options; use "
                "--overwrite to start again"
            )
        manifest = old
        manifest["done"] = {
            s: v
            for s, v in old["done"].items()
            if (dst / s).is_file() and (dst / s).stat().st_size == v["bytes"]
        }
    elif opts.resume and entries:
        raise PlanError(f"{dst}: has no {STATE_DIR}/{MANIFEST} to resume from; use --overwrite")
    elif opts.overwrite:
        shutil.rmtree(state, ignore_errors=True)
        for name in _outputs(plan):
            (dst / name).unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)
    state.mkdir(exist_ok=True)
    for p in dst.glob(".*.partial"):
        p.unlink()
    manifest["complete"] = False
    write_json_atomic(mpath, manifest)
    return manifest


def _preflight(dst: Path, plan: Plan, done: dict) -> int:
    need = sum(s.nbytes for s in plan.shards if s.name not in done)
    need += sum((plan.src / f).stat().st_size for f in plan.other_files)
    free = shutil.disk_usage(dst).free
    if need > free:
        raise PlanError(
            f"{dst}: needs {human_bytes(need)} for the output but only {human_bytes(free)} "
            "is free; free space or choose another DST"
        )
    return need


# Worker side --------------------------------------------------------------------------

_QUEUE = None


def _init_worker(q) -> None:
    global _QUEUE
    _QUEUE = q


def _run_shard(src, dst, shard_plan, headers, where, band_bytes) -> ShardResult:
    def report(n: int) -> None:
        _QUEUE.put(n)

    return convert_shard(src, dst, shard_plan, headers, where, band_bytes, report)


def _shard_inputs(plan: Plan, shard) -> tuple[dict, dict]:
    names = {t.src for t in shard.tensors} | {t.src_scale for t in shard.tensors if t.src_scale}
    where = {n: plan.where[n] for n in names}
    headers = {s: plan.headers[s] for s in set(where.values())}
    return headers, where


# Main side ----------------------------------------------------------------------------


def _finish(dst: Path, plan: Plan, rules: RuleSet, manifest: dict, seconds: float) -> dict:
    for rel in plan.other_files:
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.partial")
        shutil.copyfile(plan.src / rel, tmp)
        os.replace(tmp, out)
    cfg_tmp = dst / f".{CONFIG}.partial"
    cfg_tmp.write_bytes(config_dumps(rewrite_config(plan.config, rules.config)))
    os.replace(cfg_tmp, dst / CONFIG)
    weight_map = {t.name: s.name for s in plan.shards for t in s.tensors}
    total = sum(t.nbytes for s in plan.shards for t in s.tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(dst / INDEX, index)

    groups = report_mod.merge_groups(
        [{g: Stats.from_json(v) for g, v in d["groups"].items()} for d in manifest["done"].values()]
    )
    ops = {r.name: r.op for r in rules.rules}
    bytes_out = sum(d["bytes"] for d in manifest["done"].values())
    doc = report_mod.build(
        groups,
        ops,
        {
            "src": str(plan.src),
            "rules": str(rules.path),
            "bytes_in": plan.bytes_in,
            "bytes_out": bytes_out,
            "shards": len(plan.shards),
            "unmatched_kept": plan.unmatched_kept,
            "tool": f"vllm-h20 {__version__}",
            "seconds": round(seconds, 3),
        },
    )
    report_mod.write(dst, doc)
    manifest["complete"] = True
    write_json_atomic(dst / STATE_DIR / MANIFEST, manifest)
    return doc


def convert(src: Path, dst: Path, rules: RuleSet, opts: Options, console: Console | None = None):
    """Convert SRC into DST; returns the report document. Raises PlanError/ConvertError."""
    console = console or make_console(stderr=True)
    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    _check_paths(src, dst)
    plan = make_plan(src, rules, opts.keep_unmatched)
    fp = _fingerprint(plan, rules, opts)
    if dst.exists() and not dst.is_dir():
        raise PlanError(f"{dst}: exists and is not a directory")
    manifest = _prepare_dst(dst, plan, fp, opts)
    need = _preflight(dst, plan, manifest["done"])
    todo = sorted(
        (s for s in plan.shards if s.name not in manifest["done"]),
        key=lambda s: -s.nbytes,
    )
    total_in = sum(plan.shard_src_bytes(s.name) for s in todo)
    if opts.progress:
        console.print(
            f"[bold]convert[/] {src} -> {dst}: {len(plan.shards)} shard(s), "
            f"{human_bytes(plan.bytes_in)} in, {human_bytes(need)} to write, "
            f"{len(manifest['done'])} already done, {opts.workers} worker(s)"
        )
    band = opts.band_mib * 2**20
    if todo:
        _run_pool(src, dst, plan, todo, manifest, band, opts, total_in, console)
    return _finish(dst, plan, rules, manifest, time.perf_counter() - t0)


def _run_pool(src, dst, plan, todo, manifest, band, opts, total_in, console) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mpath = dst / STATE_DIR / MANIFEST
    progress = byte_progress(console, disable=not opts.progress)
    with (
        progress,
        ProcessPoolExecutor(
            max_workers=max(1, min(opts.workers, len(todo))),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(q,),
        ) as pool,
    ):
        task = progress.add_task("converting", total=total_in)
        futures = {
            pool.submit(_run_shard, src, dst, s, *_shard_inputs(plan, s), band): s for s in todo
        }
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(q, progress, task)
                for f in finished:
                    res: ShardResult = f.result()
                    manifest["done"][res.shard] = {
                        "bytes": res.bytes_out,
                        "groups": {g: s.to_json() for g, s in res.groups.items()},
                    }
                    write_json_atomic(mpath, manifest)
            _drain(q, progress, task)
        except BaseException:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            for p in dst.glob(".*.partial"):
                p.unlink(missing_ok=True)
            raise


def _queued(q) -> int:
    """The bytes the workers reported since the last call (emptying the queue)."""
    n = 0
    while True:
        try:
            n += q.get_nowait()
        except Exception:
            break
    return n


def _drain(q, progress: Progress, task) -> None:
    if n := _queued(q):
        progress.advance(task, n)


__all__ = ["Options", "convert", "ConvertError", "PlanError", "partial_name"]
