"""Routing FlashInfer's SM90 fused-MoE calls, and what happens when the fix module cannot be had.

The failures are real (no nvcc, a compiler error, a corrupt module in FlashInfer's JIT cache, a
FlashInfer release we do not support) and happen before any kernel runs, so they are tested on
the CPU with the installed FlashInfer. Only the fallback target, FlashInfer's own module (a
40-minute build), is stood in for by a namespace that records the call.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from vllm_h20.moe import call_routing, dispatch
from vllm_h20.moe.build import jit_env

BS = {"use_deepseek_fp8_block_scale": True}


class Recorder:
    def __init__(self, name: str):
        self.name, self.calls = name, []

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return lambda *a, **k: self.calls.append((attr, a, k)) or self.name


def test_block_scale_calls_go_to_the_reduced_module_the_rest_to_flashinfers():
    built = []
    stock, fix = Recorder("stock"), Recorder("fix")
    r = call_routing.Sm90Routes(
        stock=lambda: built.append("stock") or stock,
        reduced=lambda: built.append("fix") or fix,
        describe="test",
        strict=False,
    )
    assert r.cutlass_fused_moe(1, 2, **BS) == "fix"
    assert r.cutlass_fused_moe_workspace_size(8, **BS) == "fix"
    assert built == ["fix"]  # FlashInfer's own module is not built for block-scale calls
    assert r.cutlass_fused_moe(1, 2, use_deepseek_fp8_block_scale=False) == "stock"
    assert r.interleave_moe_weights_for_sm90_mixed_gemm(3) == "stock"
    assert built == ["fix", "stock"]  # each built once, when first needed
    assert [c[0] for c in fix.calls] == ["cutlass_fused_moe", "cutlass_fused_moe_workspace_size"]
    assert fix.calls[0][1] == (1, 2) and fix.calls[0][2] == BS


def test_install_routes_only_the_sm90_backend():
    core = types.ModuleType("fake_core")

    @functools.cache
    def get_cutlass_fused_moe_module(backend="100", use_fast_build=False):
        return ("flashinfer", backend, use_fast_build)

    core.get_cutlass_fused_moe_module = get_cutlass_fused_moe_module
    core.gen_cutlass_fused_moe_sm90_module = lambda use_fast_build=False: None
    call_routing.install(core, lambda gen, ufb: None, "test", strict=False)
    router = core.get_cutlass_fused_moe_module
    assert router.vllm_h20 and router.__wrapped__ is get_cutlass_fused_moe_module
    assert router("100") == ("flashinfer", "100", False)
    assert router("89", True) == ("flashinfer", "89", True)
    sm90 = router("90")
    assert isinstance(sm90, call_routing.Sm90Routes) and router("90") is sm90
    assert router("90", True) is not sm90
    call_routing.install(core, lambda gen, ufb: None, "test", strict=False)  # idempotent
    assert core.get_cutlass_fused_moe_module is router

    plain = types.ModuleType("old_core")
    plain.get_cutlass_fused_moe_module = lambda backend="100": None  # not cached: unknown layout
    plain.gen_cutlass_fused_moe_sm90_module = lambda: None
    with pytest.raises(RuntimeError, match="VLLM_H20_MOE_MODULE=full"):
        call_routing.install(plain, lambda gen, ufb: None, "test", strict=False)


# --------------------------------------------------------------------------- fallbacks

FALLBACK = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(name)s|%(message)s")
import flashinfer.fused_moe.core as core
from vllm_h20.moe import call_routing, dispatch

stock = []
class Stock:
    def cutlass_fused_moe(self, *a, **k):
        stock.append(k.get("use_deepseek_fp8_block_scale"))
        return "flashinfer"

decision = dispatch.decide()
stock_gen = core.gen_cutlass_fused_moe_sm90_module
make_spec = {make_spec}
cr = call_routing
r = cr.Sm90Routes(stock=Stock, reduced=lambda: cr.load_namespace(core, make_spec),
                  describe="the reduced fix module", strict=decision.strict)
served = [r.cutlass_fused_moe(use_deepseek_fp8_block_scale=True) for _ in range(3)]
print("RESULT " + json.dumps({{"served": served, "stock": stock}}))
"""
REDUCED = "lambda ufb: dispatch.reduced_spec(decision, stock_gen)"


