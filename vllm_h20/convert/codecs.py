"""Bit-level codecs for the formats a DeepSeek-V4.1 checkpoint uses.

E2M1 (MXFP4 element), E8M0 (power-of-two scale) and E4M3FN (FP8 element) are small enough
that every conversion between them is a table lookup; the tables are built once from
ml_dtypes' reference casts, so the fast path and the reference agree by construction.
"""

from __future__ import annotations

from functools import cache

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

#: E2M1 magnitudes for codes 0..7; bit 3 is the sign. Code 8 is negative zero.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
E2M1_NEG_ZERO = 0x8

#: floor(log2(|v|)) of each E2M1 magnitude code (code 0, zero, gets a very small number).
E2M1_EXPONENT = np.array([-1000, -1, 0, 0, 1, 1, 2, 2], dtype=np.int32)

E4M3_MAX = 448.0
#: Largest floor(log2|q|) of a finite E4M3 value (448 = 1.75 * 2**8).
E4M3_MAX_EXP = 8
#: E4M3FN has no infinities; S.1111.111 (0x7F, 0xFF) is NaN.
E4M3_NAN_BYTES = (0x7F, 0xFF)
#: E8M0 0xFF is NaN; every other byte b is 2**(b - 127).
E8M0_NAN_BYTE = 0xFF
E8M0_BIAS = 127

# Shift range the lookup tables cover. A shift below the minimum maps every value to
# (signed) zero anyway; above the maximum cannot occur once the block exponent is chosen
# from the block's largest value (see blockscale.py).
MXFP4_SHIFT_MIN, MXFP4_SHIFT_MAX = -16, 9
FP8_SHIFT_MIN, FP8_SHIFT_MAX = -20, 17


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """Values (float64) of E2M1 codes 0..15."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """Split bytes into codes along the last axis: low nibble is the even K index."""
    b = np.asarray(packed).view(np.uint8)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = b & 0xF
    out[..., 1::2] = b >> 4
    return out


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`unpack_e2m1`; returns int8 like the released checkpoint."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise ValueError("E2M1 packing needs an even number of values along the last axis")
    return ((c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)).astype(np.uint8).view(np.int8)


def e2m1_encode_exact(values: np.ndarray) -> np.ndarray:
    """Codes for values that are exactly E2M1 (used by the synthetic generator and tests)."""
    v = np.asarray(values, dtype=np.float64)
    mag = np.abs(v)
    codes = np.searchsorted(E2M1_MAGNITUDES, mag).astype(np.uint8)
    if not np.array_equal(E2M1_MAGNITUDES[np.minimum(codes, 7)], mag):
        raise ValueError("value is not representable in E2M1")
    return codes | (np.signbit(v).astype(np.uint8) << 3)


def e8m0_exponent(scale_bytes: np.ndarray) -> np.ndarray:
    """Unbiased exponents (int32) of E8M0 bytes; callers reject 0xFF (NaN) first."""
    return np.asarray(scale_bytes).view(np.uint8).astype(np.int32) - E8M0_BIAS


# Every E4M3FN byte's float64 value, from ml_dtypes once: a lookup is ~3x faster than
# ml_dtypes' element-wise cast, which dominated `verify`.
_E4M3_F64 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)


def e4m3_decode(q: np.ndarray) -> np.ndarray:
    """Float64 values of E4M3FN bytes (NaN for 0x7F/0xFF)."""
    return _E4M3_F64[np.asarray(q).view(np.uint8)]


def e4m3_encode(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even E4M3FN bytes (uint8), saturating at +-448."""
    v = np.clip(np.asarray(values, dtype=np.float64), -E4M3_MAX, E4M3_MAX)
    return v.astype(E4M3).view(np.uint8)


def e4m3_encode_f32_exact(values: np.ndarray) -> np.ndarray:
    """`e4m3_encode` for values that float32 holds exactly (a few mantissa bits times a power
    of two, as E2M1 and E4M3 codes under power-of-two scales are), via float32: ml_dtypes
    casts float32 ~4x faster than float64. Values below float32's range round to zero in
    E4M3 either way; anything else would round twice, so callers must only pass such values."""
    v = np.clip(np.asarray(values, dtype=np.float64), -E4M3_MAX, E4M3_MAX)
    return v.astype(np.float32).astype(E4M3).view(np.uint8)


def pow2(exp: np.ndarray | int) -> np.ndarray:
    """2**exp in float64, exact for any int exponent in float64's range."""
    return np.ldexp(1.0, np.asarray(exp, dtype=np.int32))


def _exact(q: np.ndarray, target: np.ndarray) -> np.ndarray:
    return e4m3_decode(q) == target


@cache
def mxfp4_byte_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each shift d and packed byte: two E4M3 bytes (as one little-endian uint16)
    encoding both nibbles' values times 2**d; how many of the two are inexact; and, in
    units of the source scale, the sum of squared errors and the larger abs error."""
    shifts = np.arange(MXFP4_SHIFT_MIN, MXFP4_SHIFT_MAX + 1)
    byte = np.arange(256, dtype=np.uint8)
    lo, hi = byte & 0xF, byte >> 4
    vals = np.stack([e2m1_decode(lo), e2m1_decode(hi)], axis=-1)  # [256, 2]
    target = vals[None] * pow2(shifts)[:, None, None]  # [S, 256, 2]
    q = e4m3_encode(target)
    pair = q[..., 0].astype(np.uint16) | (q[..., 1].astype(np.uint16) << 8)
    inexact = (~_exact(q, target)).sum(-1).astype(np.uint8)
    err = np.abs(e4m3_decode(q) - target) / pow2(shifts)[:, None, None]
    return pair, inexact, (err**2).sum(-1), err.max(-1)


@cache
def fp8_byte_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each shift d and E4M3 byte: the E4M3 byte of value * 2**d, whether it is
    inexact, and the abs error in units of the source scale. NaN bytes map to themselves;
    callers reject them before the lookup."""
    shifts = np.arange(FP8_SHIFT_MIN, FP8_SHIFT_MAX + 1)
    byte = np.arange(256, dtype=np.uint8)
    vals = e4m3_decode(byte)
    target = vals[None] * pow2(shifts)[:, None]
    nan = np.isnan(target)
    q = e4m3_encode(np.where(nan, 0.0, target))
    q = np.where(nan, byte[None], q).astype(np.uint8)
    inexact = ~(_exact(q, target) | nan)
    err = np.where(nan, 0.0, np.abs(e4m3_decode(q) - target)) / pow2(shifts)[:, None]
    return q, inexact.astype(np.uint8), err


def frexp_exponent(values: np.ndarray) -> np.ndarray:
    """floor(log2|v|) as int32 (very negative for zero)."""
    mant, exp = np.frexp(np.asarray(values, dtype=np.float64))
    return np.where(mant == 0, -100000, exp - 1).astype(np.int32)
