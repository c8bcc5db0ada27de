"""The CPU-side parts of the one-H200 serving A/B (benchmarks/serve_h200/): its sweep specs and
recipe under the real parsers, the test model vLLM would load, the device script's shape, the
probes' pure parts, and the published results being rebuilt from their own run files."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.benchmark_scripts import load_script, pack_published

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "serve_h200"
RESULTS = ROOT / "benchmarks" / "results" / "serve_h200"
RECIPE = ROOT / "recipes" / "test-h200-dsv3-fp8-flashinfer-cutlass.yaml"
# The V4 journey's driver: its own steps, the serving driver's for the rest, with its servers.
JOURNEY = ROOT / "benchmarks" / "journey_h200" / "h200.sh"


# Under names of their own (other benchmark folders have a stage.py and a report.py too).
make_model, probe, report, stage, steptime = (
    load_script(HERE / f"{n}.py", f"serve_h200_{n}")
    for n in ("make_model", "probe", "report", "stage", "steptime")
)


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_h20.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)  # fmt: skip


def test_sweep_specs_load_and_shorten_the_shipped_method():
    from vllm_h20.bench import spec

    decode, prefill = spec.load(HERE / "decode.yaml"), spec.load(HERE / "prefill.yaml")
    shipped = spec.load("decode")
    assert decode.concurrency == (64, 128, 256) and set(decode.concurrency) < set(
        shipped.concurrency
    )
    assert decode.throughput == "output" and prefill.throughput == "input"
    assert prefill.request.output_tokens == 1 and prefill.request.prompt_tokens == 1024
    # issue 2/4's sweep: >= 5 runs of >= 60 s per cell, a warmup longer than one request's
    # life (256 decode steps of at most ~15 ms at these tiers)
    resolve = spec.load(HERE / "decode-resolve.yaml")
    assert resolve.runs >= 5 and resolve.measure_s >= 60
    assert resolve.warmup_s >= resolve.request.output_tokens * 0.015
    assert set(resolve.concurrency) <= set(decode.concurrency)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model")
    make_model.main([str(out)])
    return out


def test_test_model_is_deepseek_v3_with_v41_flash_expert_shapes(model_dir):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    assert cfg.model_type == "deepseek_v3"
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts) == (5120, 2304, 384)
    assert cfg.num_experts_per_tok == 6 and cfg.quantization_config["weight_block_size"] == [
        128,
        128,
    ]
    # DeepSeek-V3's gate with one group (as Kimi-K2 runs 384 experts); `--router random` is
    # rounds 2-4's plain top-6 of a softmax.
    assert (cfg.topk_method, cfg.scoring_func, cfg.n_group, cfg.topk_group) == (
        "noaux_tc", "sigmoid", 1, 1)  # fmt: skip
    plain = make_model.config(router="random")
    assert (plain["topk_method"], plain["scoring_func"]) == ("greedy", "softmax")
    assert make_model.expert_bytes(make_model.config()) == 4 * 384 * 3 * 5120 * 2304
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok("Serving experts on Hopper")["input_ids"]
    assert ids and max(ids) < cfg.vocab_size


def test_recipe_is_valid_for_the_installed_vllm():
    pytest.importorskip("vllm")
    res = cli("recipe", "check", str(RECIPE))
    assert res.returncode == 0, res.stderr
    assert "9 flags valid" in res.stdout


def test_serve_dry_run_skips_the_plan_for_dummy_weights(model_dir):
    pytest.importorskip("vllm")
    res = cli("serve", str(RECIPE), "--model", str(model_dir), "--gpu", "h200", "--dry-run",
              "--", "--port", "8001", "--moe-backend", "triton")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "plan: skipped: load-format dummy" in res.stdout
    assert (
        f"serve {model_dir} --config {RECIPE}" in res.stdout
        and "--moe-backend triton" in res.stdout
    )
    missing = cli("serve", str(RECIPE), "--model", str(model_dir / "nope"), "--dry-run")
    assert missing.returncode == 2 and "no config.json" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_device_scripts_parse_and_refuse_unknown_steps_and_servers(tmp_path):
    """Both drivers: an unknown step or server is refused in one line; each knows only its own
    servers (the journey's driver hands the serving steps its own table)."""
    env = {"SH": str(tmp_path), "PATH": "/usr/bin:/bin"}

    def run(script: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip

    for script in (HERE / "h200.sh", JOURNEY):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        res = run(script, "frobnicate")
        assert res.returncode == 2 and "unknown step frobnicate" in res.stderr
    res = run(HERE / "h200.sh", "wait", "v4hum")
    assert res.returncode == 1 and (
        "unknown server v4hum (fix|stock|triton|deepgemm)" in res.stderr
    )
    res = run(JOURNEY, "wait", "fix")
    servers = "v4hum|v4fix|v4stock|v4marlin|v4triton"
    assert res.returncode == 1 and f"unknown server fix ({servers})" in res.stderr
    assert run(HERE / "h200.sh", "v4prep").returncode == 2  # the journey's step, not this one's
    # The Triton tune's inputs: a folder without config.json, and v4triton before any tune.
    res = run(JOURNEY, "v4tune", str(tmp_path / "none"))
    assert res.returncode == 1 and f"v4tune: no config.json in {tmp_path / 'none'}" in res.stdout
    (tmp_path / "v4" / "converted").mkdir(parents=True)
    (tmp_path / "v4" / "converted" / "model.safetensors.index.json").write_text("{}")
    res = run(JOURNEY, "serve", "v4triton")
    assert res.returncode == 1 and f"v4triton: no {tmp_path}/triton-configs" in res.stdout
    assert not (tmp_path / "logs" / "v4triton.log").exists()


def test_sweep_bg_outlives_its_call_and_sweep_wait_returns_the_sweep_s_status(tmp_path):
    """`sweep-bg` starts `sweep` under setsid and returns at once (round 7 ran its sweep that way
    across three device calls); `sweep-wait` says 3 while it runs, then exits with its status.
    `vllm-h20` is a stand-in here (the real sweep needs servers): it prints its arguments, waits
    and fails with 4."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "vllm-h20"
    stand_in.write_text('#!/bin/sh\necho "ok   args: $*"\nsleep 8\nexit 4\n')
    stand_in.chmod(0o755)
    env = {"SH": str(tmp_path / "sh"), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    spec = "benchmarks/serve_h200/decode-resolve.yaml"

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(HERE / "h200.sh"), *args], capture_output=True,
                              text=True, env={**env, **extra}, timeout=60, cwd=ROOT)  # fmt: skip

    started = run("sweep-bg", spec, "fix", "stock")
    assert started.returncode == 0 and "started in the background" in started.stdout
    assert "already running" in run("sweep-bg", spec, "fix", "stock").stdout
    waiting = run("sweep-wait", spec, WAIT_S="0")
    assert waiting.returncode == 3 and "sweep-decode-resolve: still running" in waiting.stdout
    done = run("sweep-wait", spec, WAIT_S="50")
    assert done.returncode == 4, done.stdout + done.stderr
    assert "bench sweep benchmarks/serve_h200/decode-resolve.yaml --target fix=" in done.stdout
    never = run("sweep-wait", "benchmarks/serve_h200/decode.yaml", WAIT_S="5")
    assert never.returncode == 1 and "sweep-decode: not running" in never.stdout


def test_stage_keeps_what_kernels_build_needs_in_the_boot_tar():
    reqs = stage.requirements()
    assert "vllm==0.26.0" in reqs and "flashinfer-python==0.6.14" in reqs
    assert len(reqs) == len({r.split("==")[0] for r in reqs})  # one version of each
    assert {"flashinfer-python", "apache-tvm-ffi"} <= {r.split("==")[0] for r in reqs}


def test_stage_refuses_a_python_without_tokenizers_before_downloading(tmp_path, monkeypatch):
    """make_model.py writes the tokenizer with `tokenizers`; without it stage.py stops in one
    line before any download (round 6 got a traceback after the wheels were fetched)."""
    real = stage.importlib.util.find_spec

    def find_spec(name, *a):
        return None if name == "tokenizers" else real(name, *a)

    monkeypatch.setattr(stage.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(stage, "download", lambda *a: pytest.fail("downloaded"))
    with pytest.raises(SystemExit, match=r"has no `tokenizers` package.*pip install tokenizers"):
        stage.main(["--stage", str(tmp_path / "st"), "--piece-mib", "8"])
    assert not (tmp_path / "st").exists()


def test_stage_sizes_pieces_beside_the_working_tree_and_keeps_only_pinned_wheels():
    assert stage.piece_bytes(10 << 20) == 52 << 20  # 64 MiB - tree - 2 MiB margin
    with pytest.raises(SystemExit, match="no room left"):
        stage.piece_bytes(58 << 20)
    journey = ROOT / "benchmarks" / "journey_h200" / "wheels.txt"
    reqs = stage.requirements([journey])
    assert "humming-kernels==0.1.10" in reqs and "tilelang==0.1.9" in reqs
    assert len(reqs) == len({r.split("==")[0] for r in reqs})
    assert stage._wanted("humming_kernels-0.1.10-py3-none-any.whl", reqs)
    assert not stage._wanted("humming_kernels-0.1.10-py3-none-any.whl", stage.requirements())
    assert not stage._wanted("vllm-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl", reqs)
    with pytest.raises(SystemExit, match="--extra nope.txt: no such wheel list"):
        stage.requirements([Path("nope.txt")])
    with pytest.raises(SystemExit, match="no jit-cache.tgz"):
        stage.jit_pieces(ROOT)


def test_device_script_v4_steps_synthesize_convert_and_verify(tmp_path):
    """`journey_h200/h200.sh v4prep` (v4release + v4convert in the background) on the tiny
    preset: our CLI
    end to end as the GPU machine runs it (synth, the BPE tokenizer, convert, verify), without
    a GPU; asked again while it runs it reports, once done it says so."""
    pytest.importorskip("tokenizers")
    env = {"SH": str(tmp_path / "sh"), "V4REL": str(tmp_path / "release"), "V4PRESET": "tiny",
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT)}  # fmt: skip

    def prep() -> str:
        res = subprocess.run(["bash", str(JOURNEY), "v4prep"], capture_output=True,
                             text=True, env=env, timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    assert prep().startswith("v4prep: started")
    deadline = time.time() + 600
    while (out := prep()).startswith("v4prep: running") and time.time() < deadline:
        time.sleep(2)
    logs = tmp_path / "sh" / "logs"
    assert out.startswith("v4prep: done"), out + (logs / "v4prep.log").read_text()
    assert "verify: rc 0" in (logs / "v4-convert.txt").read_text()
    assert (logs / "conversion_report.json").exists()
    # What `serve v4*` waits on: each checkpoint marked complete, outside the model folders.
    assert {p.name for p in (tmp_path / "sh" / "v4").glob("*.ready")} == {
        "release.ready",
        "converted.ready",
    }
    assert not list((tmp_path / "release").glob(".*ready"))
    tok = json.loads((tmp_path / "release" / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "BPE"
    conv = tmp_path / "sh" / "v4" / "converted"
    assert json.loads((conv / "config.json").read_text())["expert_dtype"] == "fp8"
    assert (conv / "tokenizer.json").read_bytes() == (
        tmp_path / "release" / "tokenizer.json"
    ).read_bytes()


def _captures(routes: list[list[list[int]]], prompt: int) -> list:
    """Requests whose generated tokens went to routes[req][step] (one layer), after `prompt`
    prompt tokens routed to expert 0."""
    out = []
    for r in routes:
        arr = np.zeros((prompt + len(r), 2, len(r[0])), dtype=np.uint16)
        for k, experts in enumerate(r):
            arr[prompt + k, 1] = experts
        out.append((prompt, arr))
    return out


def test_decode_step_counts_and_varied_layers():
    per_req = _captures([[[1, 2], [3, 4]], [[1, 5], [2, 3]], [[1, 2], [3, 3]]], prompt=4)
    step1 = probe.decode_step_counts(per_req, 1, experts=8)
    assert step1[1].tolist() == [0, 3, 2, 0, 0, 1, 0, 0] and step1[0].sum() == 6
    step2 = probe.decode_step_counts(per_req, 2, experts=8)
    assert step2[1][3] == 4 and step2[1].sum() == 6
    assert probe.varied_layers(per_req) == [1]  # layer 0 stays constant, like a dense layer
    # Degenerate routing, as measured on the dummy-weight model: every token of every request
    # goes to the same experts, so no layer counts as varied.
    same = [(3, np.tile(np.array([[0, 0], [1, 2]], dtype=np.uint16), (5, 1, 1))) for _ in range(4)]
    assert probe.varied_layers(same) == []


def test_margin_is_the_lead_of_the_best_first_token():
    assert probe.margin({"a": -1.0, "b": -3.5, "c": -2.0}) == pytest.approx(1.0)
    assert probe.margin({"a": -0.1}) == float("inf")


def test_uniform_reference_matches_its_expectation():
    ref = probe.uniform_reference(64, 384, 6, trials=300)
    expected_idle = 384 * (1 - 6 / 384) ** 64  # each token leaves a given expert idle w.p. 1-6/384
    assert abs(ref["zero"] - expected_idle) < 3
    assert ref["max"] >= 3


def test_kernels_are_summed_by_name_from_a_trace(tmp_path):
    events = [
        {"cat": "kernel", "name": "void deep_gemm::fp8_gemm_kernel_swapAB<1u>", "dur": 10.0,
         "ts": 0.0},
        {"cat": "kernel", "name": "void deep_gemm::fp8_gemm_kernel_swapAB<1u>", "dur": 12.0,
         "ts": 20.0},
        # launched beside the one before (programmatic dependent launch): overlaps 20-32
        {"cat": "kernel", "name": "fused_moe_kernel", "dur": 3.0, "ts": 30.0},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 99.0, "ts": 0.0},
    ]  # fmt: skip
    trace = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    ks = probe._kernels(trace)
    assert [(k["name"][-20:], k["calls"], k["total_us"]) for k in ks] == [
        ("fp8_gemm_kernel_swapAB<1u>"[-20:], 2, 22.0),
        ("fused_moe_kernel", 1, 3.0),
    ]
    # Busy time counts the overlap once: 0-10, then 20-33.
    assert probe._busy_us(trace) == 23.0


def test_kernel_classes_name_the_dispatch_that_ran():
    prof = json.loads((RESULTS / "round1-dummy-weights" / "check" / "profile_fix.json").read_text())
    names = [k["name"] for k in report.moe_kernels(prof)]
    assert names and all(report.kernel_class(n) == "MoE GEMM: DeepGEMM swap-A/B" for n in names)
    short = report._short(names[0])
    assert "BLOCK_N=16" in short and "groups=384" in short
    stock = json.loads(
        (RESULTS / "round1-dummy-weights" / "check" / "profile_stock.json").read_text()
    )
    assert {report.kernel_class(k["name"]) for k in report.moe_kernels(stock)} == {
        "MoE GEMM: DeepGEMM regular"
    }
    assert abs(sum(report.split(prof).values()) - prof["kernel_us_total"]) < 1e-6


@pytest.mark.parametrize("round_dir", sorted(p.name for p in RESULTS.glob("round*")))
def test_published_results_rebuild_from_their_own_run_files(tmp_path, round_dir):
    """report.py on a tarball made of a round's published check/, runs/ and logs/ reproduces
    its published summary and reports (the plots aside)."""
    pytest.importorskip("guidellm")
    published = RESULTS / round_dir
    tarball = pack_published(published, tmp_path / "serve_h200.tar.gz")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(HERE / "report.py"), str(tarball), str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (out / "summary.md").read_text() == (published / "summary.md").read_text()
    for log in published.glob("steps/*.jsonl.gz"):  # the engines' step logs (round 5 on)
        assert (out / "steps" / log.name).read_bytes() == log.read_bytes()
    specs = [s for s in ("decode", "prefill") if (published / s).exists()]
    # Every round has a sweep or step times to rebuild (round 4 measured step times only).
    assert "decode" in specs or "## Step time" in (out / "summary.md").read_text()
    for spec in specs:
        assert (out / spec / "report.md").read_text() == (
            published / spec / "report.md"
        ).read_text()
        assert (out / spec / "throughput.png").stat().st_size > 10_000


def test_report_names_the_gpu_that_ran_and_refuses_a_lease_that_names_none(tmp_path):
    """The heading comes from collect's nvidia-smi.txt (a lease asked for an H200 may get an
    H100: round 6); a tarball without it is refused in one line before anything is written."""
    published = RESULTS / "round6-h100-step-time"
    assert (published / "summary.md").read_text().startswith("# Serving on one H100: ")
    assert (
        (RESULTS / "round5-gpu-step-time" / "summary.md")
        .read_text()
        .startswith("# Serving on one H200: ")
    )
    bare = tmp_path / "bare"
    (bare / "logs").mkdir(parents=True)
    (bare / "logs" / "fix.log").write_text("INFO starting\n")
    tarball = pack_published(bare, tmp_path / "serve_h200.tar.gz")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(HERE / "report.py"), str(tarball), str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert res.returncode != 0
    assert len(res.stderr.strip().splitlines()) == 1
    assert res.stderr.startswith(f"report: {tarball}: its logs/nvidia-smi.txt")
    assert res.stderr.rstrip().endswith("names no NVIDIA H-series GPU; pass --title")
    assert "Traceback" not in res.stderr
    assert not out.exists()


def test_sweep_steps_take_each_run_s_full_batch_steps_inside_its_window(tmp_path):
    """The per-run step table counts only decode steps of the tier's full batch that started in
    that run's GuideLLM window, and sets the baseline's runs against the target's."""
    import gzip

    def steps(gpu: float, every_ms: float, t0: float) -> list[dict]:
        out = [{"t": t0 + i * every_ms / 1e3, "tokens": 128, "reqs": 128, "gpu_ms": gpu,
                "host_ms": 1.0} for i in range(300)]  # fmt: skip
        # A prefill step and a smaller batch in the window, and full steps outside it: none count.
        out[50] = {**out[50], "tokens": 900}
        out[51] = {**out[51], "tokens": 64, "reqs": 64}
        return out

    runs = tmp_path / "sweeps" / "decode-x" / "runs"
    logs = {}
    for target, gpu, every in (("stock", 9.0, 10.0), ("fix", 7.0, 8.0)):
        (runs / target).mkdir(parents=True)
        logs[target] = []
        for r in range(3):
            t0 = 1000.0 * (r + 1) + (500 if target == "fix" else 0)
            logs[target] += steps(gpu, every, t0)
            # r0: 0.1-1.5 s into its steps, r1 0.1 s longer (more steps, more throughput).
            window = {"start": t0 + 0.1, "end": t0 + 1.5 + 0.1 * r}
            # fix: more steps per window but less throughput than stock, so an r over the raw
            # runs would be made by the arms' gap; within each arm, more steps is faster.
            (runs / target / f"c128-r{r}.json").write_text(json.dumps({
                "status": "ok", "target": target, "concurrency": 128, "run": r,
                "started": t0, "throughput": (1000.0 if target == "stock" else 500.0) + 100 * r,
                "guidellm": {"window": window}}))  # fmt: skip
    (tmp_path / "steps").mkdir()
    for target, lines in logs.items():
        body = "".join(json.dumps(x) + "\n" for x in lines).encode()
        (tmp_path / "steps" / f"{target}.jsonl.gz").write_bytes(gzip.compress(body))
    table = report._sweep_steps(tmp_path, report._read_steps(tmp_path / "steps"), "stock")
    stock = next(x for x in table if x.startswith("| decode-x | 128 | stock |"))
    fix = next(x for x in table if x.startswith("| decode-x | 128 | fix |"))
    assert "| 3 | 10.00 ms | 9.00 ms | baseline | baseline |" in stock
    assert "| 3 | 8.00 ms | 7.00 ms | 1.250 (1.250-1.250) | 1.286 (1.286-1.286) |" in fix
    assert table.index(stock) < table.index(fix)
    # Each run in the order it ran. fix's r0: steps every 8 ms, 175 of them inside its window,
    # one a prefill; the full-batch pairs lose the three that touch the prefill or the batch of 64.
    runs_in_order = [x for x in table if x.startswith("| decode-x | 128 |") and "| r" in x]
    assert [x.split(" | ")[2:4] for x in runs_in_order] == [
        ["stock", "r0"], ["fix", "r0"], ["stock", "r1"], ["fix", "r1"], ["stock", "r2"],
        ["fix", "r2"]]  # fmt: skip
    assert "| r0 | 500 | 175 | 174 | 171 | 8.00 ms | 7.00 ms |" in runs_in_order[1]
    steps_col = [int(x.split(" | ")[5].replace(",", "")) for x in runs_in_order]
    thr_col = [float(x.split(" | ")[4].replace(",", "")) for x in runs_in_order]
    assert report.statistics.correlation(thr_col, steps_col) < 0  # over the raw runs
    r_line = next(x for x in table if x.startswith("decode-x, concurrency 128: throughput"))
    within = float(r_line.split("steps in the window r = ")[1].split(",")[0])
    assert within > 0.98  # within each arm, more steps in the window is more throughput
    # Each arm's steps are evenly spaced: its interval does not move, and gets no r.
    assert "against the full-batch interval r: none (a column has no spread)" in r_line


def test_mixed_steps_bin_the_prefill_carrying_steps_of_each_run_s_window(tmp_path):
    """The mixed-step table takes, per run, the window's steps that carried prefill tokens,
    by scheduled-token bin; a bin with fewer than 5 such steps in a run is left out, and a
    pure-decode step or one outside the window never counts."""
    runs = tmp_path / "sweeps" / "decode-x" / "runs"
    logs: dict[str, list[dict]] = {}
    for target, gpu in (("stock", 15.0), ("fix", 12.0)):
        (runs / target).mkdir(parents=True)
        logs[target] = []
        for r in range(2):
            t0 = 1000.0 * (r + 1) + (500 if target == "fix" else 0)
            # 10 mixed steps of 300 tokens (GPU: gpu, or gpu + 1 in run 1), 3 of 600 tokens,
            # decode steps between them, and mixed steps after the window that must not count.
            for i in range(40):
                tokens = 300 if i % 4 == 0 else 600 if i in (1, 5, 9) else 128
                logs[target].append({"t": t0 + i * 0.01, "tokens": tokens, "reqs": 128,
                                     "gpu_ms": gpu + r if tokens == 300 else 99.0,
                                     "host_ms": 5.0})  # fmt: skip
            logs[target] += [{"t": t0 + 5 + i, "tokens": 300, "reqs": 128, "gpu_ms": 99.0,
                              "host_ms": 5.0} for i in range(10)]  # fmt: skip
            (runs / target / f"c128-r{r}.json").write_text(json.dumps({
                "status": "ok", "target": target, "concurrency": 128, "run": r,
                "started": t0, "throughput": 1000.0,
                "guidellm": {"window": {"start": t0, "end": t0 + 1.0}}}))  # fmt: skip
    table = report._mixed_steps(tmp_path, logs, "stock")
    rows = [x for x in table if x.startswith("| decode-x |")]
    assert [x.split(" | ")[2:4] for x in rows] == [["256-511", "stock"], ["256-511", "fix"]]
    assert rows[0].endswith("| 2 | 300 | 15.50 ms | 5.00 ms | baseline |")
    # stock 15, 16 over fix 12, 13: geometric means 15.49 / 12.49.
    assert "| 2 | 300 | 12.50 ms | 5.00 ms | 1.240 (" in rows[1]
    assert report._mixed_steps(tmp_path, {}, "stock") == []


def test_window_clocks_read_nvidia_smi_inside_each_run_s_window(tmp_path):
    """The clock table averages the samples inside each run's window (nvidia-smi's local time
    read as UTC), per target, and skips the header, a cut line and samples outside windows."""
    import datetime

    sweeps = tmp_path / "sweeps"
    rows = ["timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
            "temperature.gpu, utilization.gpu [%]"]  # fmt: skip
    start = datetime.datetime(2026, 12, 5, 19, 0, 0, tzinfo=datetime.UTC)
    for target, t0, clock, power in (("stock", 0, 1400, 690.0), ("fix", 100, 1980, 660.0)):
        (sweeps / "decode-x" / "runs" / target).mkdir(parents=True)
        begin = start.timestamp() + t0
        (sweeps / "decode-x" / "runs" / target / "c128-r0.json").write_text(json.dumps({
            "status": "ok", "target": target, "concurrency": 128, "run": 0,
            "guidellm": {"window": {"start": begin, "end": begin + 9.5}}}))  # fmt: skip
        for i in range(-3, 13):  # 3 s before the window to 3 s after it
            when = start + datetime.timedelta(seconds=t0 + i)
            inside = 0 <= i <= 9
            rows.append(f"{when:%Y/%m/%d %H:%M:%S}.000, {clock + (i % 2) * 10 if inside else 1980} "
                        f"MHz, 3201 MHz, {power + i if inside else 100.0} W, 50, 90 %")  # fmt: skip
    rows.append("2026/12/05 19:02:00.000, 19")  # the line the logger was killed in
    (sweeps / "nvidia-smi-decode-x.csv").write_text("\n".join(rows) + "\n")
    table = [x for x in report._window_clocks(tmp_path, "stock") if x.startswith("| decode-x")]
    assert table == [
        "| decode-x | 128 | stock | 1 | 1,405 MHz | 1,400 MHz | 694 W | 699 W |",
        "| decode-x | 128 | fix | 1 | 1,985 MHz | 1,980 MHz | 664 W | 669 W |",
    ]


def test_report_refuses_a_python_without_the_package_before_writing(tmp_path, monkeypatch):
    """Without vllm_h20 importable, report.py stops in one line before it writes anything
    (round 7 got a traceback with half a results folder written)."""
    real = report.importlib.util.find_spec

    def find_spec(name, *a):
        return None if name == "vllm_h20" else real(name, *a)

    monkeypatch.setattr(report.importlib.util, "find_spec", find_spec)
    out = tmp_path / "out"
    tarball = pack_published(RESULTS / "round7-h100-sweep", tmp_path / "serve_h200.tar.gz")
    with pytest.raises(SystemExit, match=r"cannot import vllm_h20: `pip install -e \.`"):
        report.main([str(tarball), str(out)])
    assert not out.exists()


def test_generated_weights_have_the_names_shapes_and_dtypes_vllm_loads(tmp_path):
    """Round 2's checkpoint (--weights): Hugging Face DeepSeek-V3 names (as transformers builds
    the model, its fused experts aside), FP8 linears with 128x128 float32 block scales, and a
    router whose logits differ from token to token (what the dummy weights lacked)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    out = tmp_path / "m"
    make_model.main([str(out), "--weights", "--small", "--layers", "3"])
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(out / shard), "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[k] = f.get_tensor(k)
    assert set(tensors) == set(index)
    assert not list(out.glob("*.partial"))

    cfg = transformers.AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    dense = {k for k in ref if ".mlp.experts." not in k}
    ours = {k for k in tensors if ".mlp.experts." not in k and not k.endswith("_scale_inv")}
    assert ours == dense
    for k in dense:
        assert tuple(tensors[k].shape) == tuple(ref[k].shape), k
    experts = [k for k in tensors if ".mlp.experts." in k and k.endswith(".weight")]
    assert len(experts) == 2 * cfg.n_routed_experts * 3  # 2 MoE layers x experts x 3
    w = tensors["model.layers.1.mlp.experts.7.down_proj.weight"]
    s = tensors["model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (256, 128)
    assert s.dtype == torch.float32 and tuple(s.shape) == (2, 1)
    kv = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert tuple(kv.shape) == (5, 2)  # (512 + 64) x 256: a partial last block row
    # Unit-variance tokens through the router (DeepSeek-V3's noaux_tc gate): routing depends
    # on the token; the bias is float32, one per expert, and not all zero (it was fitted).
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"
    gate = tensors["model.layers.1.mlp.gate.weight"].float()
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and tuple(bias.shape) == (cfg.n_routed_experts,)
    assert bias.abs().max() > 0
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    top = torch.topk(torch.sigmoid(x @ gate.T) + bias, cfg.num_experts_per_tok, dim=1).indices
    assert len({tuple(sorted(r.tolist())) for r in top}) > 8  # of 28 pairs; dummy weights: 1


def test_make_model_sizes_its_checkpoint_and_refuses_a_disk_too_small(tmp_path, monkeypatch):
    """checkpoint_bytes is what write_weights writes (headers aside), and a disk without room
    for it stops make_model in one line before the first shard: V4.1-Flash-shaped layers are
    13.6 GB each, and the GPU machine's disk is 64 GiB."""
    import shutil
    from collections import namedtuple

    pytest.importorskip("torch")
    out = tmp_path / "m"
    make_model.main([str(out), "--weights", "--small", "--layers", "3"])
    cfg = json.loads((out / "config.json").read_text())
    written = sum(f.stat().st_size for f in out.glob("model-*.safetensors"))
    assert 0 < written - make_model.checkpoint_bytes(cfg) < 64 * 1024 * 3  # 3 shards' headers
    full = make_model.config(5)
    assert 54.4e9 < make_model.checkpoint_bytes(full) < 56e9  # LAYERS=5: 54.4 GB of experts

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 10**9))
    tight = tmp_path / "tight"
    with pytest.raises(SystemExit, match=r"needs 55\.0 GB and the disk has 1\.0 GB free"):
        make_model.main([str(tight), "--weights", "--layers", "5"])
    assert not list(tight.glob("*.safetensors*"))


