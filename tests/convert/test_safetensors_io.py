import json
import struct

import numpy as np
import pytest
import safetensors.numpy

from vllm_h20.convert.safetensors_io import (
    CheckpointError,
    ShardReader,
    ShardWriter,
    read_header,
    save_file,
)


def test_our_writer_is_read_by_the_official_library(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(7, dtype=np.uint8)
    save_file({"a": ("F32", a), "b": ("U8", b)}, tmp_path / "x.safetensors", {"format": "pt"})
    got = safetensors.numpy.load_file(tmp_path / "x.safetensors")
    assert np.array_equal(got["a"], a) and np.array_equal(got["b"], b)


def test_official_writer_is_read_by_ours(tmp_path):
    a = np.arange(10, dtype=np.int64)
    safetensors.numpy.save_file({"z": a, "y": a[:3].astype(np.float16)}, tmp_path / "o.safetensors")
    h = read_header(tmp_path / "o.safetensors")
    r = ShardReader(h)
    assert np.array_equal(r.array("z"), a)
    assert r.array("y").dtype == np.float16
    r.close()


def test_streaming_writes_in_pieces(tmp_path):
    w = ShardWriter(tmp_path / "s.safetensors", [("t", "U8", (4, 4)), ("u", "F32", (2,))], None)
    w.write("t", np.zeros(8, np.uint8))
    w.write("t", np.ones(8, np.uint8))
    w.write("u", np.array([1, 2], np.float32))
    w.close()
    got = safetensors.numpy.load_file(tmp_path / "s.safetensors")
    assert got["t"].sum() == 8 and got["u"].tolist() == [1.0, 2.0]


def test_writer_refuses_out_of_order_and_short_tensors(tmp_path):
    w = ShardWriter(tmp_path / "s.safetensors", [("t", "U8", (4,)), ("u", "U8", (2,))], None)
    with pytest.raises(RuntimeError, match="expected 't'"):
        w.write("u", np.zeros(2, np.uint8))
    w.write("t", np.zeros(2, np.uint8))
    with pytest.raises(RuntimeError, match="before tensor 't'"):
        w.close()
    w.abort()
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize(
    "damage,msg",
    [
        (lambda b: b[:-5], "truncated"),
        (lambda b: b + b"xx", "trailing data"),
        (lambda b: b[:4], "too short"),
        (lambda b: struct.pack("<Q", 10**9) + b[8:], "header length"),
        (lambda b: b[:8] + b"!" + b[9:], "not valid JSON"),
    ],
)
def test_damaged_files_are_named(tmp_path, damage, msg):
    p = tmp_path / "x.safetensors"
    save_file({"a": ("F32", np.zeros(64, np.float32))}, p)
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(CheckpointError, match=msg) as e:
        read_header(p)
    assert str(p) in str(e.value)


def test_header_size_mismatch(tmp_path):
    p = tmp_path / "x.safetensors"
    doc = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    p.write_bytes(struct.pack("<Q", len(doc)) + doc + b"\0" * 12)
    with pytest.raises(CheckpointError, match="'a' has 12 bytes but F32"):
        read_header(p)
