"""Why a case of a hot-first run misses its bar: the plan its slowest rank ran, and the price
the GPU (an emulation's measured one, or the H20 model's) puts on what that plan chose.

The hot-first plan sends an expert with 1..boundary rows to swap-A/B tiles, up to `passes` per
expert, each streaming its weights again, because on H20's ridge (37 rows) one regular 128-row
tile costs 128 / 37 = 3.46 weight streams. An emulation runs that rule at another ratio of
tensor to memory speed; its calibration measures it: a regular 128-row tile over a 16-row
swap-A/B pass, every expert alike (`tile_price`). CPU only; report_run renders both tables."""

from __future__ import annotations

import math
from dataclasses import dataclass

import cases
import model
import numpy as np

BAR = 0.98
H20_SMS = 78
REGULAR_TILE = 128  # the regular kernel's row tile above 64 rows
PASS_ROWS = 16  # the calibration's one-pass swap-A/B tile: every expert 16 rows


@dataclass(frozen=True)
class RankPlan:
    """One GEMM of one rank under the hot-first plan (model.launch_kind)."""

    kind: str  # one "swap_ab" or "regular" launch, or model.SPLIT (two, one per class)
    m: int  # rows the (cold) swap-A/B or the one launch's tiles are sized for
    boundary: int  # experts with 1..boundary rows are the cold class (split)
    tile: int  # rows of the cold class's (or the one launch's) swap-A/B tile; 0: regular
    cold: tuple[int, ...]  # rows of the rank's cold experts (split)
    hot: tuple[int, ...]  # rows of its hot experts (split)

    @property
    def passes(self) -> int:
        """The most swap-A/B tiles one cold expert gets: how often its weights stream."""
        return max((math.ceil(r / self.tile) for r in self.cold), default=0)


def rank_plan(counts: np.ndarray, tokens: int, shape, sms: int = H20_SMS) -> RankPlan:
    kind, m, boundary = model.launch_kind(tokens, shape, sms, len(counts))
    tile = model.tile_rows("swap_ab", m, shape.n, sms, len(counts)) if kind != "regular" else 0
    rows = [int(r) for r in counts if r > 0]
    split = kind == model.SPLIT
    return RankPlan(
        kind,
        m,
        boundary,
        tile,
        tuple(r for r in rows if split and r <= boundary),
        tuple(r for r in rows if split and r > boundary),
    )


def tile_price(calibration: list[dict], gemm: str) -> float:
    """A regular 128-row tile in 16-row swap-A/B passes, as the run measured them (every expert
    128 rows in one regular launch, over every expert 16 rows in one swap-A/B launch)."""
    at = {c["m"]: c for c in calibration if c["gemm"] == gemm}
    return at[REGULAR_TILE]["regular_s"] / at[PASS_ROWS]["swap_ab_s"]


def rule_price(sms: int = H20_SMS) -> float:
    """The same price as the rule takes it from the GPU's ridge (plan_row_classes)."""
    return REGULAR_TILE / model.ridge_rows(sms)


def _rows(xs: tuple[int, ...]) -> str:
    """Rows per expert, most first; a long list as its count and range."""
    if len(xs) > 6:
        return f"{len(xs)} experts, {max(xs)}-{min(xs)}"
    return ", ".join(map(str, sorted(xs, reverse=True))) or "none"


def emulation_cause(case: dict, plan: RankPlan, price: float) -> str:
    """One sentence: what on the slowest rank's plan the emulation charged for."""
    if plan.kind != model.SPLIT:
        tokens, n = case["tokens"], cases.SHAPES[0].n
        stock = model.path_of(tokens, H20_SMS)
        ours = plan.tile or model.tile_rows("regular", plan.m, n, H20_SMS)
        if plan.kind == stock and ours == model.tile_rows(stock, tokens, n, H20_SMS):
            return (
                "one launch of stock's own kernel and tile: nothing of the plan differs from stock"
            )
        return f"one {plan.kind} launch sized for {plan.m} rows"
    if not plan.cold:
        return "every expert of this rank is hot: its swap-A/B launch is empty, a fixed cost"
    if plan.passes > price:
        return (
            f"{len(plan.cold)} cold expert(s) stream their weights up to {plan.passes} times; "
            f"this grid prices a regular tile at {price:.2f} passes, the rule at "
            f"{rule_price():.2f}"
        )
    return "not explained by the plan"


def slowest(case: dict, version: str = "fix") -> int:
    times = case[f"{version}_rank_median_s"]
    return max(range(len(times)), key=times.__getitem__)