def test_serve_goes_on_without_a_plan_for_a_v3_checkpoint(tmp_path):
    """The planner sizes DeepSeek-V4.1 checkpoints; `serve` says so for the generated V3 one
    and goes on, while `plan` itself refuses with the same one line."""
    pytest.importorskip("vllm")
    out = tmp_path / "m"
    make_model.main([str(out), "--weights", "--small", "--layers", "2"])
    res = cli("serve", str(RECIPE), "--model", str(out), "--dry-run", "--",
              "--load-format", "auto")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "plan: skipped:" in res.stdout and "DeepSeek-V2/V3 tensor names" in res.stdout
    assert res.stdout.rstrip().endswith("--load-format auto")
    refused = cli("plan", str(RECIPE), "--model", str(out), "--gpu", "h200")
    assert refused.returncode == 2 and "the planner sizes the DeepSeek-V4.1 layout only" in (
        refused.stderr
    )
    assert "Traceback" not in refused.stderr


def test_warm_sends_and_times_every_wave(tmp_path, monkeypatch):
    """`probe.py warm` against GuideLLM's mock server: each wave's requests complete and its
    time is recorded, appended across calls (one call per server set)."""
    pytest.importorskip("guidellm")
    from tests.bench.conftest import MockServer

    srv = MockServer(tmp_path, "tiny-model", "--ttft-ms", "1", "--itl-ms", "0")
    try:
        monkeypatch.setattr(probe, "WAVES", [(2, 5, 2), (3, 40, 1)])
        for _ in range(2):
            probe.main(["warm", "--out", str(tmp_path), f"tiny-model={srv.port}"])
    finally:
        srv.stop()
    rows = json.loads((tmp_path / "warm.json").read_text())
    assert [(r["wave"], r["concurrency"]) for r in rows] == [(0, 2), (1, 3)] * 2
    assert all(r["server"] == "tiny-model" and r["seconds"] >= 0 for r in rows)
    assert all(r["error"] is None for r in rows)


