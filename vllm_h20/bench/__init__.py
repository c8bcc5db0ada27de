"""Benchmarks that compare deployments: GuideLLM sweeps with server-side counters, reports
with plots, and the paired GSM8K quality check (`vllm-h20 bench ...`)."""
