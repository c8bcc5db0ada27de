"""The benchmark's cases as data: DeepSeek-V4.1-Flash routed-expert shapes on EP8 ranks.

400 physical expert slots (384 experts + 16 EPLB replicas) over EP8 = 50 local experts per
rank, top-6. With TP8 + EP8 every rank sees every token and computes the rows routed to its
own 50 slots, so one rank's work is reproduced on one GPU from the routing alone.
Pure numpy: the GPU script, the report and the model all read the same cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HIDDEN = 5120
INTER = 2304
TOP_K = 6
SLOTS = 400
EP = 8
LOCAL = SLOTS // EP  # 50
# (name, N, K) of the two grouped GEMMs one MoE layer issues per rank.
GEMMS = (("fc1", 2 * INTER, HIDDEN), ("fc2", HIDDEN, INTER))
TOKENS = (1, 8, 32, 64, 128, 192, 288, 512, 1024, 2048, 4096)
ROUTINGS = ("uniform", "zipf", "hot", "eplb")
ZIPF_S = 1.2  # popularity of the i-th most popular slot ~ 1 / i^1.2
# eplb: what expert-parallel load balancing leaves behind; slot popularity log-normal with this
# sigma puts the hottest of 400 slots at ~3.4x the mean (2.97 sigma - sigma^2 / 2 = ln 3.4).
EPLB_SIGMA = 0.45
CALIB_M = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256)


def route(routing: str, tokens: int, seed: int = 0) -> np.ndarray:
    """[tokens, TOP_K] distinct physical slots per token.

    uniform: every slot equally likely. zipf: slot popularity ~ 1/rank^1.2, ranks shuffled
    over slots (so hot slots land on any EP rank). hot: slot 0 (rank 0's first expert) is in
    every token's top-k, the other five uniform: the worst case for one rank. eplb: log-normal
    slot popularity, the hottest slot ~3-4x the mean, as balanced replicas leave it."""
    rng = np.random.default_rng(seed * 1_000_003 + tokens)
    if routing == "uniform":
        logits = np.zeros(SLOTS)
    elif routing == "zipf":
        popularity = 1.0 / np.arange(1, SLOTS + 1) ** ZIPF_S
        logits = np.log(rng.permutation(popularity))
    elif routing == "eplb":
        logits = rng.normal(0.0, EPLB_SIGMA, SLOTS)
    elif routing == "hot":
        rest = np.argsort(rng.random((tokens, SLOTS - 1)), axis=1)[:, : TOP_K - 1] + 1
        return np.concatenate([np.zeros((tokens, 1), dtype=np.int64), rest], axis=1)
    else:
        raise ValueError(f"unknown routing {routing!r} (one of {', '.join(ROUTINGS)})")
    # Gumbel top-k: TOP_K distinct slots drawn without replacement with these weights.
    keys = logits[None, :] + rng.gumbel(size=(tokens, SLOTS))
    return np.argsort(-keys, axis=1)[:, :TOP_K].astype(np.int64)


def rank_counts(slots: np.ndarray, rank: int) -> np.ndarray:
    """Rows each of the rank's LOCAL experts receives."""
    local = slots[(slots >= rank * LOCAL) & (slots < (rank + 1) * LOCAL)] - rank * LOCAL
    return np.bincount(local, minlength=LOCAL).astype(np.int64)


def offsets(counts: np.ndarray) -> np.ndarray:
    """expert_first_token_offset as the MoE runner lays the permuted rows out."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


@dataclass(frozen=True)
class GemmShape:
    name: str
    n: int
    k: int

    def weight_bytes(self, experts: int) -> int:
        """FP8 weights + float32 128x128 block scales of `experts` experts."""
        scales = -(-self.n // 128) * -(-self.k // 128) * 4
        return experts * (self.n * self.k + scales)


SHAPES = tuple(GemmShape(*g) for g in GEMMS)
