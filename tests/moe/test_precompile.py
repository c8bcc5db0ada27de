"""`vllm-h20 kernels precompile`: the fix's DeepGEMM kernels planned from the patched headers and
compiled with nvcc for sm_90a here (no GPU), checked against what a fix server compiled on the
H200 (benchmarks/results/serve_h200/round3-four-moe-paths/logs/deepgemm-cache.txt)."""

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
ROUND3 = ROOT / "benchmarks/results/serve_h200/round3-four-moe-paths/logs/deepgemm-cache.txt"
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


def test_the_plan_covers_every_kernel_a_fix_server_compiled_on_the_h200(planner, tmp_path):
    """Round 3's fix server compiled these while serving (~2.3 s each, the engine waiting); the
    plan for its model, 132 SMs and vLLM's default 8,192-token steps must hold every one. The
    cache also held the stock server's kernels (same directory): the unrestricted regular
    kernels, which the fix never launches (its regular launch always has a row class)."""
    names = set(_names(planner, H200_MODEL, 132, 8192, tmp_path))
    seen = {line.split()[3].split("/")[1] for line in ROUND3.read_text().splitlines()}
    stock_only = {n for n in seen if n.startswith("gemm_") and not n.startswith("gemm_swapAB")
                  and "_rows" not in n}  # fmt: skip
    assert len(stock_only) == 4
    assert seen - stock_only <= names
    assert len(names) == 58
    # Every kernel's source was written by the patched generateKernel.
    src = tmp_path / "gemm_swapAB_4608_5120_128_40_128_384_6384_6_1_rows1-40_GroupedWithOffset.cu"
    want = "SchedulerSelectorSwapAB<GemmType::GroupedWithOffset, 4608, 5120, 128, 40, 128, 384, "
    assert want + "1, 36, 16, 1, 40>::type" in src.read_text()


def test_the_plan_follows_the_dispatch(planner, tmp_path):
    """Up to 128 tokens one swap-A/B launch with no row class; beyond, a swap-A/B class 1..T
    and a regular class T+1.., T a multiple of 8 between the threshold (32; 64 on 78 SMs) and
    128. On an H20 with EP8 (48 experts per rank) the same rules hold with its threshold."""
    small = _names(planner, H200_MODEL, 132, 128, tmp_path / "a")
    assert small and all(n.startswith("gemm_swapAB_") and "_rows" not in n for n in small)
    for sms, ep, threshold in ((132, 1, 32), (78, 8, 64)):
        shape = pc.MoeShape(5120, 2304, 384, 6, ep_size=ep)
        names = _names(planner, shape, sms, 8192, tmp_path / f"b{sms}")
        assert len(names) == len(set(names))
        bounds = {int(m.group(1)) for n in names if (m := re.search(r"_rows1-(\d+)_", n))}
        hot = {int(m.group(1)) - 1 for n in names if (m := re.search(r"_rows(\d+)-any_", n))}
        assert bounds == hot and min(bounds) == threshold and max(bounds) == 128
        assert all(b % 8 == 0 for b in bounds)
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
        "gemm_swapAB_4608_5120_128_16_128_384_8384_8_1_GroupedWithOffset",
        "gemm_swapAB_5120_2304_128_16_128_384_8384_8_1_GroupedWithOffset",
    ]
    assert all(b"fp8_gemm_kernel_swapAB" in c.read_bytes() for c in cubins)
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


def test_two_node_ep16_plans_25_slot_kernels_for_both_replicas_steps(installed_fi, tmp_path):
    """recipes' two-node layout: 384 experts + 16 EPLB replicas over EP16 = 25 slots per rank
    (the grouped GEMM's problem count is in every kernel's name), and with DP2 each MoE call
    holds both replicas' steps: --data-parallel-size doubles the rows planned for."""
    _need_nvcc()
    env = {"VLLM_H20_CACHE_DIR": str(tmp_path / "c"), "TRTLLM_DG_CACHE_DIR": str(tmp_path / "dg")}
    model = _model_dir(tmp_path)
    base = [str(model), "--num-sms", "78", "--ep-size", "16", "--num-redundant-experts", "16",
            "--max-num-batched-tokens", "128", "--dry-run", "--json"]  # fmt: skip
    one = json.loads(_cli(*base, **env).stdout)
    two = json.loads(_cli(*base, "--data-parallel-size", "2", **env).stdout)
    assert one["shape"]["ep_size"] == 16 and one["shape"]["redundant"] == 16
    assert one["names"] and all("_25_" in k for k in one["names"] + two["names"])
    # Up to 128 rows: one launch; both replicas' 256 rows add the two-class launches.
    assert not any("_rows" in k for k in one["names"])
    assert set(one["names"]) < set(two["names"]) and any("_rows" in k for k in two["names"])
