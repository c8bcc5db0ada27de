"""Parse a recipe with the installed vLLM's own `vllm serve` parser and config classes.

Run as `python -m vllm_h20.serve.vllm_parse FILE` (check.py does, in a child process with
VLLM_TARGET_DEVICE=cpu so vLLM builds its parser on a machine without a GPU and nothing of
that leaks into the `vllm serve` we exec later). Prints one JSON line: {"ok": ...}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import sys


def _result(**kw) -> None:
    print("VLLM_PARSE " + json.dumps(kw, default=str))


def main(path: str) -> None:
    import vllm
    import yaml

    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:  # vLLM <= 0.26 (the one that runs on torch 2.11)
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    options = parser._option_string_actions
    with open(path) as f:
        flags = yaml.safe_load(f) or {}
    for key in flags:
        if f"--{key}" not in options:
            near = difflib.get_close_matches(f"--{key}", list(options), n=1)
            hint = f"; did you mean {near[0][2:]}?" if near else ""
            error = f"not a `vllm serve` flag in vLLM {vllm.__version__}{hint}"
            return _result(ok=False, key=key, error=error)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(["--config", path])
    except SystemExit:
        raw = err.getvalue()
        text = raw.rsplit("error:", 1)[1] if "error:" in raw else raw[-300:]
        # argparse's line plus pydantic's detail lines, as one line
        parts = [ln.strip() for ln in text.strip().splitlines()]
        text = "; ".join(p for p in parts if p and not p.startswith("For further information"))
        key = next((k for k in flags if f"--{k}" in text or f"--{k} " in text), None)
        return _result(ok=False, key=key, error=text)
    spec = flags.get("speculative-config")
    if isinstance(spec, dict):
        from vllm.config import SpeculativeConfig

        fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        for k in spec:
            if k not in fields:
                near = difflib.get_close_matches(k, sorted(fields), n=1)
                hint = f"; did you mean {near[0]}?" if near else ""
                return _result(ok=False, key=f"speculative-config.{k}",
                               error=f"not a SpeculativeConfig field{hint}")  # fmt: skip
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        args = AsyncEngineArgs.from_cli_args(ns)
    except Exception as e:  # noqa: BLE001 - any vLLM validation error is the answer
        return _result(ok=False, key=None, error=f"{type(e).__name__}: {e}")

    def get(obj, *path):  # fields an older vLLM lacks (Engram before 0.30) read as None
        for name in path:
            obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        return obj

    parsed = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "enable_eplb": get(args, "enable_eplb"),
        "num_redundant_experts": get(args, "eplb_config", "num_redundant_experts"),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "max_cudagraph_capture_size": get(args, "max_cudagraph_capture_size"),
        "cudagraph_capture_sizes": get(args, "cudagraph_capture_sizes"),
        "kv_cache_memory_bytes": get(args, "kv_cache_memory_bytes"),
        "engram_cpu_offload": get(args, "engram_config", "cpu_offload"),
        "engram_use_thp": get(args, "engram_config", "use_thp"),
        "engram_dp_shared_memory": get(args, "engram_config", "dp_shared_memory"),
        "engram_embedding_across_dp": get(args, "engram_config", "embedding_across_dp"),
        "data_parallel_size_local": get(args, "data_parallel_size_local"),
        "all2all_backend": get(args, "all2all_backend"),
        "max_num_batched_tokens": get(args, "max_num_batched_tokens"),
        "moe_backend": get(args, "moe_backend"),
        "num_speculative_tokens": get(args, "speculative_config", "num_speculative_tokens"),
        # vLLM 0.34: None = the extensible KV cache's default (on for CUDA), and the share of
        # memory used when it is off and the recipe sets none.
        "enable_extensible_kv_cache": get(args, "enable_extensible_kv_cache"),
        "default_gpu_memory_utilization": _default_utilization(),
    }
    _result(ok=True, vllm=vllm.__version__, flags=len(flags), parsed=parsed)


def _default_utilization() -> float | None:
    try:
        from vllm.config import CacheConfig
    except ImportError:
        return None
    return getattr(CacheConfig, "DEFAULT_GPU_MEMORY_UTILIZATION", None)


if __name__ == "__main__":
    main(sys.argv[1])
