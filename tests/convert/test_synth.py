import json

import pytest

from vllm_h20.convert.safetensors_io import read_header
from vllm_h20.convert.synth import PRESETS, generate, inventory, scaled


def test_full_flash_inventory_counts_match_the_release():
    inv = inventory(PRESETS["flash"])
    experts = [n for n, *_ in inv if ".ffn.experts." in n and n.endswith(".weight")]
    assert len(experts) == 40 * 384 * 3 + 3 * 128 * 3 == 47_232  # the seed's count
    w = next(x for x in inv if x[0] == "layers.0.ffn.experts.0.w1.weight")
    assert w[1:3] == ("I8", (2304, 2560))
    s = next(x for x in inv if x[0] == "layers.0.ffn.experts.0.w2.scale")
    assert s[1:3] == ("F8_E8M0", (5120, 72))


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
