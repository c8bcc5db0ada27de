"""Per-rank memory plan: will this recipe and checkpoint fit, and with how much KV cache?

Weights come from the checkpoint's safetensors headers (exact bytes, no data read), split the
way vLLM lays DeepSeek-V4.1 out: routed experts by expert parallelism (EPLB replicas included),
the tensor-parallel linears by TP, the rest replicated, Engram tables in pinned host memory.
Runtime overheads are parameters whose defaults are the seed's H20 startup figures.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..convert.plan import INDEX
from ..convert.safetensors_io import read_header
from ..moe.precompile import auto_redundant
from .recipe import GPUS_PER_NODE, Recipe, RecipeError

GIB = 1 << 30
MIB = 1 << 20
# Device memory as nvidia-smi reports it. h20-96g is the seed's figure; the others are the
# cards' usual reports (H20-3e 141 GB assumed equal to H200's 143,771 MiB; not measured here).
GPUS = {"h20-96g": 97_871 * MIB, "h20-141g": 143_771 * MIB, "h200": 143_771 * MIB,
        "h100": 81_559 * MIB}  # fmt: skip

_EXPERT = re.compile(r"^(?P<layer>.*)\.ffn\.experts\.(?P<e>\d+)\.")
# DeepSeek-V2/V3 (Hugging Face) routed experts: a layout the planner does not size.
_HF_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_ENGRAM_TABLE = re.compile(r"\.engram\.embed\.")
# Linears vLLM splits over tensor-parallel ranks (column- or row-parallel); the rest of the
# dense tensors (low-rank down projections, norms, router, compressors) are replicated.
_TP = re.compile(
    r"(\.attn\.(wq_b|wo_a|wo_b)\.|\.indexer\.wq_b\.|\.shared_experts\.w[123]\.|\.engram\.wkv\.|"
    r"^embed\.weight$|^head\.weight$)"
)


class NotPlannable(RecipeError):
    """A checkpoint whose layout the planner does not know; `serve` goes on without a plan."""


@dataclass(frozen=True)
class Overheads:
    """Runtime memory besides weights and KV cache, per GPU. Defaults: the seed's 8xH20 run
    (vLLM 0.30.0 startup profiler): weights 70.94 GiB, weights + non-torch 76.11 GiB,
    activation peak 10.65 GiB, CUDA-graph pool 2.60 GiB at capture size 768, 3.57 GiB of KV
    cache = 1,041,984 tokens (so 3,679 bytes per token per rank for V4.1-Flash, block 64)."""

    non_torch_gib: float = 76.11 - 70.94
    activation_peak_gib: float = 10.65
    cuda_graph_gib_at_768: float = 2.60
    kv_bytes_per_token: float = 3.57 * GIB / 1_041_984


@dataclass
class RankPlan:
    gpu: str
    gpu_bytes: int
    tp: int
    ep: int
    slots_per_rank: dict[str, int]
    dp: int = 1  # data-parallel replicas: each holds its own KV cache (its TP ranks share it)
    nodes: int = 1
    gpus_per_node: int = GPUS_PER_NODE
    host_shared: bool = False  # Engram tables in shared memory, one copy per node
    weights: dict[str, int] = field(default_factory=dict)  # group -> bytes on each GPU
    host_per_rank: int = 0
    host_per_node: int = 0
    overheads: dict[str, float] = field(default_factory=dict)
    budget: int = 0
    kv_bytes: int = 0
    kv_fixed: bool = False  # kv-cache-memory-bytes set: the budget is the whole GPU
    kv_tokens: int = 0
    max_model_len: int = 0
    fits: bool = False
    why: str = ""

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def kv_tokens_total(self) -> int:
        """KV tokens of the whole deployment: every data-parallel replica's own cache."""
        return self.kv_tokens * self.dp

    def concurrency(self, context: int) -> int:
        """Requests of `context` tokens held at once: a request lives in one replica."""
        return max(0, self.kv_tokens // max(1, context)) * self.dp

    def to_json(self) -> dict:
        d = asdict(self)
        d["weights_total"] = self.weights_total
        d["kv_tokens_total"] = self.kv_tokens_total
        return d


def gpu_bytes(spec: str) -> tuple[str, int]:
    if spec in GPUS:
        return spec, GPUS[spec]
    try:
        gib = float(spec)
    except ValueError:
        raise RecipeError(
            f"--gpu {spec}: use one of {', '.join(GPUS)} or a size in GiB (e.g. 95.5)"
        ) from None
    if gib <= 0:
        raise RecipeError(f"--gpu {spec}: a GPU size must be positive")
    return f"{gib:g} GiB", int(gib * GIB)


def _tensors(model: Path):
    """(name, bytes) of every tensor, from the headers named by the index (or all shards)."""
    index = model / INDEX
    if index.is_file():
        import json

        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in model.glob("*.safetensors"))
    if not shards:
        raise RecipeError(f"{model}: no safetensors shards (is this a model directory?)")
    for s in shards:
        h = read_header(model / s)
        for name, t in h.tensors.items():
            yield name, t.end - t.begin


