"""Compile vLLM 0.26's DeepGEMM kernels for DeepSeek-V4's FP8 linears and O projection, for every
batch size, in parallel, before the servers start.

vLLM 0.26 serves V4's FP8 linears (and the O projection's grouped `fp8_einsum`) with its vendored
DeepGEMM, which JIT-compiles one kernel per configuration its heuristic picks for a token count:
block sizes, pipeline stages and TMA multicast change with the number of waves over the GPU's SMs.
h200.sh keeps vLLM's own warm-up off (`VLLM_DEEP_GEMM_WARMUP=skip`: one process, one kernel at a
time, at every start), so each new configuration compiled on the request path, 3-8 s with the
engine stalled. Journey lease 3 listed vLLM's DeepGEMM cache: 102 kernels over seven GEMM
shapes, 48 compiled during start-up, 54 after it (47 during the decode sweep, whose cells with a
compile were the slow ones).
DeepGEMM keeps compiled kernels in a disk cache every process reads (`$VLLM_CACHE_ROOT/deep_gemm`),
so compiling each configuration once here, many at a time, lets the servers load them instead.

Each GEMM is called as vLLM 0.26 calls it, with vLLM's own weight post-processing and wrappers,
for every token count from 1 to --max-tokens (the same M values as VLLM_DEEP_GEMM_WARMUP=full);
the token range of a GEMM is split over processes:

    python benchmarks/journey_h200/deepgemm_precompile.py MODEL_DIR [--max-tokens 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from precompile import add_pool_args, read_config, write_json  # noqa: E402

BLOCK = 128  # V4's FP8 block size (weight 128x128, activations 1x128)
# A call slower than this compiled a kernel or loaded one from the disk cache (a launch of a
# loaded kernel takes well under a millisecond); only the cache's new folders count as compiled
# (journey lease 4: 9 slow calls, 4 new kernels).
SLOW_S = 0.5


@dataclass(frozen=True)
class Gemm:
    """One DeepGEMM problem shape of the model: out[M, n] = a[M, k] @ w[n, k]^T, or with
    `groups` > 1 the O projection's einsum over `groups` weight matrices of [n, k]."""

    name: str
    n: int
    k: int
    groups: int = 1


