import pytest

from vllm_h20.convert import rules
from vllm_h20.convert.synth import PRESETS, inventory


def test_shipped_rules_cover_every_tensor_of_both_layouts():
    rs = rules.load(None)
    assert rs.name == "deepseek_v41_flash"
    for layout in ("v41", "v4"):
        names = {n: dt for n, dt, _, _ in inventory(PRESETS["tiny"], layout)}
        for n, dt in names.items():
            r = rs.first_match(n, dt)
            if r is None:  # only scales are matched through their weight
                assert n.endswith(".scale") and n[: -len(".scale")] + ".weight" in names, n


@pytest.mark.parametrize(
    "name,dtype,rule",
    [
        ("layers.3.ffn.experts.17.w2.weight", "I8", "routed_experts"),
        ("mtp.0.ffn.experts.5.w1.weight", "I8", "routed_experts"),
        ("layers.1.engram.embed.weight", "F8_E4M3", "engram_tables"),
        ("vision.blocks.0.attn.qkv.weight", "F8_E4M3", "vision_tower"),
        ("layers.0.attn.wq_a.weight", "F8_E4M3", "other_linears"),
        ("layers.0.ffn.shared_experts.w2.weight", "F8_E4M3", "other_linears"),
        ("layers.0.attn.compressor.wkv.weight", "BF16", "unquantized"),
        ("layers.0.ffn.gate.bias", "F32", "unquantized"),
        ("hc_head_fn", "F32", "unquantized"),
        ("embed.weight", "BF16", "unquantized"),
    ],
)
def test_rule_choice(name, dtype, rule):
    assert rules.load(None).first_match(name, dtype).name == rule


def test_unknown_tensor_matches_nothing():
    rs = rules.load(None)
    assert rs.first_match("layers.0.attn.mystery", "F8_E4M3") is None
    assert rs.first_match("layers.0.ffn.experts.0.w1.weight", "F8_E4M3").name == "other_linears"


@pytest.mark.parametrize(
    "text,msg",
    [
        ("name: x\nconfig: {model_types: [a], quantization_config: {}}\nrules: []\n", "non-empty"),
        (
            "name: x\nconfig: {model_types: [a], quantization_config: {}}\nrulez: []\n",
            "unknown key",
        ),
        (
            "name: x\nconfig: {model_types: [a], quantization_config: {}}\n"
            "rules: [{name: r, op: explode, match: a}]\n",
            "not one of",
        ),
        (
            "name: x\nconfig: {model_types: [a], quantization_config: {}}\n"
            "rules: [{name: r, op: fp8_reblock, match: a}]\n",
            "needs a `scale`",
        ),
        (
            "name: x\nconfig: {model_types: [a], quantization_config: {}}\n"
            "rules: [{name: r, op: keep, match: '('}]\n",
            "bad regex",
        ),
        ("name: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_rules_files(tmp_path, text, msg):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(rules.RulesError, match=msg) as e:
        rules.load(p)
    assert str(p) in str(e.value)
