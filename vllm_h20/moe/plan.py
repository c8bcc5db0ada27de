"""What a fix module's build consists of: FlashInfer's ninja file for it, its objects, and the
sources that compile a patched file. The policy (which module, from which sources) comes from
`dispatch.decide`; the toolchain work from `build`. Imports FlashInfer: CLI only, never the
plugin."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import build, dispatch
from .overlay import Overlay, overlay_for


@dataclass(frozen=True)
class BuildPlan:
    """What FlashInfer's ninja file for a module contains."""

    module: str
    build_dir: str
    ninja_file: str
    library: str
    objects: dict[str, str]  # source path -> object path
    touched: list[str]  # sources whose include closure reaches a patched file

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BuildPlan:
        return cls(**json.loads(text))


def select_variant(variant: str) -> None:
    """Make FlashInfer's SM90 fused-MoE spec the H20 (78-SM prebuilt-D) or generic variant
    regardless of the visible GPU; "auto" leaves FlashInfer's own choice."""
    if variant == "auto":
        return
    from flashinfer.jit import fused_moe as jit_fused_moe

    hook = getattr(jit_fused_moe, "_should_enable_sm90_moe_prebuilt_d_descriptor", None)
    if hook is None and variant == "h20":
        raise build.BuildError("this FlashInfer has no H20 (prebuilt-D) fused-MoE variant")
    if hook is not None:
        jit_fused_moe._should_enable_sm90_moe_prebuilt_d_descriptor = lambda: variant == "h20"


def _touched(spec: Any, overlay: Overlay) -> list[str]:
    includes = [Path(d) for d in spec.extra_include_dirs]
    return [str(Path(t).resolve()) for t in build.touched_sources(spec.sources, includes, overlay)]


def full_plan(variant: str = "auto", cache: Path | None = None) -> tuple[BuildPlan, Overlay]:
    """Write FlashInfer's ninja file for the whole patched SM90 fused-MoE module; return its plan.

    variant: auto (FlashInfer decides from the visible GPU), h20 (the 78-SM prebuilt-D
    variant, for building on a machine without the H20 attached), generic."""
    from flashinfer.jit import fused_moe as jit_fused_moe

    select_variant(variant)
    decision = dispatch.decide(env={dispatch.ENV: "per_expert", dispatch.MODULE_ENV: "full"})
    if not decision.overlay:
        raise build.BuildError(decision.message)
    stock_gen = jit_fused_moe.gen_cutlass_fused_moe_sm90_module
    spec = dispatch.patched_generator(stock_gen, decision, cache)()
    spec.write_ninja()
    assert decision.src is not None
    overlay = overlay_for(decision.src, decision.patches, cache)
    objects = build.object_map(Path(spec.ninja_path))
    touched = _touched(spec, overlay)
    missing = [t for t in touched if t not in objects]
    if missing:
        raise build.BuildError(f"{spec.ninja_path} has no build line for {missing[0]}")
    return _plan(spec, objects, touched), overlay


def reduced_plan(spec: Any, decision: dispatch.Decision) -> BuildPlan:
    """A reduced module's spec as a BuildPlan: its objects, and (fix module) the sources that
    include a patched file, for the header check of `patches check --compile`."""
    touched: list[str] = []
    if decision.route == "fix":
        touched = _touched(spec, overlay_for(decision.src, decision.patches))
    has_ninja = Path(spec.ninja_path).is_file()
    return _plan(spec, build.object_map(spec.ninja_path) if has_ninja else {}, touched)


def _plan(spec: Any, objects: dict[str, str], touched: list[str]) -> BuildPlan:
    return BuildPlan(
        module=spec.name,
        build_dir=str(spec.build_dir),
        ninja_file=str(spec.ninja_path),
        library=str(spec.jit_library_path),
        objects=objects,
        touched=touched,
    )
