"""candidates/one-launch (0003 on the series shipped until 2026-12-06, whose row-class kernels did
not yet stop at the launch's last tile): both row classes of the per-expert split in one launch,
compiled here with nvcc for sm_90a (no GPU needed).

With concentrated routing the shipped split's second launch is empty and still costs ~1.5 us per
GEMM on an H200 (benchmarks/results/moe_dispatch/hot-first-h200). `fp8_gemm_kernel_dual` runs
the regular kernel's body on some CTAs and the swap-A/B kernel's on the rest, the grid shared by
the classes' tiles (`share_grid`). Checked here: the dual kernel compiles only against the overlay,
spills nothing and is named for both classes; its base series' two kernels are byte-identical
under the candidate's headers (their bodies became device functions); `share_grid`, cut out of the
patch and compiled alone, never gives a CTA to a class without tiles nor leaves a class with tiles
without one; the whole schedule (the split, each CTA's first tile, its walk), run on the host with
a warp of 32 threads, computes every tile of each class exactly once, as the shipped series' two
launches do; and each series' FlashInfer test expects exactly the kernels its dispatch names.
Whether it is faster has not been measured yet (it needs a GPU run).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.moe import deepgemm_kernels as dk
from tests.moe.test_deepgemm_row_class import GEN as SHIPPED_GEN
from vllm_h20.moe import overlay
from vllm_h20.moe import precompile as pc
from vllm_h20.moe.patchfile import apply_file, read_patch

SERIES = "candidates/one-launch"
# DeepSeek-V4.1-Flash FC1 (N 4608, K 5120) on one EP8 rank (50 experts), split at 16 rows: the
# dual kernel (argv "dual") and, for the shipped series' generator too, the two classes' kernels.
GEN = r"""
#include <cstdlib>
#include <iostream>
#include "tensorrt_llm/deep_gemm/compiler.cuh"
// argv: dual | swap <min> <max> | regular <min> <max>
int main(int argc, char** argv) {
  using deep_gemm::jit::ColdShape;
  using deep_gemm::jit::RowClass;
  if (argv[1][0] == 'd') {
    RowClass const hot{17, deep_gemm::kAnyRows}, cold{1, 16};
    ColdShape const shape{128, 16, 8, cold};
    std::cerr << "tag" << hot.tag() << shape.tag() << "\n";
    std::cout << deep_gemm::jit::generateKernel(4608, 5120, 128, 128, 128, 50, 5, 1,
                                                deep_gemm::GemmType::GroupedWithOffset, false,
                                                hot, shape);
    return 0;
  }
  bool const swap = argv[1][0] == 's';
  uint32_t const max_rows = argv[3][0] == 'a' ? deep_gemm::kAnyRows : std::atoi(argv[3]);
  RowClass rows{static_cast<uint32_t>(std::atoi(argv[2])), max_rows};
  std::cerr << "tag" << rows.tag() << "\n";
  std::cout << deep_gemm::jit::generateKernel(4608, 5120, 128, swap ? 16 : 128, 128, 50,
                                              swap ? 8 : 5, 1,
                                              deep_gemm::GemmType::GroupedWithOffset, swap, rows);
}
"""
CLASSES = {"cold": ["swap", "1", "16"], "hot": ["regular", "17", "any"]}


def test_the_candidate_is_a_whole_series_on_the_0002_before_the_stop():
    """The candidate folder holds whole series (a maintainer applies a folder with `git am`), on
    both FlashInfer lines: the shipped 0001 byte for byte; the 0002 it was measured on, which is
    the shipped one but for the scheduler's stop at the launch's last tile (2026-12-06; its
    0003 rewrites the start that the stop changed); then 0003."""
    name = "0003-fused_moe-run-both-row-classes-in-one-launch.patch"
    dk.candidate_series(SERIES, name, same_bytes=1)
    root = overlay.patches_dir() / "flashinfer"
    for line in ("", "v0.6.14"):
        (ours,) = (root / SERIES / line).glob("0002-*.patch")
        (now,) = (root / line).glob("0002-*.patch")
        a, b = read_patch(ours), read_patch(now)
        assert a.subject == b.subject and a.paths == b.paths
        for x, y in zip(a.files, b.files, strict=True):
            if not x.path.endswith("deep_gemm/scheduler.cuh"):
                assert x == y, x.path
        assert "end_block_idx" not in dk.added_text(ours, "scheduler.cuh")
        assert "end_block_idx" in dk.added_text(now, "scheduler.cuh")


@pytest.fixture(scope="module")
def trees(installed_fi, patches, tmp_path_factory) -> dict[str, Path]:
    """csrc/ of the installed FlashInfer with the shipped series, with the candidate, and with
    the candidate's base (its 0001 + 0002)."""
    work = tmp_path_factory.mktemp("trees")
    candidate = dk.series_patches(installed_fi.version, SERIES)
    assert [p.subject for p in candidate[: len(patches)]] == [p.subject for p in patches]
    return {"shipped": dk.overlay_csrc(installed_fi, patches, work / "shipped"),
            "candidate": dk.overlay_csrc(installed_fi, candidate, work / "candidate"),
            "base": dk.overlay_csrc(installed_fi, candidate[: len(patches)],
                                    work / "base")}  # fmt: skip


