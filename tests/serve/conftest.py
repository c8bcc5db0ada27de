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


@pytest.fixture
def write_recipe(tmp_path):
    def write(text: str, name: str = "r.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return write
