"""benchmarks/moe_dispatch/misses.py: the plan a hot-first rank ran, and why a case misses."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_dispatch"
sys.path.insert(0, str(HERE))

import cases  # noqa: E402

from tests.benchmark_scripts import load_script  # noqa: E402

model = load_script(HERE / "model.py", "moe_dispatch_model")
why = load_script(HERE / "misses.py", "moe_dispatch_misses")
FC1 = cases.SHAPES[0]


@st.composite
def rank_steps(draw):
    """A step of `tokens` rows and one rank's experts' rows (none above the step's rows)."""
    tokens = draw(st.integers(1, 4096))
    hot = draw(st.lists(st.integers(0, tokens), min_size=cases.LOCAL, max_size=cases.LOCAL))
    return tokens, np.array(hot, dtype=np.int64)


def _fits(tc: float, bw: float) -> dict:
    fit = model.Fit(bw=bw, tc=tc, r=0.5, c0=1e-5)
    return {"regular": fit, "swap_ab": fit,
            model.SWAP_SECOND: dataclasses.replace(fit, c0=0.0)}  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(rank_steps())
def test_the_rank_plan_is_the_models_plan_and_its_charges_add_up(step):
    """rank_plan is model.row_class_launches' plan for FC1, the two classes partition the rank's
    experts at the boundary, and `charged` splits exactly the model's prediction."""
    tokens, counts = step
    plan = why.rank_plan(counts, tokens, FC1)
    active = sorted(int(r) for r in counts if r > 0)
    launches = model.row_class_launches(counts, tokens, 78, hot_first=True)
    fc1 = [t for _, (t,) in launches[: 2 if plan.kind == model.SPLIT else 1]]
    assert why.fc1_terms(counts, tokens, "hot_first") == fc1
    if plan.kind == model.SPLIT:
        assert sorted(plan.cold + plan.hot) == active
        assert all(r <= plan.boundary for r in plan.cold)
        assert all(r > plan.boundary for r in plan.hot)
        assert plan.passes == max((math.ceil(r / plan.tile) for r in plan.cold), default=0)
        assert tokens > model.ONE_LAUNCH_ROWS
    else:
        assert plan.cold == plan.hot == () and plan.passes == 0
    fits = _fits(tc=257e12, bw=3.4e12)
    for v in ("stock", "avg", "hot_first"):
        c = why.charged(fits, counts, tokens, v)
        assert c.seconds == pytest.approx(model.predict(fits, counts, tokens, v, 78))
        assert c.seconds == pytest.approx(c.c0 + c.mma_bound + c.mem_bound)
        assert c.padded_rows >= sum(active)
        assert c.streams >= len(active) - 1e-9


def test_tile_price_is_a_regular_tile_over_a_one_pass_swap_tile():
    calib = [
        {"gemm": "fc1", "m": 16, "regular_s": 9.0, "swap_ab_s": 2.0},
        {"gemm": "fc1", "m": 128, "regular_s": 5.0, "swap_ab_s": 7.0},
        {"gemm": "fc2", "m": 16, "regular_s": 1.0, "swap_ab_s": 4.0},
        {"gemm": "fc2", "m": 128, "regular_s": 6.0, "swap_ab_s": 1.0},
    ]
    assert why.tile_price(calib, "fc1") == 2.5
    assert why.tile_price(calib, "fc2") == 1.5
    assert why.rule_price(78) == pytest.approx(128 / 37)


def _case(routing: str, tokens: int, slow_rank: int, speedup: float) -> dict:
    fix = [10e-6] * cases.EP
    fix[slow_rank] = 20e-6
    stock = [x * speedup for x in fix]
    return {"routing": routing, "tokens": tokens, "speedups": {"fix": speedup},
            "fix_rank_median_s": fix, "stock_rank_median_s": stock}  # fmt: skip


def test_the_emulation_table_names_each_miss_s_plan_and_what_the_grid_charges():
    """pool16 128's rank 3 holds 4 experts (49, 48, 44, 44 rows): on H20's rule three of them are
    cold, 16-row tiles, 3 passes each, which a grid pricing a regular tile at 2 passes charges
    for; pool16 64's rank 0 has only hot experts (an empty cold launch); uniform 1 is one launch
    of stock's kernel; a case at the bar is not listed."""
    price2 = [{"gemm": g, "m": m, "regular_s": 2.0 if m == 128 else 9.0, "swap_ab_s": 1.0}
              for g in ("fc1", "fc2") for m in (16, 128)]  # fmt: skip
    emu = {"emulated_h20_40sm": {"grid": 40, "calibration": price2, "ab": [
        _case("pool16", 128, 3, 0.95), _case("pool16", 64, 0, 0.97), _case("uniform", 1, 1, 0.97),
        _case("zipf", 128, 2, 0.98)]}}  # fmt: skip
    rows = why.emulation_rows(emu, "emulated_h20_40sm")
    assert [(r["routing"], r["tokens"], r["rank"]) for r in rows] == [
        ("pool16", 128, 3), ("pool16", 64, 0), ("uniform", 1, 1)]  # fmt: skip
    p128, p64, one = (r["plan"] for r in rows)
    assert (p128.kind, sorted(p128.cold), p128.hot, p128.tile, p128.passes) == (
        model.SPLIT, [44, 44, 48], (49,), 16, 3)  # fmt: skip
    assert "up to 3 times" in rows[0]["cause"] and "2.00 passes" in rows[0]["cause"]
    assert rows[0]["gap_us"] == pytest.approx(20 * (1 - 0.95))
    assert p64.kind == model.SPLIT and p64.cold == () and "empty" in rows[1]["cause"]
    assert one.kind == "swap_ab" and "stock's own kernel" in rows[2]["cause"]
    table = why.emulation_section(emu)
    assert sum(line.startswith("| 40 CTAs |") for line in table) == 3
    cheap = [dict(c, regular_s=4.0 if c["m"] == 128 else 9.0) for c in price2]  # price 4 > 3
    emu["emulated_h20_40sm"]["calibration"] = cheap
    assert why.emulation_rows(emu, "emulated_h20_40sm")[0]["cause"] == "not explained by the plan"


def test_the_model_table_lists_hot_first_s_misses_on_a_tensor_bound_gpu_only():
    """same_rank 288 (six experts of 288 rows on rank 0): hot-first's regular tiles pad them to
    384 rows where average-only's swap-A/B tiles pad none. Charged for that padding on a
    tensor-bound GPU, hot-first misses; where tensor cores are 50x faster it does not."""
    res = {"ab": [{"routing": "same_rank", "tokens": 288}]}
    slow = why.model_rows(_fits(tc=257e12, bw=3.4e12), res, 0.0)
    assert [(r["routing"], r["best"], r["rank"]) for r in slow] == [("same_rank", "avg", 0)]
    hf, avg = slow[0]["hot_first"], slow[0]["other"]
    assert (hf.padded_rows, avg.padded_rows) == (6 * 384, 6 * 288)
    assert hf.streams < avg.streams  # what hot-first's tiles save: the weight re-reads
    cause = why.model_cause(slow[0])
    assert cause.startswith("MMA-bound") and "hot class 576 (128-row tiles)" in cause, cause
    assert cause.endswith("against 0 (16-row tiles)"), cause
    assert why.model_rows(_fits(tc=50 * 257e12, bw=3.4e12), res, 0.0) == []
    assert why.model_section(_fits(tc=50 * 257e12, bw=3.4e12), res, 0.0) == []
