"""Tune vLLM's Triton FP8 MoE kernel (fp8_w8a8, 128x128 block scales) for the journey model's
routed experts on this GPU and write the config file vLLM looks up (`VLLM_TUNED_CONFIG_FOLDER`),
so the decision's Triton arm (`v4triton`) runs tuned tiles: vLLM ships no config for these
shapes (E=384, N=2304 on any GPU, nor the EP8 user's E=48), and serving round 5's Triton arm ran
on vLLM's default config, which its logs said.

vLLM's own tuner (`benchmarks/kernels/benchmark_moe.py --tune`) is not in the wheel and needs
Ray; this one times the same operator the server runs (`fused_experts` with vLLM's
`override_config`, CUDA graphs of back-to-back calls, uniform random top-k routing as vLLM's
tuner uses) over a smaller space sized for a lease (`search_space`), always including vLLM's
default config for the batch size, and then times the winner against that default in
interleaved rounds: the ratio printed per batch size has its n and 95 % CI.

    python benchmarks/journey_h200/triton_tune.py MODEL_DIR --out DIR [--batch-sizes 1 8 ...]

MODEL_DIR: a checkpoint's config.json (the release's or the conversion's: the same experts).
DIR gets vLLM's file (`E=..,N=..,device_name=..,dtype=fp8_w8a8,block_shape=[128,128].json`)
and `tune.json` (every timing; a cut run resumes from it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from precompile import read_config  # noqa: E402

from vllm_h20._io import write_json_atomic  # noqa: E402
from vllm_h20.bench.stats import paired_ratio_ci  # noqa: E402

BLOCK = (128, 128)  # the conversion's weight block (n, k)
# The decision's decode tiers (one token per sequence per step) and its prefill's chunks (1,024
# tokens per sequence, up to vLLM's 8,192 batched tokens): vLLM picks the nearest tuned size.
BATCH_SIZES = (1, 8, 32, 64, 128, 256, 1024, 4096, 8192)
CALLS_PER_GRAPH = 10
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


@dataclass(frozen=True)
class Experts:
    """One MoE layer's routed experts as vLLM holds them: w13 [E, 2N, K], w2 [E, K, N]."""

    experts: int
    hidden: int  # K
    inter: int  # N, the w2 GEMM's K (vLLM's config files are named by it)
    top_k: int


def experts_of(cfg: dict) -> Experts:
    """The routed experts of a DeepSeek-style config.json (V4's synth writes these keys)."""
    try:
        keys = ("n_routed_experts", "hidden_size", "moe_intermediate_size", "num_experts_per_tok")
        return Experts(*(int(cfg[k]) for k in keys))
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"triton_tune: config.json has no routed-expert shape ({e!r})") from None


def search_space(m: int, block: tuple[int, int] = BLOCK) -> list[dict[str, int]]:
    """Candidate configs for batch size m. The kernel reads one weight scale per K step, so
    BLOCK_SIZE_K is the quant block; N tiles divide the quant block (vLLM's default uses 64 at
    small batches). M tiles follow the rows per expert: a decode batch gives each touched expert
    a row or two, so 16 alone; larger batches try 32-128."""
    bn, bk = block
    tiles_m = (16,) if m <= 64 else (16, 32, 64) if m <= 512 else (32, 64, 128)
    space = []
    for tm in tiles_m:
        for tn in (n for n in (64, 128) if bn % n == 0):
            for g in (1, 32):  # vLLM's default uses these two
                for w in (4, 8):
                    for s in (3, 4):
                        space.append(dict(zip(KEYS, (tm, tn, bk, g, w, s), strict=True)))
    return space


def key_of(cfg: dict[str, int]) -> str:
    """A config's identity in tune.json (its kernel parameters, in a fixed order)."""
    return ",".join(f"{k}={cfg[k]}" for k in KEYS)


def best_of(timings: dict[str, float]) -> str:
    """The fastest config key; a failed config (launch error) is timed as inf."""
    ok = {k: t for k, t in timings.items() if t < float("inf")}
    if not ok:
        raise ValueError("no config ran")
    return min(ok, key=ok.get)


