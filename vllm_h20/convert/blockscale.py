"""Re-encode block-scaled weights as E4M3 with power-of-two float32 scales per 128x128 block.

Why power-of-two scales: a value m * 2**e moves between formats without touching its
mantissa, so every source value whose exponent still fits E4M3 after the block's shift is
reproduced exactly. The block exponent is the smallest ``B`` with ``max|v| / 2**B <= 448``
(usually ``floor(log2(max|v|)) - 8``), putting the block maximum at the top of E4M3's
range. Any smaller B saturates the maximum, an error of at least 16 * 2**B, while it can
win back at most 2**-10 * 2**B on each underflowing element, so B is also the least-error
power-of-two choice (in max-abs and in L2 terms, for blocks of 16,384 elements). Elements
that still fall below E4M3's smallest subnormal are rounded to nearest-even and counted,
never dropped silently.

Everything here is pure numpy on one band of rows (a multiple of 128), so a caller bounds
memory by the band size, whatever the tensor size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from .codecs import (
    E2M1_EXPONENT,
    E2M1_VALUES,
    E4M3_MAX_EXP,
    E4M3_NAN_BYTES,
    E8M0_NAN_BYTE,
    FP8_SHIFT_MAX,
    FP8_SHIFT_MIN,
    MXFP4_SHIFT_MAX,
    MXFP4_SHIFT_MIN,
    e4m3_decode,
    e8m0_exponent,
    fp8_byte_tables,
    frexp_exponent,
    mxfp4_byte_tables,
    pow2,
)

BLOCK = 128
MXFP4_GROUP = 32
_EMPTY = -(1 << 20)  # exponent of an all-zero group or block


class BadTensorData(ValueError):
    """Tensor content that cannot be converted (NaN/Inf, bad scale). Message names no file:
    the caller adds the file and tensor name."""


@dataclass
class Stats:
    """Accuracy counters for one tensor or a group of tensors; errors are after
    dequantization against the source's own dequantized values."""

    tensors: int = 0
    elements: int = 0
    inexact: int = 0
    sq_err: float = 0.0
    sq_ref: float = 0.0
    max_abs_err: float = 0.0
    neg_zero: int = 0

    def add(self, other: Stats) -> Stats:
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(a, b) if f.name == "max_abs_err" else a + b)
        return self

    @property
    def exact_fraction(self) -> float:
        return 1.0 if self.elements == 0 else 1.0 - self.inexact / self.elements

    @property
    def rel_l2(self) -> float:
        if self.sq_err == 0.0:
            return 0.0
        return float(np.sqrt(self.sq_err / self.sq_ref)) if self.sq_ref > 0 else float("inf")

    def to_json(self) -> dict:
        d = asdict(self)
        d["exact_fraction"] = self.exact_fraction
        d["rel_l2"] = self.rel_l2
        return d

    @classmethod
    def from_json(cls, d: dict) -> Stats:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def _block_max(group_exp: np.ndarray, rows_per_group: int, cols_per_group: int) -> np.ndarray:
    """Max over each 128x128 block of a per-group exponent grid (padding with _EMPTY)."""
    gr, gc = BLOCK // rows_per_group, BLOCK // cols_per_group
    r, c = group_exp.shape
    pr, pc = -r % gr, -c % gc
    if pr or pc:
        group_exp = np.pad(group_exp, ((0, pr), (0, pc)), constant_values=_EMPTY)
    rb, cb = group_exp.shape[0] // gr, group_exp.shape[1] // gc
    return group_exp.reshape(rb, gr, cb, gc).max(axis=(1, 3))


def _expand(block_vals: np.ndarray, rows: int, cols: int, gr: int, gc: int) -> np.ndarray:
    """Broadcast a per-block grid back to a per-group grid of shape (rows, cols)."""
    return np.repeat(np.repeat(block_vals, gr, axis=0), gc, axis=1)[:rows, :cols]


