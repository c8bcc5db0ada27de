"""candidates/graph-branches (0003 on the shipped series): under CUDA-graph capture the two row
classes of the per-expert split run on two branches of a forked stream, joined after them.

With concentrated routing the shipped split's second launch is empty and still costs ~1.5 us per
GEMM on an H200 (benchmarks/results/moe_dispatch/hot-first-h200): a kernel boundary on the
graph's path. As a parallel node it is off that path. Checked here, without a GPU: the series is
the shipped one plus 0003 on both FlashInfer lines; 0003 changes no kernel (every file DeepGEMM's
run-time compile reads is the shipped series', byte for byte, so `kernels precompile` and the
kernels' cache names are unchanged) and only the host dispatch; its stream fork/join class,
cut out of the patch, compiles with nvcc against CUDA's headers; and the FlashInfer test it adds
runs the captured op against the eager one. Whether it is faster is measured on a GPU
(benchmarks/moe_dispatch/run.py --series candidates/graph-branches).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.moe import deepgemm_kernels as dk
from vllm_h20.moe import overlay
from vllm_h20.moe.patchfile import read_patch

SERIES = "candidates/graph-branches"
NAME = "0003-fused_moe-run-the-row-classes-as-CUDA-graph-branches.patch"
DISPATCH = "fp8_blockscale_gemm_kernel.cuh"


def _last() -> Path:
    return overlay.patches_dir() / "flashinfer" / SERIES / NAME


def test_the_candidate_is_the_shipped_series_and_one_patch():
    """A maintainer applies a folder with `git am`: the shipped 0001 and 0002 byte for byte, then
    0003, the same on both FlashInfer lines."""
    assert dk.candidate_series(SERIES, NAME) == _last()


def test_0003_changes_only_the_dispatch_and_the_flashinfer_test():
    """No kernel changes: the launches under capture are the shipped series' kernels on another
    stream, without the programmatic dependent launch between them."""
    files = sorted(Path(d.path).name for d in read_patch(_last()).files)
    assert files == [DISPATCH, "test_fp8_blockscale_moe_expected_m.py"]
    added = dk.added_text(_last(), DISPATCH)
    assert "RowClassBranches::when_capturing(stream)" in added
    assert "run_swap_ab(plan.cold_m, {1, plan.boundary}, /*overlap=*/false, side);" in added


def test_kernel_headers_are_the_shipped_series(installed_fi, patches, tmp_path):
    """Every header DeepGEMM's run-time compile reads (deep_gemm/) is the shipped series' byte for
    byte under the candidate, so its kernels, their cache names and `kernels precompile`'s plan
    are the shipped series'."""
    candidate = dk.series_patches(installed_fi.version, SERIES)
    trees = {
        "shipped": dk.overlay_csrc(installed_fi, patches, tmp_path / "shipped"),
        "candidate": dk.overlay_csrc(installed_fi, candidate, tmp_path / "candidate"),
    }
    deep_gemm = {k: v / "nv_internal" / "tensorrt_llm" / "deep_gemm" for k, v in trees.items()}
    names = sorted(p.name for p in deep_gemm["shipped"].iterdir())
    assert names == sorted(p.name for p in deep_gemm["candidate"].iterdir()) and names
    for name in names:
        a, b = deep_gemm["shipped"] / name, deep_gemm["candidate"] / name
        assert a.is_dir() or a.read_bytes() == b.read_bytes(), name


# The class cut out of 0003, with FlashInfer's error check (cudaUtils.h) reduced to an abort.
HOST = r"""
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#define TLLM_CUDA_CHECK(stat)                                 \
  do {                                                        \
    cudaError_t const e = (stat);                             \
    if (e != cudaSuccess) {                                   \
      std::fprintf(stderr, "%s\n", cudaGetErrorString(e));   \
      std::abort();                                           \
    }                                                         \
  } while (0)
@CLASS@
cudaStream_t branch_once(cudaStream_t stream) {
  RowClassBranches* b = RowClassBranches::when_capturing(stream);
  if (b == nullptr) return stream;
  cudaStream_t const side = b->fork(stream);
  b->join(stream);
  return side;
}
"""


def test_the_branches_class_compiles_alone(tmp_path):
    added = dk.added_text(_last(), DISPATCH)
    start = added.index("class RowClassBranches {")
    end = added.index("};", start) + 2
    (tmp_path / "branches.cu").write_text(HOST.replace("@CLASS@", added[start:end]))
    cmd = [dk.nvcc(), "-std=c++17", "-c", str(tmp_path / "branches.cu"), "-o",
           str(tmp_path / "branches.o")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_flashinfer_test_checks_the_captured_op_against_the_eager_one():
    """The test 0003 adds: both classes holding rows and the cold class empty, each replayed from
    a CUDA graph and compared with the eager call bit for bit (`graph_equal`)."""
    added = dk.added_text(_last(), "test_fp8_blockscale_moe_expected_m.py")
    assert "def test_a_cuda_graph_runs_the_row_classes_as_branches_with_the_eager_output(" in added
    assert 'id="both_classes"' in added and 'id="cold_class_empty"' in added
    assert "graph_equal = bool(torch.equal(out_graph, out))" in added