def vllm_file(progress: dict[str, Any]) -> dict[str, Any]:
    """vLLM's config file from the finished batch sizes: {"M": config}, with SPLIT_K as vLLM's
    own default carries it."""
    doc = {}
    for m, rec in sorted(progress["sizes"].items(), key=lambda kv: int(kv[0])):
        if "chosen" in rec:
            doc[m] = {**rec["configs"][rec["chosen"]], "SPLIT_K": 1}
    return doc


# ------------------------------------------------------------------------------- GPU side
def _weights(torch, ex: Experts):
    """Random FP8 experts with constant block scales, made an expert at a time (the float32
    temporary of all 384 would not fit)."""
    fp8 = torch.float8_e4m3fn
    e, k, n = ex.experts, ex.hidden, ex.inter
    w1 = torch.empty(e, 2 * n, k, dtype=fp8, device="cuda")
    w2 = torch.empty(e, k, n, dtype=fp8, device="cuda")
    for i in range(e):
        w1[i] = (torch.randn(2 * n, k, device="cuda") * 0.5).to(fp8)
        w2[i] = (torch.randn(k, n, device="cuda") * 0.5).to(fp8)
    s1 = torch.full((e, 2 * n // BLOCK[0], k // BLOCK[1]), 1e-2, device="cuda")
    s2 = torch.full((e, k // BLOCK[0], n // BLOCK[1]), 1e-2, device="cuda")
    return w1, w2, s1, s2


class Op:
    """`fused_experts` at one batch size, as a CUDA graph of CALLS_PER_GRAPH calls per config."""

    def __init__(self, torch, ex: Experts, weights, m: int):
        from vllm.model_executor.layers.fused_moe import fused_experts, override_config
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        self.torch, self.m = torch, m
        self.graph_error: str | None = None  # set when capture failed: eager calls since
        w1, w2, s1, s2 = weights
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, ex.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        scores = torch.rand(m, ex.experts, device="cuda", generator=g)
        tw, ids = scores.topk(ex.top_k, dim=-1)
        tw = (tw / tw.sum(-1, keepdim=True)).float()
        ids = ids.to(torch.int32)
        qc = fp8_w8a8_moe_quant_config(w1_scale=s1, w2_scale=s2, block_shape=list(BLOCK))
        self._override = override_config

        def call():
            return fused_experts(x, w1, w2, tw, ids, quant_config=qc)

        self._call = call

    def graph(self, cfg: dict | None):
        """CALLS_PER_GRAPH calls of the op under `cfg` (None: vLLM's own choice, no file), as a
        replay of a captured CUDA graph; where capture fails, as eager calls (then the host's
        launch time is in small batches' timings, and tune.json says so)."""
        torch = self.torch
        with self._override(cfg):
            self._call()  # compiles this config's kernels outside the capture
            torch.cuda.synchronize()
            if self.graph_error is None:
                try:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(CALLS_PER_GRAPH):
                            self._call()
                    return g.replay
                except RuntimeError as e:
                    self.graph_error = f"{type(e).__name__}: {str(e)[:300]}"
                    torch.cuda.synchronize()

        def eager():
            with self._override(cfg):
                for _ in range(CALLS_PER_GRAPH):
                    self._call()

        return eager

    def time_us(self, replay, reps: int = 3) -> float:
        """Median microseconds per call over `reps` replays (after one warm replay)."""
        torch = self.torch
        replay()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / CALLS_PER_GRAPH)
        return statistics.median(ts)


def tune_size(op: Op, ex: Experts, rec: dict, save) -> None:
    """Time every candidate of one batch size (resuming those already in `rec`), pick the
    fastest, then the winner against vLLM's default in interleaved rounds."""
    from vllm.model_executor.layers.fused_moe.fused_moe import get_default_config

    default = get_default_config(op.m, ex.experts, ex.inter, ex.hidden, ex.top_k, "fp8_w8a8",
                                 list(BLOCK))  # fmt: skip
    default = {k: default[k] for k in KEYS}
    cands = [default, *[c for c in search_space(op.m) if c != default]]
    rec.setdefault("configs", {})
    rec.setdefault("us", {})
    rec["default"] = key_of(default)
    t0 = time.time()
    for i, cfg in enumerate(cands):
        k = key_of(cfg)
        if k in rec["us"]:
            continue
        try:
            rec["us"][k] = op.time_us(op.graph(cfg))
        except Exception as e:  # a config the GPU cannot launch (shared memory, registers)
            rec["us"][k] = float("inf")
            rec.setdefault("errors", {})[k] = f"{type(e).__name__}: {str(e)[:200]}"
        rec["configs"][k] = cfg
        if i % 8 == 7:
            save()
            print(f"  M={op.m}: {i + 1}/{len(cands)} configs, {time.time() - t0:.0f} s",
                  flush=True)  # fmt: skip
    rec["best"] = best_of(rec["us"])
    # The winner against the default, interleaved (a drift hits both alike): n rounds.
    gb, gd = op.graph(rec["configs"][rec["best"]]), op.graph(default)
    best_us, default_us = [], []
    for _ in range(5):
        best_us.append(op.time_us(gb))
        default_us.append(op.time_us(gd))
    ci = paired_ratio_ci(default_us, best_us)
    rec["check"] = {"n": ci.n, "best_us": best_us, "default_us": default_us,
                    "speedup": ci.ratio, "ci_low": ci.low, "ci_high": ci.high}  # fmt: skip
    rec["chosen"] = chosen(rec)
    rec["cuda_graphs"] = op.graph_error or True
    save()


def chosen(rec: dict) -> str:
    """What the file gets: the winner, unless the interleaved check found it slower than the
    default (a screening timing that was luck); inside the noise the winner stays, as vLLM's
    tuner keeps its fastest."""
    return rec["default"] if rec["check"]["ci_high"] < 1.0 else rec["best"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", type=Path, help="a checkpoint's folder (its config.json)")
    ap.add_argument("--out", type=Path, required=True, help="VLLM_TUNED_CONFIG_FOLDER to write")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES),
                    help="token counts to tune (default: the decision's tiers)")  # fmt: skip
    a = ap.parse_args(argv)
    ex = experts_of(read_config(a.model, "triton_tune"))
    # vLLM must not read a file of ours while its default is measured.
    os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    import torch
    import triton
    from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name

    a.out.mkdir(parents=True, exist_ok=True)
    prog_path = a.out / "tune.json"
    progress = json.loads(prog_path.read_text()) if prog_path.is_file() else {"sizes": {}}
    progress.update(experts=ex.__dict__, gpu=torch.cuda.get_device_name(),
                    triton=triton.__version__, calls_per_graph=CALLS_PER_GRAPH)  # fmt: skip
    name = get_config_file_name(ex.experts, ex.inter, "fp8_w8a8", list(BLOCK))
    weights = _weights(torch, ex)
    print(f"triton_tune: {name}; batch sizes {a.batch_sizes}", flush=True)
    print("     M  configs  default us  best us  best vs default (95% CI, n=5)  written")
    for m in a.batch_sizes:
        rec = progress["sizes"].setdefault(str(m), {})
        if "chosen" not in rec:
            tune_size(Op(torch, ex, weights, m), ex, rec,
                      lambda: write_json_atomic(prog_path, progress))  # fmt: skip
            doc = {**vllm_file(progress), "triton_version": triton.__version__}
            write_json_atomic(a.out / name, doc)
        c = rec["check"]
        print(f"{m:6d}  {len(rec['us']):7d}  {statistics.median(c['default_us']):10.1f}  "
              f"{statistics.median(c['best_us']):7.1f}  {c['speedup']:.3f}x "
              f"({c['ci_low']:.3f}-{c['ci_high']:.3f})  {rec['chosen']}", flush=True)  # fmt: skip
    print(f"wrote {a.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
