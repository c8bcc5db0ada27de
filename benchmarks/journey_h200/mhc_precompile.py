"""Compile vLLM 0.26's DeepSeek-V4 mHC TileLang kernels for every batch size, in parallel, before
the servers start.

vLLM 0.26 specializes V4's mHC kernels on a split count that changes every 64 tokens of a batch
(up to ~4k tokens) and its own mHC warm-up is a no-op for the NVIDIA model (it looks for
`hc_pre`/`hc_post` layer methods that model does not have). So every new split count compiles on
the request path, 10-20 s with the engine stalled: journey lease 1 lost its sweep to that, and
its start-up (~4 min) was mostly the same compiles during CUDA-graph capture. TileLang keeps
compiled kernels in a disk cache (`TILELANG_CACHE_DIR`) that every process reads, so compiling
each variant once here, many at a time, lets the servers load them instead. (vLLM 0.33 bounds the
split counts to 1/4/16 and warms them itself, `model_executor/kernels/mhc/warmup.py`.)

It calls vLLM's own mHC entry points with the model's config values (the cache key includes
every scalar argument), one call per kernel variant a forward pass of up to --max-tokens tokens
meets, and prints the seconds each took (a cache hit takes well under one):

    python benchmarks/journey_h200/mhc_precompile.py MODEL_DIR [--max-tokens 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from precompile import add_pool_args, read_config, write_json  # noqa: E402

# The post-norm scale vLLM 0.26's DeepseekV4DecoderLayer passes (hc_post_alpha, not in config).
HC_POST_ALPHA = 2.0


def variants(
    max_tokens: int, hidden: int, hc_mult: int, num_split: Callable[[int, int, int], int]
) -> dict[tuple, int]:
    """The smallest token count that reaches each mHC kernel variant, as vLLM 0.26's
    `kernels/mhc/tilelang.py` chooses them: the first layer's broadcast pre-block splits its
    GEMM over `hidden`, the fused post+pre block over `hc_mult * hidden` (a small-FMA kernel up
    to 16 tokens), each split count a separate compile. `num_split(block_k, k, grid)` is vLLM's
    `compute_num_split` (it reads the GPU's SM count)."""
    out: dict[tuple, int] = {("head",): 1}
    for t in range(1, max_tokens + 1):
        grid = math.ceil(t / 64)
        keys = [("broadcast", num_split(64, hidden, grid))]
        if t <= 16:  # use_small_fma: tile_n and n_splits fixed by the token count
            keys.append(("post-pre-small", 2 if t < 8 else 3, 8 if t < 8 and hidden <= 4096 else 4))
        else:
            keys.append(("post-pre", num_split(64, hc_mult * hidden, grid)))
        for k in keys:
            out.setdefault(k, t)
    return out


def _model_config(model: Path) -> dict:
    """The config values the V4 model passes to the mHC kernels (DeepseekV4DecoderLayer reads
    them from config.json as is; its RMSNorm eps is rms_norm_eps)."""
    c = read_config(model, "mhc_precompile")
    missing = [k for k in ("hidden_size", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "rms_norm_eps")
               if k not in c]  # fmt: skip
    if missing:
        raise SystemExit(f"mhc_precompile: {model / 'config.json'} lacks {', '.join(missing)}: "
                         "not a DeepSeek-V4 config")  # fmt: skip
    return {k: c[k] for k in ("hidden_size", "hc_mult", "hc_eps", "hc_sinkhorn_iters",
                              "rms_norm_eps")}  # fmt: skip


_W: dict = {}


def _init(cfg: dict) -> None:
    """Per process: vLLM's mHC entry points and the model's parameter shapes (values random)."""
    try:
        import torch
        from vllm.model_executor.kernels.mhc import tilelang as mhc
    except Exception as e:  # a pool replaces a worker whose initializer raises, endlessly
        _W["error"] = f"cannot import vLLM's mHC kernels: {type(e).__name__}: {e}"
        return
    h, m = cfg["hidden_size"], cfg["hc_mult"]
    mix = (2 + m) * m
    dev = torch.device("cuda")
    fn = torch.randn(mix, m * h, dtype=torch.float32, device=dev) * 1e-3
    _W.update(torch=torch, mhc=mhc, cfg=cfg, fn=fn,
              fn_broadcast=fn.view(-1, m, h).sum(dim=1),
              scale=torch.ones(3, dtype=torch.float32, device=dev),
              base=torch.zeros(mix, dtype=torch.float32, device=dev),
              norm=torch.ones(h, dtype=torch.bfloat16, device=dev),
              head_fn=torch.randn(m, m * h, dtype=torch.float32, device=dev) * 1e-3,
              head_base=torch.zeros(m, dtype=torch.float32, device=dev),
              head_scale=torch.ones(1, dtype=torch.float32, device=dev))  # fmt: skip


def _run(key: tuple, t: int) -> tuple[tuple, int, float, str]:
    """One call that reaches the variant `key` with `t` tokens; its seconds, or the error."""
    if "error" in _W:
        return key, t, 0.0, _W["error"]
    w, torch, mhc, c = _W, _W["torch"], _W["mhc"], _W["cfg"]
    h, m, eps, hc_eps = c["hidden_size"], c["hc_mult"], c["rms_norm_eps"], c["hc_eps"]
    common = (w["fn"], w["scale"], w["base"], eps, hc_eps, hc_eps, HC_POST_ALPHA,
              c["hc_sinkhorn_iters"])  # fmt: skip
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            x = torch.zeros(t, h, dtype=torch.bfloat16, device="cuda")
            if key[0] == "broadcast":  # the first layer's pre-block (model.py: x.dim() == 2)
                mhc.mhc_pre_broadcast_tilelang(x, *common, norm_weight=w["norm"], norm_eps=eps,
                                               fn_broadcast=w["fn_broadcast"])  # fmt: skip
            elif key[0] == "head":
                mhc.hc_head_fused_kernel_tilelang(
                    torch.zeros(t, m, h, dtype=torch.bfloat16, device="cuda"), w["head_fn"],
                    w["head_scale"], w["head_base"], eps, hc_eps)  # fmt: skip
            else:  # every later pre-block: the previous block's post fused with this pre
                mhc.mhc_fused_post_pre_tilelang(
                    x, torch.zeros(t, m, h, dtype=torch.bfloat16, device="cuda"),
                    torch.zeros(t, m, 1, dtype=torch.float32, device="cuda"),
                    torch.zeros(t, m, m, dtype=torch.float32, device="cuda"), *common,
                    n_splits=1, tile_n=1, norm_weight=w["norm"], norm_eps=eps)  # fmt: skip
            torch.cuda.synchronize()
        err = ""
    except Exception as e:  # reported per variant: the servers then compile that one themselves
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return key, t, time.perf_counter() - t0, err


def _show(r: tuple[tuple, int, float, str]) -> None:
    print(f"  {'/'.join(map(str, r[0])):<22} T={r[1]:<5} {r[2]:6.1f} s {r[3]}", flush=True)


def _run_task(task: tuple[tuple, int]) -> tuple[tuple, int, float, str]:
    return _run(*task)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", type=Path, help="the V4 checkpoint's folder (its config.json)")
    add_pool_args(ap)
    ap.add_argument("--json", type=Path, help="write the per-variant times here")
    a = ap.parse_args(argv)
    if "TILELANG_CACHE_DIR" not in os.environ:
        print(
            "mhc_precompile: TILELANG_CACHE_DIR is not set; using TileLang's default "
            "(~/.tilelang/cache), which the servers must share",
            file=sys.stderr,
        )
    cfg = _model_config(a.model)
    t0 = time.perf_counter()
    # Workers import vLLM and start on the variants that share nothing while this process
    # compiles mhc_post (every fused block above 16 tokens calls it) with the first of those;
    # otherwise each worker would compile it too.
    ctx = mp.get_context("spawn")
    with ctx.Pool(a.workers, initializer=_init, initargs=(cfg,)) as pool:
        _init(cfg)
        if "error" in _W:
            raise SystemExit(f"mhc_precompile: {_W['error']}")
        from vllm.model_executor.kernels.mhc.tilelang_kernels import compute_num_split

        todo = variants(a.max_tokens, cfg["hidden_size"], cfg["hc_mult"], compute_num_split)
        fused = sorted((k for k in todo if k[0] == "post-pre"), key=lambda k: todo[k])
        early = pool.imap_unordered(_run_task, [(k, t) for k, t in todo.items()
                                                if k[0] != "post-pre"])  # fmt: skip
        rows = [_run(fused[0], todo[fused[0]])]
        _show(rows[0])
        late = pool.imap_unordered(_run_task, [(k, todo[k]) for k in fused[1:]])
        for r in itertools.chain(early, late):
            rows.append(r)
            _show(r)
    wall = time.perf_counter() - t0
    failed = [r for r in rows if r[3]]
    print(f"mhc_precompile: {len(rows)} mHC kernel variants for 1-{a.max_tokens} tokens in "
          f"{wall:.0f} s ({a.workers} workers); {len(failed)} failed")  # fmt: skip
    done = [
        {"kernel": r[0][0], "key": list(r[0][1:]), "tokens": r[1], "seconds": round(r[2], 2),
         "error": r[3]}
        for r in rows
    ]  # fmt: skip
    write_json(a, wall, config=cfg, variants=done)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
