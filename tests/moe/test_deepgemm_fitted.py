"""The fitted-row-tile candidate (patches/flashinfer/candidates/fitted-row-tiles), compiled here
with nvcc for sm_90a (no GPU needed).

DeepGEMM compiles its kernels at run time from the headers the module points it at. These
tests take the headers from a real overlay of the installed FlashInfer with the candidate patch
series, let the patched `generateKernel` write the kernel sources the dispatch launches (the
fitted swap-A/B kernel alone, and with a row class, as a split launches it), and compile them:
they build against the overlay with no register spills, their cubins hold the fitted kernel,
and FlashInfer's own headers refuse them, so a stock header set can never produce, nor be
mistaken for, a fitted kernel. The plan's Python port (`benchmarks/moe_dispatch/expected_m.py`,
used by the benchmarks' model and the FlashInfer test) is checked against the patched C++.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.benchmark_scripts import load_script
from tests.moe import deepgemm_kernels as dk
from vllm_h20.moe import overlay
from vllm_h20.moe.patchfile import read_patch

expected_m = load_script(
    Path(__file__).resolve().parents[2] / "benchmarks" / "moe_dispatch" / "expected_m.py",
    "moe_dispatch_expected_m",
)

KERNEL_CUH = (
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/"
    "fp8_blockscale_gemm_kernel.cuh"
)

GEN = r"""
#include <cstdlib>
#include <iostream>
#include "tensorrt_llm/deep_gemm/compiler.cuh"
// argv: fitted|plain, widest row tile, stages, min rows, max rows ("any")
int main(int argc, char** argv) {
  bool const fitted = argv[1][0] == 'f';
  deep_gemm::jit::RowClass rows{
      static_cast<uint32_t>(std::atoi(argv[4])),
      argv[5][0] == 'a' ? deep_gemm::kAnyRows : static_cast<uint32_t>(std::atoi(argv[5])), fitted};
  std::cerr << "tag" << rows.tag() << "\n";
  std::cout << deep_gemm::jit::generateKernel(4608, 5120, 128, std::atoi(argv[2]), 128, 50,
                                              std::atoi(argv[3]), 1,
                                              deep_gemm::GemmType::GroupedWithOffset, true, rows);
}
"""
# name: (generator arguments): the widest tile and the stages the dispatch picks for them.
SOURCES = {
    "fit128": ["fitted", "128", "5", "0", "any"],  # a step of 128+ tokens, one launch
    "fit48": ["fitted", "48", "6", "0", "any"],  # a step of 33-48 tokens
    "fit128_split": ["fitted", "128", "5", "1", "128"],  # the fitted class of a split
    "plain": ["plain", "16", "8", "0", "any"],  # FlashInfer's own swap-A/B kernel
}


CANDIDATE = overlay.patches_dir() / "flashinfer" / "candidates" / "fitted-row-tiles"


@pytest.fixture(scope="module")
def overlay_csrc(installed_fi, tmp_path_factory) -> Path:
    patches = [read_patch(p) for p in sorted(CANDIDATE.glob("*.patch"))]
    return dk.overlay_csrc(installed_fi, patches, tmp_path_factory.mktemp("c"))


@pytest.fixture(scope="module")
def generated(overlay_csrc, installed_fi, tmp_path_factory) -> dict[str, str]:
    """The kernel sources the patched generateKernel writes, and their cache-name tags."""
    return dk.generate(GEN, SOURCES, overlay_csrc, installed_fi, tmp_path_factory.mktemp("gen"))


def _compile(source: str, include: Path, tmp_path: Path, name: str):
    """One generated kernel, with ptxas's resource report."""
    return dk.compile_kernel(source, include, tmp_path, name, "-Xptxas", "-v")


