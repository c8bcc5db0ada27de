"""Every directory the fix reads or writes, worked out in one place (as FlashInfer's
`jit/env.py` does for its own): ours under the cache root, and the two caches of other tools we
look into (FlashInfer's JIT modules, DeepGEMM's compiled kernels). Stdlib only."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .. import settings


def cache_root() -> Path:
    """`$VLLM_H20_CACHE_DIR`, else `$XDG_CACHE_HOME/vllm-h20`, else `~/.cache/vllm-h20`."""
    chosen = settings.path("VLLM_H20_CACHE_DIR")
    if chosen is not None:
        return chosen
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vllm-h20"


def _root(cache: Path | None) -> Path:
    return cache if cache is not None else cache_root()


def flashinfer_dir(version: str, cache: Path | None = None) -> Path:
    """Our files for one FlashInfer release: overlays and reduced-module sources."""
    return _root(cache) / "flashinfer" / version


def overlay_dir(version: str, key: str, cache: Path | None = None) -> Path:
    """The patched copy of a release's csrc/ for one patch series (key: sources + patches)."""
    return flashinfer_dir(version, cache) / f"overlay-{key}"


def reduced_dir(version: str, base: str, variant: str, key: str, cache: Path | None = None) -> Path:
    """The generated sources (stubs, trimmed launchers) of one reduced module."""
    return flashinfer_dir(version, cache) / f"{base}-reduced-{variant}-{key[:12]}"


def link_shims_dir(cache: Path | None = None) -> Path:
    """Link-time stand-ins (libcuda stub, libnvrtc/libcudart links) for machines without them."""
    d = _root(cache) / "link-shims"
    d.mkdir(parents=True, exist_ok=True)
    return d


def precompile_dir(overlay_key: str, cache: Path | None = None) -> Path:
    """The kernel planner built against one overlay, and the kernel sources it writes."""
    return _root(cache) / "precompile" / overlay_key


def check_dir(cache: Path | None = None) -> Path:
    """Where `patches check` unpacks and builds a release (kept, so a rerun is quick)."""
    return _root(cache) / "check"


def recipe_check_dir(cache: Path | None = None) -> Path:
    """vLLM's parser's answers for recipes it accepted (serve/check.py), one file each."""
    return _root(cache) / "recipe-check"


def wheels_dir(cache: Path | None = None) -> Path:
    """Downloaded and unpacked FlashInfer wheels (CI's four releases)."""
    return _root(cache) / "ci"


def flashinfer_jit_dir(version: str) -> Path:
    """FlashInfer's own JIT cache for a release ($FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/V),
    where the modules it builds (ours included) are loaded from."""
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home()))
    return base / ".cache" / "flashinfer" / version


def deepgemm_cache_dir() -> Path:
    """Where DeepGEMM looks for compiled kernels (getDefaultUserDir in its compiler.cuh)."""
    base = os.environ.get("TRTLLM_DG_CACHE_DIR")
    if base:
        return Path(base) / "cache"
    home = os.environ.get("HOME")
    base_dir = (
        Path(home) / ".tensorrt_llm" if home else Path(tempfile.gettempdir()) / "tensorrt_llm"
    )
    return base_dir / "cache"
