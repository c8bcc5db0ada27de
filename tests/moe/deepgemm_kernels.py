"""What the DeepGEMM compile tests share (test_deepgemm_whole_expert, test_moe_dispatch): an
overlay of the installed FlashInfer with the patch series, a host program built against it (the
patched `generateKernel` writing kernel sources, or a plan cut out of the headers), and one
generated kernel compiled with DeepGEMM's own nvcc flags; and the H20 model whose plan ports
they check (also test_precompile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from vllm_h20.moe import overlay, precompile
from vllm_h20.moe.patchfile import read_patch

# The kernel header the dispatch lives in (csrc-relative), and a host program that prints the
# kernel source the patched generateKernel writes for a row class (swap|regular, min, max rows).
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


def bench_model() -> ModuleType:
    """benchmarks/moe_dispatch/model.py (a script beside its `cases` module, not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "moe_dispatch"))
    import model

    return model


def added_text(patch: Path, file_name: str) -> str:
    """What one patch file adds to the source file named `file_name` (its hunks' new side), for
    the tests that cut functions out of a patch and compile them alone."""
    (diff,) = [d for d in read_patch(patch).files if d.path.endswith("/" + file_name)]
    return "\n".join(line for h in diff.hunks for line in h.new)


def nvcc() -> str:
    found = shutil.which("nvcc")
    if found is None:
        if os.environ.get("VLLM_H20_REQUIRE_NVCC"):
            pytest.fail("nvcc is not on PATH, and VLLM_H20_REQUIRE_NVCC is set (CI)")
        pytest.skip("nvcc is not on PATH")
    return found


def overlay_csrc(installed_fi, patches, work: Path) -> Path:
    """The csrc/ of an overlay of the installed FlashInfer with `patches` applied."""
    a = overlay.assess(installed_fi, patches)
    assert a.state is overlay.FixState.NEEDS_PATCH, a.detail
    ov = overlay.build_overlay(installed_fi, a, overlay.overlay_for(installed_fi, patches, work))
    return ov.csrc_dir


def build_host(src: Path, csrc: Path, installed_fi, exe: Path) -> None:
    """A host program against an overlay's headers (only their inline host code runs)."""
    flags, common = precompile._host_includes(csrc, installed_fi.root)
    cmd = [nvcc(), "-std=c++17", "--expt-relaxed-constexpr", *flags, str(src),
           *map(str, common), "-o", str(exe), "-Xlinker",
           "--unresolved-symbols=ignore-all"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def generate(gen: str, sources: dict[str, list[str]], csrc: Path, installed_fi, work: Path):
    """The kernel sources a generator program (`gen`, printing the source on stdout and "tag"
    plus the cache-name tag on stderr) writes for each argument list, and their tags."""
    (work / "gen.cu").write_text(gen)
    build_host(work / "gen.cu", csrc, installed_fi, work / "gen")
    out = {}
    for name, args in sources.items():
        r = subprocess.run([str(work / "gen"), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[name] = r.stdout
        out[name + "_tag"] = r.stderr.strip()[len("tag") :]
    return out


def compile_kernel(source: str, include: Path, tmp_path: Path, name: str, *extra: str):
    """DeepGEMM's own nvcc flags (compiler.cuh; vllm_h20.moe.precompile keeps the copy that
    `kernels precompile` uses) for one generated kernel, and `extra` ones."""
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    cmd = [nvcc(), str(src), "-o", str(tmp_path / f"{name}.cubin"), *precompile.NVCC_FLAGS,
           *extra, f"-I{include}"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