def _block_exponent(block_max: np.ndarray) -> np.ndarray:
    return np.where(block_max <= _EMPTY, 0, block_max - E4M3_MAX_EXP).astype(np.int32)


def _scales(block_exp: np.ndarray) -> np.ndarray:
    return pow2(block_exp).astype(np.float32)


def _check_e8m0(scale: np.ndarray) -> None:
    bad = np.flatnonzero(scale.reshape(-1).view(np.uint8) == E8M0_NAN_BYTE)
    if bad.size:
        idx = np.unravel_index(bad[0], scale.shape)
        raise BadTensorData(f"{bad.size} NaN E8M0 scale(s) (0xFF), first at {tuple(map(int, idx))}")


# --------------------------------------------------------------------------------- MXFP4


_SQ4 = np.rint(4 * (E2M1_VALUES[np.arange(256) & 0xF] ** 2 + E2M1_VALUES[np.arange(256) >> 4] ** 2))
_NEGZ = ((np.arange(256) & 0xF) == 8).astype(np.uint16) + ((np.arange(256) >> 4) == 8)
#: per byte: 4 * (sum of squares of both values) in bits 0..11, negative zeros in 12..15.
#: Four bytes' entries summed in one 16-bit lane cannot carry out of either field.
_SQ4_NEGZ = (_SQ4.astype(np.uint16) | (_NEGZ.astype(np.uint16) << 12)).astype(np.uint16)
_MAXMAG = np.maximum(np.arange(256) & 0x7, (np.arange(256) >> 4) & 0x7).astype(np.uint8)
#: smallest group shift at which every E2M1 value is still exact in E4M3 (0.5 * 2**-8).
_MXFP4_EXACT_MIN_SHIFT = -8
#: largest E8M0 spread inside a block that keeps every E2M1 value exact (see module doc).
MXFP4_EXACT_SPREAD = E4M3_MAX_EXP - int(E2M1_EXPONENT[7]) - _MXFP4_EXACT_MIN_SHIFT


_LANE_SUM = np.uint64(0x0001000100010001)


