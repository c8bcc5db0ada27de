"""The per-expert dispatch of the shipped series (patches 0002-0005: no expert split into swap-A/B
tiles past what pays on the GPU), compiled here with nvcc for sm_90a (no GPU needed).

Its row-class kernels find each CTA's first tile with one warp-wide search. Where the
`griddepcontrol` instructions sat around the main loops (the series shipped until
2026-12-03, now in the tag experiments/2026-12-06), ptxas spilled 192 bytes per thread and the
kernels ran 3-15 % slower on an H200 (benchmarks/results/moe_dispatch/whole-expert-tiles-h200,
round 1): the compile here checks that the kernels the dispatch launches spill nothing, carry
their class in their cache name, and do not build against FlashInfer's own headers. The plan
(plan_row_classes, cut out of the patch) is checked for what the dispatch relies on.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.moe import deepgemm_kernels as dk
from tests.moe.deepgemm_kernels import GEN, KERNEL_CUH
from vllm_h20.moe import overlay, precompile
from vllm_h20.moe.patchfile import read_patch

SHIPPED = overlay.patches_dir() / "flashinfer"
# name: generator arguments (swap|regular, min rows, max rows): the launches of a two-class step.
SOURCES = {"cold": ["swap", "1", "16"], "hot": ["regular", "17", "any"]}


@pytest.fixture(scope="module")
def overlay_csrc(installed_fi, patches, tmp_path_factory) -> Path:
    return dk.overlay_csrc(installed_fi, patches, tmp_path_factory.mktemp("w"))


@pytest.fixture(scope="module")
def generated(overlay_csrc, installed_fi, tmp_path_factory) -> dict[str, str]:
    return dk.generate(GEN, SOURCES, overlay_csrc, installed_fi, tmp_path_factory.mktemp("gen"))


def test_class_kernels_spill_nothing_and_need_the_overlay(
    generated, overlay_csrc, installed_fi, tmp_path
):
    assert generated["cold_tag"] == "_class1-16" and generated["hot_tag"] == "_class17-any"
    ours = overlay_csrc / "nv_internal" / "tensorrt_llm"
    theirs = installed_fi.root / "csrc" / "nv_internal" / "tensorrt_llm"
    for name in SOURCES:
        r = dk.compile_kernel(generated[name], ours, tmp_path, name, "-Xptxas", "-v")
        assert r.returncode == 0, r.stderr[-3000:]
        report = r.stdout + r.stderr
        assert "0 bytes spill stores" in report, report[-2000:]
        assert not re.search(r"[1-9]\d* bytes spill stores", report), report[-2000:]
        r = dk.compile_kernel(generated[name], theirs, tmp_path, name + "_stock")
        assert r.returncode != 0


PLAN = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
%s
int main(int argc, char** argv) {
  for (int i = 1; i + 3 < argc; i += 4) {
    uint32_t const busiest = busiest_balanced_rows(std::atoi(argv[i]));
    RowClassPlan p = plan_row_classes(busiest, std::atoi(argv[i + 1]), std::atoi(argv[i + 2]),
                                      ridge_rows(std::atoi(argv[i + 3])));
    std::printf("%%u %%u %%u %%u\n", busiest, p.cold_m, p.boundary, p.hot_m);
  }
}
"""


def _plan_text(series: Path = SHIPPED) -> str:
    """A series' dispatch code as the patch that adds the plan adds it (the hunks' new side holds
    the plan functions whole)."""
    name = KERNEL_CUH.split("/")[-1]
    texts = [dk.added_text(p, name) for p in sorted(series.glob("0*.patch"))
             if any(d.path.endswith("/" + name) for d in read_patch(p).files)]  # fmt: skip
    (text,) = [t for t in texts if "struct RowClassPlan {" in t]
    return text


def test_kernels_precompile_refuses_other_headers_in_one_line(tmp_path):
    """`kernels precompile` plans the shipped series only: on headers whose plan has another
    signature (the series shipped until 2026-12-03 had plan_row_classes(expected_m, max_m,
    threshold)), or the entry point without the single-launch bounds its main() uses (the one
    shipped 2026-12-03 to 12-04), it says so instead of failing to compile its planner."""
    kernel = tmp_path / "csrc" / precompile.KERNEL_CUH
    kernel.parent.mkdir(parents=True)
    shipped = _plan_text()
    assert precompile.SHIPPED_PLAN.search(shipped)
    other_signature = precompile.SHIPPED_PLAN.sub(
        "plan_row_classes(uint32_t expected_m, uint32_t max_m, uint32_t threshold)", shipped
    )
    no_bounds = shipped
    for bound in precompile.SHIPPED_BOUNDS:
        no_bounds = no_bounds.replace(bound, bound.lower())
    for text in (other_signature, no_bounds):
        kernel.write_text(text)
        with pytest.raises(precompile.PrecompileError, match="plans the shipped series only"):
            precompile.planner_source(tmp_path / "csrc")


@pytest.fixture(scope="module")
def cpp_plan(tmp_path_factory):
    """The shipped plan functions, cut out of the patch and compiled alone."""
    text = _plan_text()
    start = text.index("struct RowClassPlan {")
    end = text.index("void grouped_gemm_dispatch(")
    work = tmp_path_factory.mktemp("plan")
    src = work / "plan.cpp"
    src.write_text(PLAN % text[start:end])
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    r = subprocess.run([cxx, "-std=c++17", "-O1", str(src), "-o", str(work / "plan")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr

    def run(expected_m: int, tile: int, max_m: int, sms: int) -> tuple[int, ...]:
        args = [str(x) for x in (expected_m, tile, max_m, sms)]
        out = subprocess.run([str(work / "plan"), *args], capture_output=True, text=True)
        return tuple(map(int, out.stdout.split()))

    return run


@settings(max_examples=150, deadline=None)
@given(
    expected_m=st.integers(1, 2048),
    tile=st.sampled_from(range(16, 129, 8)),
    max_m=st.integers(1, 65536),
    sms=st.sampled_from([78, 132]),
)
def test_no_expert_above_its_passes_runs_swap_ab(cpp_plan, expected_m, tile, max_m, sms):
    busiest, cold_m, boundary, hot_m = cpp_plan(expected_m, tile, max_m, sms)
    assert busiest >= expected_m and hot_m == max_m
    # The H20 model's port (benchmarks/moe_dispatch/model.py) is this plan.
    port = dk.bench_model().plan_whole_expert(expected_m, tile, max_m, sms)
    assert port == (busiest, cold_m, boundary)
    if max_m <= tile:  # one launch: every expert fits one tile sized for the most rows
        assert cold_m == boundary == max_m
        return
    # Two launches: the swap-A/B class ends after a whole number of tiles (one on the 132-SM
    # parts; on H20 as many as cost less than one regular tile), at most 128 rows.
    whole = boundary % tile == 0 or boundary == 128
    assert boundary == tile or (tile < boundary <= 128 and whole)
    if sms == 132:
        assert boundary == tile
    else:
        passes = max(1, int(max(1.0, (64 if max_m <= 64 else 128) / 37) / max(1.0, tile / 37)))
        assert boundary == min(128, tile * passes)
    assert 1 <= cold_m <= boundary
