"""Decide which SM90 FP8 MoE dispatch a vLLM process runs, and activate it.

Three settings, read once per process (only stdlib imports here: this runs in every vLLM
process at plugin load):

- `VLLM_H20_MOE_DISPATCH`: `per_expert` (default, the fixed kernel choice) or `stock`
  (FlashInfer's own kernel choice, for A/B runs).
- `VLLM_H20_MOE_MODULE`: `reduced` (default): FP8 block-scale MoE calls run on a module with
  only that path, built in minutes from the patched sources (per_expert) or from FlashInfer's own
  (stock); every other MoE call keeps FlashInfer's module. `full`: FlashInfer's whole SM90
  fused-MoE module built from the patched sources (per_expert; ~40 min on 16 cores), or left
  untouched (stock).
- `VLLM_H20_STRICT=1`: a fix module that cannot be had (unknown FlashInfer, no nvcc, compile
  error, corrupt cache) is an error instead of one warning and FlashInfer's own module.

The fix is built from the shipped series (`overlay.series_files`); the candidate series that
lost are in git history (tag `experiments/2026-12-06`), not selectable here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import settings as _settings
from . import flashinfer_src, hook
from .overlay import (
    Assessment,
    FixState,
    assess,
    build_overlay,
    overlay_for,
    patched_spec,
    series_name,
    shipped_patches,
)
from .patchfile import Patch, PatchError
from .paths import cache_root

ENV = "VLLM_H20_MOE_DISPATCH"
MODES = _settings.BY_NAME[ENV].choices
MODULE_ENV = "VLLM_H20_MOE_MODULE"
MODULES = _settings.BY_NAME[MODULE_ENV].choices
STRICT_ENV = "VLLM_H20_STRICT"
CORE_MODULE = "flashinfer.fused_moe.core"
GEN_NAME = "gen_cutlass_fused_moe_sm90_module"
GET_NAME = "get_cutlass_fused_moe_module"
# The FlashInfer releases the patches, the reduced module and CI cover (vLLM 0.26.0's, 0.30.0's
# and 0.33.0's pins, and the newest on PyPI when this was written, which vLLM 0.34.0 runs in CI).
SUPPORTED = ("0.6.14", "0.6.18.post1", "0.7.2.post1", "0.7.4")
# Ranges between two tested releases whose patched sources (`fp8_blockscale_gemm/`,
# `deep_gemm/`) are byte-identical: every final release inside is supported too, its sources
# still checked against the patches at load. 0.7.3 is vLLM 0.34.0's pin, which the package index
# did not serve when this was written.
SUPPORTED_RANGES = (("0.7.2.post1", "0.7.4"),)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?")


def _release_key(version: str) -> tuple[int, ...] | None:
    """A final (or post) release as a sortable tuple; None for pre- and dev releases, local
    builds and anything else: those are never assumed to match a tested range."""
    m = _VERSION.fullmatch(version)
    return None if m is None else tuple(int(g or 0) for g in m.groups())


def supported_text() -> str:
    """The supported releases as a user reads them: the tested ones and the ranges."""
    ranges = [f"any {lo}-{hi}" for lo, hi in SUPPORTED_RANGES]
    return ", ".join([*SUPPORTED, *ranges])


def tested_range(version: str) -> tuple[str, str] | None:
    """The tested range an untested release lies in (None for a tested one, or outside)."""
    key = _release_key(version)
    if version in SUPPORTED or key is None:
        return None
    for lo, hi in SUPPORTED_RANGES:
        if _release_key(lo) <= key <= _release_key(hi):
            return lo, hi
    return None


def supported(version: str) -> bool:
    """Whether vllm-h20 supports this FlashInfer release: a tested one, or a final release
    inside a range whose ends were tested with byte-identical patched sources."""
    return version in SUPPORTED or tested_range(version) is not None


class DispatchConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    mode: str
    module: str
    strict: bool


def settings(env: Mapping[str, str] | None = None) -> Settings:
    """The three dispatch settings (vllm_h20/settings.py has their table), validated."""
    try:
        return Settings(
            _settings.choice(ENV, env),
            _settings.choice(MODULE_ENV, env),
            _settings.flag(STRICT_ENV, env),
        )
    except _settings.SettingError as e:
        raise DispatchConfigError(str(e)) from None


def requested_mode(env: Mapping[str, str] | None = None) -> str:
    return settings(env).mode


@dataclass(frozen=True)
class Decision:
    mode: str  # what the user asked for
    overlay: bool  # build FlashInfer's whole SM90 fused-MoE module from our overlay (module=full)
    message: str  # the one line logged at start
    warn: bool = False
    src: flashinfer_src.FlashInferSource | None = None
    assessment: Assessment | None = None
    patches: tuple[Patch, ...] = ()
    route: str | None = None  # "fix" or "stock": block-scale calls go to that reduced module
    strict: bool = False

    @property
    def per_expert(self) -> bool:
        """Whether block-scale MoE runs the per-expert kernel choice under this decision."""
        if self.mode != "per_expert":
            return False
        fixed = self.assessment is not None and self.assessment.state in (
            FixState.HAS_FIX,
            FixState.FIXED_UPSTREAM,
        )
        return self.overlay or self.route == "fix" or fixed


class UnsupportedFlashInfer(DispatchConfigError):
    pass


def decide(
    env: Mapping[str, str] | None = None,
    src: flashinfer_src.FlashInferSource | None = None,
    patches: Sequence[Patch] | None = None,
) -> Decision:
    s = settings(env)
    if s.mode == "stock" and s.module == "full":
        return Decision(
            s.mode, False, f"MoE dispatch: FlashInfer unchanged ({ENV}=stock, {MODULE_ENV}=full)",
            strict=s.strict,
        )  # fmt: skip
    try:
        src = src or flashinfer_src.installed()
    except flashinfer_src.FlashInferNotFound as e:
        return Decision(s.mode, False, f"MoE dispatch: nothing to fix, {e}")
    where = f"FlashInfer {src.version}"
    between = tested_range(src.version)
    if between is not None:
        where += f" (between the tested {between[0]} and {between[1]})"
    if not supported(src.version):
        msg = (
            f"MoE dispatch: STOCK (fix not applied): {where} is not a release vllm-h20 supports "
            f"({supported_text()}), so FP8 block-scale MoE runs on FlashInfer's own module; "
            f"install one of them (e.g. `pip install flashinfer-python=={SUPPORTED[-1]}`) or "
            f"check this one with `vllm-h20 patches check`"
        )
        if s.strict:
            raise UnsupportedFlashInfer(f"{msg} ({STRICT_ENV}=1)")
        return Decision(s.mode, False, msg, warn=True, src=src, strict=s.strict)
    if s.mode == "stock":  # the reduced module from FlashInfer's own sources: the A/B baseline
        return Decision(
            s.mode, False,
            f"MoE dispatch: stock kernel choice ({ENV}=stock): FP8 block-scale MoE runs on the "
            f"reduced module built from {where}'s unpatched sources; other MoE calls on "
            f"FlashInfer's own module",
            src=src, route="stock", strict=s.strict,
        )  # fmt: skip
    try:
        patches = tuple(patches if patches is not None else shipped_patches(src.version))
        a = assess(src, patches)
    except (PatchError, OSError) as e:
        # A broken install must not take vLLM down: say so and run FlashInfer as it is.
        msg = f"MoE dispatch: STOCK (fix not applied): {e}"
        if s.strict:
            raise DispatchConfigError(f"{msg} ({STRICT_ENV}=1)") from e
        return Decision(s.mode, False, msg, warn=True, strict=s.strict)
    series = f"patch series {series_name(src.version)}"
    if a.state is FixState.NEEDS_PATCH:
        if s.module == "full":
            ov = overlay_for(src, patches)
            return Decision(
                s.mode, True,
                f"MoE dispatch: per-expert kernel choice; {where} SM90 fused-MoE module builds "
                f"from patched sources in {ov.root} ({series}: {a.detail})",
                src=src, assessment=a, patches=patches, strict=s.strict,
            )  # fmt: skip
        return Decision(
            s.mode, False,
            f"MoE dispatch: per-expert kernel choice; FP8 block-scale MoE runs on the reduced fix "
            f"module built from {where} + {series} ({a.detail}); other MoE calls on FlashInfer's "
            f"own module",
            src=src, assessment=a, patches=patches, route="fix", strict=s.strict,
        )  # fmt: skip
    if a.state is FixState.HAS_FIX:
        msg = f"MoE dispatch: per-expert kernel choice; {where} already contains the fix, unchanged"
        return Decision(s.mode, False, msg, src=src, assessment=a)
    if a.state is FixState.FIXED_UPSTREAM:
        msg = f"MoE dispatch: {where} unchanged; {a.detail}"
        return Decision(s.mode, False, msg, src=src, assessment=a)
    msg = (
        f"MoE dispatch: STOCK (fix not applied): {a.detail} for {where} ({series}); "
        f"run `vllm-h20 patches check` for details"
    )
    if s.strict:
        raise DispatchConfigError(f"{msg} ({STRICT_ENV}=1)")
    return Decision(s.mode, False, msg, warn=True, src=src, assessment=a)


# --------------------------------------------------------------------------- module=full


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
    """List a spec in FlashInfer's JIT registry, as gen_jit_spec does for its own."""
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
    gen = patched_generator(stock, decision)
    setattr(core, GEN_NAME, gen)
    get = getattr(core, GET_NAME, None)
    if get is None or getattr(get, "vllm_h20_full", False):
        return
    made: list[Any] = []

    def gen_and_remember(use_fast_build: bool = False) -> Any:
        made.append(gen(use_fast_build))
        return made[-1]

    gen_and_remember.__wrapped__ = stock  # type: ignore[attr-defined]
    gen_and_remember.vllm_h20 = True  # type: ignore[attr-defined]
    setattr(core, GEN_NAME, gen_and_remember)
    pointed: set[str] = set()

    def get_cutlass_fused_moe_module(backend: str = "100", use_fast_build: bool = False) -> Any:
        namespace = get(backend, use_fast_build)
        # FlashInfer points DeepGEMM at its own headers once the module is loaded: the
        # overlay's module needs the overlay's (once per module; this runs on every MoE call).
        if backend == "90" and made and made[-1].name not in pointed:
            from .call_routing import point_deepgemm

            point_deepgemm(made[-1])
            pointed.add(made[-1].name)
        return namespace

    get_cutlass_fused_moe_module.__wrapped__ = get  # type: ignore[attr-defined]
    get_cutlass_fused_moe_module.vllm_h20_full = True  # type: ignore[attr-defined]
    get_cutlass_fused_moe_module.cache_clear = getattr(get, "cache_clear", None)  # type: ignore[attr-defined]
    setattr(core, GET_NAME, get_cutlass_fused_moe_module)


