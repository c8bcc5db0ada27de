"""Can vLLM 0.26 run a DeepSeek-V4 model on this GPU, and which parameters does it build?

A first look for the user journey (issue 4/4) before any checkpoint is written: a small V4
config (V4.1-Flash's expert shapes, few experts and layers, one hash-routed layer, one layer of
each compression ratio) served from dummy weights, once with MXFP4 experts (`expert_dtype
fp4`, the release) and once with FP8 block experts (`fp8`, our conversion). Each run records
the parameters vLLM built (name, shape, dtype: what a checkpoint must fill), the MoE backend
and attention kernels it chose (its log), and a few greedy tokens, or the error that stopped it.

    python benchmarks/journey_h200/v4_probe.py --write-configs   # here, after synth changes
    python benchmarks/journey_h200/v4_probe.py OUT --expert-dtype fp4 [--moe-backend auto]
    python benchmarks/journey_h200/v4_probe.py OUT --expert-dtype fp8 --model CONVERTED_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# The probe's model: V4.1-Flash's expert shapes with few experts and layers, V4's attention.
SHAPE = dict(hidden=5120, moe_inter=2304, shared_inter=2304, experts=16, top_k=6, layers=4,
             vocab=1024, q_lora=1024, head_dim=512, heads=64, o_groups=8, o_lora=1024,
             index_heads=64, index_head_dim=128, mtp_layers=0)  # fmt: skip
CONFIGS = Path(__file__).with_name("probe_configs")


def configs() -> dict[str, dict]:
    """config.json of the release (`fp4`) as `vllm-h20 synth --layout v4` writes it, and of
    the conversion (`fp8`) as `vllm-h20 convert` rewrites it; committed under probe_configs/
    (the GPU machine runs the probe without our converter's dependencies)."""
    from vllm_h20.convert import rules
    from vllm_h20.convert.config import rewrite_config
    from vllm_h20.convert.synth import _config, scaled

    release = _config(scaled("tiny", **SHAPE), "v4")
    return {"fp4": release, "fp8": rewrite_config(release, rules.load(None).config)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--expert-dtype", choices=("fp4", "fp8"), required=True)
    ap.add_argument("--moe-backend", default="auto")
    ap.add_argument("--model", type=Path, default=None,
                    help="a checkpoint to load instead of dummy weights (vLLM 0.26 cannot "
                    "run V4 from dummy weights: its mHC broadcast weights stay unset)")  # fmt: skip
    a = ap.parse_args(argv)
    tag = f"{a.expert_dtype}-{a.moe_backend}" + ("-ckpt" if a.model else "")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.model:
        model, load_format = a.model, "auto"
    else:
        model, load_format = a.out / f"model-{a.expert_dtype}", "dummy"
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text((CONFIGS / f"v4-{a.expert_dtype}.json").read_text())
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve_h200"))
        from make_model import write_tokenizer

        write_tokenizer(model)
    result: dict = {"expert_dtype": a.expert_dtype, "moe_backend": a.moe_backend}
    t0 = time.time()
    try:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(model), load_format=load_format, enforce_eager=True,
                  max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.2,
                  kv_cache_memory_bytes=1 << 30, kv_cache_dtype="fp8",
                  moe_backend=a.moe_backend)  # fmt: skip
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
    if sys.argv[1:] == ["--write-configs"]:
        CONFIGS.mkdir(exist_ok=True)
        for k, v in configs().items():
            (CONFIGS / f"v4-{k}.json").write_text(json.dumps(v, indent=1) + "\n")
        sys.exit(0)
    sys.exit(main())
