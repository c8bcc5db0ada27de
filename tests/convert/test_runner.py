"""End-to-end conversion: output layout, vLLM-loadable dtypes, safety, resume after kill -9."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import safetensors

from vllm_h20.convert import rules
from vllm_h20.convert.runner import Options, convert
from vllm_h20.convert.safetensors_io import ShardReader, read_header
from vllm_h20.convert.synth import PRESETS, generate
from vllm_h20.convert.verify import verify


def tree_digest(root: Path, skip=("conversion_report.json",)) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_file() and ".vllm-h20" not in p.parts and p.name not in skip:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run(src, dst, **kw):
    return convert(src, dst, rules.load(None), Options(workers=2, progress=False, **kw))


def test_convert_tiny_end_to_end(tiny_src, tmp_path):
    before = tree_digest(tiny_src, skip=())
    dst = tmp_path / "out"
    doc = run(tiny_src, dst)
    assert tree_digest(tiny_src, skip=()) == before, "SRC was modified"

    g = doc["groups"]
    shape = PRESETS["tiny"]
    n_experts = (shape.layers * shape.experts + shape.mtp_layers * shape.mtp_experts) * 3
    assert g["routed_experts"]["tensors"] == n_experts
    assert g["routed_experts"]["inexact"] == 0 and g["routed_experts"]["rel_l2"] == 0
    assert g["other_linears"]["rel_l2"] <= 1e-4
    assert json.loads((dst / "conversion_report.json").read_text())["groups"] == g

    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "expert_dtype": "fp8",
    }
    assert "fp4" not in json.dumps(cfg) and "ue8m0" not in json.dumps(cfg)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (tiny_src / f).read_bytes()

    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    total = 0
    for s in shards:
        h = read_header(dst / s)
        total += sum(t.nbytes for t in h.tensors.values())
        for name, t in h.tensors.items():
            assert index["weight_map"][name] == s
            if ".experts." in name:
                want = "F8_E4M3" if name.endswith(".weight") else "F32"
                assert t.dtype == want, name
    assert index["metadata"]["total_size"] == total
    assert verify(tiny_src, dst, rules.load(None)).ok


def test_official_safetensors_loads_output_with_torch(tiny_src, tmp_path):
    torch = pytest.importorskip("torch")
    dst = tmp_path / "out"
    run(tiny_src, dst)
    shard = sorted(dst.glob("*.safetensors"))[0]
    with safetensors.safe_open(shard, framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open is not a dict
            t = f.get_tensor(k)
            if k.endswith(".scale") and (".experts." in k or ".attn.wq_a" in k):
                assert t.dtype == torch.float32
            if ".experts." in k and k.endswith(".weight"):
                assert t.dtype == torch.float8_e4m3fn


def test_v4_layout_changes_only_scale_dtype(tmp_path):
    src = tmp_path / "v4"
    generate(src, PRESETS["tiny"], layout="v4", shards=2, spread=6)
    dst = tmp_path / "out"
    doc = run(src, dst)
    assert doc["groups"]["other_linears"]["inexact"] == 0
    sh = ShardReader(read_header(sorted(src.glob("*.safetensors"))[0]))
    name = next(n for n in sh.header.tensors if n.endswith("attn.wq_a.weight"))
    out_shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    out = ShardReader(read_header(dst / out_shard))
    assert np.array_equal(out.raw(name), sh.raw(name))  # weight bytes unchanged
    s_in = sh.array(name.replace(".weight", ".scale")).view(np.uint8).astype(np.int32) - 127
    assert np.array_equal(out.array(name.replace(".weight", ".scale")), np.ldexp(1.0, s_in))


def test_wide_spread_is_counted_not_hidden(tmp_path):
    src = tmp_path / "wide"
    generate(src, PRESETS["tiny"], shards=1, spread=24)
    doc = run(src, tmp_path / "out")
    g = doc["groups"]["routed_experts"]
    assert g["inexact"] > 0 and 0 < g["rel_l2"] < 1e-3
    assert verify(src, tmp_path / "out", rules.load(None)).ok


def test_non_empty_dst_needs_resume_or_overwrite(tiny_src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="not empty"):
        run(tiny_src, dst)
    run(tiny_src, dst, overwrite=True)
    assert (dst / "keep.txt").read_text() == "mine"  # --overwrite replaces only our output
    first = tree_digest(dst)
    run(tiny_src, dst, overwrite=True)
    assert tree_digest(dst) == first


def test_resume_after_complete_run_is_a_no_op(tiny_src, tmp_path):
    dst = tmp_path / "out"
    run(tiny_src, dst)
    first = tree_digest(dst)
    run(tiny_src, dst, resume=True)
    assert tree_digest(dst) == first


def test_resume_refuses_a_different_source(tiny_src, tmp_path):
    dst = tmp_path / "out"
    run(tiny_src, dst)
    other = tmp_path / "other"
    generate(other, PRESETS["tiny"], shards=3, seed=9)
    with pytest.raises(Exception, match="different SRC"):
        run(other, dst, resume=True)


MEDIUM = replace(PRESETS["tiny"], hidden=1024, moe_inter=512, experts=24, layers=2)


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    root = tmp_path_factory.mktemp("medium")
    src = root / "src"
    generate(src, MEDIUM, shards=6, spread=6, seed=2)
    ref = root / "ref"
    convert(src, ref, rules.load(None), Options(workers=1, progress=False, band_mib=1))
    return src, tree_digest(ref)


def _start(src, dst, *extra):
    cmd = [
        sys.executable,
        "-m",
        "vllm_h20.cli",
        "convert",
        str(src),
        str(dst),
        "-j",
        "1",
        "--band-mib",
        "1",
        "-q",
        *extra,
    ]
    return subprocess.Popen(cmd, start_new_session=True)


def _kill_when(proc, cond, timeout=60.0):
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if cond():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.005)
    proc.wait()
    return False


def _done(dst):
    m = dst / ".vllm-h20" / "manifest.json"
    try:
        return len(json.loads(m.read_text())["done"])
    except (OSError, ValueError, KeyError):
        return -1


@pytest.mark.slow
@pytest.mark.parametrize(
    "when",
    ["manifest_written", "partial_file", "one_shard_done", "three_shards_done", "all_shards_done"],
)
def test_kill_9_then_resume_is_byte_identical(medium, tmp_path, when):
    src, want = medium
    dst = tmp_path / "out"
    conds = {
        "manifest_written": lambda: _done(dst) == 0,
        "partial_file": lambda: any(dst.glob(".*.partial")),
        "one_shard_done": lambda: _done(dst) >= 1,
        "three_shards_done": lambda: _done(dst) >= 3,
        "all_shards_done": lambda: _done(dst) >= 6,
    }
    killed = _kill_when(_start(src, dst), conds[when])
    # the last point is a window of milliseconds before `complete`; the others must hit
    assert killed or when == "all_shards_done"
    if killed:
        manifest = json.loads((dst / ".vllm-h20" / "manifest.json").read_text())
        assert not manifest["complete"]
        # an interrupted DST is not presented as complete
        assert (
            subprocess.run(
                [sys.executable, "-m", "vllm_h20.cli", "verify", str(src), str(dst)],
                capture_output=True,
            ).returncode
            == 2
        )
    r = _start(src, dst, "--resume")
    assert r.wait() == 0
    assert not list(dst.glob(".*.partial"))
    assert tree_digest(dst) == want
