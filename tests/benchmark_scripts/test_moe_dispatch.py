"""The CPU-side parts of the kernel-level A/B (benchmarks/moe_dispatch/): the spec and its
families, the cases, the builds' sources (calib.patch on the shipped series, compiled with
nvcc), the device script's steps, and the report rendered from a run's own JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "moe_dispatch"
RESULTS = ROOT / "benchmarks" / "results"
# The previous series' 44-case run, explorations and fused op (report.py's published files).
ESTIMATED = RESULTS / "moe_dispatch" / "estimated-row-classes-h200"
# The shipped series' 110-case run on an H100 (the old run.py's JSON, no spec in it).
LAST_TILE = RESULTS / "moe_dispatch" / "last-tile-h100"
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
import modules  # noqa: E402
import spec as specs  # noqa: E402

from tests.benchmark_scripts import load_script  # noqa: E402

SPECS = (HERE / "spec.yaml", HERE / "spec-h20.yaml")


def _run_py():
    return load_script(HERE / "run.py", "moe_dispatch_run")


def _report():
    return load_script(HERE / "report_run.py", "moe_dispatch_report_run")


def _flashinfer_data(tmp_path: Path, *subs: str):
    """The installed FlashInfer and a copy of its data directory's `subs` laid out as run.py
    unpacks its source tarball (csrc/nv_internal always), for the tests that prepare or compile
    run.py's builds; skips where FlashInfer is not installed."""
    import importlib.util

    from vllm_h20.moe import flashinfer_src

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("FlashInfer is not installed (CI installs it with vLLM 0.34.0)")
    installed_fi = flashinfer_src.installed()
    data = tmp_path / "data"
    for sub in ("csrc/nv_internal", *subs):
        shutil.copytree(installed_fi.root / sub, data / sub, symlinks=True)
    return installed_fi, data


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_load_and_name_real_patches(path):
    spec = specs.load(path)
    assert spec.lead in {v.name for v in spec.versions}
    for v in spec.versions:
        assert all((ROOT / p).is_file() for p in v.patches)
    series = (ROOT / "patches/flashinfer").glob("*.patch")
    shipped = sorted(str(p.relative_to(ROOT)) for p in series)
    lead = next(v for v in spec.versions if v.name == spec.lead)
    assert sorted(lead.patches) == shipped  # the lead is the shipped series, whole


def test_every_family_spans_1_to_256_rows_per_expert():
    """Issue 3/4: the token counts reach the regime 64-256 rows per expert on every family."""
    spec = specs.load()
    assert len(spec.families) >= 4
    for f in spec.families:
        rows = [f.rows_per_expert(t) for t in spec.tokens]
        assert min(rows) <= 1.0 and max(rows) >= 245, (f.name, rows)
        assert f.local * f.ep == f.slots and f.shapes[0].n == 2 * f.inter


@pytest.mark.parametrize(
    "edit, msg",
    [(lambda d: d.update(tokenz=[1]), "spec.yaml: unknown key(s) tokenz"),
     (lambda d: d["families"][0].update(topk=6), "family 'v4.1-flash-ep8': unknown key(s) topk"),
     (lambda d: d["families"][0].pop("hidden"), "family 'v4.1-flash-ep8': missing key(s) hidden"),
     (lambda d: d["families"][0].update(hidden=5000), "hidden and inter must be multiples of 128"),
     (lambda d: d["versions"][1].update(patches=["patches/none.patch"]),
      "version 'avg': patch patches/none.patch does not exist"),
     (lambda d: d["versions"][1].update(single=True), "version 'avg': single is a switch"),
     (lambda d: d["versions"][3].update(same_as="fixx"), "version 'fix_again': same_as names"),
     (lambda d: d.update(lead="fixx"), "lead = 'fixx' is not a version"),
     (lambda d: d.update(routings=["uniform", "zipff"]), "routings: unknown zipff"),
     (lambda d: d.update(tokens=[0]), "tokens: a list of positive integers")],
)  # fmt: skip
def test_a_bad_spec_is_refused_naming_its_key(edit, msg):
    import yaml

    doc = yaml.safe_load((HERE / "spec.yaml").read_text())
    edit(doc)
    with pytest.raises(specs.SpecError, match=re.escape(msg)):
        specs.parse(doc)


