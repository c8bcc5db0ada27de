"""Reproduce, with FlashInfer alone, how the SM90 FP8 block-scale fused MoE chooses its kernel.

`flashinfer.fused_moe.cutlass_fused_moe(..., use_deepseek_fp8_block_scale=True)` runs one DeepGEMM
grouped GEMM kernel for every local expert, chosen on the host from `expected_m`, which
`CutlassFp8BlockScaleGemmRunner::getWorkspaceSize` sets to the step's token count
(`expected_m_ = shape_m;` in fp8_blockscale_gemm.cu). `grouped_gemm_dispatch` then takes the
regular kernel (tiled on M: 64- or 128-row tiles) when `expected_m >= 64` on 78-SM GPUs (H20),
`>= 32` elsewhere, the swap-A/B kernel below. With expert parallelism an expert's GEMM sees about
`tokens * top_k / (local_experts * ep_size)` rows: 5 at 288 tokens for DeepSeek-V4.1-Flash on
EP8, padded to 128-row tiles of MMA work. On H20, whose FP8 MMA rate is low next to its memory
bandwidth, that padding, not the weight reads, sets the time.

This script times one EP rank's op (uniform routing, every tier in a CUDA graph) and prints, per
token count, the kernel the stock rule picks, the average rows per expert, the weights the rank
reads, the time, and the time over the weight-streaming floor (bytes / a measured copy
bandwidth): on H20 the floor ratio jumps where the rule switches to the regular kernel while the
rows per expert stay small. `--dry-run` prints the rule's choices without a GPU.

    python reproduce_expected_m.py                    # DeepSeek-V4.1-Flash shapes, EP8 rank 0
    python reproduce_expected_m.py --hidden 7168 --inter 2048 --experts 256 --top-k 8  # V3/R1
"""

from __future__ import annotations

import argparse
import statistics
import sys


def swap_threshold(sms: int) -> int:
    """grouped_gemm_dispatch's m_per_expert_threshold (fp8_blockscale_gemm_kernel.cuh)."""
    return 64 if sms == 78 else 32