def _fallback(tmp_path, make_spec: str = REDUCED, **env: str):
    full = {k: v for k, v in jit_env().items() if not k.startswith("VLLM_H20_")}
    full.update(
        FLASHINFER_CUDA_ARCH_LIST="9.0a",
        FLASHINFER_WORKSPACE_BASE=str(tmp_path / "ws"),
        VLLM_H20_CACHE_DIR=str(tmp_path / "cache"),
        MAX_JOBS="2",
        **env,
    )
    code = textwrap.dedent(FALLBACK.format(make_spec=make_spec))
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING|vllm.plugins")]
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return proc, result, warnings


def _assert_fell_back(proc, result, warnings, *says: str) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every block-scale call ran on FlashInfer's module; one warning, naming cause and fix.
    assert result == {"served": ["flashinfer"] * 3, "stock": [True] * 3}, result
    assert len(warnings) == 1, proc.stderr[-3000:]
    for s in says:
        assert s in warnings[0], warnings[0]
    assert "Traceback" not in proc.stderr
    return warnings[0]


def test_no_nvcc_falls_back_with_one_warning(installed_fi, tmp_path):
    path = os.pathsep.join(
        d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvcc").exists()
    )
    got = _fallback(tmp_path, CUDA_HOME=str(tmp_path / "no-cuda"), PATH=path)
    line = _assert_fell_back(*got, "nvcc was not found", "vllm-h20 kernels build")
    assert "VLLM_H20_STRICT=1" in line


@pytest.fixture
def broken_compiler_env(tmp_path) -> dict[str, str]:
    """Every nvcc and host-compiler run of the module stops at a real #error."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    header = tmp_path / "broken.h"
    header.write_text('#error "vllm-h20 test: this source does not compile"\n')
    return dict(
        FLASHINFER_EXTRA_CUDAFLAGS=f"-include {header}",
        FLASHINFER_EXTRA_CFLAGS=f"-include {header}",
    )


def test_compile_error_falls_back_with_one_warning(installed_fi, tmp_path, broken_compiler_env):
    got = _fallback(tmp_path, **broken_compiler_env)
    _assert_fell_back(
        *got, "building the fix module failed", "this source does not compile",
        "vllm-h20 kernels build --clean",
    )  # fmt: skip


def test_strict_makes_a_compile_error_an_error(installed_fi, tmp_path, broken_compiler_env):
    proc, result, _ = _fallback(tmp_path, VLLM_H20_STRICT="1", **broken_compiler_env)
    assert proc.returncode != 0 and result is None
    assert "FixModuleUnavailable: building the fix module failed" in proc.stderr


TINY = """(lambda ufb: __import__("flashinfer.jit.core", fromlist=["x"]).gen_jit_spec(
    "vllm_h20_test_tiny", [{src!r}]))"""


def test_corrupt_module_in_the_jit_cache_falls_back_with_one_warning(installed_fi, tmp_path):
    """A module built once, then truncated in FlashInfer's JIT cache (a full disk, a killed
    copy): ninja sees it up to date, loading fails."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed (FlashInfer's link line needs the CUDA toolkit)")
    src = tmp_path / "tiny.cpp"
    src.write_text('extern "C" int vllm_h20_tiny() { return 1; }\n')
    make_spec = TINY.format(src=str(src))
    code = (
        "import os; from flashinfer.jit.core import gen_jit_spec\n"
        f"s = {make_spec}(False); s.build(verbose=False); print(s.jit_library_path)"
    )
    env = dict(jit_env(), FLASHINFER_CUDA_ARCH_LIST="9.0a",
               FLASHINFER_WORKSPACE_BASE=str(tmp_path / "ws"))  # fmt: skip
    built = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    library = Path(built.stdout.strip().splitlines()[-1])
    with open(library, "r+b") as f:
        f.truncate(64)
    os.utime(library)  # newer than its objects: ninja will not rebuild it
    got = _fallback(tmp_path, make_spec=make_spec)
    _assert_fell_back(*got, f"loading {library} failed", "stale or corrupt",
                      "vllm-h20 kernels build --clean")  # fmt: skip