def _group_sums(lut16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group of 16 _SQ4_NEGZ entries: (sum of the 12-bit fields, sum of the 4-bit
    fields). Done as 4 x 16-bit lanes of uint64 words: a 16-wide uint16 reduction in numpy
    is several times slower. Multiplying by 0x0001000100010001 adds the lanes into the top
    one, which cannot overflow (16 * 288 < 2**16)."""
    v = lut16.view(np.uint64)
    words = v[..., 0] + v[..., 1] + v[..., 2] + v[..., 3]
    sq = ((words & np.uint64(0x0FFF0FFF0FFF0FFF)) * _LANE_SUM) >> np.uint64(48)
    nz = (((words >> np.uint64(12)) & np.uint64(0x000F000F000F000F)) * _LANE_SUM) >> np.uint64(48)
    return sq, nz


def mxfp4_to_fp8(packed: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, Stats]:
    """MXFP4 rows -> (E4M3 bytes [r, K], float32 scales [ceil(r/128), ceil(K/128)], stats).

    ``packed``: uint8/int8 [r, K/2], two E2M1 codes per byte, low nibble = even K.
    ``scale``: E8M0 bytes [r, K/32]. ``r`` must be a multiple of 128 unless it is the
    tensor's last band.

    The block exponent comes from the largest scale in the block (as if it held a 6):
    while the block's scale spread is at most MXFP4_EXACT_SPREAD every value is exact
    whatever the codes, so the codes need not be scanned. Only blocks with a wider spread
    get the data-driven exponent, which is the least-error one.
    """
    w = np.ascontiguousarray(packed).view(np.uint8)
    s = np.ascontiguousarray(scale).view(np.uint8)
    r, half_k = w.shape
    k = half_k * 2
    groups = k // MXFP4_GROUP
    if k % MXFP4_GROUP or s.shape != (r, groups):
        raise BadTensorData(
            f"MXFP4 scale shape {tuple(s.shape)} does not match weight [{r}, {half_k}] "
            f"(expected [{r}, {groups}])"
        )
    _check_e8m0(s)
    s_exp = e8m0_exponent(s)
    wg = w.reshape(r, groups, MXFP4_GROUP // 2)
    gr, gc = BLOCK, BLOCK // MXFP4_GROUP

    block_hi = _block_max(s_exp, 1, MXFP4_GROUP)
    block_lo = -_block_max(-s_exp, 1, MXFP4_GROUP)
    block_exp = (block_hi + int(E2M1_EXPONENT[7]) - E4M3_MAX_EXP).astype(np.int32)
    wide = block_hi - block_lo > MXFP4_EXACT_SPREAD
    if wide.any():
        in_wide = _expand(wide, r, groups, gr, gc)
        gi, gj = np.nonzero(in_wide)
        gmax = _MAXMAG[wg[gi, gj]].max(axis=-1)
        gexp = np.where(gmax == 0, _EMPTY, s_exp[gi, gj] + E2M1_EXPONENT[gmax])
        data_max = np.full(wide.shape, _EMPTY, dtype=np.int64)
        np.maximum.at(data_max, (gi // gr, gj // gc), gexp)
        block_exp = np.where(wide, _block_exponent(data_max), block_exp).astype(np.int32)
    shift = s_exp - _expand(block_exp, r, groups, gr, gc)

    pair_lut, inexact_lut, sqerr_lut, abserr_lut = mxfp4_byte_tables()
    d = np.clip(shift, MXFP4_SHIFT_MIN, MXFP4_SHIFT_MAX) - MXFP4_SHIFT_MIN
    idx = (d.astype(np.uint16) << 8)[..., None] | wg
    q = pair_lut.reshape(-1)[idx].view(np.uint8).reshape(r, k)

    group_sq4, group_nz = _group_sums(_SQ4_NEGZ[wg])
    stats = Stats(elements=r * k, neg_zero=int(group_nz.sum(dtype=np.uint64)))
    stats.sq_ref = float((group_sq4 * pow2(2 * s_exp)).sum() / 4)

    lossy = shift < _MXFP4_EXACT_MIN_SHIFT
    if lossy.any():
        sel = idx[lossy]
        stats.inexact = int(inexact_lut.reshape(-1)[sel].sum(dtype=np.int64))
        _add_errors(stats, sel, s_exp[lossy], sqerr_lut, abserr_lut, axes=(1,))
    return q, _scales(block_exp), stats


def _add_errors(
    stats: Stats,
    sel: np.ndarray,
    s_exp: np.ndarray,
    sqerr_lut: np.ndarray,
    abserr_lut: np.ndarray,
    axes: tuple[int, ...],
) -> None:
    """Add the errors of the lossy groups ``sel`` (LUT indices, groups on axis 0) whose
    source scale exponents are ``s_exp``: the tables hold errors in units of that scale."""
    sq = np.take(sqerr_lut.reshape(-1), sel).sum(axis=axes)
    stats.sq_err += float((sq * pow2(2 * s_exp)).sum())
    worst = np.take(abserr_lut.reshape(-1), sel).max(axis=axes)
    stats.max_abs_err = max(stats.max_abs_err, float((worst * pow2(s_exp)).max(initial=0.0)))


# ------------------------------------------------------------------------------------ FP8

_E4M3_VALS = np.nan_to_num(e4m3_decode(np.arange(256, dtype=np.uint8)))
#: Smallest e with |v| <= 1.75 * 2**e, per E4M3 byte: floor(log2|v|), plus one for the
#: mantissa 1.875, which would land on 480 > 448 at the top of a block.
_E4M3_NEED_EXP = frexp_exponent(_E4M3_VALS) + (
    np.abs(_E4M3_VALS) > 1.75 * pow2(frexp_exponent(_E4M3_VALS))
)
_E4M3_SQ = np.nan_to_num(e4m3_decode(np.arange(256, dtype=np.uint8)) ** 2).astype(np.float32)


def check_e4m3(weight: np.ndarray) -> None:
    """Raise on E4M3FN NaN bytes (the format has no Inf: S.1111.111 is its only non-finite)."""
    b = weight.reshape(-1).view(np.uint8)
    bad = np.flatnonzero((b & 0x7F) == E4M3_NAN_BYTES[0])
    if bad.size:
        idx = np.unravel_index(bad[0], weight.shape)
        raise BadTensorData(f"{bad.size} NaN E4M3 value(s), first at {tuple(map(int, idx))}")


def fp8_source_block(weight_shape: tuple[int, int], scale_shape: tuple[int, ...]) -> int:
    """Which square block (32 or 128) an E8M0 scale grid describes for this weight."""
    n, k = weight_shape
    for b in (MXFP4_GROUP, BLOCK):
        if tuple(scale_shape) == (-(-n // b), -(-k // b)):
            return b
    raise BadTensorData(
        f"scale shape {tuple(scale_shape)} fits neither 32x32 nor 128x128 blocks of a "
        f"[{n}, {k}] weight"
    )


def fp8_reblock(
    weight: np.ndarray, scale: np.ndarray, src_block: int
) -> tuple[np.ndarray, np.ndarray, Stats]:
    """E4M3 rows with E8M0 block scales -> (E4M3 bytes, float32 128x128 scales, stats).

    ``src_block`` 128 (V4 layout): the weight bytes are kept and only the scale dtype
    changes, exactly. ``src_block`` 32 (V4.1 layout): values are moved onto the 128x128
    block exponent. ``weight`` rows must be a multiple of 128 unless it is the last band.
    """
    w = np.ascontiguousarray(weight).view(np.uint8)
    s = np.ascontiguousarray(scale).view(np.uint8)
    r, k = w.shape
    if s.shape != (-(-r // src_block), -(-k // src_block)):
        raise BadTensorData(f"scale shape {tuple(s.shape)} does not match weight [{r}, {k}]")
    _check_e8m0(s)
    check_e4m3(w)
    s_exp = e8m0_exponent(s)
    g = src_block
    # Pad to whole groups so the per-group reductions are plain reshapes.
    pr, pc = -r % g, -k % g
    wp = np.pad(w, ((0, pr), (0, pc))) if (pr or pc) else w
    gr_, gc_ = wp.shape[0] // g, wp.shape[1] // g
    wg = wp.reshape(gr_, g, gc_, g)
    stats = Stats(elements=r * k, neg_zero=int((w == 0x80).sum(dtype=np.int64)))
    sq = _E4M3_SQ[wg].sum(axis=(1, 3), dtype=np.float64)
    stats.sq_ref = float((sq * pow2(2 * s_exp)).sum())

    if src_block == BLOCK:
        return w.copy(), pow2(s_exp).astype(np.float32), stats

    group_exp = np.where(
        (gmax := _E4M3_NEED_EXP[wg].max(axis=(1, 3))) < -1000, _EMPTY, s_exp + gmax
    )
    block_exp = _block_exponent(_block_max(group_exp, g, g))
    per = BLOCK // g
    shift = s_exp - _expand(block_exp, gr_, gc_, per, per)
    q_lut, inexact_lut, abserr_lut = fp8_byte_tables()
    d = np.clip(shift, FP8_SHIFT_MIN, FP8_SHIFT_MAX) - FP8_SHIFT_MIN
    idx = (d.astype(np.uint16) << 8)[:, None, :, None] | wg
    q = q_lut.reshape(-1)[idx].reshape(wp.shape)[:r, :k]

    lossy = shift < 0
    if lossy.any():
        gi, gj = np.nonzero(lossy)
        sel = idx[gi, :, gj, :]
        stats.inexact = int(np.take(inexact_lut.reshape(-1), sel).sum(dtype=np.int64))
        if stats.inexact:
            _add_errors(stats, sel, s_exp[gi, gj], abserr_lut**2, abserr_lut, axes=(1, 2))
    return np.ascontiguousarray(q), _scales(block_exp), stats
