"""Ask running vLLM servers what the serving A/B needs besides throughput (stdlib + numpy only:
it runs on the GPU machine next to the servers).

- `compare`: greedy completions of fixed prompts on two servers: first-token logprobs (top 20)
  and how many of the first 64 tokens are identical.
- `routing`: routed rows per expert in single decode steps, from vLLM's own routed-experts
  capture (`enable-return-routed-experts`), at 64 and 256 concurrent requests.
- `profile`: vLLM's torch profiler over a few decode steps under load: the GPU kernels that ran,
  with time per step, and which DeepGEMM MoE kernels (swap-A/B or regular) they were.

    python probe.py compare --out DIR fix=8001 stock=8002
"""

from __future__ import annotations

import argparse
import base64
import gzip
import io
import json
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving mixture-of-experts models on Hopper GPUs",
    "Inference engineers compare throughput and latency",
    "The scheduler gives each expert's rows to the kernel that suits them.",
    "FP8 block scales: one float per 128 x 128 block of weights.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Routing sends every token to six of the 384 experts",
    "A hot expert with hundreds of rows",
]
GREEDY_TOKENS = 64
TOP_LOGPROBS = 20


def post(port: int, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def complete(name: str, port: int, prompt: str, **kw) -> dict:
    body = {"model": name, "prompt": prompt, **kw}
    return post(port, "/v1/completions", body)


def _servers(specs: list[str]) -> list[tuple[str, int]]:
    out = []
    for s in specs:
        name, _, port = s.partition("=")
        if not port.isdigit():
            sys.exit(f"probe: {s!r}: expected NAME=PORT")
        out.append((name, int(port)))
    return out


def cmd_compare(a) -> None:
    (na, pa), (nb, pb) = _servers(a.servers)
    rows = []
    for prompt in PROMPTS:
        res = {}
        for name, port in ((na, pa), (nb, pb)):
            r = complete(name, port, prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                         logprobs=TOP_LOGPROBS, ignore_eos=True,
                         return_tokens_as_token_ids=True)  # fmt: skip
            res[name] = r["choices"][0]["logprobs"]
        ta, tb = res[na]["tokens"], res[nb]["tokens"]
        same = [x == y for x, y in zip(ta, tb, strict=False)]
        prefix = next((i for i, s in enumerate(same) if not s), len(same))
        top_a, top_b = res[na]["top_logprobs"][0], res[nb]["top_logprobs"][0]
        common = sorted(set(top_a) & set(top_b))
        diffs = [abs(top_a[t] - top_b[t]) for t in common]
        margins = [margin(top_a), margin(top_b)]
        rows.append({
            "prompt": prompt,
            "first_token": [ta[0], tb[0]],
            "first_token_top20_common": len(common),
            "first_token_max_abs_logprob_diff": max(diffs) if diffs else None,
            "first_token_logprob": [res[na]["token_logprobs"][0], res[nb]["token_logprobs"][0]],
            # How far each server's best first token is ahead of its second: a greedy token
            # can only flip between the two where the logprob difference exceeds this.
            "first_token_margin": margins,
            "first_token_top20": [top_a, top_b],
            "identical_tokens": sum(same),
            "identical_prefix": prefix,
            "tokens": [ta, tb],
        })  # fmt: skip
        print(f"{prompt[:40]:40s}  first-token top-20 common {len(common):2d}, max |dlogprob| "
              f"{max(diffs) if diffs else float('nan'):.2e} (top-1 margins {margins[0]:.2f}, "
              f"{margins[1]:.2f}); identical {sum(same)}/{len(ta)}, prefix {prefix}")  # fmt: skip
    out = {"servers": [na, nb], "max_tokens": GREEDY_TOKENS, "top_logprobs": TOP_LOGPROBS,
           "temperature": 0, "rows": rows}  # fmt: skip
    # One file per pair: fix vs stock is the A/B, fix vs another MoE path states how far
    # two kernels' rounding moves the same model.
    Path(a.out, f"compare_{na}-{nb}.json").write_text(json.dumps(out, indent=1))


def margin(top: dict[str, float]) -> float:
    """Logprob of the most likely token minus that of the second (inf with one candidate)."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def _words(i: int, n: int) -> str:
    vocab = ["expert", "token", "route", "kernel", "block", "scale", "tile", "wave", "graph",
             "batch", "decode", "prefill", "cache", "rank", "shard", "group"]  # fmt: skip
    return " ".join(vocab[(i * 7 + j * (i % 5 + 3)) % len(vocab)] + str((i * 31 + j) % 97)
                    for j in range(n))  # fmt: skip


def decode_step_counts(per_req: list, k: int, experts: int):
    """Rows per (layer, expert) in decode step k (k >= 1), from each request's capture.

    per_req holds (prompt_tokens, routed) with routed[t, layer, :] the experts token t went to;
    step k forwards the request's generated token k-1, at position prompt_tokens + k - 1."""
    import numpy as np

    layers = per_req[0][1].shape[1]
    counts = np.zeros((layers, experts), dtype=np.int64)
    for plen, arr in per_req:
        for layer in range(layers):
            np.add.at(counts[layer], arr[plen + k - 1, layer].astype(np.int64), 1)
    return counts


def varied_layers(per_req: list) -> list[int]:
    """Layers whose tokens did not all choose the same experts (a dense layer's capture rows
    stay constant; so do a MoE layer's when routing is degenerate)."""
    layers = per_req[0][1].shape[1]
    return [i for i in range(layers)
            if len({tuple(x) for _, arr in per_req for x in arr[:, i].tolist()}) > 1]  # fmt: skip


def uniform_reference(tokens: int, experts: int, top_k: int, trials: int = 200) -> dict:
    """Busiest expert and idle experts of one step if each token picked top_k distinct experts
    uniformly at random (means over trials): what non-degenerate routing looks like."""
    import numpy as np

    rng = np.random.default_rng(0)
    maxes, idle = [], []
    for _ in range(trials):
        picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        c = np.bincount(picks.ravel(), minlength=experts)
        maxes.append(c.max())
        idle.append((c == 0).sum())
    return {"max": float(np.mean(maxes)), "zero": float(np.mean(idle))}


def cmd_routing(a) -> None:
    import numpy as np

    ((name, port),) = _servers(a.servers)
    result = {"server": name, "tiers": []}
    for conc in a.concurrency:

        def one(i: int) -> dict:
            return complete(name, port, _words(i, 12), max_tokens=a.steps + 1,
                            temperature=0.7, seed=i, ignore_eos=True)  # fmt: skip

        with ThreadPoolExecutor(conc) as ex:
            resps = list(ex.map(one, range(conc)))
        per_req = []
        for r in resps:
            enc = r["choices"][0].get("routed_experts")
            if enc is None:
                sys.exit("probe: no routed_experts in the response: start vLLM with "
                         "--enable-return-routed-experts")  # fmt: skip
            arr = np.load(io.BytesIO(base64.b64decode(enc)))  # (tokens-1, layers, top_k)
            per_req.append((r["usage"]["prompt_tokens"], arr))
        steps = [decode_step_counts(per_req, k, a.experts) for k in range(1, a.steps + 1)]
        layers = steps[0].shape[0]
        varied = varied_layers(per_req)
        uniform = uniform_reference(conc, a.experts, a.top_k)
        tier = {
            "concurrency": conc,
            "rows_per_step": conc * a.top_k,
            "mean_rows_per_expert": conc * a.top_k / a.experts,
            "varied_layers": varied,
            "counts": [[c.tolist() for c in s] for s in steps],  # [step][layer][expert]
            "uniform_random": uniform,
        }
        result["tiers"].append(tier)
        s = steps[len(steps) // 2]
        for i in range(layers):
            c = s[i]
            print(f"c{conc} step {len(steps) // 2 + 1} layer {i}: {int(c.sum())} rows, max "
                  f"{int(c.max())} (mean {c.mean():.2f}), {int((c == 0).sum())} experts idle; "
                  f"uniform random: max {tier['uniform_random']['max']:.1f}, idle "
                  f"{tier['uniform_random']['zero']:.0f}")  # fmt: skip
    Path(a.out, f"routing_{name}.json").write_text(json.dumps(result))


def _kernel_events(trace: Path) -> list[dict]:
    with gzip.open(trace, "rt") if trace.suffix == ".gz" else open(trace) as f:
        events = json.load(f).get("traceEvents", [])
    return [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def _kernels(trace: Path) -> list[dict]:
    agg: dict[str, list[float]] = {}
    for e in _kernel_events(trace):
        agg.setdefault(e["name"], []).append(float(e["dur"]))
    return sorted(({"name": n, "calls": len(d), "total_us": sum(d)} for n, d in agg.items()),
                  key=lambda k: -k["total_us"])  # fmt: skip


def _busy_us(trace: Path) -> float:
    """Time the GPU ran at least one kernel: overlapping kernels counted once. The per-expert
    fix's second launch starts beside the first (programmatic dependent launch) and waits for
    it before leaving, so summed kernel durations count that overlap twice."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                   for e in _kernel_events(trace) if "ts" in e)  # fmt: skip
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def template_args(name: str, kernel: str) -> list[str] | None:
    """The top-level template arguments of `kernel<...>` in a demangled kernel name, or None."""
    at = re.search(rf"(?<!\w){re.escape(kernel)}<", name)
    if at is None:
        return None
    depth, start, args = 0, at.end(), []
    for j in range(start, len(name)):
        if name[j] == "<":
            depth += 1
        elif name[j] == ">" and depth:
            depth -= 1
        elif name[j] in ",>" and depth == 0:
            args.append(name[start:j].strip())
            if name[j] == ">":
                return args
            start = j + 1
    return None


def _bits(element: str) -> int | None:
    """Bits of one of Humming's element types (FloatingPointType<bits, exp, mant>,
    IntegerType<signed, bits>, as the demangler prints them)."""
    nums = [int(x) for x in re.findall(r"\d+", element)]
    if element.startswith("FloatingPointType") and nums:
        return nums[0]
    if element.startswith("IntegerType") and nums:
        return nums[-1]
    return None


def humming_precision(kernels: list[dict]) -> dict | None:
    """What Humming's MoE GEMMs ran at, from a profile's kernel names: its one templated kernel,
    `humming<MmaOpClass, ProblemShape, BlockShape, WarpShape, PadShape, ElementA, ElementB, ...>`
    (humming-kernels 0.1.10, include/humming/kernel/humming.cuh), keeps the activation (A) and
    weight (B) types in its name; W4A8 also runs Triton's `_quant_tensor_kernel` on each step's
    activations. None when no Humming GEMM ran. vLLM logs no line naming the activation type,
    and once dropped its input-quant setting silently (vLLM #51661): this is the evidence."""
    calls: dict[str, int] = {}
    quant = 0
    for k in kernels:
        args = template_args(k["name"], "humming")
        if args is not None and len(args) >= 7:
            w, a = _bits(args[6]), _bits(args[5])
            key = f"W{w}A{a}" if w and a else f"{args[6]} x {args[5]}"
            calls[key] = calls.get(key, 0) + int(k["calls"])
        elif "_quant_tensor_kernel" in k["name"]:
            quant += int(k["calls"])
    if not calls:
        return None
    return {"gemm_calls": calls, "activation_quant_calls": quant,
            "precision": "+".join(sorted(calls))}  # fmt: skip


def cmd_profile(a) -> None:
    ((name, port),) = _servers(a.servers)
    trace_dir = Path(a.trace_dir)
    before = set(trace_dir.rglob("*.json*")) if trace_dir.exists() else set()

    def one(i: int) -> None:
        complete(name, port, _words(1000 + i, 12), max_tokens=a.tokens, temperature=0.7,
                 seed=i, ignore_eos=True)  # fmt: skip

    with ThreadPoolExecutor(a.concurrency) as ex:
        futs = [ex.submit(one, i) for i in range(a.concurrency)]
        time.sleep(a.settle_s)  # every stream prefilled: steady decode at full batch
        post(port, "/start_profile")
        time.sleep(a.window_s)
        if all(f.done() for f in futs):
            print(f"{name}: every request ended before the window closed; the trace may hold "
                  "no full-batch decode step (raise --tokens)")  # fmt: skip
        try:  # with max_iterations the profiler may have stopped itself already
            post(port, "/stop_profile")
        except OSError as e:
            print(f"{name}: /stop_profile: {e}")
        for f in futs:
            f.result()
    deadline = time.time() + 120
    new: list[Path] = []
    while time.time() < deadline:
        new = [p for p in trace_dir.rglob("*.json*") if p not in before]
        if new and all(p.stat().st_size > 0 for p in new):
            sizes = [p.stat().st_size for p in new]
            time.sleep(2)
            if sizes == [p.stat().st_size for p in new]:
                break
        time.sleep(1)
    if not new:
        sys.exit(f"probe: no trace appeared in {trace_dir} within 120 s")
    trace = max(new, key=lambda p: p.stat().st_size)
    ks = _kernels(trace)
    total = sum(k["total_us"] for k in ks)
    out = {
        "server": name,
        "concurrency": a.concurrency,
        "trace": trace.name,
        "trace_bytes": trace.stat().st_size,
        "kernel_us_total": total,
        "gpu_busy_us": _busy_us(trace),
        "kernels": ks,
    }
    humming = humming_precision(ks)
    if humming:
        out["humming"] = humming
        print(f"{name}: Humming's MoE GEMMs ran {humming['precision']} ({humming['gemm_calls']}; "
              f"activation quantization {humming['activation_quant_calls']} calls)")  # fmt: skip
    Path(a.out, f"profile_{name}.json").write_text(json.dumps(out, indent=1))
    print(f"{name}: {trace.name}, {len(ks)} kernels, {total / 1e3:.1f} ms of GPU kernel time, "
          f"GPU busy {out['gpu_busy_us'] / 1e3:.1f} ms")  # fmt: skip
    for k in ks[:12]:
        print(f"  {k['total_us'] / total:6.1%} {k['calls']:6d}x  {k['name'][:110]}")


# The batch shapes the sweeps meet: (concurrency, prompt words, new tokens); the first waves
# mix prefill chunks with decode, as a sweep's first seconds do. make_model.py's byte-level
# tokenizer gives ~5.8 tokens per word: 11 words ~ the decode spec's 64-token prompts, 175 ~ the
# prefill spec's 1,024 (round 3 asked for 700 words, ~4,100 tokens: over max-model-len, HTTP 400).
WAVES = [(64, 11, 16), (128, 11, 16), (256, 11, 16), (4, 175, 1), (16, 175, 1), (64, 11, 16)]


def cmd_warm(a) -> None:
    """Send the sweeps' batch shapes once, untimed by any sweep, and time each wave: a server
    that compiles kernels on the request path shows it here (its first waves take seconds
    longer than the repeat of the first wave at the end), and the sweeps then measure serving,
    not compilation. A wave the server refuses is recorded with its error; the rest still run."""
    out = Path(a.out, "warm.json")
    rows = json.loads(out.read_text()) if out.exists() else []
    failed = []
    for name, port in _servers(a.servers):
        for w, (conc, words, new) in enumerate(WAVES):
            t0 = time.time()
            prompts = [_words(5000 + 1000 * w + i, words) for i in range(conc)]
            error = None
            with ThreadPoolExecutor(conc) as ex:
                kw = {"max_tokens": new, "temperature": 0.7, "ignore_eos": True}
                futs = [ex.submit(complete, name, port, text, seed=i, **kw)
                        for i, text in enumerate(prompts)]  # fmt: skip
                for f in futs:
                    try:
                        f.result()
                    except OSError as e:  # urllib's HTTPError and URLError are OSErrors
                        error = error or f"{type(e).__name__}: {e}"
            rows.append({"server": name, "wave": w, "concurrency": conc, "prompt_words": words,
                         "max_tokens": new, "seconds": round(time.time() - t0, 2),
                         "error": error})  # fmt: skip
            out.write_text(json.dumps(rows, indent=1))  # each wave at once: a cut call keeps it
            print(
                f"{name}: wave {w} c{conc} {words} words -> {new} tokens: "
                f"{rows[-1]['seconds']:.2f} s" + (f" ({error})" if error else ""),
                flush=True,
            )
            if error:
                failed.append(f"{name} wave {w}")
    if failed:
        sys.exit(f"probe: warm: {len(failed)} wave(s) failed ({', '.join(failed)}); see {out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("servers", nargs=2, metavar="NAME=PORT")
    r = sub.add_parser("routing")
    r.add_argument("servers", nargs=1, metavar="NAME=PORT")
    r.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    r.add_argument("--steps", type=int, default=4, help="decode steps recorded per tier")
    r.add_argument("--experts", type=int, default=384)
    r.add_argument("--top-k", type=int, default=6)
    p = sub.add_parser("profile")
    p.add_argument("servers", nargs=1, metavar="NAME=PORT")
    p.add_argument("--trace-dir", required=True, help="the server's torch_profiler_dir")
    p.add_argument("--concurrency", type=int, default=128)
    # Long enough that decode at full batch outlasts /start_profile (it returned after 11 s
    # in round 2, when 200-token requests had already finished) and the profiled steps.
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--window-s", type=float, default=2.0)
    w = sub.add_parser("warm")
    w.add_argument("servers", nargs="+", metavar="NAME=PORT")
    for s in (c, r, p, w):
        s.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    cmds = {"compare": cmd_compare, "routing": cmd_routing, "profile": cmd_profile,
            "warm": cmd_warm}  # fmt: skip
    cmds[a.cmd](a)


if __name__ == "__main__":
    main()
