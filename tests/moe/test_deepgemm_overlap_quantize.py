"""candidates/overlap-quantize (0003 on the shipped series): the per-expert split's hot launch
overlaps the kernel before it (programmatic dependent launch), as its cold launch overlaps the hot
one; before the GEMM that kernel is the grouped quantization of the activations, which now lets
its dependent launch at once.

Overlapping the kernel that writes your inputs is only correct if you wait for it before reading
them, so checked here without a GPU: the series is the shipped one plus 0003 on both FlashInfer
lines; in the overlay's regular kernel (the hot class's) the wait comes before the first-tile
search reads the offsets, while the swap-A/B kernel (the cold class's) still searches first and
waits last; the row-class kernels' cache names say so (`_pdl`), so a kernel compiled from headers
where the hot kernel does not wait first is never launched this way; and such a kernel, written by
the patched generateKernel, compiles with nvcc for sm_90a. Whether it is faster is measured on a
GPU (benchmarks/moe_dispatch/run.py --series candidates/overlap-quantize).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.moe import deepgemm_kernels as dk
from tests.moe.test_deepgemm_row_class import GEN
from vllm_h20.moe import overlay
from vllm_h20.moe.patchfile import read_patch

SERIES = "candidates/overlap-quantize"
NAME = "0003-fused_moe-let-the-SM90-FP8-hot-row-class-overlap-the-kernel-before-it.patch"
DISPATCH = "fp8_blockscale_gemm_kernel.cuh"
IMPL = "fp8_gemm_impl.cuh"


def _last() -> Path:
    return overlay.patches_dir() / "flashinfer" / SERIES / NAME


def test_the_candidate_is_the_shipped_series_and_one_patch():
    assert dk.candidate_series(SERIES, NAME) == _last()


def test_0003_overlaps_the_hot_launch_and_the_quantization_lets_it():
    files = sorted(Path(d.path).name for d in read_patch(_last()).files)
    assert files == ["compiler.cuh", DISPATCH, IMPL]
    added = dk.added_text(_last(), DISPATCH)
    hot = "run_regular(plan.hot_m, {plan.boundary + 1, deep_gemm::kAnyRows}, /*overlap=*/true);"
    assert hot in added
    assert 'asm volatile("griddepcontrol.launch_dependents;");' in added


@pytest.fixture(scope="module")
def candidate_csrc(installed_fi, tmp_path_factory) -> Path:
    patches = dk.series_patches(installed_fi.version, SERIES)
    assert patches[-1].subject.startswith("fused_moe: let the SM90 FP8 hot row class overlap")
    return dk.overlay_csrc(installed_fi, patches, tmp_path_factory.mktemp("c"))


def test_the_hot_kernel_waits_before_it_reads_and_the_cold_one_after(candidate_csrc):
    """fp8_gemm_impl.cuh holds the regular kernel, then the swap-A/B one."""
    text = (candidate_csrc / "nv_internal" / "tensorrt_llm" / "deep_gemm" / IMPL).read_text()
    start = text.index("fp8_gemm_kernel(")
    swap = text.index("fp8_gemm_kernel_swapAB(")
    regular, swap_ab = text[start:swap], text[swap:]
    wait, search = (
        'asm volatile("griddepcontrol.wait;" ::: "memory");',
        "SchedulerType::first_tile(",
    )
    assert regular.index(wait) < regular.index(search)
    assert swap_ab.index(search) < swap_ab.index(wait)


def test_row_class_kernels_are_named_for_it_and_compile(candidate_csrc, installed_fi, tmp_path):
    sources = {"hot": ["regular", "25", "any"], "cold": ["swap", "1", "24"],
               "plain": ["swap", "0", "any"]}  # fmt: skip
    generated = dk.generate(GEN, sources, candidate_csrc, installed_fi, tmp_path)
    assert generated["hot_tag"] == "_class25-any_pdl" and generated["cold_tag"] == "_class1-24_pdl"
    assert generated["plain_tag"] == ""  # FlashInfer's own kernels keep their names
    r = dk.compile_kernel(generated["hot"], candidate_csrc / "nv_internal" / "tensorrt_llm",
                          tmp_path, "hot")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