def test_unsupported_flashinfer_keeps_it_stock_with_one_warning(fake_fi, patches):
    src = fake_fi("stock", version="9.9.9")
    d = dispatch.decide({}, src=src)
    assert d.warn and d.route is None and not d.overlay and not d.per_expert
    assert "FlashInfer 9.9.9 is not a release vllm-h20 supports" in d.message
    assert "pip install flashinfer-python==" in d.message
    with pytest.raises(dispatch.UnsupportedFlashInfer, match="VLLM_H20_STRICT=1"):
        dispatch.decide({dispatch.STRICT_ENV: "1"}, src=src)


def test_explain_names_cause_and_fix(tmp_path):
    lib = tmp_path / "m.so"
    lib.write_bytes(b"x")
    assert "stale or corrupt" in call_routing.explain(
        OSError("invalid ELF header"), str(lib), "nvcc"
    )
    assert "nvcc was not found" in call_routing.explain(RuntimeError("x"), None, None)
    msg = call_routing.explain(
        RuntimeError("ninja failed (exit 1): error: boom"), None, "/bin/nvcc"
    )
    assert msg.startswith("building the fix module failed (ninja failed") and "--clean" in msg


def test_deepgemm_reads_the_headers_of_the_modules_own_sources(jit_spec, installed_fi, tmp_path):
    """DeepGEMM's run-time compiles must see the row-class scheduler for the fix module (the
    overlay's headers) and FlashInfer's own for the stock A/B module."""
    from flashinfer.jit import fused_moe

    from vllm_h20.moe import dispatch

    found = {}
    for mode in ("per_expert", "stock"):
        decision = dispatch.decide({dispatch.ENV: mode})
        spec = dispatch.reduced_spec(decision, fused_moe.gen_cutlass_fused_moe_sm90_module,
                                     cache=tmp_path / "c", build=False)  # fmt: skip
        found[mode] = Path(call_routing.deepgemm_include_dir(spec))
    scheduler = found["per_expert"] / "deep_gemm" / "scheduler.cuh"
    assert found["per_expert"].is_relative_to(tmp_path / "c")
    assert not scheduler.is_symlink() and "rows_in_class" in scheduler.read_text()
    stock = installed_fi.root / "csrc" / "nv_internal" / "tensorrt_llm"
    assert found["stock"].resolve() == stock.resolve()
    assert "rows_in_class" not in (found["stock"] / "deep_gemm" / "scheduler.cuh").read_text()


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.7.3", True), ("0.7.3.post1", True), ("0.7.2.post1", True), ("0.7.2", False),
     ("0.7.3rc1", False), ("0.7.4.post1", False), ("0.7.5", False), ("0.6.15", False)],
)  # fmt: skip
def test_a_release_inside_a_tested_range_gets_the_fix(fake_fi, patches, version, ok):
    """vLLM 0.34 pins FlashInfer 0.7.3, which the index did not serve when this was written: it
    lies between 0.7.2.post1 and 0.7.4, whose patched sources are byte-identical, so the version
    rule supports it (the patches are still applied to its own sources); pre-releases and
    releases outside the range stay stock, with the warning."""
    assert dispatch.supported(version) is ok
    d = dispatch.decide({}, src=fake_fi("stock", version=version))
    assert d.per_expert is ok and d.warn is not ok
    if not ok:
        assert "any 0.7.2.post1-0.7.4" in d.message
    elif version != "0.7.2.post1":
        assert f"FlashInfer {version} (between the tested 0.7.2.post1 and 0.7.4)" in d.message
