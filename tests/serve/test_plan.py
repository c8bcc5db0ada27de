"""Planner maths on generated checkpoints whose every size is known."""

from __future__ import annotations

import math

import pytest

from vllm_h20.convert.safetensors_io import read_header
from vllm_h20.serve import plan, recipe
from vllm_h20.serve.recipe import RecipeError

GIB = 1 << 30
BASE = {
    "tensor_parallel_size": 2,
    "data_parallel_size": 1,
    "enable_expert_parallel": True,
    "enable_eplb": True,
    "num_redundant_experts": 2,
    "gpu_memory_utilization": 0.9,
    "max_model_len": 4096,
    "max_cudagraph_capture_size": 768,
    "engram_cpu_offload": True,
    "engram_use_thp": False,
}


def _sizes(model):
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        for name, t in read_header(f).tensors.items():
            out[name] = t.end - t.begin
    return out


def _plan(model, **over):
    return plan.plan(recipe.load("deepseek-v41-flash-fp8-tp8ep8"), BASE | over, model, "h200")


def test_weights_split_by_ep_tp_and_replicated_exactly(tiny_fp8):
    sizes = _sizes(tiny_fp8)
    p = _plan(tiny_fp8)
    per_expert = max(
        v for k, v in sizes.items() if ".ffn.experts.0." in k and k.startswith("layers.0")
    )
    # all three of w1/w2/w3 (+scales) of one expert
    one = sum(v for k, v in sizes.items() if k.startswith("layers.0.ffn.experts.0."))
    assert per_expert < one
    experts_main = {k.split(".")[4] for k in sizes if k.startswith("layers.0.ffn.experts.")}
    layers = {k.split(".")[1] for k in sizes if k.startswith("layers.")}
    slots = math.ceil((len(experts_main) + 2) / 2)  # (E + redundant) / EP
    assert p.slots_per_rank["main"] == slots
    assert p.weights["routed experts (EP)"] == pytest.approx(len(layers) * slots * one, rel=1e-9)
    tp_sharded = sum(v for k, v in sizes.items() if plan._TP.search(k))
    assert p.weights["dense (TP-sharded)"] == pytest.approx(tp_sharded / 2, abs=1)
    engram = [v for k, v in sizes.items() if ".engram.embed." in k]
    replicated = (
        sum(sizes.values())
        - tp_sharded
        - sum(engram)
        - sum(v for k, v in sizes.items() if ".ffn.experts." in k)
    )
    assert p.weights["dense (replicated)"] == replicated
    # Engram tables: TP-sharded, pinned, each shard rounded up to a power of two.
    assert p.host_per_rank == sum(1 << (math.ceil(t / 2) - 1).bit_length() for t in engram)
    assert p.host_per_node == 2 * p.host_per_rank
    thp = _plan(tiny_fp8, engram_use_thp=True)
    assert thp.host_per_rank == sum(math.ceil(t / 2) for t in engram) <= p.host_per_rank


def test_without_ep_experts_are_tp_sharded_and_engram_on_gpu(tiny_fp8):
    sizes = _sizes(tiny_fp8)
    p = _plan(tiny_fp8, enable_expert_parallel=False, enable_eplb=False, engram_cpu_offload=False)
    main = sum(v for k, v in sizes.items() if ".ffn.experts." in k and k.startswith("layers."))
    assert p.weights["routed experts (TP)"] == pytest.approx(main / 2, abs=1)
    assert p.host_per_rank == 0 and p.weights["Engram tables (TP)"] > 0


def test_kv_cache_and_fit(tiny_fp8):
    ov = plan.Overheads()
    p = _plan(tiny_fp8)
    over = ov.non_torch_gib + ov.activation_peak_gib + ov.cuda_graph_gib_at_768
    assert p.budget == int(plan.GPUS["h200"] * 0.9)
    assert p.kv_bytes == pytest.approx(p.budget - p.weights_total - over * GIB, abs=2)
    assert p.kv_tokens == int(p.kv_bytes / ov.kv_bytes_per_token)
    assert p.fits and p.concurrency(4096) == p.kv_tokens // 4096
    small = plan.plan(recipe.load("deepseek-v41-flash-fp8-tp8ep8"), BASE, tiny_fp8, "10")
    assert not small.fits and "exceed 0.9 x 10.00 GiB" in small.why
    long = _plan(tiny_fp8, max_model_len=10**9)
    assert not long.fits and "fewer than max-model-len 1,000,000,000" in long.why
    half = _plan(tiny_fp8, max_cudagraph_capture_size=384)
    assert half.overheads["CUDA graphs"] == pytest.approx(p.overheads["CUDA graphs"] / 2)


@pytest.mark.parametrize("gpu", ["h20-97", "-3", "big"])
def test_bad_gpu_names(gpu):
    with pytest.raises(RecipeError, match=f"--gpu {gpu}"):
        plan.gpu_bytes(gpu)


