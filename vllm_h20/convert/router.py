"""Router biases that give a synthetic checkpoint trained-like expert loads.

A random gate routes tokens almost uniformly, which hides what skewed loads do to the MoE
kernels (serving round 2 found dummy weights worse still: every token on the same experts).
DeepSeek's auxiliary-loss-free gate picks the top-k of ``score(logit) + bias``; fitting that
bias to a load table, as its training moves the same bias, gives each layer a few hot and a few
cold experts while routing stays token-dependent. Pure maths, numpy only.
"""

from __future__ import annotations

import numpy as np

# The per-expert loads DeepSeek publishes as the example input of its expert-parallel load
# balancer (github.com/deepseek-ai/EPLB, README, `weight`: two MoE layers x 12 experts, tokens
# per expert): the only per-expert load table DeepSeek has published, an example rather than a
# measurement of a named model. Normalized per layer: hottest 2.1x the mean, CV ~0.6.
EPLB_EXAMPLE_LOADS = (
    (90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86),
    (20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27),
)
# The gate's score functions: DeepSeek-V3 (sigmoid) and V4 / V4.1 (sqrt of softplus).
SCORING = ("sigmoid", "sqrtsoftplus")


def target_loads(experts: int, seed: int) -> np.ndarray:
    """Each expert's share of the routed rows (mean 1), drawn from EPLB_EXAMPLE_LOADS (each of
    its two layers normalized to mean 1); one seed per layer, so each layer has its own hot ones."""
    loads = np.concatenate([np.asarray(r, float) / np.mean(r) for r in EPLB_EXAMPLE_LOADS])
    pick = np.random.default_rng(seed).choice(loads, experts)
    return pick / pick.mean()


def score(logits: np.ndarray, scoring: str) -> np.ndarray:
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, logits))
    raise ValueError(f"scoring must be one of {', '.join(SCORING)}, not {scoring!r}")


def expert_shares(
    bias: np.ndarray, top_k: int, logits: np.ndarray, scoring: str = "sigmoid"
) -> np.ndarray:
    """Each expert's share of the rows (mean 1) when tokens with these router logits pick the
    top-k of score(logit) + bias, as the noaux_tc gate does."""
    s = score(logits, scoring) + bias.astype(np.float32)
    top = np.argpartition(-s, top_k, axis=1)[:, :top_k]
    counts = np.bincount(top.ravel(), minlength=logits.shape[1])
    return counts * logits.shape[1] / (top_k * logits.shape[0])


def fit_router_bias(
    loads: np.ndarray,
    top_k: int,
    *,
    scoring: str = "sigmoid",
    logit_std: float = 1.0,
    tokens: int = 8192,
    iters: int = 200,
    seed: int = 0,
) -> np.ndarray:
    """The correction bias under which the router's loads follow `loads`.

    A token's router logits are taken as independent N(0, logit_std^2) across experts (a
    unit-RMS hidden state through random gate rows); each step moves every expert's bias by a
    damped, clipped log-ratio of its target to its share on sampled logits."""
    experts = loads.shape[0]
    if not 0 < top_k < experts:
        raise ValueError(f"top_k must be in 1..{experts - 1}, not {top_k}")
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, experts), dtype=np.float32) * np.float32(logit_std)
    s = score(logits, scoring).astype(np.float32)
    bias = np.zeros(experts)
    floor = 0.5 * experts / (top_k * tokens)  # half a row: an unpicked expert's log is finite
    for _ in range(iters):
        top = np.argpartition(-(s + bias.astype(np.float32)), top_k, axis=1)[:, :top_k]
        got = np.bincount(top.ravel(), minlength=experts) * experts / (top_k * tokens)
        bias += 0.02 * np.clip(np.log(loads) - np.log(np.maximum(got, floor)), -2.0, 2.0)
        bias -= bias.mean()
    return bias
