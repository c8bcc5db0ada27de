"""The previous per-expert dispatch's DeepGEMM side (patches/flashinfer/candidates/
estimated-row-classes: the series shipped until 2026-12-03, its row-class boundary from an
estimate), compiled here with nvcc for sm_90a (no GPU needed).

DeepGEMM compiles its kernels at run time from the headers the module points it at. These
tests take the headers from a real overlay of the installed FlashInfer with that patch
series, let the patched `generateKernel` write the kernel source a row-class launch compiles,
and compile it: it builds against the overlay (its scheduler type carries the row class in the
cubin's symbol), and FlashInfer's own headers refuse it, so a stock header set can never
produce, nor be mistaken for, a row-class kernel. The plan's Python port (benchmarks' model,
the FlashInfer test) is checked against the patched C++ function itself.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.moe import deepgemm_kernels as dk
from vllm_h20.moe.patchfile import read_patch

ROOT = Path(__file__).resolve().parents[2]
KERNEL_CUH = (
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/"
    "fp8_blockscale_gemm_kernel.cuh"
)

GEN = r"""
#include <cstdlib>
#include <iostream>
#include "tensorrt_llm/deep_gemm/compiler.cuh"
// argv: swap|regular, min rows, max rows ("any")
int main(int argc, char** argv) {
  bool const swap = argv[1][0] == 's';
  deep_gemm::jit::RowClass rows{
      static_cast<uint32_t>(std::atoi(argv[2])),
      argv[3][0] == 'a' ? deep_gemm::kAnyRows : static_cast<uint32_t>(std::atoi(argv[3]))};
  std::cerr << "tag" << rows.tag() << "\n";
  std::cout << deep_gemm::jit::generateKernel(4608, 5120, 128, swap ? 16 : 128, 128, 50,
                                              swap ? 8 : 5, 1,
                                              deep_gemm::GemmType::GroupedWithOffset, swap, rows);
}
"""


SERIES = ROOT / "patches" / "flashinfer" / "candidates" / "estimated-row-classes"


@pytest.fixture(scope="module")
def overlay_csrc(installed_fi, tmp_path_factory) -> Path:
    patches = [read_patch(p) for p in sorted(SERIES.glob("*.patch"))]
    return dk.overlay_csrc(installed_fi, patches, tmp_path_factory.mktemp("c"))


@pytest.fixture(scope="module")
def generated(overlay_csrc, installed_fi, tmp_path_factory) -> dict[str, str]:
    """The kernel sources the patched generateKernel writes: cold class, hot class, no class."""
    sources = {"cold": ["swap", "1", "32"], "hot": ["regular", "33", "any"],
               "plain": ["swap", "0", "any"]}  # fmt: skip
    return dk.generate(GEN, sources, overlay_csrc, installed_fi, tmp_path_factory.mktemp("gen"))


def test_row_class_kernels_compile_only_against_the_overlay(
    generated, overlay_csrc, installed_fi, tmp_path
):
    assert generated["cold_tag"] == "_rows1-32" and generated["hot_tag"] == "_rows33-any"
    assert generated["plain_tag"] == ""
    assert "50, 1, 36, 16, 1, 32>::type" in generated["cold"]
    assert "50, 1, 36, 16, 33, 4294967295>::type" in generated["hot"]
    ours = overlay_csrc / "nv_internal" / "tensorrt_llm"
    theirs = installed_fi.root / "csrc" / "nv_internal" / "tensorrt_llm"
    # The overlay holds DeepGEMM's headers as files: relative includes stay inside it.
    assert not any(p.is_symlink() for p in (ours / "deep_gemm").iterdir())
    for name in ("cold", "hot"):
        r = dk.compile_kernel(generated[name], ours, tmp_path, name)
        assert r.returncode == 0, r.stderr[-3000:]
        cubin = (tmp_path / f"{name}.cubin").read_bytes()
        # The kernel's mangled name carries the scheduler's row class (kMinRows, kMaxRows).
        bounds = b"Lj1ELj32EEE" if name == "cold" else b"Lj33ELj4294967295EEE"
        assert re.search(rb"GroupedWithOffsetScheduler\w*" + bounds, cubin), name
        r = dk.compile_kernel(generated[name], theirs, tmp_path, name + "_stock")
        assert r.returncode != 0 and "too many arguments" in r.stdout + r.stderr
    # Without a row class the source is what FlashInfer's own generateKernel writes.
    assert "SchedulerSelectorSwapAB<GemmType::GroupedWithOffset, 4608, 5120, 128, 16, 128, 50, " \
           "1>::type" in generated["plain"]  # fmt: skip
    r = dk.compile_kernel(generated["plain"], theirs, tmp_path, "plain_stock")
    assert r.returncode == 0, r.stderr[-3000:]


# --------------------------------------------------------------------------- the plan

PLAN = r"""
#include <cstdio>
#include <cstdlib>
%s
int main(int argc, char** argv) {
  for (int i = 1; i + 2 < argc; i += 3) {
    RowClassPlan p = plan_row_classes(std::atoi(argv[i]), std::atoi(argv[i + 1]),
                                      std::atoi(argv[i + 2]));
    std::printf("%%u %%u %%u\n", p.cold_m, p.boundary, p.hot_m);
  }
}
"""


@pytest.fixture(scope="module")
def cpp_plan(overlay_csrc, tmp_path_factory):
    """The patched plan_row_classes (and its struct), cut out of the header and compiled alone."""
    text = (overlay_csrc / KERNEL_CUH).read_text()
    start = text.index("struct RowClassPlan {")
    end = text.index("void grouped_gemm_dispatch(")
    work = tmp_path_factory.mktemp("plan")
    src = work / "plan.cpp"
    src.write_text("#include <algorithm>\n#include <cmath>\n#include <cstdint>\n"
                   + PLAN % text[start:end])  # fmt: skip
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    r = subprocess.run([cxx, "-std=c++17", "-O1", str(src), "-o", str(work / "plan")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr

    def run(cases: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        args = [str(x) for c in cases for x in c]
        out = subprocess.run([str(work / "plan"), *args], capture_output=True, text=True)
        return [tuple(map(int, line.split())) for line in out.stdout.splitlines()]

    return run


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(1, 65536),
    top_k=st.integers(1, 8),
    slots=st.sampled_from([8, 64, 256, 400]),
    threshold=st.sampled_from([32, 64]),
)
def test_the_plans_python_port_is_the_patch(cpp_plan, tokens, top_k, slots, threshold):
    expected_m = max(1, math.ceil(tokens * top_k / slots))
    cold_m, boundary, hot_m = cpp_plan([(expected_m, tokens, threshold)])[0]
    port_cold, port_boundary = dk.bench_model().plan_row_classes(expected_m, tokens, threshold)
    assert (cold_m, hot_m) == (port_cold, tokens)
    assert boundary == (tokens if port_boundary is None else port_boundary)
    # What the dispatch relies on: the cold class is never empty of meaning, its tiles never
    # wider than its rows, and a second launch only when an expert can exceed the boundary.
    assert 1 <= cold_m <= boundary
    if tokens > boundary:
        assert threshold <= boundary <= 128
