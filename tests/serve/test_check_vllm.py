"""Recipes against the installed vLLM's own parser and config classes (CI installs 0.34.0)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import TESTED_VLLM, installed_vllm
from vllm_h20.serve import check, recipe
from vllm_h20.serve.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


@pytest.mark.parametrize(
    "path", sorted((ROOT / "recipes").glob("deepseek-v41-*.yaml")), ids=lambda p: p.stem
)
def test_shipped_recipes_are_valid(path):
    res = check.check(recipe.load(path))
    assert res.vllm == installed_vllm() in TESTED_VLLM
    p = res.parsed
    layout = (p["tensor_parallel_size"], p["data_parallel_size"], p["enable_expert_parallel"])
    assert layout == {"deepseek-v41-flash-fp8-2node-tp8dp2ep16": (8, 2, True),
                      "deepseek-v41-flash-fp8-2node-dp16ep16": (1, 16, True),
                      "deepseek-v41-flash-fp8-tp8ep8": (8, 1, True),
                      "deepseek-v41-flash-humming-w4a8-tp8": (8, 1, False)}[path.stem]  # fmt: skip
    assert p["engram_cpu_offload"] is True
    if "2node" in path.stem:
        # 384 + 16 replicas over 16 ranks; an all-to-all FlashInfer CUTLASS takes.
        assert p["num_redundant_experts"] == 16 and p["moe_backend"] == "flashinfer_cutlass"
        assert p["all2all_backend"] == "allgather_reducescatter"


@pytest.mark.parametrize(
    "name, backend",
    [
        ("test-h200-dsv3-fp8-flashinfer-cutlass", "flashinfer_cutlass"),
        ("test-h200-dsv4-fp8-flashinfer-cutlass", "flashinfer_cutlass"),
        ("test-h200-dsv4-mxfp4-humming", "humming"),
    ],
)
def test_the_one_h200_test_recipes_are_valid(name, backend):
    """benchmarks/serve_h200's and journey_h200's recipes: one GPU, the MoE path each tests."""
    res = check.check(recipe.load(ROOT / "recipes" / f"{name}.yaml"))
    assert res.vllm == installed_vllm() in TESTED_VLLM
    assert res.parsed["tensor_parallel_size"] == 1 and not res.parsed["enable_expert_parallel"]
    assert res.parsed["moe_backend"] == backend


@pytest.mark.parametrize(
    "text, message",
    [
        ("tensor-parallel-size: 8\nblok-size: 64\n", r"r.yaml:2: blok-size: not a `vllm serve` "
         rf"flag in vLLM {re.escape(installed_vllm() or '')}; did you mean block-size\?"),
        ("block-size: sixty-four\n", r"r.yaml:1: block-size: .*invalid"),
        ("enable-expert-parallel: true\nenable-eplb: true\neplb-config:\n  num_redundant: 16\n",
         r"r.yaml:3: eplb-config: .*num_redundant"),
        ("speculative-config:\n  method: dspark\n  num_spec_tokens: 2\n",
         r"r.yaml:1: speculative-config.num_spec_tokens: not a SpeculativeConfig field"),
    ],
)  # fmt: skip
def test_bad_recipes_are_one_line_naming_the_key(write_recipe, text, message):
    with pytest.raises(RecipeError, match=message) as e:
        check.check(recipe.load(write_recipe(text)))
    assert "\n" not in str(e.value)


def test_an_accepted_recipe_is_not_parsed_again_until_it_changes(write_recipe, monkeypatch,
                                                                  tmp_path):  # fmt: skip
    """vLLM's answer for an accepted recipe is kept (its import costs 10-30 s per check); the
    same bytes are answered from the cache, a changed recipe or another interpreter asks vLLM."""
    monkeypatch.setenv("VLLM_H20_CACHE_DIR", str(tmp_path / "cache"))
    path = write_recipe("tensor-parallel-size: 2\n")
    first = check.check(recipe.load(path))
    assert first.parsed["tensor_parallel_size"] == 2
    assert len(list((tmp_path / "cache" / "recipe-check").glob("*.json"))) == 1

    def no_vllm(*a, **k):  # the only way to prove the child process was not started
        raise AssertionError("vLLM's parser ran again")

    monkeypatch.setattr(check.subprocess, "run", no_vllm)
    assert check.check(recipe.load(path)) == first
    path.write_text("tensor-parallel-size: 4\n")
    with pytest.raises(AssertionError, match="ran again"):
        check.check(recipe.load(path))
    path.write_text("tensor-parallel-size: 2\n")
    with pytest.raises(AssertionError, match="ran again"):
        check.check(recipe.load(path), python=sys.executable)
