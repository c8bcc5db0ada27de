"""The FlashInfer SM90 FP8 block-scale MoE dispatch fix (estimate, branch model)."""