def test_an_a_a_copy_runs_its_original_s_module():
    run = _run_py()
    spec = specs.load()
    builds = modules.builds_of(spec)
    assert builds["fix_again"] is builds["fix"] and builds["stock"].patches == ()
    assert len(set(builds.values())) == 3
    h20 = modules.builds_of(specs.load(HERE / "spec-h20.yaml"))
    assert len(set(h20.values())) == 1 and next(iter(h20.values())).calib  # one calib module
    cols = {c.name: c for c in run.columns_of(specs.load(HERE / "spec-h20.yaml"))}
    assert cols["stock"].single and cols["stock"].expected_m == "tokens" and not cols["fix"].single


def test_selection_narrows_the_spec_and_refuses_what_it_lacks():
    spec = specs.select(specs.load(), "dsv3-ep8,kimi-k2-ep8", "uniform", "3000,16384")
    assert [f.name for f in spec.families] == ["dsv3-ep8", "kimi-k2-ep8"]
    assert spec.routings == ("uniform",) and spec.tokens == (3000, 16384)
    with pytest.raises(specs.SpecError, match="--families: dsv4 not in"):
        specs.select(specs.load(), "dsv4")


# ----------------------------------------------------------------------------- the cases


FAMILIES = specs.load().families


def test_the_default_family_draws_what_the_published_runs_drew():
    """The cases of the shipped series' 110-case run (last-tile-h100, run before families were
    data): every rank's rows and busiest expert, recomputed from cases.route and rank_counts."""
    doc = json.loads((LAST_TILE / "kernel_h100.json").read_text())
    assert len(doc["ab"]) == 110
    for r in doc["ab"]:
        slots = cases.route(r["routing"], r["tokens"], family=FAMILIES[0])
        for rank in r["ranks"]:
            counts = cases.rank_counts(slots, rank["rank"], FAMILIES[0].local)
            assert (int(counts.sum()), int(counts.max())) == (
                rank["rows"],
                rank["max_rows_per_expert"],
            )


def test_the_module_default_family_is_the_spec_s_first():
    """cases.py's constants (read by model.py, ep.py, misses.py) are spec.yaml's V4.1 EP8."""
    import dataclasses

    assert dataclasses.replace(FAMILIES[0], label="") == dataclasses.replace(
        cases.V41_EP8, label=""
    )
    assert (cases.SLOTS, cases.EP, cases.LOCAL) == (400, 8, 50)
    assert FAMILIES[0].shapes == cases.SHAPES


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("routing", cases.ALL_ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 128, 4096])
def test_every_routing_gives_each_token_top_k_distinct_slots(fam, routing, tokens):
    slots = cases.route(routing, tokens, family=fam)
    assert slots.shape == (tokens, fam.top_k)
    assert ((slots >= 0) & (slots < fam.slots)).all()
    assert all(len(set(row)) == fam.top_k for row in slots.tolist())
    total = sum(int(cases.rank_counts(slots, r, fam.local).sum()) for r in range(fam.ep))
    assert total == tokens * fam.top_k  # every (token, k) lands on exactly one rank


def test_eplb_routing_is_skewed_like_what_eplb_leaves():
    for tokens in (1024, 4096):
        counts = np.bincount(cases.route("eplb", tokens).ravel(), minlength=cases.SLOTS)
        assert 2.5 <= counts.max() / counts.mean() <= 5


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_concentrated_routings_concentrate_as_described(fam):
    tokens, k = 512, fam.top_k
    rows = {r: [cases.rank_counts(cases.route(r, tokens, family=fam), i, fam.local)
                for i in range(fam.ep)] for r in cases.CONCENTRATED}  # fmt: skip
    # Identical requests: top-k experts with every token, on one rank or one per rank.
    assert [int((c == tokens).sum()) for c in rows["same_rank"]] == [k] + [0] * (fam.ep - 1)
    assert sorted(int((c == tokens).sum()) for c in rows["same_spread"]) == (
        [0] * (fam.ep - k) + [1] * k)  # fmt: skip
    for name, size in (("pool8", 8), ("pool16", 16)):  # a hot pool holds every routed row
        assert sum(int((c > 0).sum()) for c in rows[name]) == size

    def top_share(r):
        counts = np.bincount(cases.route(r, tokens, family=fam).ravel(), minlength=fam.slots)
        return counts.max() / counts.sum()

    assert top_share("zipf2") > top_share("zipf")
    counts = np.bincount(cases.route("trained", 4096, family=fam).ravel(), minlength=fam.slots)
    assert 2 <= counts.max() / counts.mean() <= 5 and (counts > 0).sum() > 0.85 * fam.slots


