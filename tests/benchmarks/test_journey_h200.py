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
