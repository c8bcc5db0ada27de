"""`vllm-h20 verify SRC DST`: re-read both checkpoints and check the conversion.

Deliberately independent of the converter's lookup tables: source values are decoded in
float64 from the E2M1/E4M3 tables and E8M0 exponents, and each output element must be
the nearest E4M3 value (ml_dtypes' round-to-nearest-even) of the source value under an
output scale that is a power of two no larger than the least-error one. Copied tensors and
files must match byte for byte.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import runner
from .blockscale import BLOCK, MXFP4_GROUP, Stats
from .codecs import (
    E2M1_VALUES,
    E4M3_MAX,
    e4m3_decode,
    e4m3_encode_f32_exact,
    frexp_exponent,
    pow2,
    unpack_e2m1,
)
from .config import rewrite_config
from .plan import CONFIG, INDEX, OutTensor, PlanError, make_plan
from .report import REPORT, merge_groups
from .rules import RuleSet
from .safetensors_io import CheckpointError, ShardReader, read_header
from .shard import OUTPUT_METADATA

BAND_ROWS = 512
CHUNK = 64 * 2**20


@dataclass
class VerifyResult:
    groups: dict[str, Stats] = field(default_factory=dict)
    planned: dict[str, int] = field(default_factory=dict)
    copied_tensors: int = 0
    copied_bytes: int = 0
    files: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _expand_rows(grid: np.ndarray, block: int, r0: int, r1: int, cols: int) -> np.ndarray:
    """Per-element values of rows r0:r1 from a per-block grid (only the rows needed)."""
    g = grid[r0 // block : -(-r1 // block)]
    off = r0 % block
    return np.repeat(np.repeat(g, block, 0), block, 1)[off : off + r1 - r0, :cols]


def _block_max(x: np.ndarray) -> np.ndarray:
    """Max over each 128x128 block of a band (zero-padded at the edges)."""
    pad = ((0, -x.shape[0] % BLOCK), (0, -x.shape[1] % BLOCK))
    x = np.pad(x, pad)
    return x.reshape(x.shape[0] // BLOCK, BLOCK, -1, BLOCK).max(axis=(1, 3))


def _src_values(t: OutTensor, w: np.ndarray, s: np.ndarray, r0: int, r1: int) -> np.ndarray:
    """Float64 source values of rows r0:r1."""
    if t.src_block == 0:
        codes = unpack_e2m1(np.asarray(w[r0:r1]).view(np.uint8))
        scale = np.repeat(
            pow2(np.asarray(s[r0:r1]).view(np.uint8).astype(np.int32) - 127), MXFP4_GROUP, 1
        )
        return E2M1_VALUES[codes] * scale
    se = np.asarray(s).view(np.uint8).astype(np.int32) - 127
    scale = _expand_rows(pow2(se), t.src_block, r0, r1, w.shape[1])
    return e4m3_decode(np.asarray(w[r0:r1])) * scale


def _check_pair(t: OutTensor, src_w, src_s, out_w, out_s, stats: Stats) -> str | None:
    scales = np.asarray(out_s, dtype=np.float64)
    if not np.all(np.isfinite(scales)) or np.any(scales <= 0):
        return f"{t.name}: output scale has non-finite or non-positive values"
    mant, _ = np.frexp(scales)
    if np.any(mant != 0.5):
        return f"{t.name}: output scale is not a power of two"
    n = out_w.shape[0]
    for r0 in range(0, n, BAND_ROWS):
        r1 = min(n, r0 + BAND_ROWS)
        ref = _src_values(t, src_w, src_s, r0, r1)
        blk = _expand_rows(scales, BLOCK, r0, r1, ref.shape[1])
        # The least-error scale: the smallest power of two with max|v| / scale <= 448.
        bm = _block_max(np.abs(ref))
        best = pow2(frexp_exponent(bm) - 8)
        best = np.where(bm / best > E4M3_MAX, 2 * best, best)
        mine = scales[r0 // BLOCK : r0 // BLOCK + bm.shape[0]]
        if np.any((bm > 0) & (mine < best)):
            return f"{t.name}: a block scale is too small for its values (E4M3 overflow)"
        got = e4m3_decode(np.asarray(out_w[r0:r1])) * blk
        # ref / blk: a source code (E2M1 or E4M3) times a power of two, exact in float32.
        want = e4m3_decode(e4m3_encode_f32_exact(ref / blk)) * blk
        if not np.array_equal(got, want):
            row, col = (int(i) for i in np.argwhere(got != want)[0])
            return f"{t.name}: element ({r0 + row}, {col}) is not the nearest E4M3 of the source"
        err = np.abs(got - ref)
        if np.any((_block_max(err) > 0) & (mine != best)):
            return f"{t.name}: an inexact block does not use the least-error scale"
        stats.elements += ref.size
        stats.inexact += int(np.count_nonzero(err))
        stats.sq_err += float((err**2).sum())
        stats.sq_ref += float((ref**2).sum())
        stats.max_abs_err = max(stats.max_abs_err, float(err.max(initial=0.0)))
    stats.tensors += 1
    return None


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.size != b.size:
        return False
    return all(np.array_equal(a[i : i + CHUNK], b[i : i + CHUNK]) for i in range(0, a.size, CHUNK))


def _sample(names: list[str], k: int | None) -> set[str]:
    if k is None or k >= len(names):
        return set(names)
    idx = np.linspace(0, len(names) - 1, k).round().astype(int)
    return {names[i] for i in idx}


def verify(
    src: Path,
    dst: Path,
    rules: RuleSet,
    sample: int | None = None,
    progress=None,
    workers: int = 1,
) -> VerifyResult:
    """Check DST against SRC. ``sample``: converted tensors to check per group (None: all).
    ``progress(done_bytes, total_bytes)`` is called as output tensors are checked;
    ``workers`` processes check one output shard each, as `convert` writes them."""
    src, dst = Path(src), Path(dst)
    plan = make_plan(src, rules, keep_unmatched=True)
    res = VerifyResult()
    manifest = dst / ".vllm-h20" / "manifest.json"
    if not manifest.is_file() or not json.loads(manifest.read_text()).get("complete"):
        raise PlanError(
            f"{dst}: not a complete conversion (no finished manifest); run "
            "`vllm-h20 convert --resume` first"
        )
    # config.json and the index
    want_cfg = rewrite_config(plan.config, rules.config)
    try:
        got_cfg = json.loads((dst / CONFIG).read_text())
        index = json.loads((dst / INDEX).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{dst}: cannot read config.json or the index ({e})") from None
    if got_cfg != want_cfg:
        res.failures.append(f"{dst / CONFIG}: differs from the rewritten source config")
    want_map = {t.name: s.name for s in plan.shards for t in s.tensors}
    if index.get("weight_map") != want_map:
        res.failures.append(f"{dst / INDEX}: weight_map differs from the plan")
    total = sum(t.nbytes for s in plan.shards for t in s.tensors)
    if index.get("metadata", {}).get("total_size") != total:
        res.failures.append(f"{dst / INDEX}: total_size is not {total}")

    pairs = [t for s in plan.shards for t in s.tensors if t.op == "weight"]
    by_group: dict[str, list[str]] = {}
    for t in pairs:
        by_group.setdefault(t.group, []).append(t.name)
    res.planned = {g: len(v) for g, v in by_group.items()}
    chosen = set().union(*(_sample(v, sample) for v in by_group.values())) if by_group else set()

    jobs = []  # (shard plan, source headers, where, the shard's chosen tensors, bytes checked)
    for sp in plan.shards:
        mine = frozenset(t.name for t in sp.tensors if t.name in chosen)
        nbytes = sum(t.nbytes for t in sp.tensors if _checked(t, mine))
        jobs.append((sp, *runner._shard_inputs(plan, sp), mine, nbytes))
    total = sum(j[-1] for j in jobs)
    if progress:
        progress(0, total)
    if workers > 1 and len(jobs) > 1:
        parts = _check_in_pool(dst, jobs, workers, progress, total)
    else:
        done = 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)

        parts = [_check_shard(dst, sp, h, w, mine, tick) for sp, h, w, mine, _ in jobs]
    for part in parts:  # in shard order, whatever order the workers finished in
        res.failures += part.failures
        res.copied_tensors += part.copied_tensors
        res.copied_bytes += part.copied_bytes
    res.groups = merge_groups([part.groups for part in parts])

    for rel in plan.other_files:
        a, b = src / rel, dst / rel
        if not b.is_file() or a.read_bytes() != b.read_bytes():
            res.failures.append(f"{b}: missing or differs from {a}")
        res.files += 1
    if sample is None:
        _compare_report(dst, res)
    return res


def _checked(t: OutTensor, chosen: frozenset[str]) -> bool:
    return t.op == "copy" or (t.op == "weight" and t.name in chosen)


def _check_shard(dst: Path, sp, headers: dict, where: dict, chosen, tick) -> VerifyResult:
    """One output shard against its sources; ``tick(bytes)`` after each checked tensor."""
    res = VerifyResult()
    try:
        h = read_header(dst / sp.name)
    except CheckpointError as e:
        res.failures.append(str(e))
        return res
    if h.metadata != OUTPUT_METADATA:
        res.failures.append(f"{dst / sp.name}: metadata {h.metadata} is not {OUTPUT_METADATA}")
    planned = [(t.name, t.dtype, t.shape) for t in sp.tensors]
    actual = [(t.name, t.dtype, t.shape) for t in h.tensors.values()]
    if planned != actual:
        res.failures.append(f"{dst / sp.name}: tensors, dtypes or shapes differ from the plan")
        return res
    readers: dict[str, ShardReader] = {}

    def src_reader(name: str) -> ShardReader:
        shard = where[name]
        if shard not in readers:
            readers[shard] = ShardReader(headers[shard])
        return readers[shard]

    out = ShardReader(h)
    try:
        for t in sp.tensors:
            if t.op == "copy":
                if not _same_bytes(out.raw(t.name), src_reader(t.src).raw(t.src)):
                    res.failures.append(
                        f"{dst / sp.name}: tensor {t.name!r} differs from the source"
                    )
                res.copied_tensors += 1
                res.copied_bytes += t.nbytes
            elif t.op == "weight" and t.name in chosen:
                st = res.groups.setdefault(t.group, Stats())
                msg = _check_pair(
                    t,
                    src_reader(t.src).array(t.src),
                    src_reader(t.src_scale).array(t.src_scale),
                    out.array(t.name),
                    out.array(t.src_scale),
                    st,
                )
                if msg:
                    res.failures.append(f"{dst / sp.name}: {msg}")
            if _checked(t, chosen):
                tick(t.nbytes)
    finally:
        out.close()
        for r in readers.values():
            r.close()
    return res


def _check_in_worker(dst: Path, sp, headers: dict, where: dict, chosen) -> VerifyResult:
    return _check_shard(dst, sp, headers, where, chosen, runner._QUEUE.put)


def _check_in_pool(dst: Path, jobs: list, workers: int, progress, total: int) -> list:
    """The shards in worker processes (convert's pool set-up and progress queue)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = 0

    def drain() -> None:
        nonlocal done
        n = runner._queued(q)
        if n and progress:
            done += n
            progress(done, total)

    with ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)),
        mp_context=ctx,
        initializer=runner._init_worker,
        initargs=(q,),
    ) as pool:
        # Largest first, so the last shard to finish is a small one.
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i][-1])
        futures = {pool.submit(_check_in_worker, dst, *jobs[i][:4]): i for i in order}
        pending = set(futures)
        try:
            while pending:
                _finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                drain()
            drain()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        parts = {futures[f]: f.result() for f in futures}
    return [parts[i] for i in range(len(jobs))]


def _compare_report(dst: Path, res: VerifyResult) -> None:
    """With every tensor checked, the report's counts must be what verify found."""
    try:
        doc = json.loads((dst / REPORT).read_text())
    except (OSError, json.JSONDecodeError):
        res.failures.append(f"{dst / REPORT}: missing or unreadable")
        return
    for g, st in res.groups.items():
        rep = doc["groups"].get(g)
        if rep is None or rep["inexact"] != st.inexact or rep["elements"] != st.elements:
            res.failures.append(
                f"{dst / REPORT}: group {g} reports {rep and rep['inexact']} inexact of "
                f"{rep and rep['elements']}, verify found {st.inexact} of {st.elements}"
            )