@pytest.fixture(scope="module")
def generated(trees, installed_fi, tmp_path_factory) -> dict[str, dict[str, str]]:
    """The sources each series' generateKernel writes (the candidate's also the dual kernel)."""
    work = tmp_path_factory.mktemp("gen")
    for series in ("shipped", "candidate"):
        (work / series).mkdir()
    return {
        "shipped": dk.generate(SHIPPED_GEN, CLASSES, trees["shipped"], installed_fi,
                               work / "shipped"),
        "candidate": dk.generate(GEN, {**CLASSES, "dual": ["dual"]}, trees["candidate"],
                                 installed_fi, work / "candidate"),
    }  # fmt: skip


def _include(csrc: Path) -> Path:
    return csrc / "nv_internal" / "tensorrt_llm"


def test_the_dual_kernel_spills_nothing_and_needs_the_overlay(
    generated, trees, installed_fi, tmp_path
):
    dual = generated["candidate"]
    # Its cache name: the hot class's kernel, then the cold class's tile, stages and class.
    assert dual["dual_tag"] == "_class17-any_dual128_16_8_class1-16"
    assert "fp8_gemm_kernel_dual<4608, 5120, 128, 50, 128, 128, 128, 128, 5, SchedulerType, " \
           "128, 16, 8, ColdSchedulerType>" in dual["dual"]  # fmt: skip
    r = dk.compile_kernel(dual["dual"], _include(trees["candidate"]), tmp_path, "dual",
                          "-Xptxas", "-v")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = r.stdout + r.stderr
    assert "fp8_gemm_kernel_dual" in report and "0 bytes spill stores" in report, report[-2000:]
    assert not re.search(r"[1-9]\d* bytes spill stores", report), report[-2000:]
    # DeepGEMM's runtime picks the cubin's kernel by "fp8_gemm_kernel" in its name.
    assert b"fp8_gemm_kernel_dual" in (tmp_path / "dual.cubin").read_bytes()
    # the shipped headers have no dual kernel
    r = dk.compile_kernel(dual["dual"], _include(trees["shipped"]), tmp_path, "dual_shipped")
    assert r.returncode != 0


def test_its_base_series_kernels_are_unchanged(generated, trees, tmp_path):
    """The two-launch kernels (the split where the dual launch does not apply, and every single
    launch) are what its base series (0001 + 0002) builds: same generated source (the shipped
    series' too), same cubin."""
    for name in CLASSES:
        source = generated["candidate"][name]
        assert source == generated["shipped"][name], name
        cubins = []
        for tree in ("base", "candidate"):
            r = dk.compile_kernel(source, _include(trees[tree]), tmp_path, f"{name}_{tree}")
            assert r.returncode == 0, r.stderr[-3000:]
            cubins.append((tmp_path / f"{name}_{tree}.cubin").read_bytes())
        assert cubins[0] == cubins[1], f"the {name} class's kernel changed"


