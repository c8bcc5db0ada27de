"""Put this folder on PYTHONPATH to route FlashInfer's fused MoE as vLLM with vllm-h20 would.

vLLM calls `vllm_h20.plugin.register()` in each of its processes; FlashInfer's own tests and the
subprocesses they start are no vLLM processes, so Python's start-up hook does it for them. The
settings are the plugin's (VLLM_H20_MOE_DISPATCH, VLLM_H20_MOE_MODULE, VLLM_H20_STRICT)."""

import logging

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

from vllm_h20.plugin import register  # noqa: E402

register()
