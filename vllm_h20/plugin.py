"""vLLM general plugin: activates the per-expert MoE dispatch fix in every vLLM process.

vLLM calls `register()` in the API server, the engine core and every worker before model code
runs. It imports only the standard library and our small `moe` modules, logs one line, and
defers all FlashInfer work to FlashInfer's own first fused-MoE build. `VLLM_PLUGINS` (vLLM's
allowlist) disables it; `VLLM_H20_MOE_DISPATCH=stock` runs the reduced module built from
FlashInfer's unpatched sources (the A/B baseline; with `VLLM_H20_MOE_MODULE=full`, FlashInfer's
own module, untouched);
`VLLM_H20_STEP_TIMES=DIR` also logs each engine step's GPU time (serve/steptimes.py).
"""

from __future__ import annotations

import logging

# Under vLLM's "vllm" logger so the line gets vLLM's format and level settings.
logger = logging.getLogger("vllm.plugins.vllm_h20")
_done = False


def register() -> None:
    global _done
    if _done:  # vLLM may call general plugins more than once per process
        return
    from .moe import dispatch

    decision = dispatch.decide()
    (logger.warning if decision.warn else logger.info)("vllm-h20: %s", decision.message)
    dispatch.activate(decision)
    from . import settings

    step_times = settings.path("VLLM_H20_STEP_TIMES")
    if step_times is not None:  # a diagnostic: only then is vLLM's model runner imported here
        from .serve import steptimes

        try:
            steptimes.install(step_times)
            logger.info("vllm-h20: logging each step's GPU time to %s", step_times)
        except steptimes.HookMissing as e:  # asked for, impossible here: an error, not a hint
            logger.error("vllm-h20: VLLM_H20_STEP_TIMES=%s: %s", step_times, e)
        except (ImportError, AttributeError, OSError) as e:  # a diagnostic never stops serving
            logger.warning("vllm-h20: VLLM_H20_STEP_TIMES=%s: step times not logged (%s)",
                           step_times, e)  # fmt: skip
    _done = True
