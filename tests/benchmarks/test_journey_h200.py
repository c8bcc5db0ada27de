"""CPU checks for benchmarks/journey_h200/: the V4 configs the GPU probe serves are the ones
our synth and converter write today, the mHC precompile's variants and config, and the
published leases rebuilding from their own run files."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.benchmarks import load_script

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "journey_h200"


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


def test_published_lease_rebuilds_from_its_own_run_files(tmp_path):
    """report.py on a tarball of lease 2's published check/, runs/ and logs/ reproduces its
    summary (which names Humming's MXFP4 backend for the release) and its decode report."""
    pytest.importorskip("guidellm")
    published = ROOT / "benchmarks" / "results" / "journey_h200" / "v4-lease2-decode-partial"
    tarball = tmp_path / "serve_h200.tar.gz"
    with tarfile.open(tarball, "w:gz") as t:
        for sub in ("check", "runs", "logs"):
            t.add(published / sub, arcname=sub)
    summary = (published / "summary.md").read_text()
    title = summary.splitlines()[0].removeprefix("# ")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_h200" / "report.py"),
                          str(tarball), str(out), "--baseline", "v4hum", "--title", title],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (out / "summary.md").read_text() == summary
    assert "**v4hum** (MoE backend HUMMING MXFP4)" in summary
    report = (out / "decode" / "report.md").read_text()
    assert report == (published / "decode" / "report.md").read_text()