@pytest.mark.slow
def test_full_size_flash_checkpoint_matches_the_seed(tmp_path_factory):
    """Full-size V4.1-Flash in the converted layout (sparse: headers only; the Engram table
    sizes derived from the seed's 475.24 GiB release): weights per rank vs the seed's 70.94."""
    from vllm_h20.convert.synth import PRESETS, generate_converted

    model = tmp_path_factory.mktemp("flash") / "fp8"
    info = generate_converted(model, PRESETS["flash"], shards=16)
    assert info["bytes"] / GIB == pytest.approx(718.60, abs=0.01)  # the seed's converted size
    parsed = BASE | {"tensor_parallel_size": 8, "num_redundant_experts": 16,
                     "gpu_memory_utilization": 0.97, "max_model_len": 262144}  # fmt: skip
    p = plan.plan(recipe.load("deepseek-v41-flash-fp8-tp8ep8"), parsed, model, "h20-96g")
    assert p.slots_per_rank == {"main": 50, "draft": 16}
    assert p.weights_total / GIB == pytest.approx(70.94, rel=0.05)
    assert p.fits and p.kv_tokens > 262144


def test_fixed_kv_cache_is_planned_against_the_whole_gpu(tiny_fp8):
    """With kv-cache-memory-bytes vLLM skips its memory profile and ignores the utilization
    share: the plan checks weights + overheads + that KV cache against the GPU's memory."""
    kv = 2 * GIB
    p = _plan(tiny_fp8, gpu_memory_utilization=0.05, kv_cache_memory_bytes=kv)
    assert p.kv_fixed and p.budget == plan.GPUS["h200"] and p.kv_bytes == kv
    assert p.fits and p.kv_tokens == int(kv / plan.Overheads().kv_bytes_per_token)
    small = plan.plan(recipe.load("deepseek-v41-flash-fp8-tp8ep8"),
                      BASE | {"kv_cache_memory_bytes": kv}, tiny_fp8, "10")  # fmt: skip
    assert not small.fits and "kv-cache-memory-bytes 2.00 GiB exceed 10.00 GiB" in small.why
    sized = _plan(tiny_fp8, cudagraph_capture_sizes=[1, 8, 384])
    assert sized.overheads["CUDA graphs"] == pytest.approx(p.overheads["CUDA graphs"] / 2)


def _two_node(model, gpu="h200", **over):
    parsed = BASE | {"tensor_parallel_size": 2, "data_parallel_size": 2,
                     "num_redundant_experts": 4} | over  # fmt: skip
    return plan.plan(recipe.load("deepseek-v41-flash-fp8-2node-tp8dp2ep16"), parsed, model, gpu,
                     gpus_per_node=2)  # fmt: skip