def test_warm_records_a_failed_wave_and_goes_on(tmp_path, monkeypatch):
    """A wave the server does not answer (here: nothing listens) is written with its error,
    the next waves still run, and the probe ends with one line and a non-zero exit."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    monkeypatch.setattr(probe, "WAVES", [(2, 5, 2), (1, 5, 1)])
    with pytest.raises(SystemExit) as exc:
        probe.main(["warm", "--out", str(tmp_path), f"gone={port}"])
    assert "2 wave(s) failed (gone wave 0, gone wave 1)" in str(exc.value)
    rows = json.loads((tmp_path / "warm.json").read_text())
    assert [r["wave"] for r in rows] == [0, 1]
    assert all("Connection refused" in r["error"] for r in rows)


def test_device_script_remembers_where_the_v4_release_went(tmp_path):
    """The release's place (/dev/shm or the disk) is decided once: the release itself fills
    /dev/shm, so a later step deciding again could look in the other place."""
    env = {"SH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    script = JOURNEY
    subprocess.run(["bash", str(script), "wait"], capture_output=True, env=env)
    chosen = (tmp_path / "v4rel.path").read_text().strip()
    assert chosen in ("/dev/shm/v4-release", f"{tmp_path}/v4/release")
    (tmp_path / "v4rel.path").write_text(f"{tmp_path}/elsewhere\n")
    res = subprocess.run(["bash", str(script), "serve", "v4hum"], capture_output=True,
                         text=True, env=env, timeout=60)  # fmt: skip
    assert res.returncode == 1 and f"v4hum: no checkpoint in {tmp_path}/elsewhere" in res.stdout


def test_device_script_precompiles_need_the_release(tmp_path):
    """Both precompile steps read the release's config.json: without one, each says where it
    looked and which step makes it, before starting anything."""
    env = {"SH": str(tmp_path), "PATH": "/usr/bin:/bin", "V4REL": str(tmp_path / "none")}
    for step in ("v4mhc", "v4dg"):
        res = subprocess.run(["bash", str(JOURNEY), step], capture_output=True,
                             text=True, env=env, timeout=60)  # fmt: skip
        assert res.returncode == 1
        assert res.stdout == f"{step}: no release in {tmp_path / 'none'} (v4release first)\n"


def test_device_script_collect_lists_compiled_kernels_with_their_times(tmp_path):
    """`collect` lists vLLM's DeepGEMM kernels with their configurations and Triton's kernels
    (their metadata JSONs, not the group files), both with times, for stalls.py."""
    sh = tmp_path / "sh"
    k = sh / "vllm-cache" / "deep_gemm" / "cache" / "kernel.sm90_fp8_gemm_1d2d.0123"
    k.mkdir(parents=True)
    (k / "kernel.cu").write_text("auto p = &sm90_fp8_gemm_1d2d_impl<\n 0, 1536, 5120\n>);\n")
    (k / "kernel.cubin").write_bytes(b"\0")
    t = sh / "triton" / "HASH"
    t.mkdir(parents=True)
    (t / "_topk_kernel.json").write_text("{}")
    (t / "__grp___topk_kernel.json").write_text("{}")
    for d in ("logs", "check", "sweeps"):
        (sh / d).mkdir()
    out = tmp_path / "out"
    env = {"SH": str(sh), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(["bash", str(HERE / "h200.sh"), "collect", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    with tarfile.open(out / "serve_h200.tar.gz") as tar:
        kernels = tar.extractfile("logs/vllm-deepgemm-kernels.txt").read().decode()
        triton = tar.extractfile("logs/triton-cache.txt").read().decode()
    assert kernels.endswith(" kernel.sm90_fp8_gemm_1d2d.0123 0,1536,5120\n")
    [line] = triton.splitlines()
    assert line.endswith(" 2 HASH/_topk_kernel.json")


def _wheel(d: Path, name: str, files: dict[str, str]) -> None:
    """A minimal pure-Python wheel holding `files` (path -> text)."""
    info = f"{name}-1.0.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    entries = {**files, **meta}
    record = "".join(f"{p},,\n" for p in [*entries, f"{info}/RECORD"])
    with zipfile.ZipFile(d / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for p, text in {**entries, f"{info}/RECORD": record}.items():
            z.writestr(p, text)


def test_device_script_install_keeps_every_file_of_wheels_sharing_a_folder(tmp_path):
    """CuTe DSL's wheels all write into nvidia_cutlass_dsl/, and pip --target skips a folder
    that is already there: the journey's first lease lost `cutlass.cute` that way. Install
    merges instead, into the boot step's site folder too; JIT caches staged with the wheels
    (stage.py --jit-cache) are restored."""
    sh = tmp_path / "sh"
    wheels = tmp_path / "pack" / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels, "first", {"shared/a.py": "A = 1\n"})
    _wheel(wheels, "second", {"shared/b.py": "B = 2\n"})
    _wheel(wheels, "vllm", {"vllm/__init__.py": "__version__ = '0.26.0'\n"})
    cache = tmp_path / "lease" / "tilelang" / "0.1.9-x86_64" / "k1"
    cache.mkdir(parents=True)
    (cache / "kernel.so").write_bytes(b"\x7fELF compiled")
    jit = tmp_path / "out" / "jit-cache.tgz"  # a previous lease's `jitsave`, staged
    jit.parent.mkdir()
    with tarfile.open(jit, "w:gz") as t:
        t.add(tmp_path / "lease" / "tilelang", arcname="tilelang")
    (sh / "pieces").mkdir(parents=True)
    with tarfile.open(sh / "pieces" / "piece-00", "w") as t:
        t.add(wheels, arcname="wheels")
        for j in stage.jit_pieces(jit.parent):
            t.add(j, arcname=f"jit/{j.name}")
    (sh / "stage" / "boot").mkdir(parents=True)
    (sh / "stage" / "boot" / "pieces.txt").write_text("1\n")
    (sh / "site" / "shared").mkdir(parents=True)
    (sh / "site" / "shared" / "boot.py").write_text("BOOT = 0\n")  # what boot installed
    env = {"SH": str(sh), "HOME": str(tmp_path), "PYTHONNOUSERSITE": "1",
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}  # fmt: skip
    res = subprocess.run(["bash", str(HERE / "h200.sh"), "install"], capture_output=True,
                         text=True, env=env, timeout=300)  # fmt: skip
    assert "vllm 0.26.0" in res.stdout, res.stdout + res.stderr
    shared = sh / "site" / "shared"
    assert sorted(p.name for p in shared.iterdir()) == ["a.py", "b.py", "boot.py"]
    assert (sh / "site" / "bin" / "vllm").is_file() and (sh / "stage" / ".installed").exists()
    assert not (sh / "site.new").exists()
    restored = sh / "tilelang" / "0.1.9-x86_64" / "k1" / "kernel.so"
    assert restored.read_bytes() == b"\x7fELF compiled" and (sh / "jit.loaded").exists()


def test_device_script_brings_jit_caches_back_and_restores_them_once(tmp_path):
    """`jitsave` packs the JIT caches (in pieces the device tool returns, at most 16 MiB each),
    `jitload` on a fresh machine restores them byte for byte, once; nothing carried, nothing
    done; a damaged piece is refused by name and restores nothing; no cache, no archive."""
    script = HERE / "h200.sh"
    lease = tmp_path / "lease"
    for rel, size in {"tilelang/0.1.9-x86_64/k1/kernel.so": 20 << 20,  # incompressible
                      "vllm-cache/deep_gemm/cache/kernel.a/kernel.cubin": 1000,
                      "triton/abc/x.json": 10, "deepgemm/cache/g/nvcc_kernel.cubin": 10,
                      "tilelang/tmp/partial": 10}.items():  # fmt: skip
        p = lease / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(np.random.default_rng(size).bytes(size))

    def run(sh: Path, *args: str) -> subprocess.CompletedProcess:
        env = {"SH": str(sh), "PATH": "/usr/bin:/bin"}
        return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip

    res = run(tmp_path / "bare", "jitsave", str(tmp_path / "nowhere"))
    assert res.returncode == 1 and f"jitsave: no JIT cache under {tmp_path / 'bare'}" in res.stdout
    out = tmp_path / "out"
    res = run(lease, "jitsave", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    pieces = sorted(out.glob("jit-cache.tgz*"))
    assert len(pieces) == 2 and all(p.stat().st_size <= 15 << 20 for p in pieces)
    fresh = tmp_path / "fresh"
    assert run(fresh, "jitload", str(tmp_path / "nothing")).returncode == 0
    assert not (fresh / "tilelang").exists()
    res = run(fresh, "jitload", str(out))
    assert res.returncode == 0 and "jitload: restored" in res.stdout, res.stdout + res.stderr
    jit_dirs = ("tilelang", "vllm-cache", "triton", "deepgemm")
    files = [f.relative_to(lease) for f in lease.rglob("*") if f.is_file()]
    kept = [r for r in files if r.parts[0] in jit_dirs and "tmp" not in r.parts]
    assert len(kept) == 4
    for rel in kept:
        assert (fresh / rel).read_bytes() == (lease / rel).read_bytes()
    assert not (fresh / "tilelang" / "tmp").exists()  # TileLang's half-written kernels stay
    assert run(fresh, "jitload", str(out)).stdout == ""  # once per machine
    other = tmp_path / "other"
    pieces[-1].write_bytes(pieces[-1].read_bytes()[:1000])
    res = run(other, "jitload", str(out))
    assert res.returncode == 1 and f"jitload: {out}/jit-cache.tgz* is damaged" in res.stdout
    assert not (other / "tilelang").exists() and not (other / "jit.new").exists()


def test_steptime_recovers_each_servers_per_token_latency_and_resumes(tmp_path):
    """steptime.py against two GuideLLM mock servers whose non-streaming answers take
    ttft + itl x (tokens - 1): differencing two batches recovers each one's itl, the report
    puts the slower one at ~2x the first arm with a CI, a rerun with more repeats adds repeats
    (and runs its warm-ups again), and other settings or a dead server are refused in one line
    with every sample kept."""
    pytest.importorskip("guidellm")
    from tests.bench.conftest import MockServer, free_port

    fast = MockServer(tmp_path, "fast", "--ttft-ms", "5", "--itl-ms", "8")
    slow = MockServer(tmp_path, "slow", "--ttft-ms", "5", "--itl-ms", "16")
    out = tmp_path / "run" / "steptime"
    args = ["--out", str(out), "--batch", "2", "3", "--decode-steps", "12", "--short-tokens", "2",
            "--prefill-batch", "2", "--prefill-words", "30", f"fast={fast.port}",
            f"slow={slow.port}"]  # fmt: skip
    try:
        assert steptime.main([*args, "--repeats", "2"]) == 0
        first = json.loads((out / "steptime.json").read_text())
        assert steptime.main([*args, "--repeats", "3"]) == 0
        with pytest.raises(SystemExit, match="other settings"):
            steptime.main([*args, "--repeats", "3", "--decode-steps", "20"])
    finally:
        fast.stop()
        slow.stop()
    res = json.loads((out / "steptime.json").read_text())
    assert res["arms"] == ["fast", "slow"]
    timed = [s for s in res["samples"] if s["rep"] >= 0]
    assert len(timed) == 3 * 2 * 3  # shapes x arms x repeats
    assert {(s["shape"], s["rep"], s["arm"]) for s in timed} >= {
        (s["shape"], s["rep"], s["arm"]) for s in first["samples"] if s["rep"] >= 0
    }
    # ABBA: the arms swap places every repeat.
    order = [s["arm"] for s in res["samples"] if s["shape"] == "decode-2" and s["rep"] in (0, 1)]
    assert order == ["fast", "slow", "slow", "fast"]
    for s in timed:
        if s["kind"] == "decode":
            itl = 8e-3 if s["arm"] == "fast" else 16e-3
            assert 0.5 * itl < s["step_s"] < 2 * itl  # the injected per-token time, recovered
    summary = report._steptimes(tmp_path / "run")
    row = next(x for x in summary if x.startswith("| decode-3 |"))
    ratio = float(row.split("|")[-2].split()[0])
    assert 1.4 < ratio < 2.8, row
    # A server that does not answer: one line, exit 1, the samples so far kept.
    dead = ["--out", str(tmp_path / "dead"), "--batch", "2", "--prefill-batch", "0",
            f"gone={free_port()}"]  # fmt: skip
    assert steptime.main(dead) == 1
    assert json.loads((tmp_path / "dead" / "steptime.json").read_text())["samples"] == []
    with pytest.raises(SystemExit, match="expected NAME=PORT or NAME=URL"):
        steptime.main(["--out", str(tmp_path / "bad"), "fix8001"])


def test_steptime_stops_in_one_line_when_a_server_logs_no_steps(tmp_path, capsys):
    """--step-times ROOT with a server started without VLLM_H20_STEP_TIMES=ROOT/NAME (a GuideLLM
    mock server logs nothing): exit 1 after its first sample, one line naming the folder and
    the variable, the file kept without that sample."""
    pytest.importorskip("guidellm")
    from tests.bench.conftest import MockServer

    srv = MockServer(tmp_path, "mock", "--ttft-ms", "1", "--itl-ms", "1")
    out = tmp_path / "run"
    logs = tmp_path / "logs"
    args = ["--out", str(out), "--batch", "2", "--decode-steps", "4", "--short-tokens", "2",
            "--prefill-batch", "0", "--step-times", str(logs), f"fix={srv.port}"]  # fmt: skip
    try:
        assert steptime.main(args) == 1
    finally:
        srv.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "VLLM_H20_STEP_TIMES=" + str(logs / "fix") in err[0]
    assert json.loads((out / "steptime.json").read_text())["samples"] == []


def test_steptime_measures_the_prefill_alone_when_given_no_decode_batch(tmp_path):
    """`--batch` with no sizes and one long prompt (the next lease's prefill: one request, so
    one prefill step, not a batch split over steps by its arrival); neither shape: refused."""
    pytest.importorskip("guidellm")
    from tests.bench.conftest import MockServer

    srv = MockServer(tmp_path, "mock", "--ttft-ms", "1", "--itl-ms", "1")
    out = tmp_path / "run"
    try:
        assert steptime.main(["--out", str(out), "--batch", "--prefill-batch", "1",
                              "--prefill-words", "40", "--repeats", "1",
                              f"fix={srv.port}"]) == 0  # fmt: skip
    finally:
        srv.stop()
    res = json.loads((out / "steptime.json").read_text())
    assert {s["shape"] for s in res["samples"]} == {"prefill-1x40w"}
    assert all(s["extra_prompt_tokens"] > 0 for s in res["samples"])
    with pytest.raises(SystemExit):
        steptime.main(["--out", str(tmp_path / "none"), "--batch", "--prefill-batch", "0", "a=1"])


HUMMING_KERNEL = r"""
#include <cstdint>
template <bool kIsSigned_, uint32_t kNumBits_> class IntegerType {};
template <uint32_t kNumBits_, uint32_t kExponentBits_, uint32_t kMantissaBits_>
class FloatingPointType {};
template <uint32_t M, uint32_t N, uint32_t K> class Shape {};
class MmaOpClass {}; class LayerConfig {}; class ComputeConfig {}; class TuningConfig {};
// humming-kernels 0.1.10's GEMM template (include/humming/kernel/humming.cuh), body left out
template <class MmaOpClass_, class ProblemShape, class BlockShape, class WarpShape, class PadShape,
          class ElementA, class ElementB, class ElementC, class ElementBS, class LayerConfig_,
          class ComputeConfig_, class TuningConfig_>