# --------------------------------------------------------------------------- module=reduced


def reduced_spec(
    decision: Decision,
    stock_gen: Callable[..., Any],
    use_fast_build: bool = False,
    cache: Path | None = None,
    build: bool = True,
) -> Any:
    """The reduced module's JitSpec, with (build=True) its objects built and its stubs written:
    FlashInfer's build_and_load then compiles the stubs and links. Imports FlashInfer: call it
    only from FlashInfer's own module build or the CLI."""
    from . import reduced
    from .overlay import overlay_key
    from .paths import reduced_dir

    assert decision.src is not None and decision.route in reduced.VARIANTS
    cache = cache or cache_root()
    stock = spec = stock_gen(use_fast_build)
    if decision.route == "fix":
        assert decision.assessment is not None
        ov = build_overlay(
            decision.src, decision.assessment, overlay_for(decision.src, decision.patches, cache)
        )
        spec, sources_key = patched_spec(spec, ov), ov.key
    else:
        sources_key = overlay_key(decision.src, ())
    key = reduced.reduction_key(sources_key)
    where = reduced_dir(decision.src.version, stock.name, decision.route, key, cache)
    spec = reduced.reduce_spec(spec, decision.route, key, where, base=stock.name)
    if build:
        from .build import NinjaFile, run_ninja

        jobs = int(os.environ.get("MAX_JOBS", 0) or 0) or os.cpu_count() or 1
        reduced.prepare(
            spec, lambda targets: run_ninja(NinjaFile.of(spec), targets, jobs, os.environ)
        )
    _register(spec)
    return spec


def activate(decision: Decision) -> None:
    if decision.overlay:
        hook.after_import(CORE_MODULE, lambda core: install_on(core, decision))
    elif decision.route is not None:
        from . import call_routing

        describe = f"the reduced {decision.route} module (FlashInfer {decision.src.version})"

        def make_spec(stock_gen: Callable[..., Any], use_fast_build: bool) -> Any:
            return reduced_spec(decision, stock_gen, use_fast_build)

        def install(core: ModuleType) -> None:
            try:
                call_routing.install(core, make_spec, describe, decision.strict)
            except RuntimeError as e:  # a FlashInfer layout we do not know: leave it as it is
                if decision.strict:
                    raise
                call_routing.logger.warning("%s; FlashInfer's fused MoE runs unchanged", e)

        hook.after_import(CORE_MODULE, install)
