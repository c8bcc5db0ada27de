"""The benchmark's cases as data: a model's routed-expert shapes on EP ranks, and routings.

A Family is one model on one EP size (spec.yaml lists them); the module constants are the
default family, DeepSeek-V4.1-Flash on EP8: 400 physical expert slots (384 experts + 16 EPLB
replicas) over EP8 = 50 local experts per rank, top-6. With TP + EP every rank sees every
token and computes the rows routed to its own slots, so one rank's work is reproduced on one
GPU from the routing alone. Pure numpy: the GPU script, the report and the model all read the
same cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GemmShape:
    name: str
    n: int
    k: int

    def weight_bytes(self, experts: int) -> int:
        """FP8 weights + float32 128x128 block scales of `experts` experts."""
        scales = -(-self.n // 128) * -(-self.k // 128) * 4
        return experts * (self.n * self.k + scales)


@dataclass(frozen=True)
class Family:
    """One model's routed experts on one EP size: `slots` physical experts (experts + EPLB
    replicas), `slots // ep` per rank, each token routed to `top_k` distinct slots."""

    name: str
    experts: int
    slots: int
    top_k: int
    ep: int
    hidden: int
    inter: int
    label: str = ""

    def __post_init__(self):
        if self.slots < self.experts or self.slots % self.ep or self.top_k > self.slots:
            raise ValueError(f"family {self.name}: slots must be >= experts, a multiple of ep "
                             f"and >= top_k (got {self.slots}, {self.experts}, {self.ep}, "
                             f"{self.top_k})")  # fmt: skip
        if self.hidden % 128 or self.inter % 128:
            raise ValueError(f"family {self.name}: hidden and inter must be multiples of 128 "
                             "(the FP8 block scales' 128 x 128 blocks)")  # fmt: skip

    @property
    def local(self) -> int:
        return self.slots // self.ep

    @property
    def shapes(self) -> tuple[GemmShape, GemmShape]:
        """(name, N, K) of the two grouped GEMMs one MoE layer issues per rank."""
        return (GemmShape("fc1", 2 * self.inter, self.hidden),
                GemmShape("fc2", self.hidden, self.inter))  # fmt: skip

    def rows_per_expert(self, tokens: int) -> float:
        return tokens * self.top_k / self.slots


V41_EP8 = Family("v4.1-flash-ep8", experts=384, slots=400, top_k=6, ep=8, hidden=5120,
                 inter=2304, label="DeepSeek-V4.1-Flash, EP8")  # fmt: skip
HIDDEN, INTER, TOP_K = V41_EP8.hidden, V41_EP8.inter, V41_EP8.top_k
SLOTS, EP = V41_EP8.slots, V41_EP8.ep
LOCAL = V41_EP8.local  # 50
SHAPES = V41_EP8.shapes
GEMMS = tuple((s.name, s.n, s.k) for s in SHAPES)
# The published runs' token counts (up to 4,096: ~61 rows per expert); spec.yaml goes further.
TOKENS = (1, 8, 32, 64, 128, 192, 288, 512, 1024, 2048, 4096)
# The first four: the original 44 cases. Then the concentrated ones, routing on few experts as
# users' traffic can: identical requests under greedy decoding route every token of a step to the
# same experts (same_rank: all top-k on one EP rank; same_spread: one on each of top-k ranks), a
# hot pool of 8 or 16 experts, popularity steeper than Zipf 1.2. Last a trained model's load
# shape, added with them but balanced (its hottest slot ~2x the mean): the reports class it so.
ROUTINGS = ("uniform", "zipf", "hot", "eplb")
CONCENTRATED = ("same_rank", "same_spread", "pool8", "pool16", "zipf2")
ALL_ROUTINGS = ROUTINGS + CONCENTRATED + ("trained",)
BALANCED = tuple(r for r in ALL_ROUTINGS if r not in CONCENTRATED)
ZIPF_S = 1.2  # popularity of the i-th most popular slot ~ 1 / i^1.2
ZIPF2_S = 2.0
# eplb: what expert-parallel load balancing leaves behind; slot popularity log-normal with this
# sigma puts the hottest of 400 slots at ~3.4x the mean (2.97 sigma - sigma^2 / 2 = ln 3.4).
EPLB_SIGMA = 0.45
# trained: the per-expert loads DeepSeek publishes as the example input of its expert-parallel load
# balancer (github.com/deepseek-ai/EPLB, README, `weight`: two MoE layers x 12 experts, tokens per
# expert). The only per-expert load table DeepSeek has published; an example, not a measurement of
# a named model. Each slot's popularity is drawn from these 24 loads (normalized to their layer's
# mean): max / mean 2.1, coefficient of variation 0.6.
EPLB_EXAMPLE_LOADS = (
    (90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86),
    (20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27),
)
CALIB_M = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256)


def trained_popularity(rng: np.random.Generator, slots: int = SLOTS) -> np.ndarray:
    """Per-slot popularity drawn from EPLB_EXAMPLE_LOADS, each layer normalized to mean 1."""
    loads = np.concatenate([np.asarray(r, float) / np.mean(r) for r in EPLB_EXAMPLE_LOADS])
    return rng.choice(loads, slots)


def route(routing: str, tokens: int, seed: int = 0, family: Family = V41_EP8) -> np.ndarray:
    """[tokens, top_k] distinct physical slots per token (the family's slots and top-k).

    uniform: every slot equally likely. zipf / zipf2: slot popularity ~ 1/rank^s (s 1.2 / 2.0),
    ranks shuffled over slots (so hot slots land on any EP rank). hot: slot 0 (rank 0's first
    expert) is in every token's top-k, the other five uniform: the worst case for one rank.
    eplb: log-normal slot popularity, the hottest slot ~3-4x the mean, as balanced replicas
    leave it. same_rank: every token picks slots 0-5 (all on rank 0); same_spread: every token
    picks the first slot of ranks 0-5. pool8 / pool16: top-k uniform from a pool of 8 / 16 slots
    drawn at random. trained: popularity shaped like EPLB_EXAMPLE_LOADS. The default family
    draws exactly what the published runs drew."""
    rng = np.random.default_rng(seed * 1_000_003 + tokens)
    SLOTS, TOP_K, LOCAL = family.slots, family.top_k, family.local  # noqa: N806
    if routing == "uniform":
        logits = np.zeros(SLOTS)
    elif routing in ("zipf", "zipf2"):
        s = ZIPF_S if routing == "zipf" else ZIPF2_S
        popularity = 1.0 / np.arange(1, SLOTS + 1) ** s
        logits = np.log(rng.permutation(popularity))
    elif routing == "eplb":
        logits = rng.normal(0.0, EPLB_SIGMA, SLOTS)
    elif routing == "trained":
        logits = np.log(np.maximum(trained_popularity(rng, SLOTS), 1e-6))
    elif routing == "hot":
        rest = np.argsort(rng.random((tokens, SLOTS - 1)), axis=1)[:, : TOP_K - 1] + 1
        return np.concatenate([np.zeros((tokens, 1), dtype=np.int64), rest], axis=1)
    elif routing in ("same_rank", "same_spread"):
        if routing == "same_spread" and family.ep < TOP_K:
            raise ValueError(f"same_spread needs top_k <= ep ({family.name}: top-{TOP_K}, "
                             f"EP{family.ep})")  # fmt: skip
        step = 1 if routing == "same_rank" else LOCAL
        return np.tile(np.arange(TOP_K, dtype=np.int64) * step, (tokens, 1))
    elif routing in ("pool8", "pool16"):
        pool = rng.choice(SLOTS, 8 if routing == "pool8" else 16, replace=False)
        logits = np.full(SLOTS, -np.inf)
        logits[pool] = 0.0
    else:
        raise ValueError(f"unknown routing {routing!r} (one of {', '.join(ALL_ROUTINGS)})")
    # Gumbel top-k: TOP_K distinct slots drawn without replacement with these weights.
    keys = logits[None, :] + rng.gumbel(size=(tokens, SLOTS))
    return np.argsort(-keys, axis=1)[:, :TOP_K].astype(np.int64)


def rank_counts(slots: np.ndarray, rank: int, local: int = LOCAL) -> np.ndarray:
    """Rows each of the rank's `local` experts receives."""
    mine = slots[(slots >= rank * local) & (slots < (rank + 1) * local)] - rank * local
    return np.bincount(mine, minlength=local).astype(np.int64)


def offsets(counts: np.ndarray) -> np.ndarray:
    """expert_first_token_offset as the MoE runner lays the permuted rows out."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
