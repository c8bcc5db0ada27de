import ml_dtypes
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vllm_h20.convert import codecs as c


def test_e2m1_table_matches_ocp_spec():
    assert list(c.E2M1_VALUES[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(c.E2M1_VALUES[8:]) == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(c.E2M1_VALUES[c.E2M1_NEG_ZERO])


@given(
    hnp.arrays(
        np.uint8,
        hnp.array_shapes(min_dims=2, max_dims=2, max_side=16).map(lambda s: (s[0], 2 * s[1])),
        elements=st.integers(0, 15),
    )
)
def test_pack_unpack_round_trip(codes):
    packed = c.pack_e2m1(codes)
    assert packed.dtype == np.int8
    assert np.array_equal(c.unpack_e2m1(packed), codes)
    # low nibble is the even K index
    assert np.array_equal(packed.view(np.uint8) & 0xF, codes[:, 0::2])


def test_e2m1_encode_exact_rejects_non_e2m1():
    assert np.array_equal(c.e2m1_encode_exact(np.array([0.5, -6.0, -0.0])), [1, 15, 8])
    try:
        c.e2m1_encode_exact(np.array([2.5]))
    except ValueError:
        return
    raise AssertionError("2.5 is not E2M1")


def test_e4m3_nan_bytes_and_encode_saturates():
    vals = c.e4m3_decode(np.arange(256, dtype=np.uint8))
    assert set(np.flatnonzero(np.isnan(vals))) == set(c.E4M3_NAN_BYTES)
    assert np.nanmax(vals) == c.E4M3_MAX
    assert c.e4m3_encode(np.array([1e9, -1e9])).tolist() == [0x7E, 0xFE]
    assert c.e4m3_encode(np.array([-0.0]))[0] == 0x80  # sign of zero kept


def test_lookup_tables_agree_with_ml_dtypes():
    pair, inexact, sqerr, abserr = c.mxfp4_byte_tables()
    for d in (c.MXFP4_SHIFT_MIN, -9, -8, 0, c.MXFP4_SHIFT_MAX):
        row = d - c.MXFP4_SHIFT_MIN
        for b in (0x00, 0x18, 0x7F, 0xF1, 0x88, 0x29):
            lo, hi = c.E2M1_VALUES[b & 0xF], c.E2M1_VALUES[b >> 4]
            want = np.array([lo, hi]) * 2.0**d
            got = np.array([pair[row, b] & 0xFF, pair[row, b] >> 8], np.uint8)
            ref = np.clip(want, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            assert np.array_equal(got, ref)
            exact = c.e4m3_decode(got) == want
            assert inexact[row, b] == (~exact).sum()
    q, fin, ferr = c.fp8_byte_tables()
    assert np.array_equal(q[0 - c.FP8_SHIFT_MIN], np.arange(256, dtype=np.uint8))  # d = 0
    assert not fin[0 - c.FP8_SHIFT_MIN].any()


@given(st.integers(-127, 127))
def test_e8m0_exponent(e):
    assert c.e8m0_exponent(np.array([e + 127], np.uint8))[0] == e
    assert c.pow2(e) == 2.0**e


@given(
    st.lists(st.integers(0, 255), min_size=1, max_size=64),
    st.lists(st.integers(-170, 140), min_size=1, max_size=64),
    st.booleans(),
)
def test_f32_rounding_is_e4m3_encode_for_codes_under_power_of_two_scales(codes, shifts, e2m1):
    """What verify rounds: a source code (E2M1 or E4M3) times a power of two; through float32
    it must give the very bytes the float64 cast gives, saturation and underflow included."""
    n = min(len(codes), len(shifts))
    table = (
        c.E2M1_VALUES[np.array(codes[:n]) % 16]
        if e2m1
        else c.e4m3_decode(np.array(codes[:n], np.uint8))
    )
    vals = np.nan_to_num(table) * np.ldexp(1.0, np.array(shifts[:n]))
    assert np.array_equal(c.e4m3_encode_f32_exact(vals), c.e4m3_encode(vals))


def test_e4m3_decode_is_ml_dtypes_cast():
    q = np.arange(256, dtype=np.uint8).reshape(16, 16)
    want = q.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got = c.e4m3_decode(q)
    assert got.shape == q.shape and np.array_equal(got, want, equal_nan=True)
