# vllm-h20 on the official vLLM OpenAI server image, with the reduced fix module (FlashInfer's
# SM90 FP8 block-scale fused MoE from the patched sources) prebuilt, so a container starts
# without compiling it on its first MoE call (101 s on 16 cores; benchmarks/results/).
#
#   docker build -t vllm-h20 --build-arg MAX_JOBS=32 .
#   docker run --gpus all --ipc=host --shm-size 32g -p 8000:8000 \
#       -v /models:/models vllm-h20 deepseek-v41-flash-fp8-tp8ep8 --model /models/V4.1-Flash-FP8
#
# Not built in CI (no Docker engine there): CI lints this file with hadolint.
FROM vllm/vllm-openai:v0.34.0

# Which SM90 fused-MoE variant to prebuild: h20 (FlashInfer's 78-SM variant) or generic
# (H100/H200). The build runs on the CPU: no GPU is needed. Add `--dispatch both` to the
# kernels build line for an image that also serves the unpatched A/B baseline
# (VLLM_H20_MOE_DISPATCH=stock).
ARG KERNEL_VARIANT=h20
ARG MAX_JOBS=16

# Caches inside the image, independent of the user the container runs as.
ENV VLLM_H20_CACHE_DIR=/opt/vllm-h20/cache \
    FLASHINFER_WORKSPACE_BASE=/opt/vllm-h20/flashinfer \
    TRTLLM_DG_CACHE_DIR=/opt/vllm-h20/deepgemm \
    FLASHINFER_CUDA_ARCH_LIST=9.0a

COPY pyproject.toml README.md /opt/vllm-h20/src/
COPY vllm_h20 /opt/vllm-h20/src/vllm_h20
COPY conversion /opt/vllm-h20/src/conversion
COPY patches /opt/vllm-h20/src/patches
COPY recipes /opt/vllm-h20/src/recipes

# vllm-h20 depends on neither torch nor vLLM, so this leaves the image's vLLM 0.34.0 and its
# torch and FlashInfer alone and adds only what is missing (numpy, ml_dtypes, pyyaml, click,
# rich). Which FlashInfer the image ships was not checked here (the image was not pulled): vLLM
# 0.34.0 pins 0.7.3, which PyPI does not serve. `kernels status` prints the installed one and
# the rule that covers it (0.7.3 lies between the tested 0.7.2.post1 and 0.7.4), and exits 1
# when vLLM would run FlashInfer's own kernel choice; `patches check` fails the build when the
# series does not apply to the image's sources: either way no image ships a silent stock.
RUN pip install --no-cache-dir /opt/vllm-h20/src \
    && vllm-h20 kernels status \
    && vllm-h20 patches check \
    && vllm-h20 kernels build --variant "${KERNEL_VARIANT}" -j "${MAX_JOBS}" \
    && chmod -R a+rX /opt/vllm-h20

ENTRYPOINT ["vllm-h20", "serve"]
CMD ["deepseek-v41-flash-fp8-tp8ep8", "--model", "/models/DeepSeek-V4.1-Flash-FP8"]
