"""Write the test model's directory: a DeepSeek-V3-architecture config with FP8 128x128 block
quantization and V4.1-Flash's MoE shapes, plus a byte-level BPE tokenizer trained offline.

No weights: vLLM serves it with `--load-format dummy` (random values, the same in every server
started with the same seed). vLLM 0.26 has no DeepSeek-V4.1; V3 is the closest architecture
it has, and its FP8 MoE layer is the one `--moe-backend flashinfer_cutlass` runs.

Routing is plain top-6 of a softmax (`topk_method: greedy`, one expert group): with dummy
weights, V3's sigmoid + `e_score_correction_bias` routing would send every token to the same
experts, because the random bias (+-1e-3) dwarfs the router's token-dependent logits.

    python benchmarks/serve_h200/make_model.py .stage/model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# V4.1-Flash's routed-expert shapes (../shared/DESIGN.md): what the MoE GEMMs see.
HIDDEN = 5120
MOE_INTERMEDIATE = 2304
EXPERTS = 384
TOP_K = 6
# 1 dense layer + 4 MoE layers: 4 x 13.6 GB of FP8 experts, so two servers at
# gpu-memory-utilization 0.46 each hold the model side by side on one 141 GB H200.
LAYERS = 5
VOCAB = 1024
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def config(layers: int = LAYERS, hidden: int = HIDDEN, moe_intermediate: int = MOE_INTERMEDIATE,
           experts: int = EXPERTS, top_k: int = TOP_K) -> dict:  # fmt: skip
    """The HF config.json; attention is DeepSeek-V3's MLA at a small head count so that the
    routed experts dominate each step's weight reads."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 12288,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": top_k,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "attention_bias": False,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
    }


def expert_bytes(cfg: dict) -> int:
    """FP8 bytes of the routed experts (gate, up, down) over all MoE layers."""
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    return moe_layers * cfg["n_routed_experts"] * per_expert


def write_tokenizer(out: Path) -> None:
    """A 1,000-token byte-level BPE: any text encodes, and GuideLLM can count prompt tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "Serving mixture-of-experts models on Hopper GPUs with FP8 block scales. " * 20,
        "The scheduler gives each expert's rows to the kernel that suits them. " * 20,
        "Inference engineers compare throughput and latency at every concurrency tier. " * 20,
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": 4096}))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=LAYERS, help="1 dense + (layers-1) MoE")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = config(a.layers)
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (a.out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1})
    )
    write_tokenizer(a.out)
    print(f"{a.out}: {cfg['num_hidden_layers']} layers, routed experts "
          f"{expert_bytes(cfg) / 1e9:.1f} GB FP8")  # fmt: skip


if __name__ == "__main__":
    main()
