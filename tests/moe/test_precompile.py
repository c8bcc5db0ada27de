"""`vllm-h20 kernels precompile`: the fix's DeepGEMM kernels planned from the patched headers and
compiled with nvcc for sm_90a here (no GPU), checked against what the kernel-level A/B compiled on
the H200 and the H100 (benchmarks/results/moe_dispatch/hot-first-h200/kernel_h200.json,
last-tile-h100/kernel_h100.json)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.moe import deepgemm_kernels as dk
from vllm_h20.moe import overlay
from vllm_h20.moe import precompile as pc

ROOT = Path(__file__).resolve().parents[2]
# The kernel-level A/B runs of the shipped dispatch on 132-SM GPUs: the H200 run of 2026-12-04 and
# the H100 run of 2026-12-06 (the same dispatch, its row-class kernels stopping at the last tile).
GPU_RUNS = ("hot-first-h200/kernel_h200.json", "last-tile-h100/kernel_h100.json")
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


def _names(planner: Path, shape: pc.MoeShape, sms: int, tokens: int, out: Path,
           min_tokens: int = 1) -> list[str]:  # fmt: skip
    return [k.name for k in pc.plan_kernels(planner, shape, sms, tokens, out, min_tokens)]


def _tag(name: str) -> tuple[int, int | None] | None:
    """A kernel name's row class (min rows, max rows or None for any); None: no class."""
    m = re.search(r"_class(\d+)-(\d+|any)_", name)
    return m and (int(m.group(1)), None if m.group(2) == "any" else int(m.group(2)))


def _row_tile(name: str) -> int:
    """The rows one tile covers: block_n of a swap-A/B kernel, block_m of a regular one."""
    fields = name.removeprefix("gemm_swapAB_").removeprefix("gemm_").split("_")
    return int(fields[3] if name.startswith("gemm_swapAB_") else fields[2])


@pytest.mark.parametrize("gpu_run", GPU_RUNS)
def test_the_plan_holds_every_kernel_the_gpu_runs_launched(planner, tmp_path, gpu_run):
    """The kernel-level A/B on the H200 and on the H100 (moe_dispatch/run.py: V4.1-Flash's
    experts over EP8, 50 of 400 slots per rank, 132 SMs) compiled these while timing the patched
    series; for each of its token counts the plan must name only kernels it compiled, so the
    names and the sources the planner writes are the ones DeepGEMM builds at run time. The run's
    other kernels are stock's, average-only's and the previous plan's."""
    run = json.loads((ROOT / "benchmarks/results/moe_dispatch" / gpu_run).read_text())
    compiled = set(run["kernels"])
    shape = pc.MoeShape(hidden=5120, inter=2304, experts=400, top_k=6, ep_size=8)
    planned: set[str] = set()
    model = dk.bench_model()
    for t in sorted({r["tokens"] for r in run["ab"]}):
        names = set(_names(planner, shape, 132, t, tmp_path / "src", min_tokens=t))
        assert names and names <= compiled, (t, sorted(names - compiled))
        planned |= names
        # The H20 model's port of the plan (with its port of get_best_gemm_config) agrees.
        avg = model.per_expert_expected_m(t, 6, 50, 8)
        for n, _ in shape.gemms():
            tile = model.tile_rows("swap_ab", model.busiest_balanced_rows(avg), n, 132, 50)
            _, cold_m, boundary = model.plan_whole_expert(avg, tile, t, 132)
            if t <= boundary:
                want = [(model.tile_rows("swap_ab", cold_m, n, 132, 50), None)]
            elif t <= model.ONE_LAUNCH_ROWS:
                want = [(model.tile_rows("swap_ab", t, n, 132, 50), None)]
            elif t <= model.NARROW_REGULAR_ROWS or (  # 64 rows: under the H200's ridge
                tile + model.SWAP_TILE_STEP >= model.WIDE_REGULAR_ROWS  # patch 0006
            ):
                want = []
            else:
                want = [(model.tile_rows("swap_ab", cold_m, n, 132, 50), (1, boundary))]
            swap = [x for x in names if x.startswith(f"gemm_swapAB_{n}_")]
            assert [(_row_tile(x), _tag(x)) for x in swap] == want, (t, n, swap)
            whole = [x for x in names if x.startswith(f"gemm_{n}_") and _tag(x) is None]
            assert bool(whole) is (want == []), (t, n, whole)
    assert len(planned) == 26
    # Every kernel's source was written by the patched generateKernel, its class in the type.
    src = (
        tmp_path
        / "src"
        / "gemm_swapAB_4608_5120_128_24_128_50_650_6_1_class1-24_GroupedWithOffset.cu"
    )
    want = "SchedulerSelectorSwapAB<GemmType::GroupedWithOffset, 4608, 5120, 128, 24, 128, 50, "
    assert want + "1, 36, 16, 1, 24>::type" in src.read_text()


