"""A small performance model of the grouped FP8 GEMMs, fitted on H200 and carried to H20.

Per grouped GEMM (one of FC1/FC2 on one rank):

    t = c0 + max((weight_bytes + r * reread_bytes) / bw, mma_flops / tc)

weight_bytes: the FP8 weights and scales of the experts that received rows (read once);
reread_bytes: those weights again for every further row tile of an expert (a hot expert
with 2,048 rows in 32-row tiles streams its weights 64 times; r < 1 is the share L2 does not
absorb); mma_flops: 2 * N * K * sum over experts of their rows padded to the kernel's tile
(block_m for the regular kernel, block_n for swap-A/B), the tile chosen by DeepGEMM's own
`get_best_gemm_config` (ported below); c0: launch and pipeline fill. bw, tc, r and c0 are
fitted per kernel path on the H200 measurements; H20 keeps the fitted fractions of each
device's peak (assumptions in report.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import cases
import numpy as np
from expected_m import H20_SMS, fit_n, fitted_tiles, per_expert_expected_m, swap_threshold


def best_block(shape_m: int, shape_n: int, num_groups: int, sms: int) -> tuple[int, int]:
    """(block_m, block_n) of DeepGEMM's get_best_gemm_config (jit_utils.cuh), grouped case."""
    block_m = 64 if shape_m <= 64 else 128
    best_n, best_waves, best_util = 0, None, -1
    for block_n in range(16, 129, 8):
        tiles = math.ceil(shape_m / block_m) * math.ceil(shape_n / block_n) * num_groups
        waves = math.ceil(tiles / sms)
        util = tiles % sms or sms
        if best_waves is None or waves < best_waves or (waves == best_waves and util > best_util):
            best_n, best_waves, best_util = block_n, waves, util
    return block_m, best_n


def tile_rows(path: str, expected_m: int, n: int, sms: int, groups: int = cases.LOCAL) -> int:
    """Rows of one expert's M tile: block_m (regular) or block_n over the rows (swap-A/B)."""
    if path == "regular":
        return best_block(expected_m, n, groups, sms)[0]
    return best_block(n, expected_m, groups, sms)[1]


def path_of(expected_m: int, sms: int, threshold: int | None = None) -> str:
    th = swap_threshold(sms) if threshold is None else threshold
    return "regular" if expected_m >= th else "swap_ab"


def gemm_terms(counts: np.ndarray, shape, expected_m: int, path: str, sms: int):
    """(weight bytes, re-read bytes, padded MMA flops) of one grouped GEMM."""
    tile = tile_rows(path, expected_m, shape.n, sms, len(counts))
    active = counts[counts > 0]
    tiles = np.ceil(active / tile)
    per_expert = shape.weight_bytes(1)
    return (
        per_expert * len(active),
        per_expert * float((tiles - 1).sum()),
        2.0 * shape.n * shape.k * float((tiles * tile).sum()),
    )


@dataclass(frozen=True)
class Fit:
    bw: float  # achieved bytes/s
    tc: float  # achieved FLOP/s on padded MMA work
    c0: float  # seconds per GEMM
    r: float  # share of weight re-reads that reach HBM

    def times(self, term) -> tuple[float, float]:
        """(weight-streaming seconds, MMA seconds) of one GEMM's (bytes, re-read bytes, flops)."""
        b, rb, f = term
        return (b + self.r * rb) / self.bw, f / self.tc

    def predict(self, terms) -> float:
        return sum(self.c0 + max(self.times(t)) for t in terms)


def _arrays(samples):
    width = max(len(t) for t, _ in samples)
    a = np.zeros((len(samples), width, 3))
    mask = np.zeros((len(samples), width))
    for i, (terms, _) in enumerate(samples):
        a[i, : len(terms)] = terms
        mask[i, : len(terms)] = 1
    return a, mask, np.array([m for _, m in samples])


