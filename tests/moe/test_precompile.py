"""`vllm-h20 kernels precompile`: the fix's DeepGEMM kernels planned from the patched headers and
compiled with nvcc for sm_90a here (no GPU), checked against the kernels the H200 compiled for
the fix in the kernel-level A/B (benchmarks/results/moe_dispatch_h200.json, `kernels`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_h20.moe import overlay
from vllm_h20.moe import precompile as pc

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks/results/moe_dispatch_h200.json"
# The serve_h200 test model's MoE (benchmarks/serve_h200/make_model.py): V4.1-Flash's experts.
H200_MODEL = pc.MoeShape(hidden=5120, inter=2304, experts=384, top_k=6)


def _need_nvcc() -> None:
    if shutil.which("nvcc") is None:
        if os.environ.get("VLLM_H20_REQUIRE_NVCC"):
            pytest.fail("nvcc is not on PATH, and VLLM_H20_REQUIRE_NVCC is set (CI)")
        pytest.skip("nvcc is not on PATH")


@pytest.fixture(scope="module")
def ov(installed_fi, patches, tmp_path_factory) -> overlay.Overlay:
    a = overlay.assess(installed_fi, patches)
    root = tmp_path_factory.mktemp("ov")
    return overlay.build_overlay(installed_fi, a, overlay.overlay_for(installed_fi, patches, root))


@pytest.fixture(scope="module")
def planner(ov, installed_fi, tmp_path_factory) -> Path:
    _need_nvcc()
    return pc.build_planner(ov.csrc_dir, installed_fi.root, tmp_path_factory.mktemp("planner"))


def _names(planner: Path, shape: pc.MoeShape, sms: int, tokens: int, out: Path) -> list[str]:
    return [k.name for k in pc.plan_kernels(planner, shape, sms, tokens, out)]


def _widths(names: list[str]) -> list[int]:
    """The widest row tiles (block_n, the fourth number of the cache name) of fitted kernels."""
    return sorted({int(re.match(r"gemm_swapAB_\d+_\d+_\d+_(\d+)_", n).group(1)) for n in names})


def test_the_plan_covers_every_kernel_the_h200_run_compiled_for_the_fix(planner, tmp_path):
    """The kernel-level A/B compiled the fix's kernels for V4.1-Flash FC1/FC2 on an EP8 rank
    (50 expert slots, 132 SMs) at 1-4,096 tokens; the plan for that model must hold every one
    (the run's cache also holds the other versions' kernels: stock, average-only, the previous
    plan, the split, which the fix never launches)."""
    shape = pc.MoeShape(hidden=5120, inter=2304, experts=384, top_k=6, ep_size=8, redundant=16)
    names = set(_names(planner, shape, 132, 4096, tmp_path))
    compiled = json.loads(PUBLISHED.read_text())["kernels"]
    fix = {n for n in compiled if "_fit_" in n and "_rows" not in n}
    assert fix and fix <= names, sorted(fix - names)
    # Every kernel's source was written by the patched generateKernel.
    src = tmp_path / "gemm_swapAB_4608_5120_128_128_128_50_550_5_1_fit_GroupedWithOffset.cu"
    assert "fp8_gemm_kernel_swapAB_fit<4608, 5120, 128, 128, 128, 50, 5, " in src.read_text()


def test_the_plan_follows_the_dispatch(planner, tmp_path):
    """One fitted swap-A/B launch per GEMM at every step size, its widest row tile the step's
    tokens rounded up to 16, at most 128: eight kernels per GEMM cover every step size, on an
    H200 and on an H20 with EP8 (48 experts per rank) alike."""
    small = _names(planner, H200_MODEL, 132, 40, tmp_path / "a")
    assert _widths(small) == [16, 32, 48] and len(small) == 6
    for sms, ep in ((132, 1), (78, 8)):
        shape = pc.MoeShape(5120, 2304, 384, 6, ep_size=ep)
        names = _names(planner, shape, sms, 8192, tmp_path / f"b{sms}")
        assert len(names) == len(set(names)) == 16
        assert _widths(names) == list(range(16, 129, 16))
        assert all(n.endswith("_fit_GroupedWithOffset") for n in names)
        assert all(f"_{shape.groups}_" in n for n in names)


def test_our_copy_of_deepgemms_nvcc_flags_matches_the_headers(ov, tmp_path):
    assert pc.flags_drift(ov.csrc_dir) == []
    moved = tmp_path / "csrc"
    target = moved / pc.COMPILER_CUH
    target.parent.mkdir(parents=True)
    text = (ov.csrc_dir / pc.COMPILER_CUH).read_text()
    target.write_text(text.replace('"--expt-extended-lambda"', '"--expt-other"'))
    assert pc.flags_drift(moved) == ["--expt-extended-lambda"]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_H20_", "TRTLLM_DG_"))}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "vllm_h20.cli", "kernels", "precompile", *args],
                          env=full, capture_output=True, text=True, timeout=900)  # fmt: skip


def _model_dir(tmp_path: Path, name: str = "model", **cfg) -> Path:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    base = {"hidden_size": 5120, "moe_intermediate_size": 2304, "n_routed_experts": 384,
            "num_experts_per_tok": 6}  # fmt: skip
    (d / "config.json").write_text(json.dumps(base | cfg))
    return d


def test_precompile_writes_the_cubins_deepgemm_loads_and_keeps_them(installed_fi, tmp_path):
    """End to end on a 16-token limit (two kernels): each cubin lands where DeepGEMM's runtime
    looks (<TRTLLM_DG_CACHE_DIR>/cache/<name>/nvcc_kernel.cubin) and holds the kernel; a
    second run compiles nothing."""
    _need_nvcc()
    env = {"VLLM_H20_CACHE_DIR": str(tmp_path / "c"), "TRTLLM_DG_CACHE_DIR": str(tmp_path / "dg")}
    model = _model_dir(tmp_path)
    args = [str(model), "--num-sms", "132", "--max-num-batched-tokens", "16", "--json"]
    r = _cli(*args, **env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["kernels"], out["compiled"], out["cached"], out["failed"]) == (2, 2, 0, 0)
    cubins = sorted((tmp_path / "dg" / "cache").glob("*/nvcc_kernel.cubin"))
    assert [c.parent.name for c in cubins] == [
        "gemm_swapAB_4608_5120_128_16_128_384_8384_8_1_fit_GroupedWithOffset",
        "gemm_swapAB_5120_2304_128_16_128_384_8384_8_1_fit_GroupedWithOffset",
    ]
    assert all(b"fp8_gemm_kernel_swapAB_fit" in c.read_bytes() for c in cubins)
    assert not list((tmp_path / "dg").rglob("*.tmp-*"))
    again = json.loads(_cli(*args, **env).stdout)
    assert (again["compiled"], again["cached"]) == (0, 2)


def test_precompile_refuses_bad_input_in_one_line(installed_fi, tmp_path):
    env = {"VLLM_H20_CACHE_DIR": str(tmp_path / "c"), "TRTLLM_DG_CACHE_DIR": str(tmp_path / "dg"),
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    dense = _model_dir(tmp_path, "dense", n_routed_experts=None)
    cases = [
        ([str(dense), "--num-sms", "132"], "no integer n_routed_experts"),
        ([str(_model_dir(tmp_path)), "--num-sms", "132", "--ep-size", "5"], "does not divide"),
        ([str(_model_dir(tmp_path))], "no GPU visible: pass --num-sms"),
    ]
    for args, msg in cases:
        r = _cli(*args, **env)
        assert r.returncode == 2 and msg in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "dg").exists()


def test_a_kernel_that_does_not_compile_is_reported_and_leaves_nothing(ov, tmp_path):
    """nvcc's first error line comes back with the kernel's name; no cubin, temp file or empty
    cache entry is left where DeepGEMM would look (it then compiles the kernel itself)."""
    _need_nvcc()
    bad = tmp_path / "bad.cu"
    bad.write_text("this is not CUDA\n")
    cache = tmp_path / "cache"
    out = pc.compile_kernels([pc.Kernel("gemm_bad", bad)], ov.csrc_dir, cache, jobs=1)
    assert out["compiled"] == [] and len(out["failed"]) == 1
    assert out["failed"][0].startswith("gemm_bad: ") and "error" in out["failed"][0]
    assert not (cache / "gemm_bad").exists()