__global__ void humming(uint32_t const* GS, uint32_t shape_m) {}
#define HUMMING(A) template __global__ void humming<MmaOpClass, Shape<1, 4608, 5120>, \
    Shape<64, 128, 128>, Shape<64, 32, 128>, Shape<0, 0, 0>, A, FloatingPointType<4, 2, 1>, \
    FloatingPointType<16, 8, 7>, FloatingPointType<8, 8, 0>, LayerConfig, ComputeConfig, \
    TuningConfig>(uint32_t const*, uint32_t);
using E4M3 = FloatingPointType<8, 4, 3>;
using BF16 = FloatingPointType<16, 8, 7>;
HUMMING(E4M3)
HUMMING(BF16)
"""


def test_profile_names_the_precision_humming_ran_at(tmp_path):
    """Issue 2/4's W4A8 proof reads Humming's GEMM kernel names in a profile: names made here by
    nvcc from Humming's kernel template (MXFP4 weights, FP8 or BF16 activations) and demangled,
    as a profile shows them, give W4A8 and W4A16; no Humming kernel, no verdict."""
    import shutil

    nvcc, nm, filt = (shutil.which(t) for t in ("nvcc", "nm", "c++filt"))
    if not (nvcc and nm and filt):
        pytest.skip("needs nvcc, nm and c++filt")
    (tmp_path / "k.cu").write_text(HUMMING_KERNEL)
    cubin = tmp_path / "k.cubin"
    subprocess.run([nvcc, "-arch=sm_90a", "-cubin", str(tmp_path / "k.cu"), "-o", str(cubin)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    symbols = subprocess.run([nm, str(cubin)], check=True, capture_output=True, text=True).stdout
    mangled = [ln.split()[-1] for ln in symbols.splitlines() if "humming" in ln]
    names = subprocess.run([filt], input="\n".join(mangled), check=True, capture_output=True,
                           text=True).stdout.splitlines()  # fmt: skip
    w4a8 = next(n for n in names if "FloatingPointType<8u, 4u, 3u>" in n)
    w4a16 = next(n for n in names if n != w4a8)
    quant = {"name": "_quant_tensor_kernel", "calls": 40}
    other = {"name": "void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>()", "calls": 5}
    got = probe.humming_precision([{"name": w4a8, "calls": 80}, quant, other])
    assert got == {"gemm_calls": {"W4A8": 80}, "activation_quant_calls": 40, "precision": "W4A8"}
    got = probe.humming_precision([{"name": w4a16, "calls": 80}, other])
    assert got["precision"] == "W4A16" and got["activation_quant_calls"] == 0
    assert probe.humming_precision([other]) is None


def test_h20_projection_rebuilds_from_committed_files():
    """The published projection is what h20_projection.py renders from the committed kernel
    run and round-4 profile (nothing typed in), and it projects the fix ahead of stock."""
    proj = load_script(HERE / "h20_projection.py", "serve_h200_h20_projection")
    text = proj.render()
    assert text == (RESULTS / "h20-projection" / "README.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| c")]
    assert len(rows) == 3 * len(proj.ROUTINGS)
    for row in rows:
        lo, hi = row.split(" | ")[5].rstrip("x").split("-")
        assert 1.0 < float(lo) <= float(hi)


def test_gpu_side_reads_the_engines_step_log():
    """Decode: the median GPU time of the long batch's steps at exactly the batch (its ramp-up,
    ramp-down and the other batch's steps left out); prefill: long minus short."""

    def step(t, tokens, reqs, gpu, fwd=None):
        return {"t": t, "tokens": tokens, "reqs": reqs, "padded": tokens, "gpu_ms": gpu,
                "forward_ms": fwd or gpu - 0.5, "host_ms": gpu + 1}  # fmt: skip

    steps = [
        step(1.0, 4, 4, 99.0),  # the short batch
        step(10.0, 400, 4, 30.0),
        step(10.1, 3, 3, 5.0),  # the long one's prefill, ramp-up
        *[step(10.2 + i / 100, 4, 4, 6.0 + i % 3) for i in range(9)],
        step(10.5, 2, 2, 3.0),
        step(30.0, 4, 4, 50.0),
    ]  # ramp-down, a later sample
    shape = {"kind": "decode", "batch": 4}
    got = steptime.gpu_side(steps, shape, (0.5, 2.0), (9.9, 11.0))
    assert got == {"gpu_step_ms": 7.0, "forward_ms": 6.5, "host_step_ms": 8.0, "gpu_steps": 9,
                   "padded": [4]}  # fmt: skip
    assert steptime.gpu_side(steps, {"kind": "decode", "batch": 8}, (0.5, 2.0), (9.9, 11.0)) == {}
    pre = steptime.gpu_side(steps, {"kind": "prefill", "batch": 4}, (0.5, 2.0), (9.9, 10.15))
    assert pre == {"gpu_step_ms": 35.0 - 99.0, "forward_ms": 34.0 - 98.5, "gpu_steps": 2}