SHARE = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#define __host__
#define __device__
#define __forceinline__ inline
%s
int main(int argc, char** argv) {
  for (int i = 1; i + 4 < argc; i += 5) {
    DualTileCost const cost{uint32_t(std::atol(argv[i + 3])), uint32_t(std::atol(argv[i + 4]))};
    std::printf("%%u\n", share_grid(uint32_t(std::atol(argv[i])), uint32_t(std::atol(argv[i + 1])),
                                    uint32_t(std::atol(argv[i + 2])), cost));
  }
}
"""


@pytest.fixture(scope="module")
def cpp_share(tmp_path_factory):
    """share_grid and DualTileCost, cut out of the patch and compiled alone."""
    last = sorted((overlay.patches_dir() / "flashinfer" / SERIES).glob("*.patch"))[-1]
    text = dk.added_text(last, "scheduler.cuh")
    start = text.index("struct DualTileCost {")
    end = text.index("// share_grid from the offsets")
    work = tmp_path_factory.mktemp("share")
    (work / "share.cpp").write_text(SHARE % text[start:end])
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [cxx, "-std=c++17", "-O1", str(work / "share.cpp"), "-o", str(work / "share")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

    def run(hot: int, cold: int, ctas: int, hot_cost: int, cold_cost: int) -> int:
        args = [str(x) for x in (hot, cold, ctas, hot_cost, cold_cost)]
        return int(subprocess.run([str(work / "share"), *args], capture_output=True,
                                  text=True).stdout)  # fmt: skip

    return run


@settings(max_examples=200, deadline=None)
@given(
    hot=st.integers(0, 4000) | st.sampled_from([0, 1, 2]),
    cold=st.integers(0, 4000) | st.sampled_from([0, 1, 2]),
    ctas=st.sampled_from([1, 2, 3, 20, 40, 78, 132]),
    hot_cost=st.integers(1, 20000),
    cold_cost=st.integers(1, 20000),
)
def test_share_grid_gives_every_class_with_tiles_a_cta(cpp_share, hot, cold, ctas, hot_cost,
                                                       cold_cost):  # fmt: skip
    n = cpp_share(hot, cold, ctas, hot_cost, cold_cost)
    assert 0 <= n <= ctas
    if hot == 0:
        assert n == 0  # the whole grid runs the cold class (or nothing)
        return
    if cold == 0 or ctas < 2:
        assert n == ctas  # the whole grid runs the hot class
        return
    assert 1 <= n <= ctas - 1  # both classes run
    # A class gets CTAs beyond its tiles only when the other has a CTA for each of its tiles.
    if n > hot:
        assert ctas - n >= cold or n == 1
    if ctas - n > cold:
        assert n >= hot or n == ctas - 1
    # Otherwise the grid is shared by cost: the nearest whole number of CTAs.
    hw, cw = hot * hot_cost, cold * cold_cost
    nearest = (ctas * hw + (hw + cw) // 2) // (hw + cw)
    assert abs(nearest - ctas * hw / (hw + cw)) <= 0.5 + 1e-9
    if 1 <= nearest <= ctas - 1 and nearest <= hot and ctas - nearest <= cold:
        assert n == nearest


@pytest.fixture(scope="module")
def schedules(trees, tmp_path_factory):
    """Each series' schedulers run as its launches run them, on the host (dual_schedule.cpp: a
    warp of 32 threads): shipped, the two class launches over the whole grid; candidate,
    fp8_gemm_kernel_dual's one launch. run(series, boundary, ctas, cost, rows) -> (split, tiles):
    split the candidate's hot CTAs ("two" for the shipped launches), tiles {class: [(cta, group,
    m, n), ...]} with the shipped cold launch's CTAs numbered after the hot one's."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    work = tmp_path_factory.mktemp("dual_schedule")
    src = Path(__file__).with_name("dual_schedule.cpp")
    exes = {}
    for series, extra in (("shipped", ["-DTWO_LAUNCHES"]), ("candidate", [])):
        exes[series] = work / series
        cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-w", *extra,
               f"-I{_include(trees[series])}", str(src), "-o", str(exes[series])]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]

    def run(series: str, boundary: int, ctas: int, cost: tuple[int, int], rows: list[int]):
        case = " ".join(map(str, (len(rows), boundary, ctas, *cost, *rows)))
        out = subprocess.run([str(exes[series])], input=case + "\n", capture_output=True,
                             text=True, timeout=60).stdout.split("\n")  # fmt: skip
        assert out[0].startswith("split "), out[:3]
        tiles: dict[str, list[tuple[int, ...]]] = {"hot": [], "cold": []}
        for line in out[1 : out.index("end")]:
            kind, *nums = line.split()
            assert kind in tiles, line  # "lanes-disagree CTA": a warp without one answer
            tiles[kind].append(tuple(map(int, nums)))
        return out[0].split()[1], tiles

    return run


