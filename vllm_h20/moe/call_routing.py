"""Send FlashInfer's SM90 FP8 block-scale MoE calls to the reduced module, the rest to its own.

Installed on `flashinfer.fused_moe.core` in place of `get_cutlass_fused_moe_module`: for the
SM90 backend it returns `Sm90Routes`, whose methods pass a call with
`use_deepseek_fp8_block_scale=True` to the reduced module (built on first use) and every other
call to FlashInfer's own module, which is built only if such a call comes. When the reduced
module cannot be built or loaded, the block-scale calls go to FlashInfer's own module too, after
one warning that names the cause and the command that fixes it (or an error, when strict).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.plugins.vllm_h20")

GEN_NAME = "gen_cutlass_fused_moe_sm90_module"
GET_NAME = "get_cutlass_fused_moe_module"
BLOCK_SCALE = "use_deepseek_fp8_block_scale"


class FixModuleUnavailable(RuntimeError):
    """The reduced module could not be had; the message says why and what fixes it."""


def explain(exc: BaseException, library: str | None, nvcc: str | None) -> str:
    """One line: why the reduced module is not available, and the command that fixes it."""
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    rebuild = "`vllm-h20 kernels build --clean`"
    if library and os.path.exists(library) and _looks_like_load_error(text):
        return (
            f"loading {library} failed ({text}): the JIT cache is stale or corrupt; "
            f"rebuild it with {rebuild}"
        )
    if nvcc is None and not (library and os.path.exists(library)):
        return (
            "nvcc was not found (set CUDA_HOME or put the CUDA toolkit's bin on PATH), so the "
            "fix module cannot be compiled on this node; install the CUDA toolkit, or run "
            "`vllm-h20 kernels build` on a machine that has it and copy FlashInfer's JIT cache"
        )
    return f"building the fix module failed ({text}); see the compiler output with {rebuild}"


_LOAD_ERRORS = (
    "failed to load dynamic shared library",
    "invalid elf",
    "file too short",
    "cannot open shared",
    "dlopen",
    "undefined symbol",
    "not a dynamic",
    "load_module",
    "elf header",
)


def _looks_like_load_error(text: str) -> bool:
    t = text.lower()
    return any(s in t for s in _LOAD_ERRORS)


def find_nvcc() -> str | None:
    """The nvcc FlashInfer's ninja file would run: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        cand = os.path.join(home, "bin", "nvcc")
        return cand if os.access(cand, os.X_OK) else None
    return shutil.which("nvcc")


class Sm90Routes:
    """What `get_cutlass_fused_moe_module("90")` returns while vllm-h20 routes block-scale calls."""

    def __init__(
        self,
        stock: Callable[[], Any],
        reduced: Callable[[], Any],
        describe: str,
        strict: bool,
    ):
        self._stock_factory = stock
        self._reduced_factory = reduced
        self._describe = describe
        self._strict = strict
        self._lock = threading.Lock()
        self._stock_ns: Any = None
        self._reduced_ns: Any = None
        self._reduced_failed = False

    def _stock(self) -> Any:
        with self._lock:
            if self._stock_ns is None:
                self._stock_ns = self._stock_factory()
            return self._stock_ns

    def _reduced(self) -> Any:
        with self._lock:
            if self._reduced_ns is None and not self._reduced_failed:
                try:
                    self._reduced_ns = self._reduced_factory()
                    logger.info("vllm-h20: FP8 block-scale MoE runs on %s", self._describe)
                except FixModuleUnavailable as e:
                    if self._strict:
                        raise
                    self._reduced_failed = True
                    logger.warning(
                        "vllm-h20: FP8 block-scale MoE falls back to FlashInfer's own module: "
                        "%s (VLLM_H20_STRICT=1 makes this an error)",
                        e,
                    )
            return self._reduced_ns

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            target = self._reduced() if kwargs.get(BLOCK_SCALE) else None
            return getattr(target if target is not None else self._stock(), name)(*args, **kwargs)

        call.__name__ = name
        return call


_SWAP = threading.Lock()


