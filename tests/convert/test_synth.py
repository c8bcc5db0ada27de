import json

import pytest

from vllm_h20.convert.safetensors_io import read_header
from vllm_h20.convert.synth import PRESETS, generate, inventory, scaled, tensor_nbytes

SEED_RELEASE_GIB = 475.24  # the seed write-up's MXFP4 V4.1-Flash release, bytes in


def test_full_flash_inventory_counts_match_the_release():
    inv = inventory(PRESETS["flash"])
    experts = [n for n, *_ in inv if ".ffn.experts." in n and n.endswith(".weight")]
    assert len(experts) == 40 * 384 * 3 + 3 * 128 * 3 == 47_232  # the seed's count
    w = next(x for x in inv if x[0] == "layers.0.ffn.experts.0.w1.weight")
    assert w[1:3] == ("I8", (2304, 2560))
    s = next(x for x in inv if x[0] == "layers.0.ffn.experts.0.w2.scale")
    assert s[1:3] == ("F8_E8M0", (5120, 72))


def test_flash_engram_rows_make_the_release_the_seeds_size():
    """The Engram tables' rows are the one size not published: the flash preset's value is the
    one that makes the whole release the seed's 475.24 GiB (to within one row of each table)."""
    shape = PRESETS["flash"]
    total = sum(tensor_nbytes(d, sh) for _n, d, sh, _k in inventory(shape))
    per_row = tensor_nbytes("F8_E4M3", (1, shape.engram_dim)) + tensor_nbytes(
        "F8_E8M0", (1, shape.engram_dim // 32)
    )
    slack = len(shape.engram_layers) * per_row
    assert abs(total - SEED_RELEASE_GIB * (1 << 30)) <= slack


def test_sparse_full_size_headers(tmp_path):
    info = generate(tmp_path / "f", scaled("tiny", experts=8), shards=2, sparse=True)
    for p in (tmp_path / "f").glob("*.safetensors"):
        h = read_header(p)  # exact size, valid header, no data written
        assert h.file_size == p.stat().st_size
    idx = json.loads((tmp_path / "f" / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == info["bytes"]


def test_bad_layout_and_preset():
    with pytest.raises(ValueError, match="layout"):
        generate("/nonexistent", PRESETS["tiny"], layout="v5")
    with pytest.raises(ValueError, match="preset"):
        scaled("huge")


@pytest.mark.parametrize("layout", ["v41", "v4"])
def test_quantized_weights_have_trained_magnitudes(tmp_path, layout):
    """Dequantized, a generated linear has std ~1/sqrt(fan-in) (spread 0: within the rounding
    of the scale to a power of two), so a served synthetic model routes by token and has
    real logits."""
    import numpy as np

    from vllm_h20.convert.codecs import e2m1_decode, e4m3_decode, e8m0_exponent, unpack_e2m1
    from vllm_h20.convert.safetensors_io import ShardReader

    generate(tmp_path / "m", PRESETS["tiny"], layout=layout, shards=1, spread=0)
    r = ShardReader(read_header(next((tmp_path / "m").glob("*.safetensors"))))
    h = PRESETS["tiny"].hidden
    w = e2m1_decode(unpack_e2m1(r.array("layers.0.ffn.experts.0.w1.weight").view(np.uint8)))
    e = e8m0_exponent(r.array("layers.0.ffn.experts.0.w1.scale").view(np.uint8))
    deq = w * np.repeat(np.ldexp(1.0, e), 32, axis=1)
    assert 2**-0.6 < deq.std() * np.sqrt(h) < 2**0.6
    block = 32 if layout == "v41" else 128
    q = e4m3_decode(r.array("layers.0.attn.wq_a.weight").view(np.uint8))
    s = np.ldexp(1.0, e8m0_exponent(r.array("layers.0.attn.wq_a.scale").view(np.uint8)))
    deq = q * np.kron(s, np.ones((block, block)))[: q.shape[0], : q.shape[1]]
    assert 2**-0.6 < deq.std() * np.sqrt(h) < 2**0.6


def test_v4_config_ropes_with_yarn_as_vllm_026_needs(tmp_path):
    """vLLM 0.26's DeepSeek-V4 builds its float32 cos/sin cache only on the DeepSeek-YaRN
    path (`rope_type` other than "default"); a "default" rope fails its first forward on the
    H200 (`assert cos_sin_cache.dtype == torch.float32`, fused_inv_rope_fp8_quant)."""
    generate(tmp_path / "v4", scaled("tiny", experts=8), layout="v4", shards=1, sparse=True)
    cfg = json.loads((tmp_path / "v4" / "config.json").read_text())
    rope = cfg["rope_scaling"]
    assert rope["rope_type"] == rope["type"] == "yarn"
    # What vLLM's DeepSeek-YaRN rope reads; the cache spans factor x original positions.
    positions = rope["factor"] * rope["original_max_position_embeddings"]
    assert positions == cfg["max_position_embeddings"]
    assert {"beta_fast", "beta_slow"} <= rope.keys()