def test_report_puts_gpu_step_times_beside_the_wall_clock(tmp_path):
    """Where the samples carry the engines' GPU times, the summary gives their paired ratio
    first (here stock 10 % slower in every repeat: resolved), then the wall clock's."""
    samples = []
    for rep in range(4):
        for arm, gpu in (("fix", 5.0 + rep / 10), ("stock", 1.1 * (5.0 + rep / 10))):
            samples.append({"shape": "decode-64", "kind": "decode", "batch": 64, "rep": rep,
                            "arm": arm, "step_s": 0.006 + rep / 1e4,
                            "gpu_step_ms": gpu})  # fmt: skip
    (tmp_path / "steptime").mkdir()
    (tmp_path / "steptime" / "steptime.json").write_text(
        json.dumps(
            {"command": "steptime.py", "config": {}, "arms": ["fix", "stock"], "samples": samples}
        )
    )
    lines = report._steptimes(tmp_path)
    rows = [x for x in lines if x.startswith("| decode-64 |")]
    assert len(rows) == 2
    assert rows[0].split("|")[-2].strip() == "1.100 (1.100-1.100)"
    assert "not resolved" in rows[1] or rows[1].split("|")[-2].strip().startswith("1.000")
    assert lines.index(rows[0]) < lines.index("Wall clock (two batches' difference):")


