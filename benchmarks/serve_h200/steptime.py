"""Decode- and prefill-step time of running vLLM servers, arms interleaved (stdlib only: it runs
on the GPU machine next to the servers, like probe.py).

Why not a sweep: closed-loop GuideLLM windows mix prefill, decode and request turnover, and
their run-to-run spread (CV ~9 % at c128) hides a 5-10 % change in the MoE GEMMs. Here each
sample isolates the quantity the fix changes:

- decode, batch B: B requests sent at once, each generating exactly S tokens (EOS ignored,
  greedy), then B fresh requests generating S + D tokens. The second batch runs D more decode
  steps at batch B than the first, with the same prefill, HTTP and scheduling work, so
  (wall_long - wall_short) / D is the time of one decode step at batch B.
- prefill: P requests with long prompts and P with short ones, one token each: the difference
  is the prefill of the long prompts' extra tokens (one or two chunks).

With `--step-times ROOT` (each server started with `VLLM_H20_STEP_TIMES=ROOT/NAME`, as
`h200.sh serve` does), every sample also carries the GPU's side, from the engine's own per-step
CUDA events (vllm_h20/serve/steptimes.py): for decode, the median GPU time of the long batch's
steps that ran exactly B requests (`gpu_step_ms`, and the forward alone, `forward_ms`); for
prefill, the long batch's summed GPU step time minus the short one's. Host jitter, HTTP and
scheduling then stay out of the comparison altogether. A server whose folder holds no step log
stops the run in one line (exit 1, the samples so far kept); a batch that never ran whole in
one step gets a one-line warning, its samples wall time only.

Every sample uses prompts no server has seen (prefix caching cannot skip a prefill), the same
prompts for every arm of a repeat. Arms run one at a time in an order that alternates each
repeat (A B C D, D C B A, ...), so a slow drift of the machine lands on every arm alike.
Results go to a JSON file after each sample; a rerun with the same file resumes.

    python steptime.py --out DIR fix=8001 stock=8002 triton=8003 deepgemm=8004
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Where the step-time log's reader lives; the GPU machine runs this script from the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm_h20.serve.steptimes import read as read_steps  # noqa: E402

# The engine's log thread writes a step this long after it completed (steptimes._POLL_S x 3).
LOG_LAG_S = 0.3

# make_model.py's byte-level tokenizer gives ~5.8 tokens per word (probe.py's note).
WORDS = ("expert", "router", "kernel", "tensor", "cache", "token", "batch", "scale", "block",
         "stream", "graph", "warp", "tile", "shard", "layer", "gate", "weight")  # fmt: skip


def prompts(seed: int, n: int, words: int, identical: bool = False) -> list[str]:
    """n prompts of `words` words, unique to this seed (a number and shuffled words); identical:
    n copies of one (--identical: greedy, every token of a decode step on the same experts)."""
    rng = random.Random(seed)
    if identical:
        return [f"{seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))] * n
    return [f"{seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def complete(url: str, model: str, prompt: str, tokens: int, timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def batch_wall(url: str, model: str, texts: list[str], tokens: int, timeout: float) -> dict:
    """Send every prompt at once; the wall time until the last answer, and the token counts."""
    with ThreadPoolExecutor(len(texts)) as ex:
        start, t0 = time.time(), time.perf_counter()
        futs = [ex.submit(complete, url, model, t, tokens, timeout) for t in texts]
        out = [f.result() for f in futs]
        wall = time.perf_counter() - t0
    gen = [o["usage"]["completion_tokens"] for o in out]
    if any(g != tokens for g in gen):
        raise RuntimeError(f"{model}: asked for {tokens} tokens, got {min(gen)}-{max(gen)}")
    prompt = [o["usage"]["prompt_tokens"] for o in out]
    return {"wall_s": wall, "prompt_tokens": sum(prompt), "window": (start, start + wall)}


def shapes(a) -> list[dict]:
    """The measured shapes: decode at each batch, then the prefill pair."""
    out = [{"shape": f"decode-{b}", "kind": "decode", "batch": b, "short_tokens": a.short_tokens,
            "long_tokens": a.short_tokens + a.decode_steps, "words": a.decode_words,
            "identical": a.identical} for b in a.batch]  # fmt: skip
    if a.prefill_batch:
        name = f"prefill-{a.prefill_batch}x{a.prefill_words}w"
        out.append({"shape": name, "kind": "prefill", "batch": a.prefill_batch,
                    "short_words": 2, "words": a.prefill_words,
                    "identical": a.identical})  # fmt: skip
    return out


def gpu_side(steps: list[dict], shape: dict, short: tuple, long: tuple) -> dict:
    """The GPU's step time for one sample from the engine's step log (`steps`, all of this
    server's), given the two batches' (start, end) windows. Decode: the median over the long
    batch's steps that ran exactly `batch` requests, one token each; prefill: the long batch's
    summed GPU step time minus the short one's. Empty when the log has no such step."""

    def within(w):
        return [s for s in steps if w[0] <= s["t"] <= w[1]]

    if shape["kind"] == "decode":
        b = shape["batch"]
        full = [s for s in within(long) if s["tokens"] == b and s["reqs"] == b]
        if not full:
            return {}
        return {"gpu_step_ms": statistics.median(s["gpu_ms"] for s in full),
                "forward_ms": statistics.median(s["forward_ms"] for s in full),
                "host_step_ms": statistics.median(s["host_ms"] for s in full),
                "gpu_steps": len(full), "padded": sorted({s["padded"] for s in full})}  # fmt: skip
    a, b = within(short), within(long)
    if not a or not b:
        return {}
    return {"gpu_step_ms": sum(s["gpu_ms"] for s in b) - sum(s["gpu_ms"] for s in a),
            "forward_ms": sum(s["forward_ms"] for s in b) - sum(s["forward_ms"] for s in a),
            "gpu_steps": len(b)}  # fmt: skip


class NoStepLog(RuntimeError):
    """--step-times names a folder where the server logs no step."""


def sample(url: str, model: str, shape: dict, seed: int, timeout: float,
           step_log: Path | None = None) -> dict:  # fmt: skip
    b, same = shape["batch"], shape["identical"]
    if shape["kind"] == "decode":
        short = batch_wall(url, model, prompts(seed, b, shape["words"], same),
                           shape["short_tokens"], timeout)  # fmt: skip
        long = batch_wall(url, model, prompts(seed + 1, b, shape["words"], same),
                          shape["long_tokens"], timeout)  # fmt: skip
        steps = shape["long_tokens"] - shape["short_tokens"]
        out = {"short_s": short["wall_s"], "long_s": long["wall_s"], "steps": steps,
               "step_s": (long["wall_s"] - short["wall_s"]) / steps,
               "prompt_tokens": long["prompt_tokens"]}  # fmt: skip
    else:
        short = batch_wall(url, model, prompts(seed, b, shape["short_words"], same), 1, timeout)
        long = batch_wall(url, model, prompts(seed + 1, b, shape["words"], same), 1, timeout)
        out = {"short_s": short["wall_s"], "long_s": long["wall_s"],
               "extra_prompt_tokens": long["prompt_tokens"] - short["prompt_tokens"],
               "step_s": long["wall_s"] - short["wall_s"]}  # fmt: skip
    # When each batch ran (Unix time): the engines' step logs can be re-read for any sample.
    out.update(short_window=list(short["window"]), long_window=list(long["window"]))
    if step_log is not None:
        time.sleep(LOG_LAG_S)
        steps = read_steps(step_log)
        if not steps:
            raise NoStepLog(f"{step_log} holds no step log (steps-*.jsonl) after a sample: start "
                            f"the server with VLLM_H20_STEP_TIMES={step_log}, or leave out "
                            f"--step-times")  # fmt: skip
        out.update(gpu_side(steps, shape, short["window"], long["window"]))
    return out


def arm_order(arms: list[str], rep: int) -> list[str]:
    """A B C D on even repeats, D C B A on odd ones: every arm's mean position is the same."""
    return list(arms) if rep % 2 == 0 else list(reversed(arms))


def servers(specs: list[str]) -> dict[str, str]:
    out = {}
    for s in specs:
        name, _, port = s.partition("=")
        if not name or not port:
            sys.exit(f"steptime: {s!r}: expected NAME=PORT or NAME=URL")
        out[name] = f"http://127.0.0.1:{port}" if port.isdigit() else port.rstrip("/")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("servers", nargs="+", metavar="NAME=PORT", help="the arms, in A B C D order")
    ap.add_argument("--out", type=Path, required=True, help="folder for steptime.json")
    ap.add_argument("--batch", type=int, nargs="*", default=[64, 128, 256],
                    help="decode batches (none: the prefill shape alone)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=6, help="samples per arm and shape")
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=128, help="D: the long batch's extra steps")
    ap.add_argument("--decode-words", type=int, default=11, help="prompt words (~64 tokens)")
    ap.add_argument("--prefill-batch", type=int, default=8, help="0: no prefill shape")
    ap.add_argument("--prefill-words", type=int, default=170, help="~1,000 tokens per prompt")
    ap.add_argument("--warmup", type=int, default=1, help="untimed samples per arm and shape")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--identical", action="store_true",
                    help="one prompt per batch, greedy: the concentrated-routing case")  # fmt: skip
    ap.add_argument(
        "--step-times",
        type=Path,
        default=None,
        metavar="ROOT",
        help="ROOT/NAME: each server's VLLM_H20_STEP_TIMES folder (GPU step times)",
    )
    a = ap.parse_args(argv)
    if not a.batch and not a.prefill_batch:
        ap.error("nothing to measure: give --batch sizes or a --prefill-batch")
    arms = servers(a.servers)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "steptime.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    # More repeats or another timeout may resume a file; any other setting needs its own.
    config = {k: v for k, v in vars(a).items()
              if k not in ("out", "servers", "repeats", "timeout", "step_times")}  # fmt: skip
    if res and res.get("config") != config:
        sys.exit(f"steptime: {path} was measured with other settings; use another --out")
    res.update(command="python benchmarks/serve_h200/steptime.py " + " ".join(argv or sys.argv[1:]),
               config=config, arms=list(arms))  # fmt: skip
    res.setdefault("samples", [])
    done = {(s["shape"], s["rep"], s["arm"]) for s in res["samples"]}
    warned: set[tuple[str, str]] = set()
    for si, shape in enumerate(shapes(a)):
        todo = {(shape["shape"], r, arm) for r in range(a.repeats) for arm in arms} - done
        if not todo:
            continue
        # Warm-ups run again on a resume: a server's first batch after an idle minute stalled
        # (round 4: 1.2 s), which a repeat must not absorb.
        res["samples"] = [s for s in res["samples"]
                          if not (s["shape"] == shape["shape"] and s["rep"] < 0)]  # fmt: skip
        for rep in range(-a.warmup, a.repeats):
            for arm in arm_order(list(arms), rep):
                if (shape["shape"], rep, arm) not in todo and rep >= 0:
                    continue
                seed = a.seed + 100_000 * si + 1_000 * (rep + a.warmup)
                try:
                    log = a.step_times / arm if a.step_times else None
                    s = sample(arms[arm], arm, shape, seed, a.timeout, log)
                    if (
                        log is not None
                        and "gpu_step_ms" not in s
                        and (arm, shape["shape"]) not in warned
                    ):
                        warned.add((arm, shape["shape"]))
                        print(f"steptime: warning: {log} has no step of {arm}'s "
                              f"{shape['shape']} batch (batch {shape['batch']} never ran whole): "
                              f"its samples carry wall time only", file=sys.stderr)  # fmt: skip
                except (OSError, RuntimeError, KeyError, ValueError) as e:
                    path.write_text(json.dumps(res, indent=1))
                    print(f"steptime: {arm} {shape['shape']} rep {rep}: {e}", file=sys.stderr)
                    return 1
                res["samples"].append({"shape": shape["shape"], "kind": shape["kind"],
                                       "batch": shape["batch"], "rep": rep, "arm": arm,
                                       "time": time.time(), **s})  # fmt: skip
                path.write_text(json.dumps(res, indent=1))  # each sample: a cut call keeps it
                tag = "warm-up" if rep < 0 else f"rep {rep}"
                walls = f"short {s['short_s']:.3f} s, long {s['long_s']:.3f} s"
                if "gpu_step_ms" in s:
                    walls += f"; GPU {s['gpu_step_ms']:.3f} ms ({s['gpu_steps']} steps)"
                print(f"{shape['shape']:>16} {tag:>8} {arm:>9}: {s['step_s'] * 1e3:8.3f} ms "
                      f"({walls})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
