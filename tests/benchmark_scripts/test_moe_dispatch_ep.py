"""The CPU-side parts of the concurrent-rank EP benchmark (benchmarks/moe_dispatch/ep.py):
the rows each rank computes, the seed's statistic, and the kernels warmed before timing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_dispatch"
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
import ep  # noqa: E402
from expected_m import per_expert_expected_m  # noqa: E402


@pytest.mark.parametrize("routing", cases.ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 288, 2048])
def test_rows_of_is_the_runner_layout(routing, tokens):
    slots = cases.route(routing, tokens)
    seen = 0
    for rank in range(cases.EP):
        counts, tok, pos = ep.rows_of(slots, rank)
        assert np.array_equal(counts, cases.rank_counts(slots, rank))
        expert = slots[tok, pos] - rank * cases.LOCAL
        off = cases.offsets(counts)
        for e in range(cases.LOCAL):  # rows grouped by local expert, tokens ascending
            seg = slice(off[e], off[e + 1])
            assert (expert[seg] == e).all() and (np.diff(tok[seg]) > 0).all()
        seen += len(tok)
    assert seen == tokens * cases.TOP_K  # every (token, k) lands on exactly one rank


def test_slowest_rank_median_and_exposed_combine():
    compute = [[1.0, 2.0, 3.0], [1.5, 1.0, 5.0]]  # rank x sample
    layer = [[2.0, 2.5, 6.0], [2.0, 2.6, 6.5]]
    assert ep.slowest_median(compute) == 2.0  # per sample max: 1.5, 2.0, 5.0
    assert ep.exposed(layer, compute) == pytest.approx(0.6)  # 0.5, 0.6, 1.5


def test_warm_jobs_cover_both_builds_for_every_case():
    jobs = set(ep.warm_jobs())
    for _routing, t in ep.case_list(quick=False):
        for si in range(len(cases.SHAPES)):
            fam = cases.V41_EP8.name  # as modules.compile_kernels takes them
            assert ("stock", False, fam, si, t, t, 0) in jobs
            fixed = per_expert_expected_m(t, cases.TOP_K, cases.LOCAL, cases.EP)
            assert ("fix", False, fam, si, t, fixed, 0) in jobs


def test_help_runs_without_a_gpu():
    r = subprocess.run([sys.executable, str(HERE / "ep.py"), "--help"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "--flashinfer" in r.stdout and "EP" in r.stdout


def test_published_table_is_rendered_from_the_published_json(tmp_path):
    """benchmarks/results/moe_dispatch/estimated-row-classes-h200/moe_dispatch_ep*_h200.md: every
    number comes from its JSON."""
    import shutil

    results = HERE.parents[0] / "results" / "moe_dispatch" / "estimated-row-classes-h200"
    published = sorted(results.glob("moe_dispatch_ep*_h200.json"))
    assert published
    for js in published:
        shutil.copy(js, tmp_path / js.name)
        cmd = [sys.executable, str(HERE / "ep.py"), "--render", str(tmp_path / js.name)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert (tmp_path / js.name).with_suffix(".md").read_text() == js.with_suffix(
            ".md"
        ).read_text()