def gemm_shapes(cfg: dict) -> list[Gemm]:
    """The FP8 GEMMs vLLM 0.26's DeepSeek-V4 model runs on DeepGEMM at tensor parallel 1, one per
    distinct shape (`models/deepseek_v4/attention.py`, `nvidia/model.py`): the fused q/kv down
    projection, wq_b, the grouped wo_a einsum, wo_b, the indexer's wq_b on layers with
    compression ratio 4, and the shared experts' gate_up and down projections. The compressors
    and the router are BF16 (no quant_config)."""
    try:
        h, q, hd = cfg["hidden_size"], cfg["q_lora_rank"], cfg["head_dim"]
        heads, groups, o = cfg["num_attention_heads"], cfg["o_groups"], cfg["o_lora_rank"]
        shared = (cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"]
        indexer = 4 in cfg.get("compress_ratios", [])
        idx = cfg["index_n_heads"] * cfg["index_head_dim"] if indexer else 0
    except KeyError as e:
        raise ValueError(f"lacks {e.args[0]}: not a DeepSeek-V4 config") from None
    shapes = [
        Gemm("fused_wqa_wkv", q + hd, h),
        Gemm("wq_b", heads * hd, q),
        Gemm("wo_a", o, heads * hd // groups, groups),
        Gemm("wo_b", h, groups * o),
    ]
    if idx:
        shapes.append(Gemm("indexer.wq_b", idx, q))
    if shared:
        shapes += [
            Gemm("shared_experts.gate_up_proj", 2 * shared, h),
            Gemm("shared_experts.down_proj", h, shared),
        ]
    out: dict[tuple[int, int, int], Gemm] = {}
    for g in shapes:  # one entry per shape: the kernels are the same whatever the layer
        key = (g.n, g.k, g.groups)
        out[key] = Gemm(f"{out[key].name}+{g.name}", *key) if key in out else g
    return list(out.values())


def tasks(shapes: list[Gemm], max_tokens: int, splits: int) -> list[tuple[Gemm, int, int]]:
    """Each GEMM's token counts 1..max_tokens in `splits` contiguous ranges (lo, hi inclusive):
    neighbouring token counts mostly share a configuration, so a range compiles each of its
    configurations once and ranges overlap only at their edges."""
    step = math.ceil(max_tokens / splits)
    return [
        (g, lo, min(lo + step - 1, max_tokens))
        for g in shapes
        for lo in range(1, max_tokens + 1, step)
    ]


def cached_kernels(cache: Path) -> set[str]:
    """The kernels in DeepGEMM's disk cache (one folder each, written whole by DeepGEMM)."""
    return {p.name for p in (cache / "cache").glob("kernel.*") if p.is_dir()}


def listing(cache: Path) -> list[str]:
    """One line per kernel in DeepGEMM's disk cache, oldest first: when it was compiled (its
    cubin's time, UTC), its folder and its template arguments (the configuration DeepGEMM
    chose: shape, block sizes, stages, multicast, SM count), whitespace removed."""
    rows = []
    for d in (cache / "cache").glob("kernel.*"):
        src, cubin = d / "kernel.cu", d / "kernel.cubin"
        if not (src.is_file() and cubin.is_file()):
            continue  # a kernel still compiling
        text = src.read_text(errors="replace")
        start = text.find("_impl<")
        args = text[start + 6 : text.find(">);", start)] if start >= 0 else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(cubin.stat().st_mtime))
        rows.append(f"{when} {d.name} {''.join(args.split())}")
    return sorted(rows)


def parse_listing(lines: list[str]) -> list[tuple[str, str, list[str]]]:
    """(time, kernel name, template arguments) per line of `listing`."""
    out = []
    for line in lines:
        day, clock, folder, *args = line.split(" ", 3)
        name = folder.removeprefix("kernel.").rsplit(".", 1)[0]
        out.append((f"{day} {clock}", name, args[0].split(",") if args and args[0] else []))
    return out


_W: dict = {}


def _init() -> None:
    """Per process: vLLM's DeepGEMM wrappers and weight post-processing."""
    try:
        import torch
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            deepgemm_post_process_fp8_weight_block,
        )
        from vllm.models.deepseek_v4.nvidia.ops.o_proj import compute_fp8_einsum_recipe
        from vllm.utils import deep_gemm as dg
    except Exception as e:  # a pool replaces a worker whose initializer raises, endlessly
        _W["error"] = f"cannot import vLLM's DeepGEMM wrappers: {type(e).__name__}: {e}"
        return
    _W.update(
        torch=torch,
        dg=dg,
        post=deepgemm_post_process_fp8_weight_block,
        recipe=compute_fp8_einsum_recipe()[0],
        e8m0=dg.is_deep_gemm_e8m0_used(),
    )