def emulation_rows(emu: dict, key: str) -> list[dict]:
    """The emulation's cases under BAR: the slowest rank's FC1 plan and the cause."""
    e = emu[key]
    price = tile_price(e["calibration"], "fc1")
    out = []
    for c in e["ab"]:
        if c["speedups"]["fix"] >= BAR:
            continue
        rank = slowest(c)
        counts = cases.rank_counts(cases.route(c["routing"], c["tokens"]), rank)
        plan = rank_plan(counts, c["tokens"], cases.SHAPES[0])
        out.append(
            {
                "routing": c["routing"],
                "tokens": c["tokens"],
                "speedup": c["speedups"]["fix"],
                "rank": rank,
                "gap_us": (c["fix_rank_median_s"][rank] - c["stock_rank_median_s"][rank]) * 1e6,
                "plan": plan,
                "cause": emulation_cause(c, plan, price),
            }
        )
    return out


EMULATIONS = ("emulated_78sm", "emulated_h20_40sm", "emulated_h20_20sm")


def emulation_section(emu: dict) -> list[str]:
    """The table of every emulated case under BAR, with what its slowest rank ran."""
    keys = [k for k in EMULATIONS if emu.get(k, {}).get("ab") and emu[k].get("calibration")]
    if not keys:
        return []
    prices = ", ".join(
        f"{emu[k]['grid']} CTAs {tile_price(emu[k]['calibration'], 'fc1'):.2f} "
        f"(FC2 {tile_price(emu[k]['calibration'], 'fc2'):.2f})"
        for k in keys
    )
    out = [
        "### Why the emulated cases under 0.98x miss",
        "",
        "Each emulated case under 0.98x stock, at its slowest rank (the measured quantity), with "
        "the plan that rank ran for FC1 (50 local experts; a cold expert runs one swap-A/B "
        "tile per `tile` rows, each streaming its weights). What a regular 128-row tile costs "
        "in 16-row swap-A/B passes, from each emulation's forced kernels: "
        f"{prices}; the rule takes {rule_price():.2f} from H20's ridge "
        f"({model.ridge_rows(H20_SMS)} rows). Rendered by `misses.py`.",
        "",
        "| emulation | routing | tokens | speedup | rank | rank's gap (us) | plan | cold rows "
        "(tile) | hot rows | cause |",
        "|---|---|---:|---:|---:|---:|---|---|---|---|",
    ]
    for k in keys:
        for r in emulation_rows(emu, k):
            p = r["plan"]
            cold = f"{_rows(p.cold)} ({p.tile})" if p.kind == model.SPLIT else "-"
            hot = _rows(p.hot) if p.kind == model.SPLIT else "-"
            out.append(
                f"| {emu[k]['grid']} CTAs | {r['routing']} | {r['tokens']} | "
                f"{r['speedup']:.3f}x | {r['rank']} | {r['gap_us']:+.1f} | {p.kind} | {cold} | "
                f"{hot} | {r['cause']} |"
            )
    return out


# ----------------------------------------------------------------------------- the H20 model


@dataclass(frozen=True)
class Charged:
    """One rank's FC1 + FC2 under one version on the model: seconds charged, the padded MMA
    rows and the weight streams behind them, summed over the GEMMs' launches."""

    seconds: float
    c0: float
    mma_bound: float  # seconds of the launches charged for their MMA work
    mem_bound: float  # seconds of the launches charged for their weight streams
    padded_rows: int  # FC1's rows after padding to its tiles
    streams: float  # FC1's weight streams, in whole experts (first reads + re-reads)


def fc1_terms(counts: np.ndarray, tokens: int, version: str) -> list[tuple[float, float, float]]:
    """FC1's (weight bytes, re-read bytes, padded MMA flops) per launch of one rank."""
    if version in ("stock", "avg"):
        return [model.rank_terms(counts, tokens, version, H20_SMS)[1][0]]
    plan = model.row_class_launches(counts, tokens, H20_SMS, hot_first=True,
                                    shapes=cases.SHAPES[:1])  # fmt: skip
    return [term for _, (term,) in plan]


def charged(fits: dict, counts: np.ndarray, tokens: int, version: str) -> Charged:
    if version in ("stock", "avg"):
        plan = model.launches(counts, tokens, version, H20_SMS)
    else:
        plan = model.row_class_launches(counts, tokens, H20_SMS, hot_first=True)
    c0 = mma = mem = 0.0
    for p, terms in plan:
        f = fits[p]
        for term in terms:
            c0 += f.c0
            m, x = f.times(term)
            mma += x if x >= m else 0.0
            mem += m if m > x else 0.0
    fc1 = cases.SHAPES[0]
    terms = fc1_terms(counts, tokens, version)
    rows = sum(fl for _, _, fl in terms) / (2.0 * fc1.n * fc1.k)
    streams = sum(b + rb for b, rb, _ in terms) / fc1.weight_bytes(1)
    return Charged(c0 + mma + mem, c0, mma, mem, round(rows), streams)


