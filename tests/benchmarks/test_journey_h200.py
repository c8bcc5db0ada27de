"""CPU checks for benchmarks/journey_h200/: the V4 configs the GPU probe serves are the ones
our synth and converter write today."""

from __future__ import annotations

import json
from pathlib import Path

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
    del release["hc_eps"]
    (tmp_path / "config.json").write_text(json.dumps(release))
    try:
        pre._model_config(tmp_path)
    except SystemExit as e:
        assert "lacks hc_eps" in str(e) and str(tmp_path / "config.json") in str(e)
    else:
        raise AssertionError("a config without hc_eps was accepted")