def fit(samples: list[tuple[list[tuple[float, float, float]], float]]) -> Fit:
    """Least relative squared error over (terms, measured seconds): coarse-to-fine grid over
    (bw, tc, r), c0 >= 0 solved in closed form for each point."""
    a, mask, t = _arrays(samples)
    n = mask.sum(1)
    w = 1 / t**2

    def loss(bw, tc, r):
        base = (np.maximum((a[..., 0] + r * a[..., 1]) / bw, a[..., 2] / tc) * mask).sum(1)
        c0 = max(0.0, float(((t - base) * n * w).sum() / (n * n * w).sum()))
        err = (base + n * c0 - t) / t
        return float((err**2).mean()), c0

    lo = np.array([0.3e12, 20e12, 0.0])
    hi = np.array([6e12, 2000e12, 1.0])
    best = None
    for _ in range(5):
        for bw in np.geomspace(lo[0], hi[0], 24):
            for tc in np.geomspace(lo[1], hi[1], 24):
                for r in np.linspace(lo[2], hi[2], 11):
                    val, c0 = loss(bw, tc, r)
                    if best is None or val < best[0]:
                        best = (val, bw, tc, r, c0)
        _, bw, tc, r, _ = best
        lo = np.array([bw / 1.4, tc / 1.4, max(0.0, r - 0.1)])
        hi = np.array([bw * 1.4, tc * 1.4, min(1.0, r + 0.1)])
    return Fit(bw=best[1], tc=best[2], c0=best[4], r=best[3])


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    fp8_tflops: float  # dense FP8 the fit's tc is scaled by
    hbm_tbps: float  # bandwidth the fit's bw is scaled by


# H20 datasheet: 296 dense FP8 TFLOP/s, 4.0 TB/s HBM3, 78 SMs (threshold 64).
H20 = Device("H20", 78, 296.0, 4.0)


def single_launch(tokens: int, version: str, sms: int, threshold: int | None = None):
    """(m, path) of the one launch per GEMM of stock (m: the token count) or the avg estimate."""
    m = (
        tokens
        if version == "stock"
        else per_expert_expected_m(tokens, cases.TOP_K, cases.LOCAL, cases.EP)
    )
    return m, path_of(m, sms, threshold)


def rank_terms(counts, tokens: int, version: str, sms: int, threshold: int | None = None):
    """The two GEMMs one rank issues, as (path, terms) for the stock or the avg estimate."""
    m, path = single_launch(tokens, version, sms, threshold)
    return path, [gemm_terms(counts, s, m, path, sms) for s in cases.SHAPES]


MAX_SWAP_ROWS = 128  # the widest swap-A/B row tile


def busiest_balanced_rows(expected_m: int) -> int:
    """The rows the busiest expert gets under balanced routing, mean + 3 standard deviations of a
    Poisson count (the patches' busiest_balanced_rows)."""
    m = max(expected_m, 1)
    return m + math.ceil(3 * math.sqrt(m))