def test_serve_starts_each_server_from_its_drivers_table(tmp_path):
    """`serve` through either driver: each server's recipe, checkpoint, flags and environment
    come from that driver's table (vllm-h20 replaced by a script that prints what it got); a
    journey server whose checkpoint is missing is refused in one line."""
    sh, bin_dir = tmp_path / "sh", tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm-h20"
    fake.write_text('#!/bin/sh\necho "ARGS: $@"\nenv | grep -E "^VLLM_(H20|DISABLED)" | sort\n')
    fake.chmod(0o755)
    (sh / "v4" / "converted").mkdir(parents=True)
    (sh / "v4" / "converted" / "model.safetensors.index.json").write_text("{}")
    (sh / "build.done").touch()
    env = {"SH": str(sh), "V4REL": str(tmp_path / "rel"), "PATH": f"{bin_dir}:/usr/bin:/bin"}

    def serve(script: Path, *names: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), "serve", *names], capture_output=True,
                              text=True, env=env, timeout=60)  # fmt: skip

    def log(name: str) -> str:
        deadline = time.time() + 10
        while "VLLM_H20_STRICT" not in (text := (sh / "logs" / f"{name}.log").read_text()):
            assert time.time() < deadline, text
            time.sleep(0.1)
        return text

    assert serve(HERE / "h200.sh", "stock", "deepgemm").returncode == 0
    stock, deepgemm = log("stock"), log("deepgemm")
    assert f"--model {sh}/stage/model --gpu h200 -- --port 8002" in stock
    assert "VLLM_H20_MOE_DISPATCH=stock" in stock and f"STEP_TIMES={sh}/steps/stock" in stock
    assert deepgemm.splitlines()[0].endswith("--moe-backend deep_gemm")
    assert "VLLM_H20_MOE_DISPATCH" not in deepgemm
    env["SERVE_ARGS"] = "--no-enable-prefix-caching"  # a lease's extra flags, every server
    assert serve(HERE / "h200.sh", "triton").returncode == 0
    assert log("triton").splitlines()[0].endswith("--moe-backend triton --no-enable-prefix-caching")
    del env["SERVE_ARGS"]
    res = serve(JOURNEY, "v4stock", "v4hum")
    assert res.returncode == 1
    assert f"v4hum: no checkpoint in {tmp_path / 'rel'} (v4release / v4convert first)" in res.stdout
    v4stock = log("v4stock")
    assert "test-h200-dsv4-fp8-flashinfer-cutlass.yaml" in v4stock and "--port 8013" in v4stock
    assert "VLLM_DISABLED_KERNELS=FlashInferFp8DeepGEMMDynamicBlockScaledKernel\n" in v4stock


