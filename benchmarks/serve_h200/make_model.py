"""Write the test model's directory: a DeepSeek-V3-architecture config with FP8 128x128 block
quantization and V4.1-Flash's MoE shapes, plus a byte-level BPE tokenizer trained offline.

vLLM 0.26 has no DeepSeek-V4.1; V3 is the closest architecture it has, and its FP8 MoE layer
is the one `--moe-backend flashinfer_cutlass` runs. Routing is plain top-6 of a softmax
(`topk_method: greedy`, one expert group).

Two ways to get weights:
- none written: vLLM's `--load-format dummy` fills every weight uniformly in +-1e-3. Round 1
  showed what that does to routing: every token chose the same 6 experts
  (benchmarks/results/serve_h200/README.md);
- `--weights` (round 2): a safetensors checkpoint with real magnitudes (FP8 E4M3 weights of
  unit variance with 128x128 block scales 1/sqrt(fan_in), a normal router, unit norms), one
  shard per layer, generated on `--device` (~41 GB for 3 MoE layers; its time on a GPU is not
  measured yet). Routing then depends on the token.

The router (`--router`): `trained` (default from round 5) is DeepSeek-V3's auxiliary-loss-free
gate as Kimi-K2 runs it with 384 experts (`noaux_tc`: sigmoid scores, top-6 of score + a
per-expert `e_score_correction_bias`, one group), the bias fitted so that each layer's expert
loads follow the only per-expert load table DeepSeek has published (the EPLB example,
`vllm_h20.convert.router`: hottest expert ~2.1x the mean, coefficient of variation ~0.6);
`random`: rounds 2-4's softmax top-6 of a random gate (nearly uniform loads).

    python benchmarks/serve_h200/make_model.py .stage/model
    python benchmarks/serve_h200/make_model.py $SH/stage/model --weights --layers 4 --device cuda
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from vllm_h20.convert.router import fit_router_bias, target_loads

# V4.1-Flash's routed-expert shapes (the `flash` preset of vllm_h20/convert/synth.py): what
# the MoE GEMMs see.
HIDDEN = 5120
MOE_INTERMEDIATE = 2304
EXPERTS = 384
TOP_K = 6
# 1 dense layer + 4 MoE layers: 4 x 13.6 GB of FP8 experts (~52 GiB per server with the
# rest), so two servers hold the model side by side on one 141 GB H200.
LAYERS = 5
VOCAB = 1024
ROUTERS = ("trained", "random")
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def config(layers: int = LAYERS, hidden: int = HIDDEN, moe_intermediate: int = MOE_INTERMEDIATE,
           experts: int = EXPERTS, top_k: int = TOP_K,
           router: str = "trained") -> dict:  # fmt: skip
    """The HF config.json; attention is DeepSeek-V3's MLA at a small head count so that the
    routed experts dominate each step's weight reads."""
    trained = router == "trained"
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
        "topk_method": "noaux_tc" if trained else "greedy",
        "scoring_func": "sigmoid" if trained else "softmax",
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


BLOCK = 128


