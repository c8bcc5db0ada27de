"""vllm-h20: serve DeepSeek-V4.1-class MXFP4 MoE models fast on NVIDIA H20 with vLLM."""

__version__ = "0.1.0"