def plan_row_classes(expected_m: int, max_m: int, threshold: int) -> tuple[int, int | None]:
    """(rows the swap-A/B tiles are sized for, boundary or None for one launch): a port of
    plan_row_classes in the previous series' fp8_blockscale_gemm_kernel.cuh."""
    busiest = busiest_balanced_rows(expected_m)
    if max_m <= MAX_SWAP_ROWS:
        return min(busiest, max_m), None
    boundary = max(threshold, min(MAX_SWAP_ROWS, -(-busiest // 8) * 8))
    return min(busiest, boundary), boundary


def launches(counts, tokens: int, version: str, sms: int) -> list[tuple[str, list]]:
    """(path, terms) per kernel launch one rank makes for FC1 + FC2. stock / avg: one launch
    per GEMM (avg = the average-only estimate); split: the per-expert dispatch, a swap-A/B
    launch for the experts with 1..boundary rows and a regular one for the rest."""
    if version != "split":
        return [rank_terms(counts, tokens, version, sms)]
    th = swap_threshold(sms)
    avg = per_expert_expected_m(tokens, cases.TOP_K, cases.LOCAL, cases.EP)
    cold_m, boundary = plan_row_classes(avg, tokens, th)
    if boundary is None:
        return [("swap_ab", [gemm_terms(counts, s, cold_m, "swap_ab", sms) for s in cases.SHAPES])]
    cold = np.where(counts <= boundary, counts, 0)
    hot = np.where(counts > boundary, counts, 0)
    return [
        ("swap_ab", [gemm_terms(cold, s, cold_m, "swap_ab", sms) for s in cases.SHAPES]),
        ("regular", [gemm_terms(hot, s, tokens, "regular", sms) for s in cases.SHAPES]),
    ]


def ridge_rows(sms: int) -> int:
    """Rows per tile where dense FP8 MMA time equals weight-streaming time (the patch's
    ridge_rows): 37 on H20, 160 on the 132-SM parts."""
    return 37 if sms == 78 else 160


def plan_whole_expert(expected_m: int, swap_tile: int, max_m: int, sms: int):
    """(busiest, cold_m, boundary) of the shipped series' plan_row_classes (a port; boundary
    >= max_m means one launch): the swap-A/B class ends after the passes over an expert's weights
    that cost less than one regular tile on the GPU."""
    busiest = busiest_balanced_rows(expected_m)
    if max_m <= swap_tile:
        return busiest, max_m, max_m
    ridge = ridge_rows(sms)
    regular_pass = max(1.0, (64 if max_m <= 64 else 128) / ridge)
    passes = max(1, int(regular_pass / max(1.0, swap_tile / ridge)))
    boundary = min(MAX_SWAP_ROWS, swap_tile * passes)
    return busiest, min(busiest, boundary), boundary


# The regular launch that follows a swap-A/B launch of the same GEMM (programmatic dependent
# launch): the regular kernel's rates, its own fixed cost (fit_second).
SECOND = "regular_second"
# The hot-first order (the shipped series): the swap-A/B launch follows the regular one.
SWAP_SECOND = "swap_ab_second"
# candidates/one-launch: the split's cold class inside the hot class's launch (one c0 for both,
# until a run of it fits this one's).
IN_ONE_LAUNCH = "swap_ab_in_one_launch"
# candidates/graph-branches: the split's cold launch on a parallel CUDA-graph branch beside the
# hot one (its own c0, fitted on that series' runs).
IN_BRANCH = "swap_ab_branch"
# Each second launch's kernel, whose rates it keeps.
BASE_OF = {SECOND: "regular", SWAP_SECOND: "swap_ab", IN_ONE_LAUNCH: "swap_ab",
           IN_BRANCH: "swap_ab"}  # fmt: skip
# The hot-first plan's single launches (its kOneLaunchRows, kNarrowRegularRows; patch 0006's
# kWideRegularRows and kSwapTileStep: one regular launch where the cold tile is that wide).
ONE_LAUNCH_ROWS = 32
NARROW_REGULAR_ROWS = 64
WIDE_REGULAR_ROWS = 128
SWAP_TILE_STEP = 8


SPLIT = "split"  # launch_kind: a regular launch for the hot class, a swap-A/B one for the cold


def launch_kind(tokens: int, shape, sms: int, groups: int = cases.LOCAL,
                hot_first: bool = True) -> tuple[str, int, int]:  # fmt: skip
    """(kind, m, boundary) of one GEMM of a row-class plan: one "swap_ab" or "regular" launch with
    tiles sized for m rows, or SPLIT, its cold class's tiles sized for m and experts with
    1..boundary rows in that class (the patches' grouped_gemm_dispatch; hot_first as in
    row_class_launches)."""
    avg = per_expert_expected_m(tokens, cases.TOP_K, cases.LOCAL, cases.EP)
    tile = tile_rows("swap_ab", busiest_balanced_rows(avg), shape.n, sms, groups)
    _, cold_m, boundary = plan_whole_expert(avg, tile, tokens, sms)
    if tokens <= boundary:
        return "swap_ab", cold_m, boundary
    if hot_first and tokens <= ONE_LAUNCH_ROWS:
        return "swap_ab", tokens, boundary
    if hot_first and tokens <= NARROW_REGULAR_ROWS <= ridge_rows(sms):
        return "regular", tokens, boundary
    if hot_first and tile + SWAP_TILE_STEP >= WIDE_REGULAR_ROWS:
        return "regular", tokens, boundary
    return SPLIT, cold_m, boundary


def row_class_launches(counts, tokens: int, sms: int, hot_first: bool, one_launch: bool = False,
                       branch: bool = False,
                       shapes=cases.SHAPES) -> list[tuple[str, list]]:  # fmt: skip
    """The two-class plans per GEMM (each launch pays its c0, empty or not): one swap-A/B launch
    when every expert fits one tile, else a swap-A/B launch for the experts with 1..boundary
    rows and a regular one for the rest. hot_first=False: the whole-expert-tile series
    (candidates/whole-expert-tiles), the swap-A/B launch first. hot_first=True: the shipped
    series since 2026-12-04, the regular launch first, and one launch where one tile shape reads
    every expert once (a swap-A/B tile sized for up to 32 rows; a regular 64-row tile up to 64
    rows where 64 rows are under the ridge: the 132-SM parts). one_launch (with hot_first):
    candidates/one-launch, whose split is one launch where both kernels have 128-row weight tiles
    (above 64 tokens: the regular kernel's row tile is 128; every V4.1-Flash N is above 64).
    branch (with hot_first): candidates/graph-branches, whose split's cold launch is a parallel
    branch of the CUDA graph (IN_BRANCH). shapes: the GEMMs, in order (both by default)."""
    out = []
    for s in shapes:
        kind, m, boundary = launch_kind(tokens, s, sms, len(counts), hot_first)
        if kind != SPLIT:
            out.append((kind, [gemm_terms(counts, s, m, kind, sms)]))
        else:
            cold = gemm_terms(np.where(counts <= boundary, counts, 0), s, m, "swap_ab", sms)
            hot = gemm_terms(np.where(counts > boundary, counts, 0), s, tokens, "regular", sms)
            if one_launch and tokens > NARROW_REGULAR_ROWS:
                out += [("regular", [hot]), (IN_ONE_LAUNCH, [cold])]
            elif branch:
                out += [("regular", [hot]), (IN_BRANCH, [cold])]
            elif hot_first:
                out += [("regular", [hot]), (SWAP_SECOND, [cold])]
            else:
                out += [("swap_ab", [cold]), (SECOND, [hot])]
    return out


def fit_second(fits: dict, samples: list[tuple[list[tuple[str, list]], float]]) -> dict:
    """fits with each second launch (BASE_OF) added: its kernel's fit with the one c0 that best
    explains (least relative squares) the measured times of two-launch plans (samples:
    (launches, seconds)); >= 0."""
    num = den = 0.0
    seen = set()
    for plan, t in samples:
        base, k = 0.0, 0
        for p, terms in plan:
            f = fits[BASE_OF.get(p, p)]
            part = f.predict(terms)
            if p in BASE_OF:
                seen.add(p)
                part -= f.c0 * len(terms)
                k += len(terms)
            base += part
        num += k * (t - base) / t**2
        den += k * k / t**2
    seen = seen or {SECOND}
    out = dict(fits)
    for p in seen:
        c1 = max(0.0, num / den) if den else fits[BASE_OF[p]].c0
        out[p] = dataclasses.replace(fits[BASE_OF[p]], c0=c1)
    return out


def fitted_terms(counts: np.ndarray, shape, widest: int):
    """(weight bytes, re-read bytes, padded MMA flops) of one fitted swap-A/B GEMM: each expert's
    rows in tiles of `widest` rows, the last narrowed to its rest rounded up to 16."""
    active = counts[counts > 0]
    tiles = [fitted_tiles(int(r), widest) for r in active]
    per_expert = shape.weight_bytes(1)
    return (
        per_expert * len(active),
        per_expert * float(sum(len(t) - 1 for t in tiles)),
        2.0 * shape.n * shape.k * float(sum(sum(t) for t in tiles)),
    )


def candidate_launches(counts, tokens: int) -> list[tuple[str, list]]:
    """The fitted-row-tile candidate: one fitted launch per GEMM (plan_launches)."""
    return [("fitted", [fitted_terms(counts, s, fit_n(tokens)) for s in cases.SHAPES])]


def predict(fits: dict, counts, tokens: int, version: str, sms: int) -> float:
    """Seconds for one rank's FC1 + FC2 under a version (each launch pays its c0): stock,
    avg (average-only), split (the per-expert plan shipped until 2026-12-03), fitted (the
    fitted-tile candidate), classes (the whole-expert-tile plan, shipped 2026-12-03 to 12-04),
    hot_first (the shipped plan), one_launch (candidates/one-launch: without a fit of its own,
    the cold class's part of the one launch pays no c0) or branches (candidates/graph-branches:
    the same for its parallel cold launch)."""
    if version == "fitted":
        plan = candidate_launches(counts, tokens)
    elif version in ("classes", "hot_first", "one_launch", "branches"):
        plan = row_class_launches(counts, tokens, sms, hot_first=version != "classes",
                                  one_launch=version == "one_launch",
                                  branch=version == "branches")  # fmt: skip
        for own in (IN_ONE_LAUNCH, IN_BRANCH):
            if own not in fits:
                fits = {**fits, own: dataclasses.replace(fits["swap_ab"], c0=0.0)}
    else:
        plan = launches(counts, tokens, version, sms)
    return sum(fits[p].predict(terms) for p, terms in plan)


def slowest_rank(fits: dict, routing: str, tokens: int, version: str, sms: int,
                 ep: int = cases.EP) -> float:  # fmt: skip
    """Predicted seconds of the slowest of the EP ranks for one case (the measured quantity):
    `tokens` rows routed over the 400 slots, each rank holding SLOTS / ep of them (EP16: 25)."""
    slots = cases.route(routing, tokens)
    local = cases.SLOTS // ep

    def counts(k: int) -> np.ndarray:
        mine = slots[(slots >= k * local) & (slots < (k + 1) * local)] - k * local
        return np.bincount(mine, minlength=local).astype(np.int64)

    return max(predict(fits, counts(k), tokens, version, sms) for k in range(ep))


def on_device(fits: dict, tc: float, bw: float) -> dict:
    """The fits carried to another GPU: every kernel at one tensor rate and one bandwidth (their
    c0 and re-read share kept)."""
    return {p: dataclasses.replace(f, tc=tc, bw=bw) for p, f in fits.items()}


def calibrate_to_seed(
    fits: dict, overhead: float, sms: int = 78, stock_s: float = 1.808e-3, avg_s: float = 0.564e-3
) -> tuple[float, float]:
    """(tensor rate, bandwidth) that reproduce the seed's H20 uniform-288 fused-op times, stock
    compute-bound and the average-only fix bandwidth-bound, given the fused op's other kernels
    (overhead seconds). Alternates two one-dimensional root finds until both agree."""

    def gap(tc: float, bw: float, version: str, target: float) -> float:
        f = on_device(fits, tc, bw)
        return slowest_rank(f, "uniform", 288, version, sms) + overhead - target

    tc, bw = 250e12, 3.5e12
    for _ in range(6):
        tc = _root(lambda x, bw=bw: gap(x, bw, "stock", stock_s), 20e12, 2000e12)
        bw = _root(lambda x, tc=tc: gap(tc, x, "avg", avg_s), 0.2e12, 10e12)
    return tc, bw


def _root(fn, lo: float, hi: float, iters: int = 80) -> float:
    """Bisection for a function that decreases in its argument (times fall as rates rise)."""
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        if fn(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


# ----------------------------------------------------------------------------- a run's fit
# Datasheet memory bandwidth (TB/s) of the GPUs a run can come from and of H20: the fused op's
# other kernels (memory-bound) are carried to H20 in this ratio.
HBM_TBPS = {"h200": 4.8, "h100": 3.35}
H20_TBPS = 4.0
H20_OVER_H200_BW = H20_TBPS / HBM_TBPS["h200"]


def tag_of(folder) -> str:
    """The GPU a published run folder's kernel file is named for (kernel_<tag>.json)."""
    found = sorted(folder.glob("kernel_*.json"))
    tags = [f.stem.removeprefix("kernel_") for f in found]
    if len(tags) != 1 or tags[0] not in HBM_TBPS:
        raise SystemExit(f"{folder}: expected one kernel_<gpu>.json (gpu: {', '.join(HBM_TBPS)})")
    return tags[0]


def fit_run(res: dict) -> tuple[dict, int]:
    """The model's kernel fits on a 132-SM run of the shipped (hot-first) series: regular and
    swap-A/B from the single-launch versions (stock, average-only) and the forced sweep, the
    second launch's fixed cost from the series' own times."""
    sms = res["device"]["sms"]
    samples: dict[str, list] = {"regular": [], "swap_ab": []}
    second = []
    for r in res["ab"]:
        slots = cases.route(r["routing"], r["tokens"])
        for rank in range(cases.EP):
            counts = cases.rank_counts(slots, rank)
            for version in ("stock", "avg"):
                path, terms = rank_terms(counts, r["tokens"], version, sms)
                samples[path].append((terms, r[f"{version}_rank_median_s"][rank]))
            plan = row_class_launches(counts, r["tokens"], sms, True)
            second.append((plan, r["fix_rank_median_s"][rank]))
    for c in res["calibration"]:
        shape = next(s for s in cases.SHAPES if s.name == c["gemm"])
        counts = np.full(cases.LOCAL, c["m"])
        for path in ("regular", "swap_ab"):
            samples[path].append(([gemm_terms(counts, shape, c["m"], path, sms)], c[f"{path}_s"]))
    fits = fit_second({p: fit(s) for p, s in samples.items() if s}, second)
    return fits, sum(len(s) for s in samples.values())


def carried_to_h20(res: dict, folder, fits: dict, tag: str):
    """The run's fits carried to H20 and calibrated to the seed: the fused op's other kernels
    (the fused op's stock time over the kernel-level stock time at uniform 288 tokens, both on
    the run's GPU) on that GPU and on H20 (s), the tensor rate and bandwidth that reproduce the
    seed's uniform-288 times, and the H20 fits."""
    import json

    fused = json.loads((folder / f"fused_{tag}.json").read_text())
    f288 = next(r for r in fused["ab"] if (r["routing"], r["tokens"]) == ("uniform", 288))
    k288 = next(r for r in res["ab"] if (r["routing"], r["tokens"]) == ("uniform", 288))
    overhead_gpu = f288["stock_s"] - k288["stock_s"]
    overhead = overhead_gpu * HBM_TBPS[tag] / H20_TBPS
    tc, bw = calibrate_to_seed(fits, overhead, H20_SMS)
    return overhead_gpu, overhead, tc, bw, on_device(fits, tc, bw)