def load_namespace(
    core: ModuleType, make_spec: Callable[[bool], Any], use_fast_build: bool = False
) -> Any:
    """FlashInfer's own SM90 wrapper (autotuner, runner cache, DeepGEMM include dirs) around
    the module make_spec(use_fast_build) describes; raises FixModuleUnavailable.

    `get_cutlass_fused_moe_module`'s body looks the generator up in the module's globals at
    call time, so the uncached function is called once with ours in its place."""
    fn = getattr(core, GET_NAME)
    if getattr(fn, "vllm_h20", False):  # our router: it wraps FlashInfer's cached function
        fn = fn.__wrapped__
    raw = getattr(fn, "__wrapped__", fn)  # functools.cache keeps the function it caches
    stock_gen = getattr(core, GEN_NAME)
    specs: list[Any] = []

    def gen(ufb: bool = False) -> Any:
        try:
            specs.append(make_spec(ufb))
        except FixModuleUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any build failure is a fallback cause
            raise FixModuleUnavailable(explain(e, None, find_nvcc())) from e
        return specs[-1]

    with _SWAP:
        setattr(core, GEN_NAME, gen)
        try:
            namespace = raw("90", use_fast_build)
            point_deepgemm(specs[-1])
            return namespace
        except FixModuleUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - load failures come from tvm_ffi / ninja
            library = str(specs[-1].jit_library_path) if specs else None
            raise FixModuleUnavailable(explain(e, library, find_nvcc())) from e
        finally:
            setattr(core, GEN_NAME, stock_gen)


def deepgemm_include_dir(spec: Any) -> str | None:
    """The DeepGEMM header dir that belongs to a module's sources: `<csrc>/nv_internal/
    tensorrt_llm` of the csrc tree its sources come from (the overlay's for a patched module)."""
    for source in getattr(spec, "sources", None) or ():
        parts = Path(source).parts
        if "csrc" in parts:
            csrc = Path(*parts[: len(parts) - parts[::-1].index("csrc")])
            return str(csrc / "nv_internal" / "tensorrt_llm")
    return None


def point_deepgemm(spec: Any) -> None:
    """Make a loaded module's DeepGEMM run-time compiles read the headers of its own sources.

    FlashInfer points them at its installed csrc after loading the module; a module built from
    the overlay needs the overlay's headers (its scheduler has row classes), or its kernels
    would not compile."""
    include = deepgemm_include_dir(spec)
    if include is None:
        return
    module = spec.load(spec.jit_library_path)  # the loaded library: its statics are the same
    module.set_deepgemm_jit_include_dirs([include])


def install(
    core: ModuleType,
    make_spec: Callable[[Callable[..., Any], bool], Any],
    describe: str,
    strict: bool,
) -> None:
    """Replace `core.get_cutlass_fused_moe_module` with a router for the SM90 backend.

    make_spec(stock_gen, use_fast_build) returns the reduced module's JitSpec (built objects,
    stubs written) or raises FixModuleUnavailable."""
    stock_get = getattr(core, GET_NAME, None)
    stock_gen = getattr(core, GEN_NAME, None)
    if stock_get is None or stock_gen is None or not hasattr(stock_get, "__wrapped__"):
        raise RuntimeError(
            f"vllm-h20: {core.__name__} has no cached {GET_NAME} and {GEN_NAME}; this FlashInfer "
            "layout is not supported (set VLLM_H20_MOE_MODULE=full, or leave vllm_h20 out of "
            "VLLM_PLUGINS)"
        )
    if getattr(stock_get, "vllm_h20", False):
        return
    routes: dict[tuple[str, bool], Sm90Routes] = {}

    def reduced_namespace(use_fast_build: bool) -> Any:
        return load_namespace(core, lambda ufb: make_spec(stock_gen, ufb), use_fast_build)

    def get_cutlass_fused_moe_module(backend: str = "100", use_fast_build: bool = False):
        if backend != "90":
            return stock_get(backend, use_fast_build)
        key = (backend, use_fast_build)
        if key not in routes:
            routes[key] = Sm90Routes(
                stock=lambda: stock_get(backend, use_fast_build),
                reduced=lambda: reduced_namespace(use_fast_build),
                describe=describe,
                strict=strict,
            )
        return routes[key]

    get_cutlass_fused_moe_module.__wrapped__ = stock_get  # type: ignore[attr-defined]
    get_cutlass_fused_moe_module.vllm_h20 = True  # type: ignore[attr-defined]
    get_cutlass_fused_moe_module.cache_clear = routes.clear  # type: ignore[attr-defined]
    setattr(core, GET_NAME, get_cutlass_fused_moe_module)
