"""Rewrite config.json for the FP8-128 checkpoint.

vLLM's DeepseekV41Config copies ``text_config`` onto the top level and prefers an existing
``expert_dtype`` attribute over the quantization_config's, so a stale ``expert_dtype:
fp4`` anywhere would route FP8 experts to the MXFP4 kernel. Every copy is rewritten.
"""

from __future__ import annotations

import copy
import json

from .rules import ConfigRewrite


def rewrite_config(config: dict, spec: ConfigRewrite) -> dict:
    out = copy.deepcopy(config)

    def fix(d: dict) -> None:
        if "quantization_config" in d:
            old = d["quantization_config"] or {}
            new = dict(spec.quantization_config)
            for key in spec.carry_over:
                if key in old:
                    new[key] = old[key]
            d["quantization_config"] = new
        if spec.expert_dtype is not None and "expert_dtype" in d:
            d["expert_dtype"] = spec.expert_dtype

    fix(out)
    if "quantization_config" not in out and not isinstance(out.get("text_config"), dict):
        out["quantization_config"] = dict(spec.quantization_config)
    if isinstance(out.get("text_config"), dict):
        fix(out["text_config"])
        if "quantization_config" not in out and "quantization_config" not in out["text_config"]:
            out["quantization_config"] = dict(spec.quantization_config)
    return out


def dumps(config: dict) -> bytes:
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
