"""Recipes and FP8-layout checkpoints for the serving tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_h20.convert.synth import PRESETS, generate_converted

ROOT = Path(__file__).resolve().parents[2]
FP8_RECIPE = ROOT / "recipes" / "deepseek-v41-flash-fp8-tp8ep8.yaml"


@pytest.fixture(scope="session")
def tiny_fp8(tmp_path_factory) -> Path:
    """A tiny checkpoint in the layout `vllm-h20 convert` writes (headers only)."""
    d = tmp_path_factory.mktemp("tiny_fp8") / "model"
    generate_converted(d, PRESETS["tiny"], shards=2)
    return d


@pytest.fixture(scope="session")
def small_fp8(tmp_path_factory) -> Path:
    """The tiny checkpoint with 16 routed experts: 16 + the recipes' 16 EPLB replicas spread
    evenly over 8 and 16 ranks, as vLLM's EPLB requires (the tiny one's 4 do not)."""
    from dataclasses import replace

    d = tmp_path_factory.mktemp("small_fp8") / "model"
    generate_converted(d, replace(PRESETS["tiny"], experts=16), shards=2)
    return d


@pytest.fixture
def write_recipe(tmp_path):
    def write(text: str, name: str = "r.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return write