def parallelism(parsed: dict) -> tuple[int, int, int, int | None]:
    """(TP, DP, EP, EPLB's redundant experts) as vLLM reads them from a recipe: experts are
    spread over TP x DP ranks when expert parallelism is on, replicas only with EPLB. None:
    EPLB on and the count left unset, which vLLM 0.34 fills with the fewest that spread the
    experts evenly (`moe.precompile.auto_redundant`); 0.33 read an unset count as 0."""
    tp = int(parsed.get("tensor_parallel_size") or 1)
    dp = int(parsed.get("data_parallel_size") or 1)
    ep = tp * dp if parsed.get("enable_expert_parallel") else 1
    if not parsed.get("enable_eplb"):
        return tp, dp, ep, 0
    n = parsed.get("num_redundant_experts")
    return tp, dp, ep, None if n is None else int(n)


def memory_utilization(parsed: dict) -> float:
    """The share of GPU memory vLLM sizes the KV cache from: the recipe's, else the installed
    vLLM's default (0.33: 0.9 from its parser; 0.34: unset means 1.0 with the extensible KV
    cache, its default on CUDA, else CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION)."""
    util = parsed.get("gpu_memory_utilization")
    if util is not None:
        return float(util)
    if parsed.get("enable_extensible_kv_cache") is not False:
        return 1.0
    return float(parsed.get("default_gpu_memory_utilization") or 0.92)


def nodes_for(tp: int, dp: int, gpus_per_node: int = GPUS_PER_NODE) -> int:
    """Nodes a TP x DP deployment fills; a tensor-parallel group never spans nodes here."""
    if tp > gpus_per_node or gpus_per_node % tp:
        raise RecipeError(
            f"tensor-parallel-size {tp} does not fit a node of {gpus_per_node} GPUs "
            f"(it must divide {gpus_per_node}; spread further with data-parallel-size)"
        )
    return max(1, math.ceil(tp * dp / gpus_per_node))


def plan(
    recipe: Recipe,
    parsed: dict,
    model: Path,
    gpu: str = "h20-96g",
    overheads: Overheads | None = None,
    gpus_per_node: int = GPUS_PER_NODE,
) -> RankPlan:
    """parsed: the values vLLM's parser read from the recipe (check.CheckResult.parsed)."""
    ov = overheads or Overheads()
    gpu_name, total = gpu_bytes(gpu)
    tp, dp, ep, redundant = parallelism(parsed)
    nodes = nodes_for(tp, dp, gpus_per_node)
    w, slots, engram_tables = _weights(recipe, parsed, model, tp, ep, redundant)
    host_shared, host_per_rank, host_per_node = _engram(parsed, engram_tables, w, tp, dp,
                                                        gpus_per_node)  # fmt: skip
    sizes = parsed.get("cudagraph_capture_sizes") or []
    capture = int(max(sizes) if sizes else parsed.get("max_cudagraph_capture_size") or 768)
    over = {
        "non-torch": ov.non_torch_gib * GIB,
        "activation peak": ov.activation_peak_gib * GIB,
        "CUDA graphs": ov.cuda_graph_gib_at_768 * GIB * capture / 768,
    }
    p = RankPlan(
        gpu=gpu_name,
        gpu_bytes=total,
        tp=tp,
        ep=ep,
        slots_per_rank=slots,
        dp=dp,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        host_shared=host_shared,
        weights={k: int(v) for k, v in sorted(w.items())},
        host_per_rank=host_per_rank,
        host_per_node=host_per_node,
        overheads={k: float(v) for k, v in over.items()},
        max_model_len=int(parsed.get("max_model_len") or 0),
    )
    _kv_cache(p, parsed, ov)
    return p


