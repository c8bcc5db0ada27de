"""CPU checks for benchmarks/journey_h200/: the V4 configs the GPU probe serves are the ones
our synth and converter write today, the mHC and DeepGEMM precompiles' variants, shapes and
config errors, the stall count per sweep cell, and the published leases rebuilding from their
own run files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_script, pack_published

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "journey_h200"
RESULTS = ROOT / "benchmarks" / "results" / "journey_h200"


def _load(name: str):
    return load_script(HERE / f"{name}.py", f"journey_h200_{name}")


def test_probe_configs_match_synth_and_convert():
    probe = _load("v4_probe")
    for dtype, cfg in probe.configs().items():
        committed = json.loads((probe.CONFIGS / f"v4-{dtype}.json").read_text())
        assert committed == cfg, f"rerun v4_probe.py --write-configs ({dtype})"
    fp8 = probe.configs()["fp8"]
    assert fp8["expert_dtype"] == "fp8" and "scale_fmt" not in fp8["quantization_config"]


def _num_split(n_sms: int):
    """vLLM 0.26's `compute_num_split` (kernels/mhc/tilelang_kernels.py) for a GPU of n_sms."""

    def num_split(block_k: int, k: int, grid: int) -> int:
        return max(min(n_sms // grid, -(-k // block_k) // 4), 1)

    return num_split


def test_mhc_variants_reach_each_kernel_variant_once_at_its_smallest_batch():
    pre = _load("mhc_precompile")
    split = _num_split(132)
    todo = pre.variants(8192, 5120, 4, split)

    def keys(t: int) -> set[tuple]:
        small = (("post-pre-small", 2 if t < 8 else 3, 4),) if t <= 16 else ()
        fused = () if t <= 16 else (("post-pre", split(64, 4 * 5120, -(-t // 64))),)
        return {("broadcast", split(64, 5120, -(-t // 64))), *small, *fused}

    seen: dict[tuple, int] = {}
    for t in range(1, 8193):
        for k in keys(t):
            seen.setdefault(k, t)
    assert todo == {("head",): 1, **seen}
    # Every split count from 1 to the cap shows up below 4,225 tokens: 42 compiles on an H200,
    # fewer on an H20 (78 SMs cap the split counts lower).
    assert len(todo) == 42 and todo[("post-pre", 1)] == 4225
    assert len(pre.variants(8192, 5120, 4, _num_split(78))) < len(todo)


def test_mhc_precompile_takes_its_scalars_from_the_v4_config(tmp_path):
    pre = _load("mhc_precompile")
    release = json.loads((HERE / "probe_configs" / "v4-fp4.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(release))
    cfg = pre._model_config(tmp_path)
    assert cfg == {k: release[k] for k in cfg} and cfg["hc_sinkhorn_iters"] == 20
    with pytest.raises(SystemExit, match=f"cannot read {tmp_path / 'none' / 'config.json'}"):
        pre._model_config(tmp_path / "none")
    del release["hc_eps"]
    (tmp_path / "config.json").write_text(json.dumps(release))
    with pytest.raises(SystemExit, match=f"{tmp_path / 'config.json'} lacks hc_eps"):
        pre._model_config(tmp_path)


@pytest.mark.parametrize(
    "lease", ["v4-lease2-decode-partial", "v4-lease3-decode-stalled", "v4-lease4-decode-clean"]
)
def test_published_lease_rebuilds_from_its_own_run_files(tmp_path, lease):
    """report.py on a tarball of a lease's published check/, sweeps/ and logs/ reproduces its
    summary (which names Humming's MXFP4 backend for the release) and its sweep reports."""
    pytest.importorskip("guidellm")
    published = RESULTS / lease
    tarball = pack_published(published, tmp_path / "serve_h200.tar.gz")
    summary = (published / "summary.md").read_text()
    title = summary.splitlines()[0].removeprefix("# ")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_h200" / "report.py"),
                          str(tarball), str(out), "--baseline", "v4hum", "--title", title],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (out / "summary.md").read_text() == summary
    assert "**v4hum** (MoE backend HUMMING MXFP4)" in summary
    sweeps = [d.name for d in published.iterdir() if (d / "report.md").is_file()]
    assert "decode" in sweeps
    for sweep in sweeps:
        report = (out / sweep / "report.md").read_text()
        assert report == (published / sweep / "report.md").read_text(), sweep


def test_precompiles_write_the_common_fields_then_their_own(tmp_path):
    """Both precompiles' --json: model, pool size and wall time first, then the script's own
    fields; the folder is made; without --json nothing is written."""
    import argparse

    shared = _load("precompile")
    out = tmp_path / "check" / "x.json"
    a = argparse.Namespace(json=out, model=Path("/m"), max_tokens=8192, workers=14)
    shared.write_json(a, 45.94, cache="c", compiled=["k"])
    assert list(json.loads(out.read_text()).items()) == [
        ("model", "/m"), ("max_tokens", 8192), ("workers", 14), ("wall_s", 45.9),
        ("cache", "c"), ("compiled", ["k"]),
    ]  # fmt: skip
    out.unlink()
    shared.write_json(argparse.Namespace(**{**vars(a), "json": None}), 1.0)
    assert not out.exists()


def _release_config(tmp_path: Path) -> Path:
    """The journey's release (`synth --preset v4-h200 --layout v4`), headers only."""
    from vllm_h20.convert.synth import PRESETS, generate

    generate(tmp_path / "release", PRESETS["v4-h200"], layout="v4", shards=8, sparse=True)
    return tmp_path / "release"


def test_deepgemm_shapes_are_the_ones_vllm_compiled_on_the_h200(tmp_path):
    """The GEMMs the precompile derives from the release's config.json are exactly the shapes
    of the FP8-linear kernels vLLM 0.26 compiled while serving it (lease 3's cache listing):
    none missing (it would compile on the request path), none extra (wasted compiles)."""
    pre = _load("deepgemm_precompile")
    shapes = pre.gemm_shapes(pre.read_config(_release_config(tmp_path), "deepgemm_precompile"))
    listing = RESULTS / "v4-lease3-decode-stalled" / "logs" / "vllm-deepgemm-kernels.txt"
    seen = {(int(a[2]), int(a[3]), int(a[4])): a[17]
            for _t, name, a in pre.parse_listing(listing.read_text().splitlines())
            if name == "sm90_fp8_gemm_1d2d"}  # fmt: skip
    assert {(g.n, g.k, g.groups) for g in shapes} == set(seen)
    assert {g.groups for g in shapes} == {1, 8} and len(shapes) == 7
    for g in shapes:  # the einsum is DeepGEMM's batched GEMM, the linears its normal one
        kind = "GemmType::Batched" if g.groups > 1 else "GemmType::Normal"
        assert seen[(g.n, g.k, g.groups)] == kind
    names = {g.name for g in shapes}
    assert {"fused_wqa_wkv", "wo_a", "indexer.wq_b", "shared_experts.down_proj"} <= names


def test_deepgemm_shapes_merge_equal_shapes_and_skip_what_the_config_lacks():
    pre = _load("deepgemm_precompile")
    cfg = {"hidden_size": 256, "q_lora_rank": 128, "head_dim": 64, "num_attention_heads": 4,
           "o_groups": 2, "o_lora_rank": 128, "n_shared_experts": 0, "moe_intermediate_size": 128,
           "compress_ratios": [0, 128], "index_n_heads": 2, "index_head_dim": 32}  # fmt: skip
    shapes = pre.gemm_shapes(cfg)  # no ratio-4 layer: no indexer; no shared experts
    assert [g.name for g in shapes] == ["fused_wqa_wkv", "wq_b", "wo_a", "wo_b"]
    cfg.update(compress_ratios=[4], index_n_heads=4, index_head_dim=64)  # indexer wq_b = wq_b
    assert [g.name for g in pre.gemm_shapes(cfg)][1] == "wq_b+indexer.wq_b"
    del cfg["o_lora_rank"]
    with pytest.raises(ValueError, match="lacks o_lora_rank: not a DeepSeek-V4 config"):
        pre.gemm_shapes(cfg)


def test_deepgemm_tasks_cover_every_token_count_once_per_gemm():
    pre = _load("deepgemm_precompile")
    shapes = [pre.Gemm("a", 256, 128), pre.Gemm("b", 128, 256, 2)]
    for max_tokens, splits in [(8192, 2), (100, 3), (5, 8), (1, 1)]:
        todo = pre.tasks(shapes, max_tokens, splits)
        for g in shapes:
            ms = [m for t, lo, hi in todo if t == g for m in range(lo, hi + 1)]
            assert ms == list(range(1, max_tokens + 1))
        assert len(todo) == 2 * min(splits, max_tokens)


def test_deepgemm_listing_reads_a_cache_and_the_cli_names_what_is_wrong(tmp_path, capsys):
    pre = _load("deepgemm_precompile")
    cache = tmp_path / "deep_gemm"
    k = cache / "cache" / "kernel.sm90_fp8_gemm_1d2d.0123abcd"
    k.mkdir(parents=True)
    (k / "kernel.cu").write_text(
        "static void f() {\n  auto ptr = &sm90_fp8_gemm_1d2d_impl<\n"
        "    cute::UMMA::Major::K,\n    0, 1536, 5120,\n    1\n  >);\n}\n"
    )
    (k / "kernel.cubin").write_bytes(b"\0")
    (cache / "cache" / "kernel.sm90_fp8_gemm_1d2d.half").mkdir()  # still compiling: no cubin
    assert pre.main(["--list", str(cache)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        " kernel.sm90_fp8_gemm_1d2d.0123abcd cute::UMMA::Major::K,0,1536,5120,1"
    )
    [(when, name, args)] = pre.parse_listing(lines)
    assert name == "sm90_fp8_gemm_1d2d" and args[2:4] == ["1536", "5120"] and len(when) == 19
    assert pre.cached_kernels(cache) == {"kernel.sm90_fp8_gemm_1d2d.0123abcd",
                                         "kernel.sm90_fp8_gemm_1d2d.half"}  # fmt: skip
    with pytest.raises(SystemExit, match=f"no DeepGEMM cache in {tmp_path} \\(no cache/ folder\\)"):
        pre.main(["--list", str(tmp_path)])
    with pytest.raises(SystemExit, match=f"cannot read {tmp_path / 'config.json'}"):
        pre.main([str(tmp_path)])
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 5120}))
    with pytest.raises(SystemExit, match=f"{tmp_path / 'config.json'} lacks q_lora_rank"):
        pre.main([str(tmp_path)])
    with pytest.raises(SystemExit):
        pre.main([])  # neither a model nor --list: argparse's usage error


def test_stalls_count_the_compiles_inside_each_cell(tmp_path, capsys):
    stalls = _load("stalls")
    published = RESULTS / "v4-lease3-decode-stalled"
    rows = stalls.table(published / "sweeps" / "decode-v4", published / "logs")
    assert len(rows) == 16 and sum(bool(r["deepgemm"] or r["triton"]) for r in rows) == 12
    first = rows[0]
    assert (first["target"], first["concurrency"], first["deepgemm"]) == ("v4hum", 128, 8)
    # Lease 4 started with lease 3's caches and the DeepGEMM precompile: one Triton compile left.
    clean = RESULTS / "v4-lease4-decode-clean"
    rows = stalls.table(clean / "sweeps" / "decode-v4", clean / "logs")
    [hit] = [r for r in rows if r["deepgemm"] or r["triton"]]
    assert len(rows) == 18 and (hit["target"], hit["concurrency"], hit["run"]) == ("v4fix", 256, 2)
    assert (hit["deepgemm"], hit["triton"]) == (0, 1)
    # A cell from 10:00:00 to 10:00:30 UTC; compiles at 09:59:59, 10:00:10 and 10:00:31.
    run = tmp_path / "sweep" / "runs" / "a"
    run.mkdir(parents=True)
    t0 = 1796205600.0  # 2026-12-02 10:00:00 UTC
    (run / "c64-r0.json").write_text(json.dumps({
        "target": "a", "concurrency": 64, "run": 0, "status": "ok", "throughput": 1234.5,
        "started": t0, "finished": t0 + 30}))  # fmt: skip
    (run / "c64-r1.log").write_text("a cut run leaves only its log")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "vllm-deepgemm-kernels.txt").write_text(
        "2026-12-02 09:59:59 kernel.x.1 a\n2026-12-02 10:00:10 kernel.x.2 b\n"
    )
    (logs / "triton-cache.txt").write_text("2026-12-02 10:00:31.50 12 H/k.json\n")
    assert stalls.main([str(tmp_path / "sweep"), "--logs", str(logs)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["10:00:00", "a", "c64", "1", "0", "1,234", "1", "0"]
    assert "1 of 1 cells had a kernel compiled" in out
    [row] = stalls.table(tmp_path / "sweep", logs)
    assert (row["deepgemm"], row["triton"], row["retry"]) == (1, 0, 0)
    with pytest.raises(SystemExit, match=f"stalls: {logs} has no runs/ folder"):
        stalls.main([str(logs), "--logs", str(logs)])
    with pytest.raises(SystemExit, match="has neither vllm-deepgemm-kernels.txt nor triton"):
        stalls.main([str(tmp_path / "sweep"), "--logs", str(tmp_path)])


def test_humming_moved_between_leases_as_much_as_release_and_conversion_differ(capsys):
    """Lease 3 vs lease 4, measured as `probe.py compare` measures two servers: the release on
    Humming moved by up to 0.74 nats among the shared top-20 candidates; the conversion (fix)
    did not move at all."""
    drift = _load("logprob_drift")
    files = [RESULTS / lease / "check" / "compare_v4hum-v4fix.json"
             for lease in ("v4-lease3-decode-stalled", "v4-lease4-decode-clean")]  # fmt: skip
    assert drift.main([*map(str, files), "--server", "v4hum"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "v4hum: moved on 5 of 8 prompts, 17-20 candidates shared, max |diff| 0.74 nats"
    )
    a, b = (json.loads(f.read_text()) for f in files)
    assert {r["max_abs_diff"] for r in drift.drift(a, b, "v4fix")} == {0.0}
    assert drift.main([*map(str, files), "--server", "v4stock"]) == 1


def _decision_lease(root: Path, name: str, gpu: str, runs: dict, compile_at: float | None = None):
    """A lease folder as report.py renders it: one decision-decode sweep, `runs` mapping
    (server, tier) to per-run throughputs, nvidia-smi.txt naming the GPU, and a Triton cache
    listing with one compile at `compile_at` (epoch seconds) if given."""
    lease = root / name
    sweep = lease / "sweeps" / "decision-decode-l1"
    t = 1796205600.0  # 2026-12-02 10:00:00 UTC
    for (server, tier), values in runs.items():
        d = sweep / "runs" / server
        d.mkdir(parents=True, exist_ok=True)
        for i, v in enumerate(values):
            (d / f"c{tier}-r{i}.json").write_text(json.dumps({
                "target": server, "concurrency": tier, "run": i, "status": "ok",
                "throughput": v, "started": t, "finished": t + 40}))  # fmt: skip
            t += 60
    spec = {"name": "decision-decode", "throughput": "output"}
    (sweep / "sweep.json").write_text(json.dumps({"spec": spec}))
    logs = lease / "logs"
    logs.mkdir(parents=True)
    (logs / "nvidia-smi.txt").write_text(f"|   0  NVIDIA {gpu}   On |\n")
    stamp = (
        "" if compile_at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(compile_at))
    )
    (logs / "triton-cache.txt").write_text(f"{stamp} 12 H/k.json\n" if stamp else "")
    return lease


def test_decision_pairs_arms_run_by_run_and_says_which_to_pick(tmp_path, capsys):
    """fp8_fix beats Humming by 20-30 % in every pair at c64 (resolved), ties at c128 (pairs go
    both ways: not resolved); a run during which a kernel compiled is left out and listed; the
    rows carry the keys the issue names; the table quotes the seed's 8xH20 numbers."""
    dec = _load("decision")
    lease = _decision_lease(tmp_path, "l1", "H200", {
        ("v4hum", 64): [1000, 1010, 990, 1005, 995],
        ("v4fix", 64): [1250, 1260, 1220, 1300, 1230],
        ("v4hum", 128): [2000, 2100, 1900, 2050, 1950],
        ("v4fix", 128): [2100, 1950, 2000, 1900, 2080],
    }, compile_at=1796205600.0 + 60 * 19 + 10)  # fmt: skip  # the last c128 fix run
    out = tmp_path / "out"
    assert dec.main([str(lease), "--out", str(out)]) == 0
    rows = json.loads((out / "decision.json").read_text())
    keys = {"workload", "concurrency", "arm", "n", "mean", "ci_low", "ci_high", "unit"}
    assert all(keys <= set(r) for r in rows)
    by = {(r["concurrency"], r["arm"]): r for r in rows}
    assert by[(64, "fp8_fix")]["n"] == 5 and by[(128, "fp8_fix")]["n"] == 4
    assert by[(64, "fp8_fix")]["mean"] == pytest.approx(1252)
    lo, hi = by[(64, "humming_w4a8")]["ci_low"], by[(64, "humming_w4a8")]["ci_high"]
    assert lo < 1000 < hi and by[(64, "humming_w4a8")]["unit"] == "output tok/s"
    doc = json.loads((out / "ratios.json").read_text())
    r = {(x["concurrency"], x["arm"], x["baseline"]): x for x in doc["ratios"]}
    assert r[(64, "fp8_fix", "humming_w4a8")]["verdict"] == "fp8_fix"
    assert r[(64, "fp8_fix", "humming_w4a8")]["ci_low"] > 1.2
    assert r[(128, "fp8_fix", "humming_w4a8")]["verdict"] == "not resolved"
    assert r[(128, "fp8_fix", "humming_w4a8")]["n"] == 4
    [left] = doc["excluded"]
    assert (left["arm"], left["concurrency"], left["run"]) == ("fp8_fix", 128, 4)
    assert "1 kernel(s) compiled while it ran" in left["why"]
    md = (out / "decision.md").read_text()
    assert "| c64 | 1,000 [" in md and "2,507 -> 4,214 (+68.1 %)" in md
    assert "| fp8_fix |" in md and "not resolved |" in md


def test_decision_refuses_what_it_cannot_decide_from(tmp_path, capsys):
    dec = _load("decision")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert dec.main([str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "no sweeps/*/sweep.json" in capsys.readouterr().err
    a = _decision_lease(tmp_path, "a", "H200", {("v4hum", 64): [1, 2], ("v4fix", 64): [2, 3]})
    b = _decision_lease(tmp_path, "b", "H100", {("v4hum", 64): [1, 2]})
    assert dec.main([str(a), str(b), "--out", str(tmp_path / "o")]) == 2
    assert "decode c64: runs from H100 and H200 do not pool" in capsys.readouterr().err
    c = _decision_lease(tmp_path, "c", "H200", {("mystery", 64): [1, 2]})
    assert dec.main([str(c), "--out", str(tmp_path / "o")]) == 2
    assert "server 'mystery' is no arm of the decision" in capsys.readouterr().err
    # A run record cut short (a collect that ran out of time): one line naming it, no traceback.
    d = _decision_lease(tmp_path, "d", "H200", {("v4hum", 64): [1, 2], ("v4fix", 64): [2, 3]})
    cut = d / "sweeps" / "decision-decode-l1" / "runs" / "v4fix" / "c64-r1.json"
    cut.write_text(cut.read_text()[:30])
    assert dec.main([str(d), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{cut}: not a run record" in err and "Traceback" not in err and err.count("\n") == 1
    (d / "sweeps" / "decision-decode-l1" / "sweep.json").write_text('{"spec": ')
    assert dec.main([str(d), "--out", str(tmp_path / "o")]) == 2
    assert "sweep.json: not a sweep manifest" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_triton_tune_space_is_launchable_and_holds_vllms_own_default():
    """Every candidate fits the conversion's 128x128 blocks as vLLM's kernel reads them (one
    weight scale per K step, N tiles dividing the block); vLLM's default for each batch size
    is timed too, so the written config is never one the default was not measured against."""
    vllm_fm = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
    tune = _load("triton_tune")
    cfg = json.loads((HERE / "probe_configs" / "v4-fp8.json").read_text())
    ex = tune.experts_of(cfg)
    assert (ex.experts, ex.top_k) == (cfg["n_routed_experts"], cfg["num_experts_per_tok"])
    for m in tune.BATCH_SIZES:
        space = tune.search_space(m)
        assert len({tune.key_of(c) for c in space}) == len(space) <= 48
        for c in space:
            assert c["BLOCK_SIZE_K"] == 128 and 128 % c["BLOCK_SIZE_N"] == 0
        default = vllm_fm.get_default_config(m, ex.experts, ex.inter, ex.hidden, ex.top_k,
                                             "fp8_w8a8", [128, 128])  # fmt: skip
        assert set(tune.KEYS) <= set(default) and default.get("SPLIT_K", 1) == 1
    with pytest.raises(SystemExit, match="no routed-expert shape"):
        tune.experts_of({"hidden_size": 5120})


def test_triton_tune_writes_the_checked_winner_in_vllms_layout():
    tune = _load("triton_tune")
    a = dict(zip(tune.KEYS, (16, 64, 128, 1, 4, 3), strict=True))
    b = dict(zip(tune.KEYS, (16, 128, 128, 32, 4, 3), strict=True))
    ka, kb = tune.key_of(a), tune.key_of(b)
    assert tune.best_of({ka: 9.0, kb: 7.5, "x": float("inf")}) == kb
    with pytest.raises(ValueError, match="no config ran"):
        tune.best_of({"x": float("inf")})

    def rec(ci_high):
        r = {"configs": {ka: a, kb: b}, "default": ka, "best": kb,
             "check": {"ci_low": 0.9, "ci_high": ci_high}}  # fmt: skip
        return {**r, "chosen": tune.chosen(r)}

    # The winner stays unless the interleaved check found it slower than the default.
    assert rec(1.05)["chosen"] == kb and rec(0.98)["chosen"] == ka
    doc = tune.vllm_file({"sizes": {"64": rec(1.05), "8": rec(0.98), "256": {"us": {}}}})
    assert list(doc) == ["8", "64"]  # sorted by batch size; an unfinished size is left out
    assert doc["8"] == {**a, "SPLIT_K": 1} and doc["64"] == {**b, "SPLIT_K": 1}
    r = subprocess.run([sys.executable, str(HERE / "triton_tune.py"), "--help"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "VLLM_TUNED_CONFIG_FOLDER" in r.stdout