def _weight(g: Gemm):
    """The weight and scales as the server holds them after loading: FP8 [groups*n, k] and
    float32 128x128 block scales, through vLLM's DeepGEMM post-processing (the einsum's as
    ColumnParallelLinear wo_a with is_bmm)."""
    torch = _W["torch"]
    wq = torch.zeros(g.groups * g.n, g.k, dtype=torch.float8_e4m3fn, device="cuda")
    ws = torch.ones(g.groups * g.n // BLOCK, g.k // BLOCK, dtype=torch.float32, device="cuda")
    return _W["post"](
        wq,
        ws,
        (BLOCK, BLOCK),
        use_e8m0=_W["e8m0"],
        is_bmm=g.groups > 1,
        bmm_batch_size=g.groups if g.groups > 1 else 0,
    )


def _call(g: Gemm, w, m: int) -> None:
    """One forward's GEMM at m tokens, with the activation layouts the model passes."""
    torch, dg = _W["torch"], _W["dg"]
    if g.groups == 1:  # DeepGemmFp8BlockScaledMMKernel (vLLM's own warm-up uses these layouts)
        a = torch.zeros(m, g.k, dtype=torch.float8_e4m3fn, device="cuda")
        sa = torch.ones(m, g.k // BLOCK, dtype=torch.float32, device="cuda")
        out = torch.empty(m, g.n, dtype=torch.bfloat16, device="cuda")
        dg.fp8_gemm_nt((a, sa), w, out, is_deep_gemm_e8m0_used=_W["e8m0"])
        return
    # deep_gemm_fp8_o_proj: fused_inv_rope_fp8_quant's [groups, m, k] buffers as [m, groups, k]
    inner, tma_m = g.k // BLOCK, dg.get_tma_aligned_size(m, 4)
    a = torch.zeros(g.groups, m, g.k, dtype=torch.float8_e4m3fn, device="cuda").transpose(0, 1)
    sa = (
        torch.ones(g.groups * inner * tma_m, dtype=torch.float32, device="cuda")
        .as_strided((g.groups, m, inner), (inner * tma_m, 1, tma_m))
        .transpose(0, 1)
    )
    out = torch.empty(m, g.groups, g.n, dtype=torch.bfloat16, device="cuda")
    dg.fp8_einsum("bhr,hdr->bhd", (a, sa), w, out, recipe=_W["recipe"])


def _run(task: tuple[Gemm, int, int]) -> dict:
    """Every token count of one range: its seconds and its slow calls (compiles or cache loads)."""
    g, lo, hi = task
    row = {"gemm": g.name, "lo": lo, "hi": hi, "seconds": 0.0, "slow_calls": 0, "error": ""}
    if "error" in _W:
        return {**row, "error": _W["error"]}
    t0 = time.perf_counter()
    m = lo
    try:
        with _W["torch"].inference_mode():
            w = _weight(g)
            for m in range(lo, hi + 1):
                t = time.perf_counter()
                _call(g, w, m)
                if time.perf_counter() - t > SLOW_S:
                    row["slow_calls"] += 1
            _W["torch"].cuda.synchronize()
    except Exception as e:  # reported per range: the servers then compile the rest themselves
        first = str(e).splitlines()[0][:200] if str(e) else ""
        row["error"] = f"M={m}: {type(e).__name__}: {first}"
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "model", type=Path, nargs="?", help="the V4 checkpoint's folder (its config.json)"
    )
    ap.add_argument(
        "--list",
        type=Path,
        metavar="CACHE",
        help="print the kernels in this DeepGEMM cache folder (when compiled, "
        "configuration) and exit",
    )
    add_pool_args(ap)
    ap.add_argument(
        "--splits",
        type=int,
        default=0,
        help="token ranges per GEMM (default: enough to give every worker one)",
    )
    ap.add_argument("--json", type=Path, help="write the per-range results here")
    a = ap.parse_args(argv)
    if a.list:
        if not (a.list / "cache").is_dir():
            raise SystemExit(
                f"deepgemm_precompile: no DeepGEMM cache in {a.list} (no cache/ folder)"
            )
        print("\n".join(listing(a.list)))
        return 0
    if a.model is None:
        ap.error("give MODEL_DIR (or --list CACHE)")
    if a.max_tokens < 1 or a.workers < 1 or a.splits < 0:
        raise SystemExit("deepgemm_precompile: --max-tokens and --workers must be >= 1")
    try:
        shapes = gemm_shapes(read_config(a.model, "deepgemm_precompile"))
    except ValueError as e:
        raise SystemExit(f"deepgemm_precompile: {a.model / 'config.json'} {e}") from None
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm")
    cache = Path(os.environ.get("DG_JIT_CACHE_DIR") or Path(root) / "deep_gemm")
    if "VLLM_CACHE_ROOT" not in os.environ and "DG_JIT_CACHE_DIR" not in os.environ:
        print(
            f"deepgemm_precompile: VLLM_CACHE_ROOT is not set; compiling into {cache}, which "
            "the servers must share",
            file=sys.stderr,
        )
    splits = a.splits or max(1, math.ceil(a.workers / len(shapes)))
    todo = tasks(shapes, a.max_tokens, splits)
    before = cached_kernels(cache)
    t0 = time.perf_counter()
    rows = []
    with mp.get_context("spawn").Pool(min(a.workers, len(todo)), initializer=_init) as pool:
        for r in pool.imap_unordered(_run, todo):
            rows.append(r)
            print(
                f"  {r['gemm']:<44} M={r['lo']}-{r['hi']:<5} {r['seconds']:6.1f} s "
                f"{r['slow_calls']:3d} slow call(s) {r['error']}",
                flush=True,
            )
    wall = time.perf_counter() - t0
    new = cached_kernels(cache) - before
    failed = [r for r in rows if r["error"]]
    print(
        f"deepgemm_precompile: {len(shapes)} GEMM shapes x 1-{a.max_tokens} tokens in {wall:.0f} s "
        f"({len(todo)} ranges, {min(a.workers, len(todo))} workers): {len(new)} kernels compiled, "
        f"{len(before)} were cached; {len(failed)} range(s) failed"
    )
    write_json(
        a,
        wall,
        cache=str(cache),
        cached_before=len(before),
        compiled=sorted(new),
        shapes=[asdict(g) for g in shapes],
        ranges=rows,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