def _weights(recipe: Recipe, parsed: dict, model: Path, tp: int, ep: int, redundant: int):
    """(bytes per GPU by kind, expert slots per rank, Engram table sizes) from the headers:
    routed experts by EP (EPLB replicas on the main model's layers), TP-split linears, the rest
    replicated."""
    experts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    w: dict[str, float] = defaultdict(float)
    engram_tables: list[int] = []
    for name, nbytes in _tensors(model):
        if _HF_EXPERT.search(name):
            raise NotPlannable(
                f"{model}: DeepSeek-V2/V3 tensor names ({name}); the planner sizes the "
                "DeepSeek-V4.1 layout only"
            )
        m = _EXPERT.match(name)
        if m:
            experts[m["layer"]][m["e"]] += nbytes
        elif _ENGRAM_TABLE.search(name):
            engram_tables.append(nbytes)
        elif _TP.search(name):
            w["dense (TP-sharded)"] += nbytes / tp
        else:
            w["dense (replicated)"] += nbytes
    slots = {}
    for layer, per_expert in experts.items():
        draft = layer.startswith("mtp.")
        n = len(per_expert)
        if ep == 1:
            w["draft experts (TP)" if draft else "routed experts (TP)"] += (
                sum(per_expert.values()) / tp
            )
            continue
        # EPLB replicas apply to the main model's MoE layers, not the DSpark draft (mtp.*).
        r = 0 if draft else auto_redundant(n, ep) if redundant is None else redundant
        if parsed.get("enable_eplb") and not draft and (n + r) % ep:
            raise RecipeError(
                f"{recipe.where('eplb-config')}: {n} experts + {r} redundant = {n + r} "
                f"expert slots do not spread evenly over EP{ep} (vLLM's EPLB needs that); "
                f"choose eplb-config.num_redundant_experts so that {n} + it divides by {ep}"
            )
        k = math.ceil((n + r) / ep)
        slots["draft" if draft else "main"] = k
        w["draft experts (EP)" if draft else "routed experts (EP)"] += k * max(per_expert.values())
    return w, slots, engram_tables


def _engram(parsed: dict, tables: list[int], w: dict[str, float], tp: int, dp: int,
            gpus_per_node: int) -> tuple[bool, int, int]:  # fmt: skip
    """Where the Engram tables live: (shared on the host, pinned bytes per rank, per node); on
    the GPU (added to w) when not offloaded. They are sharded over the TP group (times DP with
    embedding_across_dp). Offloaded, each rank pins its shard (rounded up to a power of two
    unless backed by huge pages), or, with dp_shared_memory (vLLM's default when DP > 1), the
    DP replicas of one node share one copy of every TP shard in /dev/shm; replicas on different
    nodes keep their own."""
    offload = bool(parsed.get("engram_cpu_offload"))
    across = bool(parsed.get("engram_embedding_across_dp")) and dp > 1
    group = tp * dp if across else tp
    shared_opt = parsed.get("engram_dp_shared_memory")
    shared_opt = (dp > 1 and not parsed.get("engram_use_thp")) if shared_opt is None else shared_opt
    local_replicas = max(1, min(dp, gpus_per_node // tp))
    host_shared = offload and bool(shared_opt) and not across and local_replicas > 1
    host_per_rank = host_per_node = 0
    for t in tables:
        shard = math.ceil(t / group)
        if not offload:
            w["Engram tables (TP)" if not across else "Engram tables (TP x DP)"] += shard
        elif host_shared:
            host_per_node += shard * tp
        else:
            pinned = shard if parsed.get("engram_use_thp") else 1 << (shard - 1).bit_length()
            host_per_rank += pinned
            host_per_node += pinned * min(gpus_per_node, tp * dp)
    return host_shared, host_per_rank, host_per_node


def _kv_cache(p: RankPlan, parsed: dict, ov: Overheads) -> None:
    """The KV cache what is left leaves (or kv-cache-memory-bytes), and whether it fits."""
    total, over = p.gpu_bytes, sum(p.overheads.values())
    util = memory_utilization(parsed)
    fixed_kv = int(parsed.get("kv_cache_memory_bytes") or 0)
    if fixed_kv:
        # vLLM then sizes the KV cache from this alone and skips its memory profile: the
        # utilization share no longer bounds anything, the GPU's memory does.
        p.kv_fixed = True
        p.budget = total
        p.kv_bytes = fixed_kv
        short = p.weights_total + over + fixed_kv - total
        needs = f" + kv-cache-memory-bytes {fixed_kv / GIB:.2f} GiB exceed {total / GIB:.2f} GiB"
    else:
        p.budget = int(total * util)
        p.kv_bytes = int(p.budget - p.weights_total - over)
        short = -p.kv_bytes
        needs = f" exceed {util:g} x {total / GIB:.2f} GiB"
    p.kv_tokens = max(0, int(p.kv_bytes / ov.kv_bytes_per_token))
    if short > 0:
        p.why = (
            f"weights {p.weights_total / GIB:.2f} GiB + overheads "
            f"{over / GIB:.2f} GiB{needs} by {short / GIB:.2f} GiB per GPU"
        )
    elif p.max_model_len and p.kv_tokens < p.max_model_len:
        p.why = (
            f"KV cache holds {p.kv_tokens:,} tokens per GPU, fewer than max-model-len "
            f"{p.max_model_len:,}: vLLM refuses to start"
        )
    p.fits = not p.why