def test_boot_builds_the_reduced_modules_in_the_background(tmp_path):
    """`boot` builds the fix and stock modules in the background (BUILD_DISPATCH=per_expert:
    the fix's alone), its stderr in the build log, and marks the build done after it.
    `vllm-h20` is a stand-in that records its arguments."""
    for dispatch, want in ((None, "both"), ("per_expert", "per_expert")):
        sh = tmp_path / (dispatch or "default") / "sh"
        (sh / "stage").mkdir(parents=True)
        (sh / "stage" / ".boot").touch()  # the wheels are installed: boot skips that part
        bin_dir = sh / "site" / "bin"  # env.sh puts $SITE/bin first on PATH
        bin_dir.mkdir(parents=True)
        calls = sh.parent / "calls"
        stub = bin_dir / "vllm-h20"
        stub.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n'
                        'echo "building $*" >&2\necho "{}"\n')  # fmt: skip
        stub.chmod(0o755)
        for tool in ("nvidia-smi", "python3"):
            (bin_dir / tool).write_text("#!/bin/bash\necho stub\n")
            (bin_dir / tool).chmod(0o755)
        env = {"SH": str(sh), "PATH": "/usr/bin:/bin"} | (
            {"BUILD_DISPATCH": dispatch} if dispatch else {}
        )
        res = subprocess.run(["bash", str(HERE / "h200.sh"), "boot"], capture_output=True,
                             text=True, env=env, timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        for _ in range(100):
            if (sh / "build.done").exists():
                break
            time.sleep(0.1)
        assert (sh / "build.done").exists(), (sh / "logs" / "build.log").read_text()
        assert calls.read_text().splitlines() == [f"kernels build --dispatch {want} --json"]
        assert (sh / "build.json").read_text().strip() == "{}"
        assert (sh / "logs" / "build.log").read_text().splitlines() == [
            f"building kernels build --dispatch {want} --json"
        ]


def test_start_up_reads_the_last_start_of_a_server_log(tmp_path):
    """The memory table (issue 1/4's KV capacity per server) takes a restarted server's last
    start, and leaves out what its log does not say."""
    log = tmp_path / "v4fix.log"
    first = (
        "INFO [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: ...\n"
        "INFO [gpu_model_runner.py:5347] Model loading took 38.89 GiB memory and 7.4 seconds\n"
        "INFO [kv_cache_utils.py:2177] GPU KV cache size: 117,636 tokens\n"
        "INFO [kv_cache_utils.py:2180] Maximum concurrency for 2,048 tokens per request: 57.44x\n"
        "ERROR engine died\n"
    )
    second = (
        "INFO [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: ...\n"
        "INFO [gpu_model_runner.py:5347] Model loading took 47.51 GiB memory and 9.1 seconds\n"
        "INFO [kv_cache_utils.py:2177] GPU KV cache size: 470,544 tokens\n"
    )
    log.write_text(first + second)
    assert report.start_up(log) == {"weights GiB": "47.51", "KV cache tokens": "470,544"}
    log.write_text(first)
    assert report.start_up(log)["requests of max length"] == "57.44x at 2,048 tokens"
    log.write_text(first + second)
    (tmp_path / "quiet.log").write_text("nothing here\n")
    assert report.start_up(tmp_path / "quiet.log") == {}
    lines = report._memory({"v4fix": log, "quiet": tmp_path / "quiet.log", "gone": tmp_path / "x"})
    assert lines[2].startswith("| server | weights GiB |") and lines[4].endswith("| n/a |")
    assert len(lines) == 6  # heading, blank, head, rule, one server, blank
