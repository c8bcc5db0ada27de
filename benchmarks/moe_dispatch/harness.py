"""What the GPU benchmarks of the MoE dispatch share (run.py, ep.py, ../fused_moe/run.py): the
timing method (CUDA graphs replayed in a rotating order, medians of CUDA-event times), the
device's copy bandwidth and FP8 rate measured in the same run, relative error, JSON written
atomically, FlashInfer's sources unpacked. torch is passed in: importing this needs no GPU."""

from __future__ import annotations

import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import cases  # noqa: E402

from vllm_h20._io import write_json_atomic  # noqa: E402

WARMUPS, SAMPLES = 5, 24  # warm-ups and timed samples per case


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: Path, obj) -> None:
    """A result file, compact, written atomically (a lease may end mid-run)."""
    write_json_atomic(path, obj, indent=None)


def unpack_flashinfer(archive: Path, work: Path) -> Path:
    """FlashInfer's data dir (csrc/, include/, cutlass/, spdlog/) from a tarball or a dir."""
    if not archive.exists():
        raise SystemExit(
            f"no FlashInfer sources at {archive}: make them with "
            "`python benchmarks/moe_dispatch/fetch_sources.py` (and carry .fi)"
        )
    if archive.is_dir():
        return archive
    dest = work / "flashinfer-data"
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
        (dest / ".complete").write_text(archive.name)
    return dest


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def measure_copy_bandwidth(torch) -> float:
    """Device copy bandwidth, bytes read + written per second (eager SM copy, not a graph)."""
    n = 4 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


def measure_fp8_tflops(torch) -> float | None:
    """Dense FP8 GEMM rate (8192^3, torch._scaled_mm on random data): the model's tc scale."""
    try:
        n = 8192
        a = (torch.randn(n, n, device="cuda") * 8).to(torch.float8_e4m3fn)
        b = (torch.randn(n, n, device="cuda") * 8).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")

        def mm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        for _ in range(3):
            mm()
        times = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            mm()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        return 2 * n**3 / statistics.median(times) / 1e12
    except Exception as e:  # noqa: BLE001 - optional: the model falls back to the probe
        log(f"FP8 GEMM rate not measured: {e}")
        return None


def graph_of(torch, fn):
    fn()  # JIT-compiled kernels load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graphs(torch, graphs: list, samples: int = SAMPLES, warmups: int = WARMUPS):
    """[sample][i] seconds: every graph replayed once per sample. The order rotates from
    sample to sample so no graph is always the first after the synchronize (idle GPU)."""
    for _ in range(warmups):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    out = []
    for k in range(samples):
        events = {}
        for j in range(len(graphs)):
            i = (j + k) % len(graphs)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[i].replay()
            b.record()
            events[i] = (a, b)
        torch.cuda.synchronize()
        out.append([events[i][0].elapsed_time(events[i][1]) / 1e3 for i in range(len(graphs))])
    return out


def weight_bytes(counts: np.ndarray) -> int:
    active = int((counts > 0).sum())
    return sum(s.weight_bytes(active) for s in cases.SHAPES)
