"""Serving: recipes checked against the installed vLLM, the memory planner, `vllm-h20 serve`."""