def layer_tensors(cfg: dict, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of layer i in the Hugging Face DeepSeek-V3 naming vLLM loads; kind
    is "fp8" (a block-quantized linear: weight + weight_scale_inv), "router" or "norm"."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    p = f"model.layers.{i}."
    t = [
        (p + "input_layernorm", (h,), "norm"),
        (p + "post_attention_layernorm", (h,), "norm"),
        (p + "self_attn.q_a_proj", (cfg["q_lora_rank"], h), "fp8"),
        (p + "self_attn.q_a_layernorm", (cfg["q_lora_rank"],), "norm"),
        (p + "self_attn.q_b_proj", (heads * qk, cfg["q_lora_rank"]), "fp8"),
        (
            p + "self_attn.kv_a_proj_with_mqa",
            (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
            "fp8",
        ),  # fmt: skip
        (p + "self_attn.kv_a_layernorm", (cfg["kv_lora_rank"],), "norm"),
        (
            p + "self_attn.kv_b_proj",
            (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
            "fp8",
        ),  # fmt: skip
        (p + "self_attn.o_proj", (h, heads * cfg["v_head_dim"]), "fp8"),
    ]

    def mlp(prefix: str, inter: int) -> list:
        return [(prefix + "gate_proj", (inter, h), "fp8"), (prefix + "up_proj", (inter, h), "fp8"),
                (prefix + "down_proj", (h, inter), "fp8")]  # fmt: skip

    if i < cfg["first_k_dense_replace"]:
        return t + mlp(p + "mlp.", cfg["intermediate_size"])
    t.append((p + "mlp.gate", (cfg["n_routed_experts"], h), "router"))
    if cfg["topk_method"] == "noaux_tc":
        t.append((p + "mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],), "bias"))
    t += mlp(p + "mlp.shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    for e in range(cfg["n_routed_experts"]):
        t += mlp(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"])
    return t


def shard_tensors(cfg: dict, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Shard i's tensors: layer i's, and in the last shard the embeddings, head and final norm."""
    if i < cfg["num_hidden_layers"] - 1:
        return layer_tensors(cfg, i)
    vocab, h = cfg["vocab_size"], cfg["hidden_size"]
    return layer_tensors(cfg, i) + [("model.embed_tokens", (vocab, h), "embed"),
                                    ("lm_head", (vocab, h), "router"),
                                    ("model.norm", (h,), "norm")]  # fmt: skip


def checkpoint_bytes(cfg: dict) -> int:
    """Tensor bytes of the checkpoint write_weights writes (safetensors headers aside): what the
    disk must hold, checked before the first shard (the GPU machine's disk is 64 GiB)."""
    total = 0
    for i in range(cfg["num_hidden_layers"]):
        for _, shape, kind in shard_tensors(cfg, i):
            n = int(np.prod(shape))
            if kind == "fp8":
                total += n + 4 * (-(-shape[0] // BLOCK)) * (-(-shape[1] // BLOCK))
            else:
                total += n * (4 if kind == "bias" else 2)
    return total


def check_room(out: Path, cfg: dict) -> None:
    """Refuse, in one line and before writing anything, a checkpoint the disk cannot hold (shards
    already in `out` are replaced one at a time, so all but one of them count as room)."""
    import shutil

    need = checkpoint_bytes(cfg)
    old = sorted((f.stat().st_size for f in out.glob("model-*.safetensors")), reverse=True)
    room = shutil.disk_usage(out).free + sum(old[1:])
    if need > room:
        per_layer = expert_bytes(cfg) / max(
            1, cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
        )
        raise SystemExit(
            f"make_model: {out}: the checkpoint needs {need / 1e9:.1f} GB and the disk has "
            f"{room / 1e9:.1f} GB free: pass fewer --layers (each MoE layer {per_layer / 1e9:.1f} "
            f"GB) or another folder (e.g. /dev/shm)"
        )


def _materialize(name: str, shape: tuple[int, ...], kind: str, gen, device: str,
                 cfg: dict | None = None, layer: int = 0) -> dict:  # fmt: skip
    import torch

    if kind == "bias":  # the fitted gate bias, float32 as vLLM declares it
        bias = fit_router_bias(target_loads(shape[0], seed=layer), cfg["num_experts_per_tok"],
                               seed=layer)  # fmt: skip
        return {name: torch.from_numpy(bias.astype(np.float32))}
    if kind == "norm":
        return {name + ".weight": torch.ones(shape, dtype=torch.bfloat16)}
    if kind in ("router", "embed"):
        # Unit-variance embeddings (the first norm rescales them); 1/sqrt(fan-in) otherwise.
        std = 1.0 if kind == "embed" else shape[-1] ** -0.5
        w = torch.randn(shape, generator=gen, device=device) * std
        return {name + ".weight": w.to(torch.bfloat16).cpu()}
    out_f, in_f = shape
    q = torch.randn(shape, generator=gen, device=device).to(torch.float8_e4m3fn)
    blocks = (-(-out_f // BLOCK), -(-in_f // BLOCK))
    scale = torch.full(blocks, in_f**-0.5, dtype=torch.float32)
    return {name + ".weight": q.cpu(), name + ".weight_scale_inv": scale}


def write_weights(out: Path, cfg: dict, device: str = "cpu", seed: int = 0) -> int:
    """One safetensors shard per layer (+ embeddings and head in the last) and the index;
    returns the bytes written. Each shard is written to a temporary name, then renamed."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    n = cfg["num_hidden_layers"]
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n):
        shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict = {}
        for name, shape, kind in shard_tensors(cfg, i):
            tensors.update(_materialize(name, shape, kind, gen, device, cfg, i))
        tmp = out / (shard + ".partial")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.rename(out / shard)
        total += (out / shard).stat().st_size
        weight_map.update(dict.fromkeys(tensors, shard))
        print(f"{shard}: {len(tensors)} tensors, {(out / shard).stat().st_size / 1e9:.2f} GB",
              flush=True)  # fmt: skip
    # Written last and atomically: `h200.sh weights` takes an index as a finished checkpoint.
    from vllm_h20._io import write_json_atomic
    from vllm_h20.convert.plan import INDEX

    write_json_atomic(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=LAYERS, help="1 dense + (layers-1) MoE")
    ap.add_argument("--weights", action="store_true", help="write a random checkpoint too")
    ap.add_argument("--device", default="cpu", help="where to generate the weights (cuda)")
    ap.add_argument("--small", action="store_true", help="tiny shapes, for tests")
    ap.add_argument(
        "--router",
        choices=ROUTERS,
        default="trained",
        help="trained: expert loads shaped like DeepSeek's published example "
        "(noaux_tc gate, fitted bias); random: nearly uniform (rounds 2-4)",
    )
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    small = (256, 128, 8, 2) if a.small else ()
    cfg = config(a.layers, *small, router=a.router)
    if a.small:
        cfg.update(intermediate_size=512, q_lora_rank=128, num_attention_heads=2,
                   num_key_value_heads=2)  # fmt: skip
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (a.out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1})
    )
    write_tokenizer(a.out)
    if a.weights:
        check_room(a.out, cfg)
        write_weights(a.out, cfg, a.device)
    print(f"{a.out}: {cfg['num_hidden_layers']} layers, routed experts "
          f"{expert_bytes(cfg) / 1e9:.1f} GB FP8")  # fmt: skip


if __name__ == "__main__":
    main()
