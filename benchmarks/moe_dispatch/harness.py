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
    """fn captured in a CUDA graph, which keeps fn (and the tensors its closure holds) alive:
    each capture empties the allocator's cache, so a tensor an earlier graph reads that was
    freed since is unmapped, and that graph's replay faults (illegal memory access)."""
    fn()  # JIT-compiled kernels load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.keep_alive = fn
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


def loop_time(torch, graph, replays: int = 20, samples: int = 8) -> list[float]:
    """Seconds per replay of `replays` back-to-back replays of one graph, `samples` times: the
    GPU-bound rate, where the next replay's launch overlaps this one (time_graphs times each
    replay alone, launch latency included)."""
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / replays)
    return out


def trace_graph(torch, graph, replays: int = 20) -> list[tuple[str, float, float]]:
    """Every kernel of `replays` replays of one graph as the profiler (CUPTI) saw it: (name,
    start us, duration us), in start order. Read from the profiler's own trace file (its event
    list's fields for kernels differ between torch versions)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
               if e.get("cat") == "kernel" and e.get("ph") == "X"]  # fmt: skip
    return sorted(kernels, key=lambda k: k[1])


def kernel_kind(name: str) -> str:
    """A DeepGEMM kernel's short name: which kernel (regular or swap-A/B); anything else by the
    name before its template arguments."""
    if "fp8_gemm_kernel_swapAB" in name:
        return "swap_ab"
    if "fp8_gemm_kernel" in name:
        return "regular"
    if "scale_1x128_kernel" in name:  # FlashInfer's grouped quantization of the activations
        return "quantize"
    return name.split("<")[0].split("(")[0].removeprefix("void ").strip()[:60]


NAME_CHARS = 600  # a DeepGEMM kernel's name with all its template arguments fits


def trace_summary(kernels: list[tuple[str, float, float]], replays: int) -> dict:
    """Medians over the replays of a graph's trace (trace_graph): the span from its first
    kernel's start to its last kernel's end, the time some kernel runs (busy) and the rest
    (idle: launch and dependency gaps inside the graph), and each kernel's start offset and
    duration by its place in the graph. Where the kernels do not split evenly into replays
    (the profiler lost some), only their count is given."""
    n = len(kernels)
    if replays <= 0 or n == 0 or n % replays:
        return {"kernels_seen": n, "replays": replays, "uneven": True}
    k = n // replays
    per = [kernels[i * k : (i + 1) * k] for i in range(replays)]
    spans, busy = [], []
    for rep in per:
        t0 = min(s for _, s, _ in rep)
        spans.append(max(s + d for _, s, d in rep) - t0)
        covered, end = 0.0, t0
        for _, s, d in sorted(rep, key=lambda x: x[1]):
            if s + d > end:
                covered += s + d - max(s, end)
                end = s + d
        busy.append(covered)
    # A kernel is known by its kind and how many of that kind started before it in its replay
    # (two parallel branches may start in either order from one replay to the next).
    # Its full name (template arguments: tiles, stages, multicast, row class) says which build of
    # the kernel ran, so that two versions' kernels compare like with like.
    by_key: dict[str, list[tuple[float, float]]] = {}
    names: dict[str, str] = {}
    for rep in per:
        t0, seen = rep[0][1], {}
        for name, s, d in rep:
            kind = kernel_kind(name)
            seen[kind] = seen.get(kind, -1) + 1
            key = f"{kind}#{seen[kind]}"
            by_key.setdefault(key, []).append((s - t0, d))
            names.setdefault(key, name)
    med = statistics.median
    return {
        "kernels_per_replay": k,
        "span_us": med(spans),
        "busy_us": med(busy),
        "idle_us": med(s - b for s, b in zip(spans, busy, strict=True)),
        "kernels": {
            key: {
                "start_us": med(s for s, _ in v),
                "us": med(d for _, d in v),
                "replays": len(v),
                "name": names[key][:NAME_CHARS],
            }
            for key, v in by_key.items()
        },
    }


def weight_bytes(counts: np.ndarray) -> int:
    active = int((counts > 0).sum())
    return sum(s.weight_bytes(active) for s in cases.SHAPES)
