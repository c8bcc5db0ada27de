import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_h20.convert import blockscale as bs
from vllm_h20.convert.codecs import E2M1_VALUES, e4m3_decode, e4m3_encode, pow2, unpack_e2m1


def dequant_out(q, scale, shape):
    s = np.repeat(np.repeat(scale.astype(np.float64), 128, 0), 128, 1)[: shape[0], : shape[1]]
    return e4m3_decode(q) * s


def mxfp4_ref(packed, scale):
    vals = E2M1_VALUES[unpack_e2m1(packed)]
    return vals * np.repeat(pow2(scale.view(np.uint8).astype(np.int32) - 127), 32, axis=1)


def fp8_ref(w, s, b):
    sc = np.repeat(np.repeat(pow2(s.astype(np.int32) - 127), b, 0), b, 1)[
        : w.shape[0], : w.shape[1]
    ]
    return e4m3_decode(w) * sc


@settings(max_examples=60, deadline=None)
@given(
    code=st.integers(0, 15),
    offset=st.integers(0, bs.MXFP4_EXACT_SPREAD),
    base=st.integers(-110, 110),
)
def test_every_e2m1_code_at_every_exponent_offset_is_exact(code, offset, base):
    """All 16 codes x every exponent offset inside the exact spread come out bit-exact,
    including the block's own maximum (6 at the top scale) and the negative-zero code."""
    n, k = 128, 128
    packed = np.full((n, k // 2), 0x77, np.uint8)  # +6 everywhere: block max at `base`
    scale = np.full((n, k // 32), base + 127, np.uint8)
    packed[5, 3] = code | (code << 4)
    scale[5, 0] = base - offset + 127
    q, sc, stats = bs.mxfp4_to_fp8(packed, scale)
    ref = mxfp4_ref(packed, scale)
    assert np.array_equal(dequant_out(q, sc, (n, k)), ref)
    assert stats.inexact == 0 and stats.sq_err == 0
    if code == 8:
        assert q[5, 6] == 0x80 and stats.neg_zero == 2


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    spread=st.integers(0, 30),
    rows=st.sampled_from([128, 256, 384]),
    k=st.sampled_from([128, 256, 2304 // 9]),
)
def test_mxfp4_random_tensors_match_the_float_reference(seed, spread, rows, k):
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scale = (120 - rng.integers(0, spread + 1, (rows, k // 32))).astype(np.uint8)
    q, sc, stats = bs.mxfp4_to_fp8(packed, scale)
    ref = mxfp4_ref(packed, scale)
    got = dequant_out(q, sc, ref.shape)
    blk = np.repeat(np.repeat(sc.astype(np.float64), 128, 0), 128, 1)[:rows, :k]
    # every element is the nearest E4M3 value of the source under its block scale
    assert np.array_equal(got, e4m3_decode(e4m3_encode(ref / blk)) * blk)
    err = np.abs(got - ref)
    assert stats.inexact == np.count_nonzero(err)
    assert stats.max_abs_err == err.max()
    assert stats.sq_err == pytest.approx((err**2).sum(), rel=1e-9, abs=0)
    assert stats.sq_ref == pytest.approx((ref**2).sum(), rel=1e-12)
    if spread <= bs.MXFP4_EXACT_SPREAD:
        assert stats.inexact == 0
    assert np.all(np.abs(ref / blk) <= 448)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    spread=st.integers(0, 12),
    shape=st.sampled_from([(128, 128), (256, 384), (96, 200), (130, 64)]),
)
def test_fp8_reblock_32_matches_reference_with_least_error_scale(seed, spread, shape):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, shape, dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x7E
    s = (120 - rng.integers(0, spread + 1, (-(-shape[0] // 32), -(-shape[1] // 32)))).astype(
        np.uint8
    )
    q, sc, stats = bs.fp8_reblock(w, s, 32)
    assert sc.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and sc.dtype == np.float32
    ref = fp8_ref(w, s, 32)
    blk = np.repeat(np.repeat(sc.astype(np.float64), 128, 0), 128, 1)[: shape[0], : shape[1]]
    got = e4m3_decode(q) * blk
    assert np.all(np.abs(ref / blk) <= 448)  # never saturates
    assert np.array_equal(got, e4m3_decode(e4m3_encode(ref / blk)) * blk)
    err = np.abs(got - ref)
    assert stats.inexact == np.count_nonzero(err)
    assert stats.max_abs_err == err.max()
    if spread == 0:
        # one scale per block: only a shift, values whose exponent fits stay exact
        assert stats.inexact == 0


def test_fp8_reblock_mantissa_1875_at_block_top_does_not_overflow():
    """1.875 * 2**k is exact in E4M3 below the top binade only: the block exponent must
    leave room for it (regression: it was saturated to 448)."""
    w = np.full((128, 128), 0x38, np.uint8)  # 1.0
    w[0, 0] = 0x5F  # 15 = 1.875 * 2**3
    s = np.full((4, 4), 127, np.uint8)
    q, sc, stats = bs.fp8_reblock(w, s, 32)
    assert stats.inexact == 0
    assert np.array_equal(dequant_out(q, sc, w.shape), fp8_ref(w, s, 32))


def test_fp8_v4_layout_keeps_bytes_and_converts_scale_exactly():
    rng = np.random.default_rng(0)
    w = rng.integers(0, 0x7E, (256, 384), dtype=np.uint8)
    s = rng.integers(100, 130, (2, 3)).astype(np.uint8)
    q, sc, stats = bs.fp8_reblock(w, s, 128)
    assert np.array_equal(q, w)
    assert np.array_equal(sc, pow2(s.astype(np.int32) - 127).astype(np.float32))
    assert stats.inexact == 0


def test_bands_give_the_same_bytes_as_one_pass():
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (512, 128), dtype=np.uint8)
    scale = (120 - rng.integers(0, 20, (512, 8))).astype(np.uint8)
    q, sc, st_all = bs.mxfp4_to_fp8(packed, scale)
    parts = [bs.mxfp4_to_fp8(packed[i : i + 128], scale[i : i + 128]) for i in range(0, 512, 128)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), q)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), sc)
    assert sum(p[2].inexact for p in parts) == st_all.inexact


@pytest.mark.parametrize(
    "fn,args,msg",
    [
        (
            bs.mxfp4_to_fp8,
            (np.zeros((128, 64), np.uint8), np.full((128, 4), 0xFF, np.uint8)),
            "NaN E8M0",
        ),
        (
            bs.mxfp4_to_fp8,
            (np.zeros((128, 64), np.uint8), np.zeros((128, 3), np.uint8)),
            "scale shape",
        ),
        (
            bs.fp8_reblock,
            (np.full((128, 128), 0x7F, np.uint8), np.zeros((4, 4), np.uint8), 32),
            "NaN E4M3",
        ),
        (
            bs.fp8_reblock,
            (np.full((128, 128), 0xFF, np.uint8), np.zeros((1, 1), np.uint8), 128),
            "NaN E4M3",
        ),
    ],
)
def test_bad_values_raise(fn, args, msg):
    with pytest.raises(bs.BadTensorData, match=msg):
        fn(*args)


def test_stats_merge_and_json_round_trip():
    a = bs.Stats(1, 10, 2, 4.0, 16.0, 0.5, 1)
    b = bs.Stats(2, 30, 0, 0.0, 84.0, 0.25, 0)
    a.add(b)
    assert (a.tensors, a.elements, a.inexact, a.max_abs_err) == (3, 40, 2, 0.5)
    assert a.rel_l2 == pytest.approx(0.2)
    assert bs.Stats.from_json(a.to_json()) == a
