from vllm_h20.convert import rules
from vllm_h20.convert.config import rewrite_config

SPEC = rules.load(None).config
TARGET = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "expert_dtype": "fp8",
}


def test_v41_nested_config_loses_every_stale_fp4_field():
    src = {
        "model_type": "deepseek_v41",
        "text_config": {"hidden_size": 8, "expert_dtype": "fp4"},
        "quantization_config": {
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [32, 32],
            "expert_dtype": "fp4",
            "ignored_layers": ["vision"],
        },
    }
    out = rewrite_config(src, SPEC)
    assert out["quantization_config"] == {**TARGET, "ignored_layers": ["vision"]}
    assert out["text_config"]["expert_dtype"] == "fp8"
    assert src["quantization_config"]["expert_dtype"] == "fp4"  # input not modified


def test_v4_flat_config_and_config_without_quantization():
    out = rewrite_config({"model_type": "deepseek_v4", "expert_dtype": "fp4"}, SPEC)
    assert out["expert_dtype"] == "fp8" and out["quantization_config"] == TARGET
    nested = rewrite_config({"model_type": "deepseek_v41", "text_config": {}}, SPEC)
    assert nested["quantization_config"] == TARGET