def rows_per_expert(tokens: int, top_k: int, slots: int) -> int:
    """The average routed rows per physical expert slot, rounded up (at least 1)."""
    return max(1, -(-tokens * top_k // slots))


def plan(args: argparse.Namespace, sms: int) -> list[dict]:
    """Per token count: the kernel the stock rule picks and the rows an expert really gets."""
    slots = args.experts
    out = []
    for t in args.tokens:
        stock = "regular" if t >= swap_threshold(sms) else "swap_ab"
        avg = rows_per_expert(t, args.top_k, slots)
        by_rows = "regular" if avg >= swap_threshold(sms) else "swap_ab"
        out.append({"tokens": t, "stock_expected_m": t, "stock_kernel": stock,
                    "rows_per_expert": avg, "kernel_for_rows": by_rows})  # fmt: skip
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1,16,32,64,128,192,288,512,1024,2048")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=2304, help="moe_intermediate_size")
    ap.add_argument("--experts", type=int, default=384, help="physical expert slots, all ranks")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--ep-size", type=int, default=8)
    ap.add_argument("--ep-rank", type=int, default=0)
    ap.add_argument("--replays", type=int, default=24)
    ap.add_argument("--sms", type=int, default=None, help="with --dry-run: the GPU's SM count")
    ap.add_argument("--dry-run", action="store_true", help="the rule's choices only, no GPU")
    a = ap.parse_args(argv)
    try:
        a.tokens = [int(x) for x in a.tokens.split(",") if x]
    except ValueError:
        ap.error(f"--tokens {a.tokens!r}: comma-separated integers")
    if a.experts % a.ep_size or not 0 <= a.ep_rank < a.ep_size:
        ap.error(f"--experts {a.experts} must divide by --ep-size {a.ep_size}, rank below it")
    if a.hidden % 128 or a.inter % 128:
        ap.error("--hidden and --inter must be multiples of 128 (block scales)")
    return a


def _print(rows: list[dict], timed: bool) -> None:
    head = "tokens  stock kernel  rows/expert  kernel for rows"
    head += "   weights MB   time ms   floor ms  x floor" if timed else ""
    print(head)
    for r in rows:
        line = (f"{r['tokens']:6d}  {r['stock_kernel']:12s}  {r['rows_per_expert']:11d}  "
                f"{r['kernel_for_rows']:15s}")  # fmt: skip
        if timed:
            line += (f"   {r['weight_bytes'] / 1e6:10.1f}  {r['ms']:8.3f}  {r['floor_ms']:9.3f}"
                     f"  {r['ms'] / r['floor_ms']:7.2f}")  # fmt: skip
        print(line)


def _time(torch, fn, replays: int) -> float:
    """Median CUDA-graph replay time of fn (after a warm-up call), in ms."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(replays + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts[3:])


def _copy_bandwidth(torch) -> float:
    """Bytes per second of a large device-to-device copy (read + write), in a plain kernel."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _time(torch, lambda: b.copy_(a), 10)
    return 2 * a.numel() / (ms / 1e3)


def run(a: argparse.Namespace) -> list[dict]:
    import torch
    from flashinfer.fused_moe import cutlass_fused_moe

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    local = a.experts // a.ep_size
    g = torch.Generator(device="cuda").manual_seed(0)

    def block_fp8(rows: int, cols: int):
        w = (torch.randn(local, rows, cols, generator=g, device="cuda") * 64).clamp(-448, 448)
        s = torch.rand(local, rows // 128, cols // 128, generator=g, device="cuda") * 3e-3 + 1e-3
        return w.to(torch.float8_e4m3fn), s

    w31, s31 = block_fp8(2 * a.inter, a.hidden)  # FlashInfer's fc1 = [w3 (up); w1 (gate)]
    w2, s2 = block_fp8(a.hidden, a.inter)
    expert_bytes = 3 * a.inter * a.hidden  # FP8 bytes of one expert's three matrices
    bw = _copy_bandwidth(torch)
    rows = plan(a, sms)
    first = a.ep_rank * local
    for r in rows:
        t = r["tokens"]
        # Uniform routing: token i picks top_k distinct experts in a rotating pattern.
        ids = (torch.arange(t, device="cuda")[:, None] * a.top_k
               + torch.arange(a.top_k, device="cuda")[None, :]) % a.experts  # fmt: skip
        ids = ids.to(torch.int32)
        scales = torch.full((t, a.top_k), 1.0 / a.top_k, device="cuda")
        x = torch.randn(t, a.hidden, generator=g, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(x)
        mine = ((ids >= first) & (ids < first + local)).any(dim=1)
        active = torch.unique(ids[(ids >= first) & (ids < first + local)]).numel()
        r["weight_bytes"] = active * expert_bytes
        r["floor_ms"] = max(r["weight_bytes"], 1) / bw * 1e3
        r["rank_tokens"] = int(mine.sum())

        def call(x=x, ids=ids, scales=scales, out=out):
            cutlass_fused_moe(x, ids, scales, w31, w2, torch.bfloat16, quant_scales=[s31, s2],
                              ep_size=a.ep_size, ep_rank=a.ep_rank,
                              use_deepseek_fp8_block_scale=True, output=out)  # fmt: skip

        r["ms"] = _time(torch, call, a.replays)
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; copy {bw / 1e12:.2f} TB/s; "
          f"EP{a.ep_size} rank {a.ep_rank}: {local} of {a.experts} experts, top-{a.top_k}, "
          f"hidden {a.hidden}, intermediate {a.inter}; "
          f"stock threshold {swap_threshold(sms)}")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.dry_run:
        sms = a.sms or 78
        print(f"the stock rule on a {sms}-SM GPU (threshold {swap_threshold(sms)}), "
              f"{a.experts} expert slots, top-{a.top_k}:")  # fmt: skip
        _print(plan(a, sms), timed=False)
        return 0
    try:
        import torch

        if not torch.cuda.is_available():
            print("reproduce: no CUDA GPU here (--dry-run prints the rule's choices without one)",
                  file=sys.stderr)  # fmt: skip
            return 2
        rows = run(a)
    except ImportError as e:
        print(f"reproduce: {e.name or e}: needs torch and flashinfer-python", file=sys.stderr)
        return 2
    _print(rows, timed=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
