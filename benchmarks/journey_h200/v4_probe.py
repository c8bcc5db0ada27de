"""Can vLLM 0.26 run a DeepSeek-V4 model on this GPU, and which parameters does it build?

A first look for the user journey (issue 4/4) before any checkpoint is written: a small V4
config (V4.1-Flash's expert shapes, few experts and layers, one hash-routed layer, one layer of
each compression ratio) served from dummy weights, once with MXFP4 experts (`expert_dtype
fp4`, the release) and once with FP8 block experts (`fp8`, our conversion). Each run records
the parameters vLLM built (name, shape, dtype: what a checkpoint must fill), the MoE backend
and attention kernels it chose (its log), and a few greedy tokens, or the error that stopped it.

    python benchmarks/journey_h200/v4_probe.py OUT --expert-dtype fp4 [--moe-backend auto]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def config(expert_dtype: str, layers: int = 4, experts: int = 16) -> dict:
    """DeepSeek-V4's config keys as vLLM 0.26's model reads them (it has no defaults)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": 1024,
        "hidden_size": 5120,
        "moe_intermediate_size": 2304,
        "num_hidden_layers": layers,
        "num_hash_layers": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"rope_type": "default", "rope_theta": 10000.0},
        # 0: sliding window only; 4: compressed + sparse (indexer); 128: compressed.
        "compress_ratios": ([0, 4, 128] * layers)[:layers],
        "sliding_window": 128,
        "hc_eps": 1e-6,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 512,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "expert_dtype": expert_dtype,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            **({"scale_fmt": "ue8m0"} if expert_dtype == "fp4" else {}),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--expert-dtype", choices=("fp4", "fp8"), required=True)
    ap.add_argument("--moe-backend", default="auto")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    a = ap.parse_args(argv)
    tag = f"{a.expert_dtype}-{a.moe_backend}"
    model = a.out / f"model-{a.expert_dtype}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(
        json.dumps(config(a.expert_dtype, a.layers, a.experts), indent=1)
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve_h200"))
    from make_model import write_tokenizer

    write_tokenizer(model)
    result: dict = {"expert_dtype": a.expert_dtype, "moe_backend": a.moe_backend}
    t0 = time.time()
    try:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(model), load_format="dummy", enforce_eager=True,
                  max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.2,
                  kv_cache_memory_bytes=1 << 30, moe_backend=a.moe_backend)  # fmt: skip
        result["init_s"] = round(time.time() - t0, 1)

        def params(m):
            return [(n, list(p.shape), str(p.dtype)) for n, p in m.named_parameters()]

        result["parameters"] = llm.apply_model(params)[0]
        outs = llm.generate(["Serving mixture-of-experts models"] * 2,
                            SamplingParams(temperature=0, max_tokens=16))  # fmt: skip
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["ok"] = True
    except Exception as e:  # the error is the finding
        import traceback

        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
    result["wall_s"] = round(time.time() - t0, 1)
    (a.out / f"v4_{tag}.json").write_text(json.dumps(result, indent=1))
    print(f"v4 {tag}: ok={result['ok']} {result.get('error', '')[:300]}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
