"""Decide which SM90 FP8 MoE dispatch a vLLM process runs, and activate it.

`VLLM_H20_MOE_DISPATCH=per_expert` (default) makes FlashInfer build its SM90 fused-MoE JIT
module from our patched overlay when the installed sources still carry the bug; `stock`
leaves FlashInfer alone, for A/B runs. Only stdlib imports here: this runs in every vLLM
process at plugin load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from . import flashinfer_src, hook
from .overlay import (
    Assessment,
    FixState,
    assess,
    build_overlay,
    overlay_for,
    patched_spec,
    shipped_patches,
)
from .patchfile import Patch, PatchError

ENV = "VLLM_H20_MOE_DISPATCH"
MODES = ("per_expert", "stock")
CORE_MODULE = "flashinfer.fused_moe.core"
GEN_NAME = "gen_cutlass_fused_moe_sm90_module"


class DispatchConfigError(ValueError):
    pass


def requested_mode(env: Mapping[str, str] | None = None) -> str:
    value = (os.environ if env is None else env).get(ENV, "per_expert").strip() or "per_expert"
    if value not in MODES:
        raise DispatchConfigError(
            f"{ENV}={value!r} is not one of {', '.join(MODES)} "
            f"(per_expert: the fixed kernel choice; stock: FlashInfer unchanged)"
        )
    return value


@dataclass(frozen=True)
class Decision:
    mode: str  # what the user asked for
    overlay: bool  # whether to build FlashInfer's SM90 fused-MoE module from our overlay
    message: str  # the one line logged at start
    warn: bool = False
    src: flashinfer_src.FlashInferSource | None = None
    assessment: Assessment | None = None
    patches: tuple[Patch, ...] = ()


def decide(
    env: Mapping[str, str] | None = None,
    src: flashinfer_src.FlashInferSource | None = None,
    patches: Sequence[Patch] | None = None,
) -> Decision:
    mode = requested_mode(env)
    if mode == "stock":
        return Decision(mode, False, f"MoE dispatch: stock FlashInfer kernel choice ({ENV}=stock)")
    try:
        src = src or flashinfer_src.installed()
    except flashinfer_src.FlashInferNotFound as e:
        return Decision(mode, False, f"MoE dispatch: nothing to fix, {e}")
    try:
        patches = tuple(patches if patches is not None else shipped_patches())
        a = assess(src, patches)
    except (PatchError, OSError) as e:
        # A broken install must not take vLLM down: say so and run FlashInfer as it is.
        return Decision(mode, False, f"MoE dispatch: STOCK (fix not applied): {e}", warn=True)
    where = f"FlashInfer {src.version}"
    if a.state is FixState.NEEDS_PATCH:
        ov = overlay_for(src, patches)
        return Decision(
            mode,
            True,
            f"MoE dispatch: per-expert expected_m; {where} SM90 fused-MoE module builds from "
            f"patched sources in {ov.root} ({a.detail})",
            src=src,
            assessment=a,
            patches=patches,
        )
    if a.state is FixState.HAS_FIX:
        msg = f"MoE dispatch: per-expert expected_m; {where} already contains the fix, unchanged"
        return Decision(mode, False, msg, src=src, assessment=a)
    if a.state is FixState.FIXED_UPSTREAM:
        msg = f"MoE dispatch: {where} unchanged; {a.detail}"
        return Decision(mode, False, msg, src=src, assessment=a)
    return Decision(
        mode,
        False,
        f"MoE dispatch: STOCK (fix not applied): {a.detail} for {where}; "
        f"run `vllm-h20 patches check` for details",
        warn=True,
        src=src,
        assessment=a,
    )


def patched_generator(
    stock_gen: Callable[..., Any], decision: Decision, cache: Path | None = None
) -> Callable[..., Any]:
    """Wrap FlashInfer's `gen_cutlass_fused_moe_sm90_module` to return the overlay's spec."""
    assert decision.src is not None and decision.assessment is not None

    def gen_cutlass_fused_moe_sm90_module(use_fast_build: bool = False):
        overlay = build_overlay(
            decision.src, decision.assessment, overlay_for(decision.src, decision.patches, cache)
        )
        spec = patched_spec(stock_gen(use_fast_build), overlay)
        _register(spec)
        return spec

    gen_cutlass_fused_moe_sm90_module.__wrapped__ = stock_gen  # type: ignore[attr-defined]
    gen_cutlass_fused_moe_sm90_module.vllm_h20 = True  # type: ignore[attr-defined]
    return gen_cutlass_fused_moe_sm90_module


def _register(spec: Any) -> None:
    """List the patched spec in FlashInfer's JIT registry, as gen_jit_spec does for its own."""
    try:
        from flashinfer.jit.core import jit_spec_registry
    except ImportError:
        return
    jit_spec_registry.register(spec)


def install_on(core: ModuleType, decision: Decision) -> None:
    stock = getattr(core, GEN_NAME, None)
    if stock is None:
        raise RuntimeError(
            f"vllm-h20: {core.__name__} has no {GEN_NAME}; this FlashInfer layout is not "
            f"supported (set {ENV}=stock or VLLM_PLUGINS to run without vllm-h20)"
        )
    if getattr(stock, "vllm_h20", False):
        return
    setattr(core, GEN_NAME, patched_generator(stock, decision))


def activate(decision: Decision) -> None:
    if decision.overlay:
        hook.after_import(CORE_MODULE, lambda core: install_on(core, decision))
