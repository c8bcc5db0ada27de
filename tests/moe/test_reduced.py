"""The reduced FP8 block-scale module's spec, against FlashInfer's real JIT spec (no GPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from vllm_h20.moe import overlay, reduced


def test_instantiation_file_is_cut_to_the_bf16_fp8_runner(installed_fi):
    src = next(installed_fi.csrc_dir.rglob(reduced.SELECT_FILE))
    text = reduced.select_instantiations(src, reduced.SELECT_ARGS)
    active = re.findall(r"^template class [^;]*;", text, re.M)
    assert active == [
        "template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;"
    ]
    every = re.findall(r"^template class [^;]*;", src.read_text(), re.M)
    commented = text.count("/* not in the reduced module: template class")
    assert len(every) > 10 and commented == len(every) - 1
    assert text.count("#ifdef") == src.read_text().count("#ifdef")
    assert "INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16" in text  # macro instantiations stay
    # A header beside the source is found by absolute path; others through the -I dirs.
    assert f'#include "{src.parent / "cutlass_fused_moe_kernels.cuh"}"' in text
    assert '#include "moe_kernels.h"' in text
    with pytest.raises(reduced.ReduceError, match="does not know this layout"):
        reduced.select_instantiations(src, ("__nv_fp8_e5m2",))


def test_reduced_spec_keeps_the_block_scale_path_only(installed_fi, patches, jit_spec, tmp_path):
    a = overlay.assess(installed_fi, patches)
    ov = overlay.overlay_for(installed_fi, patches, tmp_path)
    ov = overlay.build_overlay(installed_fi, a, ov)
    fixed = overlay.patched_spec(jit_spec, ov)
    key = reduced.reduction_key(ov.key)
    spec = reduced.reduce_spec(fixed, "fix", key, tmp_path / "gen", base=jit_spec.name)

    assert spec.name == f"{jit_spec.name}_vllm_h20_bs_fix_{key[:8]}"
    assert jit_spec.name == "fused_moe_90"  # the generic variant on a machine without a GPU
    names = [s.name for s in spec.sources]
    assert not any(n.endswith(".generated.cu") for n in names)
    assert set(names) == (reduced.KEEP - {reduced.SELECT_FILE}) | {
        f"vllm_h20_{reduced.SELECT_FILE}",
        reduced.STUBS_FILE,
    }
    assert names[-1] == reduced.STUBS_FILE
    # FlashInfer's own sources come from the overlay (patched), ours from the gen dir.
    for s in spec.sources:
        assert str(s).startswith((str(ov.csrc_dir), str(tmp_path / "gen"))), s
    # Everything else is FlashInfer's: flags, include order, link line.
    for field in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags", "extra_include_dirs"):
        assert getattr(spec, field) == getattr(fixed, field), field
    assert len(spec.sources) < len(jit_spec.sources) / 8

    stock = reduced.reduce_spec(jit_spec, "stock", reduced.reduction_key("s"), tmp_path / "g2")
    assert stock.name.startswith("fused_moe_90_vllm_h20_bs_stock_")
    assert not any(str(s).startswith(str(ov.root)) for s in stock.sources)
    with pytest.raises(ValueError, match="variant"):
        reduced.reduce_spec(jit_spec, "other", "k", tmp_path / "g3")


def test_an_unknown_source_layout_is_refused(jit_spec, tmp_path):
    import dataclasses

    spec = dataclasses.replace(
        jit_spec, sources=[s for s in jit_spec.sources if s.name != "fp8_blockscale_gemm.cu"]
    )
    with pytest.raises(reduced.ReduceError, match="fp8_blockscale_gemm.cu"):
        reduced.reduce_spec(spec, "fix", "k", tmp_path)


def test_stub_classification():
    fn = "_ZN12tensorrt_llm7kernels15cutlass_kernels13MoeGemmRunnerIffffLb0EEC1Ev"
    vtable = "_ZTVN12tensorrt_llm7kernels15cutlass_kernels13MoeGemmRunnerIffffLb0EEE"
    stub, rest = reduced.stubbable({fn, vtable, "cudaMalloc", "_ZNSt6vectorIiSaIiEE9push_backEv"})
    assert stub == [fn]
    assert sorted(rest) == sorted([vtable, "cudaMalloc", "_ZNSt6vectorIiSaIiEE9push_backEv"])


def test_stubs_define_the_missing_functions_and_throw_naming_them(tmp_path):
    """The generated stub file, compiled with g++ against a tiny stand-in for FlashInfer's
    assert.h, defines exactly the requested mangled symbols."""
    inc = tmp_path / "inc" / "tensorrt_llm" / "common"
    inc.mkdir(parents=True)
    (inc / "assert.h").write_text(
        "#include <stdexcept>\n#include <cstdio>\n"
        "#define TLLM_THROW(fmt, ...) do { char b[1024]; std::snprintf(b, sizeof b, fmt, "
        "__VA_ARGS__); throw std::runtime_error(b); } while (0)\n"
    )
    names = [
        "_ZN12tensorrt_llm7kernels15cutlass_kernels13MoeGemmRunnerIffffLb0EEC1Ev",
        "_ZNK12tensorrt_llm7kernels15cutlass_kernels13MoeGemmRunnerIffffLb0EE5getSMEv",
    ]
    src = tmp_path / "stubs.cpp"
    src.write_text(reduced.stub_source(names))
    assert "MoeGemmRunner<float, float, float, float, false>::getSM() const" in src.read_text()
    obj = tmp_path / "stubs.o"
    subprocess.run(["g++", "-std=c++17", "-c", "-fPIC", f"-I{tmp_path / 'inc'}", str(src),
                    "-o", str(obj)], check=True)  # fmt: skip
    defined, undefined = reduced.symbols([obj])
    assert set(names) <= defined


def test_link_search_dirs_expand_cuda_home(tmp_path):
    ninja = tmp_path / "build.ninja"
    ninja.write_text("cuda_home = /opt/cuda\nldflags = -shared -L$cuda_home/lib64 -lcudart\n")
    assert reduced.link_search_dirs(ninja) == [Path("/opt/cuda/lib64")]