def test_warm_jobs_cover_every_column_family_and_token_count():
    run = _run_py()
    for path in SPECS:
        spec = specs.load(path)
        cols = run.columns_of(spec)
        jobs = run.warm_jobs(spec, cols, spec.tokens)
        for f in spec.families:
            for c in cols:
                for t in spec.tokens:
                    m = t if c.expected_m == "tokens" else -(-t * f.top_k // f.slots)
                    for si in (0, 1):
                        assert (c.build, c.single, f.name, si, t, max(m, 1), 0) in jobs


# ----------------------------------------------------------------------------- the builds


def test_each_build_gets_its_patches_and_calib_patch_applies_on_the_series(tmp_path):
    """run.py's builds as the GPU machine prepares them, from FlashInfer's installed sources: a
    patch or calib.patch that no longer applies fails here, not after a lease's start."""
    _, data = _flashinfer_data(tmp_path)
    builds = modules.builds_of(specs.load())
    prepare = modules.prepare_sources
    texts = {v: (prepare(data, tmp_path / "work", b) / modules.KERNEL_CUH).read_text()
             for v, b in builds.items()}  # fmt: skip
    assert "plan_row_classes(" not in texts["stock"] and "plan_row_classes(" not in texts["avg"]
    assert "ridge_rows(" in texts["fix"] and "vllm_h20_single_launch()" not in texts["fix"]
    calib = modules.builds_of(specs.load(HERE / "spec-h20.yaml"))["fix"]
    text = (prepare(data, tmp_path / "work", calib) / modules.KERNEL_CUH).read_text()
    assert "ridge_rows(" in text and calib.name == "stock-calib"
    assert "if (max_m_per_problem == 0 || vllm_h20_single_launch()) {" in text
    assert "static int kNumDeviceSMs = vllm_h20_num_sms_override();" in text
    assert modules.deepgemm_dir(data, tmp_path / "work", builds["stock"]).startswith(str(data))


def test_the_calibration_build_compiles(tmp_path):
    """The calibration build (the series + calib.patch, the switches in deepgemm_setup.cu) is
    compiled on the GPU machine first thing in a lease: compiled here too (-c, FlashInfer's
    installed sources, run.py's nvcc flags), so that a switch that does not compile fails in
    CI."""
    from tests.moe import deepgemm_kernels as dk
    from vllm_h20.moe import build

    _, data = _flashinfer_data(tmp_path, "include", "cutlass/include",
                               "cutlass/tools/util/include", "spdlog/include")  # fmt: skip
    nvcc = dk.nvcc()
    calib = next(b for b in modules.builds_of(specs.load(HERE / "spec-h20.yaml")).values())
    nv = modules.prepare_sources(data, tmp_path / "work", calib)
    includes = modules.include_dirs(nv, data)
    cublas = build.find_cublas_include(build.find_cuda_home())  # None: the toolkit has it
    flags = [*modules.NVCC_FLAGS, "-DVLLM_H20_PATCHED", "-DVLLM_H20_CALIB",
             *(f"-I{i}" for i in includes), *(["-isystem", cublas] if cublas else [])]  # fmt: skip
    for src in (nv / modules.GEMM_CU, HERE / "ext" / "deepgemm_setup.cu"):
        cmd = [nvcc, "-c", str(src), "-o", str(tmp_path / f"{src.stem}.o"), *flags]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, src.name + ": " + r.stderr[-3000:]
    # And they link: every switch calib.patch's lines use is defined, in the namespace they are
    # declared in, by deepgemm_setup.cu (a first H100 run failed to load the module on one).
    need = {s for s in _symbols(tmp_path / f"{Path(modules.GEMM_CU).stem}.o", "--undefined-only")
            if "vllm_h20" in s}  # fmt: skip
    have = _symbols(tmp_path / "deepgemm_setup.o", "--defined-only")
    assert len(need) >= 3, need  # the SM override, the single launch, the forced branch
    assert need <= have, f"undefined: {sorted(need - have)}"


def _symbols(obj: Path, which: str) -> set[str]:
    """An object file's (mangled) symbol names, undefined or defined ones (nm)."""
    r = subprocess.run(["nm", which, str(obj)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in r.stdout.splitlines() if line.strip()}


def test_a_changed_patch_gets_its_own_builds_and_kernel_cache(tmp_path):
    """run.py keys its work dir (sources copied once, DeepGEMM's cache by template arguments)
    by what the builds are made from: the same inputs find the same dir, a one-byte change to
    a patch, another spec's builds or another FlashInfer tarball a new one."""
    work, fi = tmp_path / "work", "flashinfer-0.7.2.post1-src.tar.xz"
    builds = modules.builds_of(specs.load())
    shipped = modules.work_for(work, builds, fi)
    work_for, builds_of = modules.work_for, modules.builds_of
    assert shipped == work_for(work, builds_of(specs.load()), fi) and shipped.parent == work
    assert work_for(work, builds, "flashinfer-0.7.4-src.tar.xz") != shipped
    assert work_for(work, builds_of(specs.load(HERE / "spec-h20.yaml")), fi) != shipped
    copy = tmp_path / "0002.patch"
    copy.write_bytes((ROOT / builds["fix"].patches[1]).read_bytes() + b"\n")
    changed = dict(builds, fix=modules.Build("fix", (builds["fix"].patches[0], str(copy))))
    assert modules.work_for(work, changed, fi) != shipped


def test_every_kernel_compiles_from_one_patched_header_set(tmp_path):
    """The modules of one process share DeepGEMM's include list (a process-wide static): the
    build that patches DeepGEMM's headers is the one set last (FlashInfer's own headers, which
    the stock and average-only builds keep, compile the same kernels without a row class), and
    two builds that patch them differently cannot be timed in one run."""
    builds = {b.name: b for b in modules.builds_of(specs.load()).values()}
    data, work = tmp_path / "fi", tmp_path / "work"

    def headers(b, text: str) -> Path:
        d = Path(modules.deepgemm_dir(data, work, b)) / "deep_gemm"
        d.mkdir(parents=True, exist_ok=True)
        (d / "scheduler.cuh").write_text(text)
        return d

    headers(modules.Build("stock", ()), "// FlashInfer's\n")
    headers(builds["avg"], "// FlashInfer's\n")  # 0001 leaves deep_gemm/ alone
    headers(builds["fix"], "// row classes\n")
    assert modules.shared_headers(data, work, builds) == "fix"
    headers(builds["avg"], "// other row classes\n")
    with pytest.raises(SystemExit, match="patch DeepGEMM's headers differently"):
        modules.shared_headers(data, work, builds)


@pytest.mark.parametrize(
    "args, msg",
    [(["--routings", "uniform,zipff"], "run.py: --routings: zipff not in"),
     (["--families", "dsv4-ep8"], "run.py: --families: dsv4-ep8 not in"),
     (["--calibrate"], "run.py: --calibrate forces kernels through calib.patch's switches"),
     (["--spec", "nowhere.yaml"], "run.py: nowhere.yaml: no such spec file")],
)  # fmt: skip
def test_run_refuses_a_bad_selection_in_one_line(tmp_path, args, msg):
    cmd = [sys.executable, str(HERE / "run.py"), "--flashinfer", str(tmp_path / "none.tar.xz"),
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_run_without_the_flashinfer_sources_says_how_to_make_them(tmp_path):
    cmd = [sys.executable, str(HERE / "run.py"), "--flashinfer", str(tmp_path / "none.tar.xz"),
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (
        f"no FlashInfer sources at {tmp_path / 'none.tar.xz'}: make them with "
        "`python benchmarks/moe_dispatch/fetch_sources.py` (and carry .fi)"
    )


def _full(tmp_path: Path, steps: str) -> subprocess.CompletedProcess:
    """`h200.sh full` in a session whose repository copy lacks .fi (as a lease without it in
    `carry` would), so that every step's run.py fails at once, on this machine."""
    session = tmp_path / "session"
    (session / "repo").mkdir(parents=True)
    for name in ("benchmarks", "vllm_h20", "patches"):
        (session / "repo" / name).symlink_to(ROOT / name)
    env = {**os.environ, "MOE_SESSION": str(session), "STEPS": steps}
    return subprocess.run(["bash", str(HERE / "h200.sh"), "full"], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip


def test_full_logs_each_step_s_own_exit_status(tmp_path):
    """The session log's "exit N" is the step's status: it was always 0 until 2026-12-05, `$?`
    being read after the `$(date)` of the same line. A failed step leaves the others running and
    the whole run failing; STEPS picks the steps."""
    r = _full(tmp_path, "kernel rerun")
    lines = [re.sub(r"^\[[0-9:]+\] ", "", line) for line in r.stdout.splitlines()]
    assert lines == [
        "kernel-level A/B",
        "kernel-level A/B: exit 1",
        "kernel-level A/B again, concentrated routings (the bar's re-run)",
        "kernel-level A/B again, concentrated routings (the bar's re-run): exit 1",
        "done (2 failed)",
    ], r.stdout
    assert r.returncode == 1
    log = (tmp_path / "session" / "out" / "kernel.log").read_text()
    assert log.strip().splitlines()[-1] == (
        "no FlashInfer sources at .fi/flashinfer-0.7.2.post1-src.tar.xz: make them with "
        "`python benchmarks/moe_dispatch/fetch_sources.py` (and carry .fi)"
    )


def test_full_refuses_an_unknown_step_before_running_any(tmp_path):
    r = _full(tmp_path, "kernel fussed")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        "h200.sh full: unknown step 'fussed' in STEPS (profile kernel emulated rerun fused "
        "stock_tests)"
    )


def _harness():
    return load_script(HERE / "harness.py", "moe_dispatch_harness")


REGULAR = "void deep_gemm::fp8_gemm_kernel<128u, 5120u, 128u>(float*, int)"
SWAP = "void deep_gemm::fp8_gemm_kernel_swapAB<128u, 24u>(float*, int)"


def test_trace_summary_splits_replays_and_counts_parallel_branches_once():
    """Two replays of a graph whose two branches start in either order: the kernels are
    known by kind and order of their kind, busy time counts overlapping kernels once, and the
    gaps between them are the idle time."""
    h = _harness()
    trace = [  # (name, start us, duration us)
        (REGULAR, 0.0, 20.0), (SWAP, 1.0, 2.0), (REGULAR, 25.0, 10.0), (SWAP, 26.0, 1.0),
        (SWAP, 100.0, 2.0), (REGULAR, 101.0, 22.0), (REGULAR, 128.0, 10.0), (SWAP, 129.0, 3.0),
    ]  # fmt: skip
    s = h.trace_summary(trace, replays=2)
    assert s["kernels_per_replay"] == 4
    assert s["span_us"] == pytest.approx((35.0 + 38.0) / 2)
    assert s["busy_us"] == pytest.approx((30.0 + 33.0) / 2)  # 20 + 10, then 23 + 10
    assert s["idle_us"] == pytest.approx(5.0)
    assert list(s["kernels"]) == ["regular#0", "swap_ab#0", "regular#1", "swap_ab#1"]
    assert s["kernels"]["regular#0"]["us"] == pytest.approx(21.0)
    assert s["kernels"]["swap_ab#0"]["start_us"] == pytest.approx(0.5)  # 1 after, 0 before
    assert all(k["replays"] == 2 for k in s["kernels"].values())
    assert s["kernels"]["swap_ab#1"]["name"] == SWAP  # which build ran: its template arguments


def test_trace_summary_refuses_a_trace_that_lost_kernels():
    h = _harness()
    assert h.trace_summary([(REGULAR, 0.0, 1.0)] * 3, replays=2) == {
        "kernels_seen": 3, "replays": 2, "uneven": True,
    }  # fmt: skip
    assert h.kernel_kind("void at::native::vectorized_elementwise_kernel<4, X>(int)") == (
        "at::native::vectorized_elementwise_kernel"
    )


# ----------------------------------------------------------------------------- the report


def test_the_last_tile_run_renders_with_its_published_numbers(tmp_path):
    """last-tile-h100's files through today's report_run.py: the numbers its README (written by
    the report of the time) gives, read again from the same JSONs: 110 of 110 cases at >= 0.98x,
    worst 0.981x, uniform 128-2,048 at 1.02-1.04x, 6 emulated misses of 180."""
    pytest.importorskip("matplotlib")
    for f in ("kernel_h100.json", "rerun_h100.json", "emulated_h100.json"):
        shutil.copy(LAST_TILE / f, tmp_path / f)
    cmd = [sys.executable, str(HERE / "report_run.py"), str(tmp_path), "--title", "t"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "README.md").read_text()
    row = "| v4.1-flash-ep8 | 110 | 110 | 109 | 0.981x (pool8 288) | 1.02-1.04x | 110/110 |"
    assert row in text
    published = (LAST_TILE / "README.md").read_text()
    assert "worst 0.981x" in published and "1.02-1.04x" in published
    emulated = re.findall(r"^- v4.1-flash-ep8 .*: 0\.\d+x$", text.split("## emulated_")[1]
                          + "".join(text.split("## emulated_")[2:]), re.M)  # fmt: skip
    index = (RESULTS / "README.md").read_text()
    assert len(emulated) == 6 and "each emulated miss (6 of 180)" in index
    assert (tmp_path / "speedup.png").stat().st_size > 10_000


def _new_run(tmp_path: Path) -> Path:
    """A run.py JSON with the spec in it (two families, synthetic times): the labels, families
    and bar come from the file, as report_run.py must read them."""
    spec = specs.select(specs.load(), "v4.1-flash-ep8,dsv3-ep8", "uniform,pool8", "128,3072")
    ab = []
    for f in spec.families:
        for routing in spec.routings:
            for t in spec.tokens:
                fix = 0.95 if (f.name, routing, t) == ("dsv3-ep8", "uniform", 3072) else 1.1
                ab.append(
                    {
                        "model": f.name,
                        "ep": f.ep,
                        "routing": routing,
                        "tokens": t,
                        "rows_per_expert": f.rows_per_expert(t),
                        "stock_s": 1e-3,
                        "speedups": {"avg": 1.0, "fix": fix, "fix_again": fix},
                        "roofline_s": 5e-4,
                        "max_rel_err": 2e-3,
                        "ok": True,
                        "first_run": {"speedups": {"fix": 0.94}} if fix < 1 else {},
                    }
                )
    (tmp_path / "moe_dispatch.json").write_text(
        json.dumps({"spec": spec.to_json(), "ab": ab, "command": "run.py", "device": {"name": "X"}})
    )
    return tmp_path


def test_a_run_is_rendered_with_its_own_labels_and_families(tmp_path):
    report = _report()
    text = report.render(_new_run(tmp_path))
    assert "`fix` = per-expert dispatch (0001-0006, shipped)" in text
    assert "| v4.1-flash-ep8 | 4 | 4 | 4 | 1.100x (uniform 128) | 1.10-1.10x | 4/4 |" in text
    assert "| dsv3-ep8 | 4 | 3 | 3 | 0.950x (uniform 3072) | 1.10-1.10x | 4/4 |" in text
    assert ("- dsv3-ep8 uniform 3072 tokens (96.0 rows per expert): 0.9500x (first run 0.940x)"
            in text)  # fmt: skip
    assert "## DeepSeek-V3/R1, EP8 (256 experts, top-8)" in text and "32 per rank" in text


def test_the_lead_against_also_beat_is_a_ci_not_a_point():
    """Paired within the run: a lead 5 % faster in every case resolves as faster; one whose
    samples overlap the other's within their spread is not resolved."""
    report = _report()
    rng = np.random.default_rng(1)

    def row(ratio: float) -> dict:
        base = 1e-3 * (1 + 0.01 * rng.standard_normal(24))
        return {"fix_samples_slowest_s": list(base),
                "cand_samples_slowest_s": list(base[rng.permutation(24)] / ratio)}  # fmt: skip

    g, lo, hi = report.paired_ci([row(1.05) for _ in range(6)], "cand", "fix")
    assert 1.0 < lo < g < hi and g == pytest.approx(1.05, rel=0.01)
    g, lo, hi = report.paired_ci([row(1.0) for _ in range(6)], "cand", "fix")
    assert lo < 1.0 < hi


def test_a_folder_without_a_run_is_refused_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(HERE / "report_run.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"report_run: {tmp_path}: no moe_dispatch.json or "
                                "kernel_<dev>.json (what run.py writes to --out)")  # fmt: skip


def test_profile_lines_render_each_traced_version_and_skip_untraced_cases():
    report = _report()
    h = _harness()
    summary = h.trace_summary([(REGULAR, 0.0, 20.0), (SWAP, 1.0, 1.5), (REGULAR, 22.0, 18.0)], 1)
    doc = {"ab": [
        {"routing": "uniform", "tokens": 64, "speedups": {"fix": 1.0}},
        {"routing": "pool16", "tokens": 192, "speedups": {"fix": 1.0},
         "profile": {"rank": 2, "replays": 1, "versions": {
             "stock": summary | {"event_us": 57.3, "loop_us": 45.0},
             "fix": {"error": "CUPTI unavailable"}}}},
    ]}  # fmt: skip
    lines = report.profile_lines(report.Run(doc, "x"))
    assert lines[-1] == ("| v4.1-flash-ep8 | pool16 | 192 | stock | 57.3 | 40.0 | 38.0 | 2.0 | "
                         "regular#0 20.0, swap_ab#0 1.5, regular#1 18.0 |")  # fmt: skip
    assert len([ln for ln in lines if ln.startswith("| v4.1")]) == 1


def test_published_report_is_rendered_from_the_published_json(tmp_path):
    """moe_dispatch/estimated-row-classes-h200/moe_dispatch_h200.md (under benchmarks/results)
    and the H20 model: every number from the JSON."""
    pytest.importorskip("matplotlib")
    for f in ("moe_dispatch_h200.json", "moe_dispatch_explore_h200.json"):
        shutil.copy(ESTIMATED / f, tmp_path / f)
    cmd = [sys.executable, str(HERE / "report.py"), str(tmp_path / "moe_dispatch_h200.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    for md in ("moe_dispatch_h200.md", "moe_dispatch_h20_model.md"):
        assert (tmp_path / md).read_text() == (ESTIMATED / md).read_text(), md
    md = (ESTIMATED / "moe_dispatch_h200.md").read_text()
    assert "every one of the 44 cases is at or above 0.98x stock" in md


def _compare(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(HERE / "compare_runs.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_repeats_readme_is_rendered_from_the_six_runs():
    """whole-expert-tiles-v2-h200/repeats/README.md: the six alternating runs (v2 v1 v2 v1 v1 v2)
    compared by compare_runs.py, as its first line says."""
    folder = RESULTS / "moe_dispatch" / "whole-expert-tiles-v2-h200"
    want = (folder / "repeats" / "README.md").read_text()
    command = re.search(r"Written by `compare_runs.py ([^`]*)`", want).group(1).split()
    r = _compare(command, folder)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want
    assert "| every case | 1-4096 | 110 |" in want and "not resolved |" in want


def test_the_rebuilt_harness_is_compared_with_the_table_it_replaced():
    """families-h100/against-last-tile.md: V4.1-Flash EP8's cases of the rebuilt harness's
    first run against last-tile-h100's (same series, same GPU type), as its first line says;
    --family keeps that family's rows of a run of several."""
    folder = RESULTS / "moe_dispatch" / "families-h100"
    want = (folder / "against-last-tile.md").read_text()
    command = re.search(r"Written by `compare_runs.py ([^`]*)`", want).group(1).split()
    r = _compare(command, folder)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want and "| every case | 1-4096 | 35 |" in want
    r = _compare([*command, "--family", "kimi-k2-ep8"], folder)
    assert r.returncode == 1 and "last-tile-h100" not in r.stdout
    assert "kernel_h100.json: no case of family 'kimi-k2-ep8'" in r.stderr


def _synthetic_run(path: Path, scale: float, wobble: float, seed: int) -> str:
    rng = np.random.default_rng(seed)
    ab = [{"routing": r, "tokens": t,
           "speedups": {"fix": scale * (1.0 + wobble * rng.standard_normal())}}
          for r in cases.ALL_ROUTINGS for t in cases.TOKENS]  # fmt: skip
    path.write_text(json.dumps({"ab": ab}))
    return str(path)


def test_compare_runs_resolves_a_shift_and_not_noise(tmp_path):
    """A 5 % shift between two series is resolved with its sign; two draws of the same series
    (1 % noise per case and run) are "not resolved"; bad arguments get one line."""
    order = [("a", 1.05), ("b", 1.0), ("b", 1.0), ("a", 1.05)]
    runs = [f"{lab}={_synthetic_run(tmp_path / f'{i}.json', s, 0.01, i)}"
            for i, (lab, s) in enumerate(order)]  # fmt: skip
    r = _compare(runs, tmp_path)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("| every case"))
    ratio, ci, verdict = row.split(" | ")[5:8]
    lo, hi = map(float, ci.split("-"))
    assert verdict.strip(" |") == "faster" and 1.0 < lo < 1.05 < hi < 1.1, row
    same = [f"{lab}={_synthetic_run(tmp_path / f's{i}.json', 1.0, 0.01, 10 + i)}"
            for i, lab in enumerate("abba")]  # fmt: skip
    r = _compare(same, tmp_path)
    assert "| every case | 1-4096 | 110 |" in r.stdout
    assert all(line.endswith("not resolved |") for line in r.stdout.splitlines()
               if line.startswith(("| balanced", "| concentrated", "| every")))  # fmt: skip
    third = f"c={runs[1].split('=')[1]}"
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"ab": []}')
    for args, msg in (([f"a={tmp_path / 'none.json'}", runs[1]], "no such run file"),
                      (["a", runs[1]], "expected LABEL=FILE"),
                      ([runs[0], runs[1], third], "exactly two labels"),
                      ([f"a={tmp_path / 'bad.json'}", runs[1]], "not a run.py result"),
                      ([f"a={tmp_path / 'other.json'}", runs[1]], "no cases with speedups"),
                      ([*runs[:2], "--column", "nope"], "has no column 'nope'")):  # fmt: skip
        r = _compare(args, tmp_path)
        assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_the_model_charges_the_graph_branch_as_its_own_second_launch():
    """model.row_class_launches(branch=True): the hot-first plan's launches, its split's cold
    launch named IN_BRANCH (its own fixed cost); single launches are the hot-first plan's. With
    both second launches' fits equal, the two plans predict the same time."""
    import dataclasses

    model = load_script(HERE / "model.py", "moe_dispatch_model")
    counts = np.zeros(cases.LOCAL, dtype=int)
    counts[[3, 17]] = 192  # identical requests: two experts with every token, the rest empty
    split = model.row_class_launches(counts, 192, 132, True, branch=True)
    assert [p for p, _ in split] == ["regular", model.IN_BRANCH] * len(cases.SHAPES)
    shipped = model.row_class_launches(counts, 192, 132, True)
    assert [t for _, t in split] == [t for _, t in shipped]
    assert [p for p, _ in shipped] == ["regular", model.SWAP_SECOND] * len(cases.SHAPES)
    for tokens in (8, 32, 64):  # one launch there, the same in both
        small = np.minimum(counts, tokens)
        assert model.row_class_launches(small, tokens, 132, True, branch=True) == \
            model.row_class_launches(small, tokens, 132, True)  # fmt: skip
    fit = model.Fit(bw=4e12, tc=8e14, r=0.5, c0=1e-5)
    fits = {"regular": fit, "swap_ab": fit, model.SWAP_SECOND: dataclasses.replace(fit, c0=2e-6),
            model.IN_BRANCH: dataclasses.replace(fit, c0=2e-6)}  # fmt: skip
    both = [model.predict(fits, counts, 192, v, 132) for v in ("hot_first", "branches")]
    assert both[0] == both[1] > 0
    fits[model.IN_BRANCH] = dataclasses.replace(fit, c0=0.0)
    assert model.predict(fits, counts, 192, "branches", 132) < both[0]