def model_rows(h20: dict, res: dict, overhead: float) -> list[dict]:
    """The cases where the hot-first plan is more than 2 % below max(stock, average-only) on the
    H20 model's fused op (overhead: its other kernels, seconds), as report_run's H20 table
    marks them, with both plans' GEMM charges at hot-first's slowest rank."""
    out = []
    for c in res["ab"]:
        routing, tokens = c["routing"], c["tokens"]
        t = {v: model.slowest_rank(h20, routing, tokens, v, H20_SMS) + overhead for v in
             ("stock", "avg", "hot_first")}  # fmt: skip
        best = "stock" if t["stock"] <= t["avg"] else "avg"
        if t[best] / t["hot_first"] >= BAR:
            continue
        slots = cases.route(routing, tokens)
        ranks = [cases.rank_counts(slots, k) for k in range(cases.EP)]
        k = max(range(cases.EP), key=lambda i: model.predict(h20, ranks[i], tokens,
                                                                "hot_first", H20_SMS))  # fmt: skip
        out.append(
            {
                "routing": routing,
                "tokens": tokens,
                "best": best,
                "ratio": t[best] / t["hot_first"],
                "rank": k,
                "plan": rank_plan(ranks[k], tokens, cases.SHAPES[0]),
                "counts": ranks[k],
                "hot_first": charged(h20, ranks[k], tokens, "hot_first"),
                "other": charged(h20, ranks[k], tokens, best),
            }
        )
    return out


def padding(rows, tile: int) -> int:
    """Rows the tiles add to experts with `rows` rows (MMA work on zeros)."""
    return sum(math.ceil(r / tile) * tile - r for r in rows)


def one_launch_tile(tokens: int, version: str) -> tuple[str, int]:
    """(kernel, row tile) of FC1's one launch in stock or average-only."""
    m, path = model.single_launch(tokens, version, H20_SMS)
    return path, model.tile_rows(path, m, cases.SHAPES[0].n, H20_SMS, cases.LOCAL)


def model_cause(r: dict) -> str:
    """What the model charges hot-first for, against the better single-launch plan."""
    hf, other, plan = r["hot_first"], r["other"], r["plan"]
    if hf.padded_rows > other.padded_rows and hf.mma_bound > other.mma_bound:
        active = [int(x) for x in r["counts"] if x > 0]
        _, tile = one_launch_tile(r["tokens"], r["best"])
        if plan.kind == model.SPLIT:
            hot_tile = model.tile_rows("regular", r["tokens"], cases.SHAPES[0].n, H20_SMS)
            ours = (f"hot class {padding(plan.hot, hot_tile)} ({hot_tile}-row tiles), cold "
                    f"{padding(plan.cold, plan.tile)} ({plan.tile}-row tiles)")  # fmt: skip
        else:
            size = plan.tile or model.tile_rows("regular", plan.m, cases.SHAPES[0].n, H20_SMS)
            ours = f"{padding(active, size)} ({size}-row tiles)"
        return (
            f"MMA-bound; FC1's padding: {ours}, against {padding(active, tile)} ({tile}-row tiles)"
        )
    if hf.mma_bound + hf.mem_bound > other.mma_bound + other.mem_bound:
        return "its two launches are each charged their own bound (no overlap modelled)"
    return "its launches' fixed costs"


def model_section(h20: dict, res: dict, overhead: float) -> list[str]:
    """The table of the H20 model's hot-first misses, with what the model charges for."""
    rows = model_rows(h20, res, overhead)
    if not rows:
        return []
    out = [
        "#### Why hot-first misses on the model",
        "",
        "Each case above where hot-first is more than 2 % below max(stock, average-only) (the "
        "fused op's ratio), at hot-first's slowest rank: the model's charge for its grouped GEMMs, "
        "FC1 + FC2 (fixed costs; launches bound "
        "by their MMA work; launches bound by their weight streams), FC1's rows after padding "
        "to the tiles, and its weight streams in whole experts (first reads and re-reads, "
        "before the re-read share `r`). Rendered by `misses.py`.",
        "",
        "| routing | tokens | hot-first / best | best | rank | hot-first us (c0 + MMA + "
        "memory) | best us | FC1 padded rows | FC1 weight streams | cause |",
        "|---|---:|---:|---|---:|---|---|---:|---:|---|",
    ]
    for r in rows:
        hf, o = r["hot_first"], r["other"]
        out.append(
            f"| {r['routing']} | {r['tokens']} | {r['ratio']:.3f} | {r['best']} | {r['rank']} | "
            f"{_us(hf)} | {_us(o)} | {hf.padded_rows} / {o.padded_rows} | "
            f"{hf.streams:.0f} / {o.streams:.0f} | {model_cause(r)} |"
        )
    return out


def _us(c: Charged) -> str:
    return (
        f"{c.seconds * 1e6:.0f} ({c.c0 * 1e6:.0f} + {c.mma_bound * 1e6:.0f} + "
        f"{c.mem_bound * 1e6:.0f})"
    )