def test_data_parallel_replicas_spread_experts_and_multiply_the_kv_cache(tiny_fp8):
    """TP2 x DP2 on nodes of two GPUs: experts over 4 ranks (half the slots of EP2), two nodes,
    two replicas each with its own KV cache; Engram shards stay per TP rank, private per node."""
    one = _plan(tiny_fp8)
    two = _two_node(tiny_fp8)
    assert (two.nodes, two.dp, two.ep) == (2, 2, 4) and one.nodes == 1
    experts = {k.split(".")[4] for k in _sizes(tiny_fp8) if k.startswith("layers.0.ffn.experts.")}
    assert two.slots_per_rank["main"] == (len(experts) + 4) // 4
    assert two.weights["routed experts (EP)"] < one.weights["routed experts (EP)"]
    assert two.kv_bytes > one.kv_bytes and two.kv_tokens_total == 2 * two.kv_tokens
    assert two.concurrency(4096) == 2 * (two.kv_tokens // 4096)
    assert not two.host_shared and two.host_per_node == 2 * two.host_per_rank == one.host_per_node


def test_dp_attention_shares_engram_tables_per_node(tiny_fp8):
    """TP1 x DP4 on nodes of two GPUs: each GPU a replica; the tables are not TP-sharded (each
    replica needs all of them) and the node's two replicas share one copy (dp_shared_memory,
    vLLM's default with DP > 1), unrounded; with it off every GPU pins its own copy."""
    engram = [v for k, v in _sizes(tiny_fp8).items() if ".engram.embed." in k]
    shared = _two_node(tiny_fp8, tensor_parallel_size=1, data_parallel_size=4)
    assert shared.nodes == 2 and shared.dp == 4 and shared.host_shared
    assert shared.host_per_node == sum(engram) and shared.host_per_rank == 0
    private = _two_node(tiny_fp8, tensor_parallel_size=1, data_parallel_size=4,
                        engram_dp_shared_memory=False)  # fmt: skip
    assert private.host_per_rank == sum(1 << (t - 1).bit_length() for t in engram)
    assert private.host_per_node == 2 * private.host_per_rank
    across = _two_node(tiny_fp8, tensor_parallel_size=1, data_parallel_size=4,
                       engram_embedding_across_dp=True)  # fmt: skip
    assert across.host_per_rank == sum(1 << (math.ceil(t / 4) - 1).bit_length() for t in engram)


def test_layouts_that_cannot_be_laid_out_are_one_line(tiny_fp8):
    with pytest.raises(RecipeError, match="tensor-parallel-size 4 does not fit a node of 2"):
        _two_node(tiny_fp8, tensor_parallel_size=4)
    with pytest.raises(RecipeError, match=r"do not spread evenly over EP4.*num_redundant_experts"):
        _two_node(tiny_fp8, num_redundant_experts=1)


@pytest.mark.slow
def test_two_nodes_of_the_full_size_flash_checkpoint(tmp_path_factory):
    """The shipped two-node layouts on the full-size V4.1-Flash checkpoint (headers only), beside
    the one-node recipe: EP16 halves the expert slots per GPU (25, draft 8), which multiplies
    each GPU's KV cache on 96 GB cards about tenfold, and the replicas add up."""
    from vllm_h20.convert.synth import PRESETS, generate_converted

    model = tmp_path_factory.mktemp("flash2") / "fp8"
    generate_converted(model, PRESETS["flash"], shards=16)
    common = {"enable_expert_parallel": True, "enable_eplb": True, "num_redundant_experts": 16,
              "gpu_memory_utilization": 0.97, "max_model_len": 262144,
              "max_cudagraph_capture_size": 768, "engram_cpu_offload": True}  # fmt: skip
    layouts = {"deepseek-v41-flash-fp8-tp8ep8": (8, 1), "deepseek-v41-flash-fp8-2node-tp8dp2ep16":
               (8, 2), "deepseek-v41-flash-fp8-2node-dp16ep16": (1, 16)}  # fmt: skip
    out = {}
    for name, (tp, dp) in layouts.items():
        parsed = common | {"tensor_parallel_size": tp, "data_parallel_size": dp}
        for gpu in ("h20-96g", "h20-141g"):
            out[name, gpu] = plan.plan(recipe.load(name), parsed, model, gpu)
    one = out["deepseek-v41-flash-fp8-tp8ep8", "h20-96g"]
    tp8dp2 = out["deepseek-v41-flash-fp8-2node-tp8dp2ep16", "h20-96g"]
    dp16 = out["deepseek-v41-flash-fp8-2node-dp16ep16", "h20-96g"]
    assert all(p.fits for p in out.values())
    assert tp8dp2.slots_per_rank == dp16.slots_per_rank == {"main": 25, "draft": 8}
    assert (tp8dp2.nodes, dp16.nodes) == (2, 2)
    assert tp8dp2.kv_bytes > 9 * one.kv_bytes and tp8dp2.kv_tokens_total == 2 * tp8dp2.kv_tokens
    assert dp16.weights_total > tp8dp2.weights_total  # attention and shared experts whole
    assert tp8dp2.host_per_node == one.host_per_node and not tp8dp2.host_shared
    assert dp16.host_shared and dp16.host_per_node < one.host_per_node
    big = out["deepseek-v41-flash-fp8-2node-tp8dp2ep16", "h20-141g"]
    assert big.kv_bytes - tp8dp2.kv_bytes == pytest.approx(
        (plan.GPUS["h20-141g"] - plan.GPUS["h20-96g"]) * 0.97, rel=1e-6
    )


def test_vllm_034_defaults_fill_what_the_recipe_leaves_unset(tiny_fp8):
    """vLLM 0.34 parses an unset EPLB replica count and memory share as None: the planner then
    takes vLLM's own fills, the fewest replicas that spread the experts evenly (here 4 experts
    over EP2 need none, over EP3 two) and 1.0 of the GPU with the extensible KV cache (its CUDA
    default), CacheConfig's default share without it."""
    assert [plan.auto_redundant(384, ep) for ep in (8, 16, 5, 7)] == [0, 0, 1, 1]
    unset = _plan(tiny_fp8, num_redundant_experts=None, gpu_memory_utilization=None)
    assert unset.slots_per_rank["main"] == 2  # 4 experts + 0 replicas over EP2
    assert unset.budget == plan.GPUS["h200"]
    off = _plan(tiny_fp8, gpu_memory_utilization=None, enable_extensible_kv_cache=False,
                default_gpu_memory_utilization=0.92)  # fmt: skip
    assert off.budget == int(plan.GPUS["h200"] * 0.92)
    three = _plan(
        tiny_fp8, tensor_parallel_size=1, data_parallel_size=3, num_redundant_experts=None
    )
    assert three.slots_per_rank["main"] == 2  # (4 + 2) / 3
    assert (
        _plan(tiny_fp8, enable_eplb=False, num_redundant_experts=None).slots_per_rank["main"] == 2
    )