def test_fitted_kernels_compile_only_against_the_overlay(
    generated, overlay_csrc, installed_fi, tmp_path
):
    tags = {n: generated[n + "_tag"] for n in SOURCES}
    assert tags == {"fit128": "_fit", "fit48": "_fit", "fit128_split": "_fit_rows1-128",
                    "plain": ""}  # fmt: skip
    assert "fp8_gemm_kernel_swapAB_fit<4608, 5120, 128, 128, 128, 50, 5, " in generated["fit128"]
    assert "50, 1, 36, 16, 1, 128>::type" in generated["fit128_split"]
    ours = overlay_csrc / "nv_internal" / "tensorrt_llm"
    theirs = installed_fi.root / "csrc" / "nv_internal" / "tensorrt_llm"
    # The overlay holds DeepGEMM's headers as files: relative includes stay inside it.
    assert not any(p.is_symlink() for p in (ours / "deep_gemm").iterdir())
    for name in ("fit128", "fit48", "fit128_split"):
        r = _compile(generated[name], ours, tmp_path, name)
        assert r.returncode == 0, r.stderr[-3000:]
        report = r.stdout + r.stderr
        # Eight (or three) instantiations of the math loop share the math warps' registers.
        assert "0 bytes spill stores" in report and " spill stores" in report, report[-2000:]
        assert not re.search(r"[1-9]\d* bytes spill stores", report), report[-2000:]
        cubin = (tmp_path / f"{name}.cubin").read_bytes()
        assert b"fp8_gemm_kernel_swapAB_fit" in cubin, name
        r = _compile(generated[name], theirs, tmp_path, name + "_stock")
        assert r.returncode != 0 and "fp8_gemm_kernel_swapAB_fit" in r.stdout + r.stderr
    # Without fitting or a class the source is what FlashInfer's own generateKernel writes.
    assert "SchedulerSelectorSwapAB<GemmType::GroupedWithOffset, 4608, 5120, 128, 16, 128, 50, " \
           "1>::type" in generated["plain"]  # fmt: skip
    assert "fp8_gemm_kernel_swapAB<" in generated["plain"]
    r = _compile(generated["plain"], theirs, tmp_path, "plain_stock")
    assert r.returncode == 0, r.stderr[-3000:]


# --------------------------------------------------------------------------- the plan

PLAN = r"""
#include <cstdio>
#include <cstdlib>
// argv: sms, then triples: max_m, shape_n, shape_k
int main(int argc, char** argv) {
  int const sms = std::atoi(argv[1]);
  for (int i = 2; i + 2 < argc; i += 3) {
    LaunchPlan p = plan_launches(std::atoi(argv[i]), split_rows_for(sms));
    FittedConfig c = fitted_gemm_config(std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), p.fit_n);
    std::printf("%u %u %d %d %d\n", p.fit_n, p.regular_m, c.block_m, c.num_stages, c.smem_size);
  }
}
"""


@pytest.fixture(scope="module")
def cpp_plan(overlay_csrc, installed_fi, tmp_path_factory):
    """The patched plan_launches and fitted_gemm_config, cut out of the header (as `kernels
    precompile` cuts them) and compiled with the headers they use."""
    text = (overlay_csrc / KERNEL_CUH).read_text()
    start = text.index("struct LaunchPlan {")
    end = text.index("void grouped_gemm_dispatch(")
    work = tmp_path_factory.mktemp("plan")
    src = work / "plan.cu"
    src.write_text('#include <algorithm>\n#include "tensorrt_llm/deep_gemm/compiler.cuh"\n'
                   + text[start:end] + PLAN)  # fmt: skip
    dk.build_host(src, overlay_csrc, installed_fi, work / "plan")

    def run(sms: int, cases: list[tuple[int, int, int]]) -> list[tuple[int, ...]]:
        args = [str(sms)] + [str(x) for c in cases for x in c]
        out = subprocess.run([str(work / "plan"), *args], capture_output=True, text=True)
        return [tuple(map(int, line.split())) for line in out.stdout.splitlines()]

    return run


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.integers(1, 65536),
    sms=st.sampled_from([78, 132]),
    shape=st.sampled_from([(4608, 5120), (5120, 2304), (1024, 512), (64, 7168)]),
)
def test_the_plans_python_port_is_the_patch(cpp_plan, tokens, sms, shape):
    fit_n, regular_m, block_m, stages, smem = cpp_plan(sms, [(tokens, *shape)])[0]
    assert (fit_n, regular_m) == expected_m.launch_plan(tokens, sms)
    # What the kernel relies on: a multiple of 16 up to 128, at least the rows any expert of a
    # step up to 128 tokens can hold (one tile each); a configuration that fits shared memory.
    assert fit_n % expected_m.FIT_STEP == 0 and 16 <= fit_n <= expected_m.MAX_FIT_N
    assert fit_n >= min(tokens, expected_m.MAX_FIT_N)
    assert block_m == (64 if shape[0] <= 64 else 128) and 4 <= stages <= 8
    assert 0 < smem <= 232448


@given(rows=st.integers(1, 100_000), widest=st.sampled_from(range(16, 129, 16)))
def test_fitted_tiles_cover_the_rows_with_under_a_step_of_padding(rows, widest):
    tiles = expected_m.fitted_tiles(rows, widest)
    assert sum(tiles) >= rows and sum(tiles) - rows < expected_m.FIT_STEP
    assert len(tiles) == -(-rows // widest) and all(t <= widest for t in tiles)