def test_the_plan_follows_the_dispatch(planner, tmp_path):
    """A step whose token count fits one swap-A/B tile, or of at most 32 tokens: one swap-A/B
    launch, no row class; up to 64 tokens on a 132-SM GPU, one regular launch with 64-row tiles;
    where the swap-A/B tile for the busiest expert is 120-128 rows, one regular launch with
    128-row tiles. Otherwise a swap-A/B class 1..B and a regular class B+1..: on a 132-SM GPU B
    is the swap-A/B kernel's own row tile (one pass over an expert's weights); on an H20 (78 SMs,
    EP8: 48 experts per rank) up to three passes, B at most three tiles, never past 128."""
    small = _names(planner, H200_MODEL, 132, 16, tmp_path / "a")
    assert small and all(n.startswith("gemm_swapAB_") and _tag(n) is None for n in small)
    for sms, ep, most in ((132, 1, 1), (78, 8, 3)):
        shape = pc.MoeShape(5120, 2304, 384, 6, ep_size=ep)
        names = _names(planner, shape, sms, 8192, tmp_path / f"b{sms}")
        assert len(names) == len(set(names))
        assert all(f"_{shape.groups}_" in n for n in names)
        cold = [n for n in names if n.startswith("gemm_swapAB_") and _tag(n)]
        hot = [n for n in names if not n.startswith("gemm_swapAB_") and _tag(n)]
        # The regular kernel without a class: the 64-row single launch, on 132 SMs only, and
        # the 128-row one where the cold class's swap-A/B tile would be as wide (patch 0006).
        whole = [n for n in names if not n.startswith("gemm_swapAB_") and not _tag(n)]
        assert {_row_tile(n) for n in whole} == ({64, 128} if sms == 132 else {128}), whole
        bounds = {_tag(n)[1] for n in cold}
        # One pass on 132 SMs: B is a tile under 120 rows; on H20, up to 128 in three passes.
        assert bounds == {_tag(n)[0] - 1 for n in hot}
        assert max(bounds) == (112 if sms == 132 else 128)
        passes = {_tag(n)[1] / _row_tile(n) for n in cold if _tag(n)[1] < 128}
        assert passes and max(passes) == most and all(p == int(p) for p in passes)


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
    assert (out["kernels"], out["compiled"], out["cached"], out["failed"], out["replaced"]) == (
        2, 2, 0, 0, 0)  # fmt: skip
    cubins = sorted((tmp_path / "dg" / "cache").glob("*/nvcc_kernel.cubin"))
    assert [c.parent.name for c in cubins] == [
        "gemm_swapAB_4608_5120_128_16_128_384_8384_8_1_GroupedWithOffset",
        "gemm_swapAB_5120_2304_128_16_128_384_8384_8_1_GroupedWithOffset",
    ]
    assert all(b"fp8_gemm_kernel_swapAB" in c.read_bytes() for c in cubins)
    assert not list((tmp_path / "dg").rglob("*.tmp-*"))
    again = json.loads(_cli(*args, **env).stdout)
    assert (again["compiled"], again["cached"]) == (0, 2)


def test_a_cubin_from_other_sources_is_compiled_again_and_one_from_these_kept(tmp_path):
    """DeepGEMM names a cached kernel by its template arguments only. A cubin under that name
    built from other headers (an earlier patch series: another `sources` key), or left by
    DeepGEMM's run-time build (no stamp), is compiled again and stamped; a stamped one from
    the same sources is kept untouched."""
    _need_nvcc()
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void fp8_gemm_kernel_swapAB() {}\n')
    kern = pc.Kernel("gemm_swapAB_1_2_128_16_128_50_550_5_1_GroupedWithOffset", src)
    cache, entry = tmp_path / "cache", tmp_path / "cache" / kern.name

    def once(sources: str) -> dict[str, list[str]]:
        return pc.compile_kernels([kern], tmp_path, cache, jobs=1, sources=sources)

    assert once("series-a") == {"compiled": [kern.name], "cached": [], "failed": [],
                                "replaced": []}  # fmt: skip
    built = (entry / pc.CUBIN).read_bytes()
    assert b"fp8_gemm_kernel_swapAB" in built
    assert (entry / pc.STAMP).read_text().strip() == pc.fingerprint(kern, "series-a")
    assert once("series-a")["cached"] == [kern.name]
    assert (entry / pc.CUBIN).read_bytes() == built
    (entry / pc.CUBIN).write_bytes(b"an earlier series' kernel")
    assert once("series-b")["replaced"] == [kern.name]
    assert (entry / pc.CUBIN).read_bytes() == built
    assert (entry / pc.STAMP).read_text().strip() == pc.fingerprint(kern, "series-b")
    (entry / pc.STAMP).unlink()  # as DeepGEMM's own run-time build leaves its cubins
    assert once("series-b")["replaced"] == [kern.name]
    src.write_text(src.read_text() + "// the generated source changed\n")
    assert once("series-b")["replaced"] == [kern.name]
    assert sorted(p.name for p in entry.iterdir()) == sorted([pc.CUBIN, pc.STAMP])


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
    assert (one["max_num_batched_tokens"], two["max_num_batched_tokens"]) == (128, 256)
    # At 78 SMs a 25-expert rank's steps past 48 rows already make both class launches.
    assert set(one["names"]) <= set(two["names"]) and any("_class" in k for k in one["names"])
