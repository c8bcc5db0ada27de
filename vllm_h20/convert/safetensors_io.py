"""Streaming reader and writer for the safetensors file format.

The format is an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}`` and the raw bytes. We implement it here, with
every check the official library makes, because the converter must write a shard tensor
by tensor with bounded memory (the official API takes a whole dict of tensors) and must
handle F8_E4M3 / F8_E8M0 / BF16, which ``safetensors.numpy`` cannot. Tests read our output
back with the official library.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_MAX_HEADER = 100 * 1024 * 1024  # the official library's limit


class CheckpointError(Exception):
    """A checkpoint file that cannot be used as it is; the message names file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]  # in file order
    metadata: dict[str, str]
    data_offset: int
    file_size: int


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    return int(np.prod(tuple(shape), dtype=np.int64)) * DTYPES[dtype].itemsize


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate a shard's header without reading tensor data.

    Catches what a truncated or corrupt download produces: a short file, a bad length,
    invalid JSON, unknown dtypes, sizes that disagree with shapes, overlapping or
    out-of-file offsets.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{p}: file is {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", raw_len)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{p}: header length {n} does not fit the {size}-byte file "
                    "(truncated or not a safetensors file); re-download it"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(
            f"{p}: header is not valid JSON (corrupt file); re-download it"
        ) from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{p}: header is not a JSON object (corrupt file)")
    metadata = doc.pop("__metadata__", None) or {}
    infos = []
    for name, entry in doc.items():
        try:
            dtype, shape, (b, e) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{p}: tensor {name!r} has a malformed header entry") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{p}: tensor {name!r} has unsupported dtype {dtype}")
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise CheckpointError(f"{p}: tensor {name!r} has an invalid shape {list(shape)}")
        if e - b != tensor_nbytes(dtype, shape):
            raise CheckpointError(
                f"{p}: tensor {name!r} has {e - b} bytes but {dtype}{list(shape)} needs "
                f"{tensor_nbytes(dtype, shape)} (corrupt header)"
            )
        infos.append(TensorInfo(name, dtype, shape, b, e))
    infos.sort(key=lambda t: t.begin)
    pos = 0
    for t in infos:
        if t.begin != pos:
            raise CheckpointError(f"{p}: tensor {t.name!r} overlaps or leaves a gap (corrupt)")
        pos = t.end
    data_offset = 8 + n
    if data_offset + pos != size:
        raise CheckpointError(
            f"{p}: header describes {data_offset + pos} bytes but the file has {size} "
            f"({'truncated' if size < data_offset + pos else 'trailing data'}); re-download it"
        )
    return Header(p, {t.name: t for t in infos}, dict(metadata), data_offset, size)


class ShardReader:
    """Memory-mapped access to one shard's tensors (read-only: SRC is never modified)."""

    def __init__(self, header: Header):
        self.header = header
        self._mm = (
            np.memmap(header.path, dtype=np.uint8, mode="r")
            if header.file_size > header.data_offset
            else np.zeros(0, np.uint8)
        )

    def raw(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        o = self.header.data_offset
        return self._mm[o + t.begin : o + t.end]

    def array(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        return self.raw(name).view(DTYPES[t.dtype]).reshape(t.shape)

    def close(self) -> None:
        mm = getattr(self._mm, "_mmap", None)
        if mm is not None:
            mm.close()


def build_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None) -> bytes:
    """Header bytes for tensors laid out in the given order, padded to 8 bytes like the
    official writer so that data stays aligned."""
    doc: dict = {}
    if metadata:
        doc["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape in entries:
        n = tensor_nbytes(dtype, shape)
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Write one shard tensor by tensor, in header order, to ``path`` directly.

    The caller writes to a temporary name and renames when :meth:`close` returns, so a
    reader never sees a partial shard under its final name.
    """

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata):
        self.path = path
        self._expected = [(name, tensor_nbytes(dt, shape)) for name, dt, shape in entries]
        self._next = 0
        self._left = self._expected[0][1] if self._expected else 0
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._f.write(build_header(entries, metadata))

    @property
    def current(self) -> str:
        return self._expected[self._next][0]

    def write(self, name: str, data: np.ndarray | bytes | memoryview) -> None:
        """Append bytes of tensor ``name``; may be called several times per tensor."""
        if self._next >= len(self._expected) or name != self._expected[self._next][0]:
            raise RuntimeError(f"writer expected {self.current!r}, got {name!r}")
        buf = (
            memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
            if isinstance(data, np.ndarray)
            else memoryview(data)
        )
        if buf.nbytes > self._left:
            raise RuntimeError(f"too many bytes for tensor {name!r}")
        self._f.write(buf)
        self._left -= buf.nbytes
        while self._left == 0 and self._next < len(self._expected):
            self._next += 1
            if self._next < len(self._expected):
                self._left = self._expected[self._next][1]

    def close(self) -> None:
        if self._next != len(self._expected):
            raise RuntimeError(f"shard closed before tensor {self.current!r} was complete")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def truncate_sparse(self) -> None:
        """Finish the file at its full size without writing data (a sparse file with a
        real header): lets the planner read exact full-size checkpoints in a few KiB."""
        self._f.truncate(self._f.tell() + sum(n for _, n in self._expected))
        self._f.close()
        self._next = len(self._expected)

    def abort(self) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)


def save_file(tensors: dict[str, tuple[str, np.ndarray]], path: Path, metadata=None) -> None:
    """Write small in-memory tensors ``{name: (dtype, array)}`` (generator and tests)."""
    entries = [(n, dt, tuple(a.shape)) for n, (dt, a) in tensors.items()]
    w = ShardWriter(Path(path), entries, metadata)
    for n, (_, a) in tensors.items():
        w.write(n, a)
    w.close()
