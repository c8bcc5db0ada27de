"""Convert one shard, streaming: runs in a worker process.

Memory is bounded by the band size, not by the shard or tensor size: a converted weight is
processed 128-row bands at a time (about ``band_bytes`` of input each, roughly 8-12x that
in temporaries), a kept tensor is copied in ``band_bytes`` chunks.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .blockscale import BLOCK, BadTensorData, Stats, fp8_reblock, mxfp4_to_fp8
from .plan import OutTensor, ShardPlan
from .safetensors_io import DTYPES, Header, ShardReader, ShardWriter

OUTPUT_METADATA = {"format": "pt"}
_FLOAT_EXP_MASK = {
    "BF16": (np.uint16, 0x7F80),
    "F16": (np.uint16, 0x7C00),
    "F32": (np.uint32, 0x7F800000),
}


class ConvertError(Exception):
    """A conversion failure with a one-line message that names file, tensor and remedy."""


@dataclass
class ShardResult:
    shard: str
    bytes_out: int
    groups: dict[str, Stats] = field(default_factory=dict)


def partial_name(shard: str) -> str:
    return f".{shard}.partial"


def _non_finite(dtype: str, chunk: np.ndarray) -> int:
    if dtype in _FLOAT_EXP_MASK:
        ut, mask = _FLOAT_EXP_MASK[dtype]
        v = chunk[: chunk.size - chunk.size % np.dtype(ut).itemsize].view(ut)
        return int(np.count_nonzero((v & ut(mask)) == ut(mask)))
    if dtype == "F8_E4M3":
        return int(np.count_nonzero((chunk & 0x7F) == 0x7F))
    if dtype == "F8_E8M0":
        return int(np.count_nonzero(chunk == 0xFF))
    return 0


def _rows_per_band(row_bytes: int, band_bytes: int) -> int:
    return max(BLOCK, (band_bytes // max(row_bytes, 1)) // BLOCK * BLOCK)


class _Job:
    def __init__(self, src: Path, headers: dict[str, Header], where: dict[str, str], report):
        self.src = src
        self.headers = headers
        self.where = where
        self.readers: dict[str, ShardReader] = {}
        self.report = report

    def reader(self, tensor: str) -> ShardReader:
        shard = self.where[tensor]
        if shard not in self.readers:
            self.readers[shard] = ShardReader(self.headers[shard])
        return self.readers[shard]

    def where_text(self, tensor: str) -> str:
        return f"{self.src / self.where[tensor]}: tensor {tensor!r}"

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def _copy(job: _Job, w: ShardWriter, t: OutTensor, band_bytes: int) -> None:
    raw = job.reader(t.src).raw(t.src)
    if raw.size == 0:
        w.write(t.name, raw)
    itemsize = DTYPES[t.dtype].itemsize
    step = max(itemsize, band_bytes // itemsize * itemsize)
    for i in range(0, raw.size, step):
        chunk = np.array(raw[i : i + step])
        bad = _non_finite(t.dtype, chunk)
        if bad:
            raise ConvertError(
                f"{job.where_text(t.src)} holds {bad} NaN/Inf value(s); the checkpoint is "
                "corrupt, re-download this shard"
            )
        w.write(t.name, chunk)
        job.report(chunk.size)


def _convert_pair(
    job: _Job, w: ShardWriter, wt: OutTensor, st: OutTensor, band_bytes: int
) -> Stats:
    weight = job.reader(wt.src).array(wt.src)
    scale = job.reader(wt.src_scale).array(wt.src_scale)
    n = weight.shape[0]
    rows = _rows_per_band(weight.shape[1] * weight.dtype.itemsize, band_bytes)
    stats = Stats(tensors=1)
    scale_bands = []
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        try:
            if wt.src_block == 0:
                q, sc, s = mxfp4_to_fp8(np.array(weight[r0:r1]), np.array(scale[r0:r1]))
            else:
                b = wt.src_block
                q, sc, s = fp8_reblock(
                    np.array(weight[r0:r1]), np.array(scale[r0 // b : -(-r1 // b)]), b
                )
        except BadTensorData as e:
            raise ConvertError(
                f"{job.where_text(wt.src)} (scale {wt.src_scale!r}): {e}; the checkpoint is "
                "corrupt, re-download this shard"
            ) from None
        w.write(wt.name, q)
        scale_bands.append(sc)
        stats.add(s)
        job.report(weight[r0:r1].nbytes)
    out_scale = (
        np.concatenate(scale_bands, axis=0) if scale_bands else np.zeros(st.shape, np.float32)
    )
    if out_scale.shape != st.shape:
        raise ConvertError(
            f"internal: scale of {wt.name} has shape {out_scale.shape}, planned {st.shape}"
        )
    w.write(st.name, out_scale)
    job.report(scale.nbytes)
    return stats


def convert_shard(
    src: Path,
    dst: Path,
    plan: ShardPlan,
    headers: dict[str, Header],
    where: dict[str, str],
    band_bytes: int,
    report=lambda n: None,
) -> ShardResult:
    """Write ``dst/<shard>`` from ``plan``: to a hidden partial file, fsync, then rename."""
    tmp = dst / partial_name(plan.name)
    job = _Job(src, headers, where, report)
    result = ShardResult(plan.name, plan.nbytes)
    writer = None
    try:
        writer = ShardWriter(
            tmp, [(t.name, t.dtype, t.shape) for t in plan.tensors], OUTPUT_METADATA
        )
        ts = plan.tensors
        i = 0
        while i < len(ts):
            t = ts[i]
            if t.op == "copy":
                _copy(job, writer, t, band_bytes)
                g = result.groups.setdefault(t.group, Stats())
                g.tensors += 1
                i += 1
            else:
                s = _convert_pair(job, writer, t, ts[i + 1], band_bytes)
                result.groups.setdefault(t.group, Stats()).add(s)
                i += 2
        writer.close()
        os.replace(tmp, dst / plan.name)
        return result
    except OSError as e:
        if writer is not None:
            writer.abort()
        if e.errno == errno.ENOSPC:
            raise ConvertError(
                f"{dst}: disk full while writing {plan.name}; free space, then rerun with --resume"
            ) from None
        raise ConvertError(f"{dst / plan.name}: write failed ({e.strerror})") from None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        job.close()
