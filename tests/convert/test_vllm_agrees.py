"""The installed vLLM's own code accepts the converted checkpoint (CPU only, no model build).

Uses vLLM's DeepSeek-V4.1 weight-name mapper, its DSpark draft loader's scale rule, its
fused-MoE expert mapping and its FP8 quant-config parsing. CI installs vLLM to run this.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import TESTED_VLLM
from vllm_h20.convert import rules
from vllm_h20.convert.runner import Options, convert
from vllm_h20.convert.safetensors_io import read_header
from vllm_h20.convert.synth import PRESETS

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (0.34.0)")

EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.")


@pytest.fixture(scope="module")
def converted(tiny_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("vllm") / "fp8"
    convert(tiny_src, dst, rules.load(None), Options(workers=1, progress=False))
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {s: read_header(dst / s) for s in set(index.values())}
    tensors = {n: headers[s].tensors[n] for n, s in index.items()}
    return dst, tensors


def test_version_is_one_the_suite_covers():
    assert vllm.__version__ in TESTED_VLLM


def test_quantization_config_parses_as_block_fp8_with_fp8_experts(converted, tiny_src):
    from vllm.models.deepseek_v41.quant_config import DeepseekV4FP8Config
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    dst, _ = converted
    raw = json.loads((dst / "config.json").read_text())
    hf = DeepseekV41Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert hf.expert_dtype == "fp8"  # what the model and quant config key off
    q = raw["quantization_config"]
    assert DeepseekV4FP8Config.override_quantization_method(q, None, hf) == "deepseek_v4_fp8"
    cfg = DeepseekV4FP8Config.from_config(q)
    assert cfg.weight_block_size == [128, 128]
    assert cfg.is_checkpoint_fp8_serialized
    assert cfg.activation_scheme == "dynamic"
    cfg._resolved_expert_dtype = hf.expert_dtype  # what the lazy property resolves to
    assert cfg.is_scale_e8m0 is False  # float32 scales, read as values, not E8M0 bytes

    # the released config resolves to the MXFP4 path, so the test can tell them apart
    src_raw = json.loads((tiny_src / "config.json").read_text())
    src_hf = DeepseekV41Config(**{k: v for k, v in src_raw.items() if k != "model_type"})
    assert src_hf.expert_dtype == "fp4"


def test_every_main_model_tensor_maps_to_a_vllm_fp8_parameter(converted):
    import inspect

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
    from vllm.models.deepseek_v41.nvidia.model import _make_deepseek_v4_weights_mapper

    assert "weight_scale_inv" in inspect.getsource(Fp8LinearMethod.create_weights)
    _, tensors = converted
    shape = PRESETS["tiny"]
    mapper = _make_deepseek_v4_weights_mapper("fp8", "weight_scale_inv")
    experts = RoutedExperts.build_expert_params_mapping("w1", "w2", "w3", shape.experts)
    fp4_mapper = _make_deepseek_v4_weights_mapper("fp4", "weight_scale_inv")

    def map_name(m, name):
        out = m.apply_list([name])
        return out[0] if out else None

    checked = 0
    for name, t in tensors.items():
        mapped = map_name(mapper, name)
        if name.startswith(("mtp.", "vision.", "aligner.")):
            assert mapped is None  # owned by the DSpark draft / the vision tower
            continue
        assert mapped is not None, name
        if EXPERT.search(name):
            hits = [(p, w) for p, w, _, _ in experts if w in mapped]
            assert len(hits) == 1, (name, mapped)
            param = mapped.replace(hits[0][1], hits[0][0])
            suffix = "weight_scale_inv" if name.endswith(".scale") else "weight"
            assert param.endswith(("w13_" + suffix, "w2_" + suffix)), param
            if name.endswith(".scale"):
                assert map_name(fp4_mapper, name).endswith(".weight_scale")  # the MXFP4 name
            checked += 1
        if name.endswith(".scale") and "engram.embed" not in name:
            assert mapped.endswith(".weight_scale_inv"), mapped
            assert t.dtype == "F32"
    assert checked == 2 * 3 * shape.layers * shape.experts


def test_dspark_draft_expert_scales_load_as_float32_block_scales(converted):
    from vllm.models.deepseek_v41.nvidia import dspark

    _, tensors = converted
    n = 0
    for name, t in tensors.items():
        if name.startswith("mtp.") and dspark._EXPERT_SCALE_RE.search(name):
            # dspark.load_weights: expert_dtype fp8 -> ".weight_scale_inv", and only
            # E8M0 tensors are reinterpreted as raw bytes; ours are float32 values.
            assert t.dtype == "F32"
            w = tensors[name.removesuffix(".scale") + ".weight"]
            assert w.dtype == "F8_E4M3"
            assert list(t.shape) == [-(-w.shape[0] // 128), -(-w.shape[1] // 128)]
            n += 1
    assert n == 3 * PRESETS["tiny"].mtp_layers * PRESETS["tiny"].mtp_experts


def test_dspark_context_wkv_projection_loads_from_the_converted_draft(converted):
    """vLLM 0.34's DSpark draft has a cross-layer `context_wkv_proj` (one FP8 block-scale linear
    whose output is every draft layer's WKV) that its loader fills from `mtp.{i}.attn.wkv.*`:
    each converted pair is picked up under that name with its layer as the shard, the scale
    goes to the block-FP8 scale parameter (our block scales are float32 values), and the real
    V4.1 head dim fills whole 128-row blocks, so the stacked shards' scales line up."""
    from vllm.models.deepseek_v41.nvidia import dspark, model

    dup = getattr(dspark, "_duplicate_context_wkv_weights", None)
    if dup is None:
        pytest.skip(f"vLLM {vllm.__version__}'s DSpark draft has no context_wkv_proj (0.34 on)")
    import torch
    from safetensors.torch import load_file

    dst, tensors = converted
    shape = PRESETS["tiny"]
    wkv = sorted(n for n in tensors if re.fullmatch(r"mtp\.\d+\.attn\.wkv\.(weight|scale)", n))
    assert len(wkv) == 2 * shape.mtp_layers
    loaded = {}
    for shard in sorted(dst.glob("*.safetensors")):
        loaded |= {k: v for k, v in load_file(shard).items() if k in wkv}
    out = list(dup(((n, loaded[n]) for n in wkv), shape.mtp_layers))
    stacked = [(n, t) for n, t in out if n.startswith("context_wkv_proj.")]
    assert sorted(n for n, _ in stacked) == sorted(
        f"context_wkv_proj.{part}" for part in ("scale", "weight") for _ in range(shape.mtp_layers)
    )
    for name, t in stacked:
        layer = t.shard_id
        src = loaded[f"mtp.{layer}.attn.wkv.{name.split('.', 1)[1]}"]
        assert torch.equal(t.view(torch.uint8), src.view(torch.uint8))
        if name.endswith(".scale"):
            assert t.dtype == torch.float32
            w = loaded[f"mtp.{layer}.attn.wkv.weight"]
            assert w.dtype == torch.float8_e4m3fn
            assert list(t.shape) == [-(-w.shape[0] // 128), -(-w.shape[1] // 128)]

    # The loader's rename (`.scale` -> the linear method's parameter): block FP8 for our config.
    class _Cfg:
        quant_config = type("Q", (), {"weight_block_size": [128, 128]})()

    assert model._linear_scale_param_name(_Cfg(), "fp8") == "weight_scale_inv"
    assert PRESETS["flash"].head_dim % 128 == 0
