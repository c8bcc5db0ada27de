"""Synthetic DeepSeek-V4.1-Flash-layout checkpoints, at any scale.

Tensor names, dtypes, packing and scale layouts follow the release as vLLM 0.33's
``models/deepseek_v41`` reads it (DeepSeek-native names: ``layers.L.ffn.experts.E.w1``,
``attn.wq_a``, ``engram.embed``, ``mtp.K``, ``vision.*`` ...); sizes come from a
:class:`ModelShape` preset scaled down for tests and the benchmark. ``scale_spread`` sets
how far E8M0 exponents vary inside a block: up to 14 every MXFP4 value stays exact in
E4M3 after re-blocking, beyond that some blocks cannot be held exactly.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import ml_dtypes
import numpy as np

from .router import fit_router_bias, target_loads
from .safetensors_io import ShardWriter, tensor_nbytes


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 5120
    moe_inter: int = 2304
    shared_inter: int = 2304
    experts: int = 384
    top_k: int = 6
    layers: int = 40
    vocab: int = 129280
    q_lora: int = 1280
    head_dim: int = 512
    heads: int = 64
    o_groups: int = 8
    o_lora: int = 1024
    index_heads: int = 32
    index_head_dim: int = 128
    hc_mult: int = 4
    compress_ratio: int = 4
    engram_layers: tuple[int, ...] = (1, 14)
    engram_rows: int = 2_000_000
    engram_dim: int = 1024
    mtp_layers: int = 3
    mtp_experts: int = 128
    mtp_top_k: int = 3
    vision_layers: int = 2
    vision_dim: int = 1024
    # DeepSeek-V4 layout only: the first `hash_layers` layers route by token id (a table, no
    # router bias); attention keeps a sliding window and, per layer, a compression ratio.
    hash_layers: int = 1
    sliding_window: int = 128
    index_topk: int = 512


ROUTERS = ("trained", "random")


def v4_compress_ratios(s: ModelShape) -> list[int]:
    """Per-layer KV compression of the V4 layout: 0 (sliding window only) for layer 0, then 4
    (compressed, sparse through the indexer) and 128 (compressed) alternating, so that even a
    few layers hold every kind. A release states its own list in config.json."""
    return [0 if i == 0 else (4 if i % 2 else 128) for i in range(s.layers)]


PRESETS: dict[str, ModelShape] = {
    # Every kind of tensor, a few MiB: unit and end-to-end tests, the embedded demo.
    "tiny": ModelShape(
        hidden=256,
        moe_inter=128,
        shared_inter=128,
        experts=4,
        top_k=2,
        layers=2,
        vocab=512,
        q_lora=128,
        head_dim=64,
        heads=4,
        o_groups=2,
        o_lora=64,
        index_heads=2,
        index_head_dim=32,
        engram_layers=(1,),
        engram_rows=512,
        engram_dim=64,
        mtp_layers=1,
        mtp_experts=2,
        mtp_top_k=1,
        vision_layers=1,
        vision_dim=64,
    ),
    # Real V4.1-Flash matrix shapes, few layers/experts: ~2.3 GiB, the converter benchmark.
    "bench": ModelShape(
        layers=3,
        experts=36,
        engram_layers=(1,),
        engram_rows=65536,
        mtp_layers=1,
        mtp_experts=8,
        vocab=32768,
        vision_layers=1,
    ),
    # The published V4.1-Flash shapes (with --sparse: headers only, for the planner). The
    # Engram table geometry is not published: 2 tables x 95,981,714 rows x 1024 E4M3 values
    # (+ E8M0 scales) is what makes the release total the seed's 475.24 GiB, everything else
    # being sized from the published shapes (tests/convert/test_synth.py re-derives it).
    "flash": ModelShape(engram_rows=95_981_714),
    # The user journey on one H200 (--layout v4, benchmarks/journey_h200/): V4.1-Flash's MoE
    # shapes with V4's attention, 3 layers (hash-routed, ratio 4, ratio 128), a 1,024-token
    # vocabulary: 21.6 GB released, 41 GB converted, both served side by side.
    "v4-h200": ModelShape(
        layers=3,
        vocab=1024,
        q_lora=1024,
        head_dim=512,
        heads=64,
        o_groups=8,
        o_lora=1024,
        index_heads=64,
        index_head_dim=128,
        engram_layers=(),
        mtp_layers=0,
        vision_layers=0,
    ),
}


def _config(shape: ModelShape, layout: str) -> dict:
    text = {
        "hidden_size": shape.hidden,
        "moe_intermediate_size": shape.moe_inter,
        "n_routed_experts": shape.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers,
        "vocab_size": shape.vocab,
        "q_lora_rank": shape.q_lora,
        "head_dim": shape.head_dim,
        "num_attention_heads": shape.heads,
        "o_groups": shape.o_groups,
        "o_lora_rank": shape.o_lora,
        "index_n_heads": shape.index_heads,
        "index_head_dim": shape.index_head_dim,
        "qk_rope_head_dim": 64,
        "hc_mult": shape.hc_mult,
        "num_nextn_predict_layers": shape.mtp_layers,
        "engram_layer_ids": list(shape.engram_layers),
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }
    if layout == "v4":
        return _v4_config(shape, text)
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": {"model_type": "deepseek_v41_text", **text},
        "vision_config": {
            "hidden_size": shape.vision_dim,
            "num_hidden_layers": shape.vision_layers,
        },
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [32, 32],
            "expert_dtype": "fp4",
        },
    }


def _v4_config(shape: ModelShape, text: dict) -> dict:
    """config.json of the V4 layout: vLLM's DeepseekV4Config has no defaults, so every key its
    model reads is here."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **{k: v for k, v in text.items() if k != "engram_layer_ids"},
        "num_key_value_heads": 1,
        "num_hash_layers": shape.hash_layers,
        "compress_ratios": v4_compress_ratios(shape),
        "sliding_window": shape.sliding_window,
        "index_topk": shape.index_topk,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "max_position_embeddings": 65536,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        # YaRN, as V4 is released: vLLM 0.26's V4 kernels take their cos/sin cache in
        # float32, which only its DeepSeek-YaRN rope builds ("default" gives a BF16 cache
        # and fails `assert cos_sin_cache.dtype == torch.float32` on the first forward).
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "rope_theta": 10000.0,
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "expert_dtype": "fp4",
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }


# (name, dtype, shape, kind); kind picks the data generator.
Entry = tuple[str, str, tuple[int, ...], str]


def _fp8_linear(name: str, n: int, k: int, block: int) -> list[Entry]:
    return [
        (f"{name}.weight", "F8_E4M3", (n, k), "fp8"),
        (f"{name}.scale", "F8_E8M0", (-(-n // block), -(-k // block)), f"e8m0:fp8:{k}"),
    ]


def _mxfp4(name: str, n: int, k: int) -> list[Entry]:
    return [
        (f"{name}.weight", "I8", (n, k // 2), "fp4"),
        (f"{name}.scale", "F8_E8M0", (n, k // 32), f"e8m0:fp4:{k}"),
    ]


def _compressor(c: str, s: ModelShape, head_dim: int, ratio: int) -> list[Entry]:
    """V4: ratio-4 compressors overlap two windows, so their projections are twice as wide."""
    wide = (2 if ratio == 4 else 1) * head_dim
    return [
        (f"{c}.wkv.weight", "BF16", (wide, s.hidden), "bf16"),
        (f"{c}.wgate.weight", "BF16", (wide, s.hidden), "bf16"),
        (f"{c}.norm.weight", "BF16", (head_dim,), "norm"),
        (f"{c}.ape", "F32", (ratio, wide), "f32"),
    ]


def _block(
    prefix: str,
    s: ModelShape,
    experts: int,
    block: int,
    engram: bool,
    v4_layer: int | None = None,
) -> list[Entry]:
    """One decoder block; `v4_layer` (the layer's index, -1 for a draft block) selects the V4
    layout's per-layer compressor, indexer and routing table."""
    h, mix = s.hidden, (2 + s.hc_mult) * s.hc_mult
    e: list[Entry] = [
        (f"{prefix}.attn_norm.weight", "BF16", (h,), "norm"),
        (f"{prefix}.ffn_norm.weight", "BF16", (h,), "norm"),
    ]
    for part in ("attn", "ffn"):
        e += [
            (f"{prefix}.hc_{part}_fn", "F32", (mix, s.hc_mult * h), "f32"),
            (f"{prefix}.hc_{part}_base", "F32", (mix,), "f32"),
            (f"{prefix}.hc_{part}_scale", "F32", (3,), "f32"),
        ]
    a = f"{prefix}.attn"
    e += _fp8_linear(f"{a}.wq_a", s.q_lora, h, block)
    e += _fp8_linear(f"{a}.wkv", s.head_dim, h, block)
    e += [
        (f"{a}.q_norm.weight", "BF16", (s.q_lora,), "norm"),
        (f"{a}.kv_norm.weight", "BF16", (s.head_dim,), "norm"),
    ]
    e += _fp8_linear(f"{a}.wq_b", s.heads * s.head_dim, s.q_lora, block)
    e += _fp8_linear(f"{a}.wo_a", s.o_groups * s.o_lora, s.heads * s.head_dim // s.o_groups, block)
    e += _fp8_linear(f"{a}.wo_b", h, s.o_groups * s.o_lora, block)
    e += [(f"{a}.attn_sink", "F32", (s.heads,), "f32")]
    if v4_layer is None:
        for c in (f"{a}.compressor", f"{a}.indexer.compressor"):
            e += [
                (f"{c}.wkv.weight", "BF16", (s.head_dim, h), "bf16"),
                (f"{c}.wgate.weight", "BF16", (s.head_dim, h), "bf16"),
                (f"{c}.norm.weight", "BF16", (s.head_dim,), "norm"),
                (f"{c}.ape", "F32", (s.compress_ratio, s.head_dim), "f32"),
            ]
    ratio = v4_compress_ratios(s)[v4_layer] if v4_layer is not None and v4_layer >= 0 else 0
    if v4_layer is not None and ratio > 1:
        e += _compressor(f"{a}.compressor", s, s.head_dim, ratio)
    if v4_layer is None or ratio == 4:
        e += _fp8_linear(f"{a}.indexer.wq_b", s.index_heads * s.index_head_dim, s.q_lora, block)
        e += [(f"{a}.indexer.weights_proj.weight", "BF16", (s.index_heads, h), "bf16")]
    if v4_layer is not None and ratio == 4:
        e += _compressor(f"{a}.indexer.compressor", s, s.index_head_dim, ratio)
    if engram:
        g = f"{prefix}.engram"
        e += [
            (f"{g}.embed.weight", "F8_E4M3", (s.engram_rows, s.engram_dim), "fp8"),
            (f"{g}.embed.scale", "F8_E8M0", (s.engram_rows, s.engram_dim // 32), "e8m0:fp8:1"),
        ]
        e += _fp8_linear(f"{g}.wkv", h * (s.hc_mult + 1), s.engram_dim, block)
        e += [
            (f"{g}.q_weight", "BF16", (s.hc_mult, h), "bf16"),
            (f"{g}.k_weight", "BF16", (s.hc_mult, h), "bf16"),
            (f"{g}.norm.weight", "BF16", (h,), "norm"),
        ]
    f = f"{prefix}.ffn"
    e += [(f"{f}.gate.weight", "BF16", (experts, h), "bf16")]
    if v4_layer is not None and 0 <= v4_layer < s.hash_layers:
        e += [(f"{f}.gate.tid2eid", "I32", (s.vocab, s.top_k), f"tid2eid:{experts}")]
    else:
        # The fitted correction bias (`_Data.make`): trained-like loads, a seed per block.
        seed, top_k = zlib.crc32(prefix.encode()), s.top_k if experts == s.experts else s.mtp_top_k
        e += [(f"{f}.gate.bias", "F32", (experts,), f"router:{top_k}:{h}:{seed}")]
    e += _fp8_linear(f"{f}.shared_experts.w1", s.shared_inter, h, block)
    e += _fp8_linear(f"{f}.shared_experts.w2", h, s.shared_inter, block)
    e += _fp8_linear(f"{f}.shared_experts.w3", s.shared_inter, h, block)
    for x in range(experts):
        e += _mxfp4(f"{f}.experts.{x}.w1", s.moe_inter, h)
        e += _mxfp4(f"{f}.experts.{x}.w2", h, s.moe_inter)
        e += _mxfp4(f"{f}.experts.{x}.w3", s.moe_inter, h)
    return e


def inventory(s: ModelShape, layout: str = "v41") -> list[Entry]:
    """Every tensor of a checkpoint of this shape, in file order."""
    block = 32 if layout == "v41" else 128
    e: list[Entry] = [("embed.weight", "BF16", (s.vocab, s.hidden), "bf16")]
    v4 = layout == "v4"
    for layer in range(s.layers):
        # V4 has no Engram (V4.1 added it).
        engram = layer in s.engram_layers and not v4
        e += _block(f"layers.{layer}", s, s.experts, block, engram, layer if v4 else None)
    for k in range(s.mtp_layers):
        p = f"mtp.{k}"
        e += [
            (f"{p}.enorm.weight", "BF16", (s.hidden,), "norm"),
            (f"{p}.hnorm.weight", "BF16", (s.hidden,), "norm"),
            (f"{p}.e_proj.weight", "BF16", (s.hidden, s.hidden), "bf16"),
            (f"{p}.h_proj.weight", "BF16", (s.hidden, s.hidden), "bf16"),
        ]
        e += _block(p, s, s.mtp_experts, block, False, -1 if v4 else None)
    e += [
        ("norm.weight", "BF16", (s.hidden,), "norm"),
        ("head.weight", "BF16", (s.vocab, s.hidden), "bf16"),
        ("hc_head_fn", "F32", (s.hc_mult, s.hc_mult * s.hidden), "f32"),
        ("hc_head_base", "F32", (s.hc_mult,), "f32"),
        ("hc_head_scale", "F32", (1,), "f32"),
    ]
    if layout == "v41":
        v = s.vision_dim
        e += [("vision.patch_embed.weight", "BF16", (v, 3 * 14 * 14), "bf16")]
        for b in range(s.vision_layers):
            e += [
                (f"vision.blocks.{b}.attn.qkv.weight", "BF16", (3 * v, v), "bf16"),
                (f"vision.blocks.{b}.attn.proj.weight", "BF16", (v, v), "bf16"),
                (f"vision.blocks.{b}.norm1.weight", "BF16", (v,), "norm"),
            ]
        e += [("aligner.fc.weight", "BF16", (s.hidden, v * 9), "bf16")]
    return e


# RMS of the values the generator writes: uniform E2M1 codes (sqrt(68.5 / 8)), and the FP8
# generator's N(0, 64).
_CODE_RMS = {"fp4": 2.93, "fp8": 64.0}


class _Data:
    """Deterministic tensor contents; expert codes uniform, FP8 values Gaussian; router biases
    fitted to trained-like loads (`router="trained"`) or small noise (`"random"`)."""

    def __init__(self, seed: int, spread: int, router: str = "trained"):
        self.rng = np.random.default_rng(seed)
        self.spread = spread
        self.router = router

    def make(self, dtype: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        r, n = self.rng, int(np.prod(shape))
        if kind == "fp4":
            return r.integers(0, 256, n, dtype=np.uint8).view(np.int8).reshape(shape)
        if kind.startswith("tid2eid:"):  # each token's experts: distinct, like a hash
            experts = int(kind.split(":")[1])
            rows = np.argsort(r.random((shape[0], experts)), axis=1)[:, : shape[1]]
            return rows.astype(np.int32)
        if kind.startswith("router:"):
            if self.router == "random":
                return (0.02 * r.standard_normal(n)).astype(np.float32).reshape(shape)
            # The gate (bf16 rows of std 0.02, `bf16` below) on a unit-RMS normed hidden
            # state: logits of std 0.02 * sqrt(hidden); V4's sqrt-softplus scores.
            _, top_k, hidden, seed = kind.split(":")
            bias = fit_router_bias(
                target_loads(shape[0], seed=int(seed)),
                int(top_k),
                scoring="sqrtsoftplus",
                logit_std=0.02 * float(hidden) ** 0.5,
                seed=int(seed),
            )
            return bias.astype(np.float32).reshape(shape)
        if kind.startswith("e8m0:"):
            # Centred so the dequantized weight has std ~1/sqrt(fan-in), as trained weights
            # roughly do (a served model then has token-dependent routing and real logits);
            # `spread` exponents of variation around that centre.
            _, codes, fan_in = kind.split(":")
            target = np.log2(1.0 / (np.sqrt(int(fan_in)) * _CODE_RMS[codes]))
            top = int(np.clip(127 + round(target) + self.spread // 2, self.spread, 254))
            return (top - r.integers(0, self.spread + 1, n)).astype(np.uint8).reshape(shape)
        if kind == "fp8":
            v = np.clip(r.standard_normal(n, dtype=np.float32) * 64.0, -448, 448)
            return v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(shape)
        if kind == "norm":
            return (1.0 + 0.01 * r.standard_normal(n)).astype(ml_dtypes.bfloat16).reshape(shape)
        if kind == "bf16":
            return (
                (0.02 * r.standard_normal(n, dtype=np.float32))
                .astype(ml_dtypes.bfloat16)
                .reshape(shape)
            )
        return (0.02 * r.standard_normal(n)).astype(np.float32).reshape(shape)


def _split(entries: list[Entry], shards: int) -> Iterator[list[Entry]]:
    total = sum(tensor_nbytes(dt, sh) for _, dt, sh, _ in entries)
    per = total / shards
    cur: list[Entry] = []
    acc = 0
    done = 0
    for ent in entries:
        cur.append(ent)
        acc += tensor_nbytes(ent[1], ent[2])
        if acc >= per * (done + 1) and done < shards - 1:
            yield cur
            cur, done = [], done + 1
    yield cur


TOKENIZER = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {
        "type": "WordLevel",
        "vocab": {"<unk>": 0, "hello": 1, "world": 2},
        "unk_token": "<unk>",
    },
}


def generate_converted(dst: Path, shape: ModelShape, *, shards: int = 4) -> dict:
    """Headers-only (sparse) checkpoint in the layout `vllm-h20 convert` writes: the source
    inventory mapped through the shipped conversion rules by the converter's own planner, so
    the planner and `serve` can be exercised on a full-size FP8 checkpoint without 700 GiB."""
    import tempfile

    from . import rules as rules_mod
    from .config import dumps as config_dumps
    from .config import rewrite_config
    from .plan import CONFIG, INDEX, make_plan

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    rs = rules_mod.load(None)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        generate(Path(tmp) / "src", shape, shards=shards, sparse=True)
        plan = make_plan(Path(tmp) / "src", rs)
        weight_map, total = {}, 0
        for sp in plan.shards:
            w = ShardWriter(dst / sp.name, [(t.name, t.dtype, t.shape) for t in sp.tensors],
                            {"format": "pt"})  # fmt: skip
            w.truncate_sparse()
            for t in sp.tensors:
                weight_map[t.name] = sp.name
                total += t.nbytes
        for rel in plan.other_files:
            (dst / rel).write_bytes((plan.src / rel).read_bytes())
        (dst / CONFIG).write_bytes(config_dumps(rewrite_config(plan.config, rs.config)))
    (dst / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return {"dst": str(dst), "bytes": total, "tensors": len(weight_map), "sparse": True}


def generate(
    dst: Path,
    shape: ModelShape,
    *,
    layout: str = "v41",
    shards: int = 4,
    spread: int = 4,
    seed: int = 0,
    sparse: bool = False,
    router: str = "trained",
) -> dict:
    """Write a checkpoint to ``dst`` (created, must be empty or missing); return a summary.
    ``router``: trained (gate biases fitted to DeepSeek's published example loads) or random
    (near-uniform routing)."""
    if layout not in ("v41", "v4"):
        raise ValueError(f"layout must be v41 or v4, not {layout!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {router!r}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    entries = inventory(shape, layout)
    data = _Data(seed, spread, router)
    parts = [p for p in _split(entries, shards) if p]
    n = len(parts)
    weight_map, total = {}, 0
    for i, part in enumerate(parts, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        w = ShardWriter(dst / name, [(t, dt, sh) for t, dt, sh, _ in part], {"format": "pt"})
        if sparse:
            w.truncate_sparse()
        else:
            for t, dt, sh, kind in part:
                w.write(t, data.make(dt, sh, kind))
            w.close()
        for t, dt, sh, _ in part:
            weight_map[t] = name
            total += tensor_nbytes(dt, sh)
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (dst / "config.json").write_text(json.dumps(_config(shape, layout), indent=2))
    (dst / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (dst / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    (dst / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_p": 0.95}))
    return {
        "path": str(dst),
        "tensors": len(entries),
        "shards": n,
        "bytes": total,
        "shape": asdict(shape),
        "layout": layout,
        "spread": spread,
        "sparse": sparse,
        "router": router,
    }


def scaled(preset: str, **overrides) -> ModelShape:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
