"""The router-bias fit behind synthetic checkpoints' trained-like loads, checked on logits it
never saw, for both gate scorings (V3's sigmoid, V4's sqrt-softplus)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_h20.convert import router


@pytest.mark.parametrize(("scoring", "logit_std"), [("sigmoid", 1.0), ("sqrtsoftplus", 1.43)])
def test_fitted_bias_gives_the_published_load_shape(scoring, logit_std):
    """Warm and hot experts follow their target (median error under 10 %, none over 40 %: the
    fit's own sampling noise), the layer's skew is the EPLB example's, and without the bias the
    same router is nearly uniform."""
    loads = router.target_loads(384, seed=3)
    bias = router.fit_router_bias(loads, 6, scoring=scoring, logit_std=logit_std, seed=3)
    fresh = np.random.default_rng(99).standard_normal((16384, 384), dtype=np.float32)
    fresh *= np.float32(logit_std)
    got = router.expert_shares(bias, 6, fresh, scoring)
    assert abs(got.mean() - 1) < 1e-9
    warm = loads >= 0.8
    err = np.abs(got[warm] / loads[warm] - 1)
    assert np.median(err) < 0.1 and err.max() < 0.4
    assert abs(got.max() - loads.max()) < 0.5 and abs(got.std() - loads.std()) < 0.05
    flat = router.expert_shares(np.zeros(384), 6, fresh, scoring)
    assert flat.std() < 0.1 < loads.std()


@settings(max_examples=25, deadline=None)
@given(experts=st.integers(4, 64), seed=st.integers(0, 2**16))
def test_target_loads_have_mean_one_and_come_from_the_table(experts, seed):
    loads = router.target_loads(experts, seed)
    assert loads.shape == (experts,) and abs(loads.mean() - 1) < 1e-9
    table = np.concatenate([np.asarray(r, float) / np.mean(r) for r in router.EPLB_EXAMPLE_LOADS])

    # Each draw is a table entry, all rescaled by one common factor.
    def in_table(x):
        return np.min(np.abs(x[:, None] - table[None, :]), axis=1) < 1e-9

    assert any(np.all(in_table(loads * (t / loads[0]))) for t in table)


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(3, 40),
    top_k=st.integers(1, 2),
    tokens=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    scoring=st.sampled_from(router.SCORING),
)
def test_shares_count_every_token_top_k_times(experts, top_k, tokens, seed, scoring):
    """Shares are counts scaled to mean 1, whatever the bias: each token picks top_k experts."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    got = router.expert_shares(rng.standard_normal(experts), top_k, logits, scoring)
    assert got.min() >= 0
    np.testing.assert_allclose(got.sum() * top_k * tokens / experts, top_k * tokens)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="scoring must be one of sigmoid, sqrtsoftplus"):
        router.score(np.zeros(3), "softmax")
    with pytest.raises(ValueError, match="top_k must be in 1..3"):
        router.fit_router_bias(np.ones(4), 4)
