"""The `vllm-h20` CLI end to end: help, demo, convert/verify, and every bad input as one
line with a non-zero exit code and no traceback."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_h20.convert.safetensors_io import read_header


def cli(*args, check_code=None):
    p = subprocess.run(
        [sys.executable, "-m", "vllm_h20.cli", *map(str, args)], capture_output=True, text=True
    )
    if check_code is not None:
        assert p.returncode == check_code, p.stdout + p.stderr
    return p


def one_line_error(p, *needles):
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_help_lists_commands():
    out = cli("--help", check_code=0).stdout
    for c in ("convert", "verify", "synth", "demo"):
        assert c in out


def test_synth_offers_every_preset():
    """The CLI lists presets by hand (it imports no numpy at start): it must name them all."""
    from vllm_h20.convert.cli import synth
    from vllm_h20.convert.synth import PRESETS

    choice = next(p for p in synth.params if p.name == "preset").type
    assert sorted(choice.choices) == sorted(PRESETS)


def test_demo_runs_and_verifies():
    p = cli("demo", check_code=0)
    assert "verify: OK" in p.stdout
    assert "routed_experts" in p.stdout


def test_convert_then_verify(tiny_src, tmp_path):
    dst = tmp_path / "out"
    p = cli("convert", tiny_src, dst, "--json", "-q", check_code=0)
    doc = json.loads(p.stdout)
    assert doc["groups"]["routed_experts"]["exact_fraction"] == 1.0
    assert "verify: OK" in cli("verify", tiny_src, dst, check_code=0).stdout
    assert "verify: OK" in cli("verify", tiny_src, dst, "--sample", "2", check_code=0).stdout
    assert "verify: OK" in cli("verify", tiny_src, dst, "-j", "2", check_code=0).stdout


def _shard_with(src: Path, suffix: str) -> tuple[Path, str]:
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in index if n.endswith(suffix))
    return src / index[name], name


def _poke(path: Path, tensor: str, byte_offset: int, value: bytes) -> None:
    h = read_header(path)
    t = h.tensors[tensor]
    with open(path, "r+b") as f:
        f.seek(h.data_offset + t.begin + byte_offset)
        f.write(value)


def test_verify_catches_tampering(tiny_src, tmp_path):
    dst = tmp_path / "out"
    cli("convert", tiny_src, dst, "-q", check_code=0)
    shard, name = _shard_with(dst, "experts.0.w1.weight")
    _poke(shard, name, 10, b"\x00")
    _poke(shard, name, 11, b"\x7e")
    shard2, kept = _shard_with(dst, "embed.weight")
    _poke(shard2, kept, 0, b"\x12\x34")
    fails = []
    for workers in ("1", "3"):  # one process, or one output shard per worker process
        p = cli("verify", tiny_src, dst, "-j", workers)
        assert p.returncode == 1
        assert "not the nearest E4M3" in p.stdout and "'embed.weight' differs" in p.stdout
        fails.append([line for line in p.stdout.splitlines() if line.startswith("FAIL")])
    assert fails[0] == fails[1]  # same failures, in shard order, whatever finished first


# -- bad input: each a one-line message naming the file/tensor and what to do ----------


def test_truncated_shard(tiny_copy, tmp_path):
    shard = sorted(tiny_copy.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    one_line_error(cli("convert", tiny_copy, tmp_path / "o"), shard.name, "truncated")


def test_corrupt_header(tiny_copy, tmp_path):
    shard = sorted(tiny_copy.glob("*.safetensors"))[0]
    b = shard.read_bytes()
    shard.write_bytes(b[:8] + b"]" + b[9:])
    one_line_error(cli("convert", tiny_copy, tmp_path / "o"), shard.name, "corrupt")


def test_index_names_missing_shard(tiny_copy, tmp_path):
    shard = sorted(tiny_copy.glob("*.safetensors"))[2]
    shard.unlink()
    one_line_error(cli("convert", tiny_copy, tmp_path / "o"), shard.name, "missing")


def test_weight_without_scale(tiny_copy, tmp_path):
    # rewrite the index and shard without one expert scale
    shard, name = _shard_with(tiny_copy, "experts.1.w2.weight")
    from vllm_h20.convert.safetensors_io import ShardReader, save_file

    r = ShardReader(read_header(shard))
    scale = name.replace(".weight", ".scale")
    keep = {n: (t.dtype, np.array(r.array(n))) for n, t in r.header.tensors.items() if n != scale}
    r.close()
    save_file(keep, shard, {"format": "pt"})
    ip = tiny_copy / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    del index["weight_map"][scale]
    ip.write_text(json.dumps(index))
    one_line_error(cli("convert", tiny_copy, tmp_path / "o"), name, "no scale")


def _retype(src: Path, suffix: str, dtype: str):
    shard, name = _shard_with(src, suffix)
    h = read_header(shard)
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8 : 8 + n])
    doc[name]["dtype"] = dtype
    new = json.dumps(doc).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[h.data_offset :])
    return name


def test_wrong_dtype(tiny_copy, tmp_path):
    name = _retype(tiny_copy, "experts.0.w3.scale", "I8")
    one_line_error(cli("convert", tiny_copy, tmp_path / "o"), name, "dtype I8")


def test_unmatched_tensor_stops_unless_keep_flag(tiny_copy, tmp_path):
    name = _retype(tiny_copy, "layers.0.attn_norm.weight", "F16")  # F16 of same size
    _retype(tiny_copy, "layers.0.attn.attn_sink", "I32")
    line = one_line_error(
        cli("convert", tiny_copy, tmp_path / "o"), "match no rule", "--keep-unmatched"
    )
    assert "attn_sink" in line
    p = cli("convert", tiny_copy, tmp_path / "o2", "-q", "--keep-unmatched", "--json", check_code=0)
    assert json.loads(p.stdout)["unmatched_kept"] == ["layers.0.attn.attn_sink"]
    assert name


@pytest.mark.parametrize(
    "suffix,offset,value,needle",
    [
        ("attn.wq_a.weight", 7, b"\x7f", "NaN E4M3"),
        ("experts.0.w1.scale", 3, b"\xff", "NaN E8M0"),
        ("embed.weight", 6, b"\x80\x7f", "NaN/Inf"),
        ("engram.embed.weight", 1, b"\xff", "NaN/Inf"),
    ],
)
def test_nan_inf_in_weights_and_scales(tiny_copy, tmp_path, suffix, offset, value, needle):
    shard, name = _shard_with(tiny_copy, suffix)
    _poke(shard, name, offset, value)
    dst = tmp_path / "o"
    line = one_line_error(cli("convert", tiny_copy, dst), needle, shard.name)
    assert name.rsplit(".", 1)[0] in line
    assert not list(dst.glob("*.partial")) and not list(dst.glob(".*.partial"))
    man = json.loads((dst / ".vllm-h20" / "manifest.json").read_text())
    assert not man["complete"]


def test_config_missing_or_wrong(tiny_copy, tmp_path):
    cfg = tiny_copy / "config.json"
    text = cfg.read_text()
    cfg.write_text(text.replace('"deepseek_v41"', '"llama"'))
    one_line_error(cli("convert", tiny_copy, tmp_path / "o"), "config.json", "llama")
    cfg.unlink()
    one_line_error(cli("convert", tiny_copy, tmp_path / "o"), "config.json", "missing")


def test_non_empty_dst_and_dst_inside_src(tiny_src, tmp_path):
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "x").write_text("x")
    one_line_error(cli("convert", tiny_src, dst), "not empty", "--resume")
    one_line_error(cli("convert", tiny_src, tiny_src / "sub"), "inside")


def test_not_enough_space_is_refused_up_front(tiny_src, tmpfs):
    mnt = tmpfs("64k")
    one_line_error(cli("convert", tiny_src, mnt / "o"), "needs", "free")


def test_disk_full_during_write(tmp_path, tmpfs):
    """Space that passes the preflight is taken by another writer mid-conversion."""
    import threading
    import time
    from dataclasses import replace

    from vllm_h20.convert.synth import PRESETS, generate

    src = tmp_path / "src"
    generate(src, replace(PRESETS["tiny"], hidden=1024, moe_inter=512, experts=16), shards=4)
    size = sum(p.stat().st_size for p in src.iterdir())
    mnt = tmpfs(f"{2 * size // 1024}k")
    dst = mnt / "o"

    def grab():
        for _ in range(2000):
            if list(dst.glob(".*.partial")):
                break
            time.sleep(0.002)
        try:
            with open(mnt / "other-writer", "wb") as f:
                while True:
                    f.write(b"\0" * 2**20)
        except OSError:
            pass

    th = threading.Thread(target=grab)
    th.start()
    p = cli("convert", src, dst, "-j", "1", "--band-mib", "1")
    th.join()
    one_line_error(p, "disk full", "--resume")


@pytest.fixture
def tmpfs(tmp_path):
    """Mount small tmpfs file systems (needs root; CI runs as root); always unmounted."""
    mounted = []

    def make(size: str) -> Path:
        mnt = tmp_path / f"tmpfs-{size}"
        mnt.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip("needs root to mount a small tmpfs")
        mounted.append(mnt)
        return mnt

    yield make
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)
