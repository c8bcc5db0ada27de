"""Reading recipes and the conflicts vLLM would accept silently."""

from __future__ import annotations

import pytest

from vllm_h20.serve import check, recipe
from vllm_h20.serve.recipe import RecipeError


def test_shipped_recipes_load_by_name_with_lines():
    r = recipe.load("deepseek-v41-flash-fp8-tp8ep8")
    assert r.get("tensor-parallel-size") == 8
    assert r.get("eplb-config.num_redundant_experts") == 16
    assert r.where("eplb-config").endswith(f":{r.lines['eplb-config']}")
    assert r.lines["tensor-parallel-size"] < r.lines["eplb-config"]
    names = {p.stem for p in recipe.shipped_recipes().glob("*.yaml")}
    assert names == {
        "deepseek-v41-flash-fp8-tp8ep8",
        "deepseek-v41-flash-fp8-2node-tp8dp2ep16",
        "deepseek-v41-flash-fp8-2node-dp16ep16",
        "deepseek-v41-flash-humming-w4a8-tp8",
        "test-h200-dsv3-fp8-flashinfer-cutlass",
        "test-h200-dsv4-fp8-flashinfer-cutlass",
        "test-h200-dsv4-mxfp4-humming",
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ("enable-eplb: true\n", r"r.yaml:1: enable-eplb needs enable-expert-parallel: true"),
        (
            "tensor-parallel-size: 8\neplb-config:\n  num_redundant_experts: 16\n",
            r"r.yaml:2: eplb-config.num_redundant_experts: 16 has no effect without enable-eplb",
        ),
        ("block-size: 64\nconfig: other.yaml\n", r"r.yaml:2: config: a recipe cannot include"),
        # Node-specific flags: one recipe serves every node, serve --node-rank adds them.
        ("data-parallel-size: 2\nheadless: true\n", r"r.yaml:2: headless: differs per node"),
        ("data-parallel-address: 10.0.0.1\n", r"r.yaml:1: data-parallel-address: differs per"),
        (
            "all2all-backend: deepep_high_throughput\n",
            r"r.yaml:1: all2all-backend: deepep_high_throughput has no effect without enable-exp",
        ),
        (
            "enable-expert-parallel: true\nmoe-backend: flashinfer_cutlass\n"
            "all2all-backend: deepep_low_latency\n",
            r"r.yaml:3: all2all-backend: deepep_low_latency hands the experts batched activations",
        ),
    ],
)
def test_conflicts_name_file_line_and_key(write_recipe, text, message):
    with pytest.raises(RecipeError, match=message):
        check.conflicts(recipe.load(write_recipe(text)))


@pytest.mark.parametrize(
    "text, message",
    [
        ("a: [1\n", r"r.yaml:\d+: not valid YAML"),
        ("- just\n- a list\n", "a recipe is a mapping"),
    ],
)
def test_bad_files(write_recipe, text, message):
    with pytest.raises(RecipeError, match=message):
        recipe.load(write_recipe(text))


def test_unknown_recipe_name_lists_the_shipped_ones():
    with pytest.raises(
        RecipeError, match="shipped: deepseek-v41-flash-fp8-2node-dp16ep16, .*tp8ep8"
    ):
        recipe.load("no-such-recipe")


def test_json_recipes_are_refused(write_recipe):
    with pytest.raises(RecipeError, match="only .yaml/.yml"):
        recipe.load(write_recipe("{}", name="r.json"))


def test_config_equals_form_in_extra_args_is_refused():
    with pytest.raises(RecipeError, match="vLLM ignores --config=FILE"):
        check.check_argv(["--port", "8001", "--config=x.yaml"])
    check.check_argv(["--port", "8001"])


@pytest.mark.parametrize(
    ("vllm", "refused"), [("0.33.0", False), ("0.34.0", True), ("0.34.1rc1", True), ("1.0", True)]
)
def test_deepep_v2_with_flashinfer_cutlass_is_refused_from_vllm_034(write_recipe, vllm, refused):
    """vLLM 0.34 gives deepep_v2 padded activations, which FlashInfer CUTLASS refuses at
    start-up; 0.33 gave it the standard layout. Another MoE backend is not ours to judge."""
    text = (
        "enable-expert-parallel: true\nmoe-backend: flashinfer_cutlass\n"
        "all2all-backend: deepep_v2\n"
    )
    r = recipe.load(write_recipe(text))
    check.conflicts(r)  # nothing wrong whatever vLLM parses it
    if refused:
        with pytest.raises(RecipeError, match=rf"r.yaml:3: all2all-backend: deepep_v2 hands the "
                           rf"experts padded activations in vLLM {vllm}"):  # fmt: skip
            check.version_conflicts(r, vllm)
    else:
        check.version_conflicts(r, vllm)
    other = recipe.load(write_recipe(text.replace("flashinfer_cutlass", "triton")))
    check.version_conflicts(other, vllm)