def _expected_tiles(rows: list[int], boundary: int) -> dict[str, set[tuple[int, int, int]]]:
    """Every tile of V4.1-Flash FC1 (N 4608: 36 blocks of 128 weight rows) each class owns:
    hot (rows > boundary) 128-row blocks x 36, cold (1..boundary rows) 36 x 16-token blocks."""
    hot = {(g, m, n) for g, r in enumerate(rows) if r > boundary
           for m in range(-(-r // 128)) for n in range(36)}  # fmt: skip
    cold = {(g, m, n) for g, r in enumerate(rows) if 1 <= r <= boundary
            for m in range(36) for n in range(-(-r // 16))}  # fmt: skip
    return {"hot": hot, "cold": cold}


@st.composite
def routings(draw):
    """Rows per expert (the groups' offsets) for the simulated shapes: uniform, a few hot
    experts, all tokens on one, empty, and one row."""
    groups, boundary = draw(st.sampled_from([(8, 16), (50, 16), (50, 48), (100, 32)]))
    kind = draw(st.sampled_from(["uniform", "hot", "one", "empty", "single"]))
    if kind == "empty":
        rows = [0] * groups
    elif kind == "one":
        rows = [0] * groups
        rows[draw(st.integers(0, groups - 1))] = draw(st.integers(1, 2048))
    elif kind == "single":
        rows = [0] * groups
        rows[draw(st.integers(0, groups - 1))] = 1
    else:
        top = 2 * boundary if kind == "uniform" else 600
        rows = draw(st.lists(st.integers(0, top), min_size=groups, max_size=groups))
    # one_launch_fits keeps a one-CTA grid to two launches: both classes need a CTA each
    ctas = draw(st.sampled_from([2, 3, 40, 78, 132]))
    cost = (draw(st.integers(1, 20000)), draw(st.integers(1, 20000)))
    return boundary, ctas, cost, rows


@pytest.mark.parametrize("series", ["shipped", "candidate"])
@settings(max_examples=60, deadline=None)
@given(case=routings())
def test_every_tile_of_each_class_is_computed_once(schedules, series, case):
    """Each series' schedule, run as its kernels run it (each CTA's first tile by a warp-wide
    search, then its strided walk; the candidate's grid split by split_grid and each CTA walking
    with its role's index and count, the shipped series' two launches each over the whole grid):
    every tile of each class is computed exactly once, by a CTA of that class, none of another
    class's experts, and the tiles of a class are dealt evenly over its CTAs."""
    boundary, ctas, cost, rows = case
    split, tiles = schedules(series, boundary, ctas, cost, rows)
    expected = _expected_tiles(rows, boundary)
    if series == "shipped":
        assert split == "two"
        roles = {"hot": range(ctas), "cold": range(ctas, 2 * ctas)}
    else:
        hot_ctas = int(split)
        assert 0 <= hot_ctas <= ctas
        if not expected["hot"]:
            assert hot_ctas == 0
        elif not expected["cold"]:
            assert hot_ctas == ctas
        roles = {"hot": range(hot_ctas), "cold": range(hot_ctas, ctas)}
    for kind, role in roles.items():
        got = [t[1:] for t in tiles[kind]]
        assert len(got) == len(set(got)) and set(got) == expected[kind], kind
        per_cta = [sum(t[0] == c for t in tiles[kind]) for c in role]
        if per_cta:
            assert max(per_cta) - min(per_cta) <= 1, (kind, per_cta)
        assert all(t[0] in role for t in tiles[kind])


FI_TEST = "tests/moe/test_fp8_blockscale_moe_expected_m.py"
# FlashInfer's test cases (the patched test file's parameters): (tokens, experts, top_k, ep_size).
FI_CASES = [(256, 256, 8, 8), (128, 64, 4, 1), (4096, 64, 8, 8), (512, 64, 4, 1),
            *((t, 64, 4, 1) for t in (32, 64, 128, 300))]  # fmt: skip


def _flashinfer_test(series: str, version: str, work: Path):
    """The FlashInfer test file as the series leaves it (its patches' hunks for that file,
    applied in order as fused_moe/stage.py stages it), imported, with the SM count it reads from
    the GPU settable."""
    import importlib.util

    text = None
    for patch in dk.series_patches(version, "" if series == "shipped" else SERIES):
        for diff in patch.files:
            if diff.path == FI_TEST:
                text = apply_file(diff, text)
    assert text, f"{series}: no patch writes {FI_TEST}"
    work.mkdir(parents=True)
    (work / "test_expected_m.py").write_text(text)
    spec = importlib.util.spec_from_file_location(f"fi_expected_m_{series}",
                                                  work / "test_expected_m.py")  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("series", ["shipped", "candidate"])
def test_flashinfer_s_test_expects_the_kernels_the_dispatch_plans(
    trees, installed_fi, series, tmp_path, monkeypatch
):
    """The series' FlashInfer test (run on a GPU: it reads which kernels DeepGEMM compiled) checks
    them against its own mirror of the dispatch (`_plan`, `_expect_kernels`). Here that check
    meets the kernels the patched dispatch's host code itself names for the same cases
    (`kernels precompile`'s planner, compiled from the series' headers), on 132 and 78 SMs: a
    mirror that disagrees with the dispatch fails here, not on a lent GPU."""
    pytest.importorskip("torch")
    mod = _flashinfer_test(series, installed_fi.version, tmp_path / "fi")
    planner = pc.build_planner(trees[series], installed_fi.root, tmp_path / "planner")
    for sms in (132, 78):
        monkeypatch.setattr(mod, "_num_sms", lambda sms=sms: sms)
        for tokens, experts, top_k, ep in FI_CASES:
            shape = pc.MoeShape(hidden=mod.HIDDEN_SIZE, inter=mod.INTERMEDIATE_SIZE,
                                experts=experts, top_k=top_k, ep_size=ep)  # fmt: skip
            out = tmp_path / f"k{sms}-{tokens}-{experts}-{ep}"
            names = [k.name for k in pc.plan_kernels(planner, shape, sms, tokens, out, tokens)]
            expected_m = mod._expected_m(tokens, top_k, experts)
            try:
                mod._expect_kernels(names, tokens, expected_m, shape.groups)
            except AssertionError as e:
                raise AssertionError(f"{series}, {sms} SMs, {tokens} tokens, {experts} experts "
                                     f"top-{top_k} EP{ep}: {e}") from None  # fmt: skip


def _row_class_names(planner: Path, shape: pc.MoeShape, sms: int, tokens: int, out: Path):
    """Per step of 1..tokens tokens, the kernels a planner names (one step at a time)."""
    return {t: [k.name for k in pc.plan_kernels(planner, shape, sms, t, out, t)]
            for t in range(1, tokens + 1)}  # fmt: skip


def test_kernels_precompile_plans_the_one_launch(trees, installed_fi, tmp_path):
    """With the candidate's headers `kernels precompile` names the dual kernel wherever the split
    runs in one launch (V4.1-Flash over EP8 on 132 SMs: every split, above 64 tokens; on an H20,
    78 SMs, the splits at 33-64 tokens keep two launches: the regular kernel's 64-row tile runs
    256 threads), and every other step's kernels as the shipped series' planner does."""
    shape = pc.MoeShape(hidden=5120, inter=2304, experts=400, top_k=6, ep_size=8)
    planners = {s: pc.build_planner(trees[s], installed_fi.root, tmp_path / s) for s in trees}
    for sms, tokens in ((132, 160), (78, 96)):
        steps = {s: _row_class_names(p, shape, sms, tokens, tmp_path / f"{s}{sms}")
                 for s, p in planners.items()}  # fmt: skip
        for t in range(1, tokens + 1):
            shipped, candidate = steps["shipped"][t], steps["candidate"][t]
            classes = [n for n in shipped if "_class" in n]
            if not classes or (sms == 78 and t <= 64):
                assert candidate == shipped, (sms, t)
                continue
            # each GEMM's two class kernels become one dual kernel, named for both classes
            assert len(candidate) == len(classes) // 2 == len(shape.gemms()), (sms, t, candidate)
            for name in candidate:
                m = re.fullmatch(
                    r"gemm_(\d+)_\d+_128_\d+_128_50_\d+50_\d+_1_class(\d+)-any"
                    r"_dual128_(\d+)_(\d+)_class1-(\d+)_GroupedWithOffset",
                    name,
                )
                assert m and int(m.group(2)) == int(m.group(5)) + 1, name
                n = m.group(1)
                hot = next(x for x in classes if x.startswith(f"gemm_{n}_"))
                cold = next(x for x in classes if x.startswith(f"gemm_swapAB_{n}_"))
                # the same hot kernel, and the cold one's tile and stages after "_dual128_"
                assert name.startswith(hot.removesuffix("_GroupedWithOffset"))
                assert cold.split("_")[5] == m.group(3), (cold, name)
