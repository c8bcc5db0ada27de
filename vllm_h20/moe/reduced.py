"""The reduced SM90 fused-MoE module: FlashInfer's DeepSeek FP8 block-scale path and nothing else.

FlashInfer's SM90 fused-MoE module compiles every data type and CUTLASS tile (~250 objects,
about 40 minutes on 16 cores). `cutlass_fused_moe(..., use_deepseek_fp8_block_scale=True)`
takes bf16 activations and FP8 weights: FlashInfer's binding builds a
`CutlassMoeFCRunner<bf16, fp8>` for it, whose GEMMs are the DeepGEMM block-scale ones
(`fp8_blockscale_gemm.cu`); its CUTLASS `MoeGemmRunner<bf16, fp8>` only answers workspace and
tactic queries (bf16 x fp8 has no SM90 TMA grouped GEMM, so none of the generated kernels is
reachable). This module is FlashInfer's own JIT spec (flags, include order, ninja file) with:

- the sources that path compiles, from the patched overlay (the fix) or from FlashInfer's own
  csrc (the unpatched A/B baseline), with the runner instantiation file cut down to the
  bf16 x fp8 runner;
- a generated stub file defining every other `tensorrt_llm` function the kept objects reference
  (the other data types' runners and GEMMs) as one that throws a `TllmException` naming it.

The stubs are derived from the compiled objects (`nm`), so the module links on any supported
FlashInfer release without a hand-kept list, and the final link is checked for undefined
symbols.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .build import object_map

FORMAT = "2"  # bump when the reduction changes: it is part of the module name
VARIANTS = ("fix", "stock")

# FlashInfer's SM90 fused-MoE sources the block-scale path compiles (basenames; the rest of the
# spec's sources are other data types' grouped GEMMs and the generated CUTLASS kernels).
KEEP = frozenset(
    {
        "flashinfer_cutlass_fused_moe_binding.cu",
        "cutlass_fused_moe_instantiation.cu",
        "deepgemm_jit_setup.cu",
        "fp8_blockscale_gemm.cu",
        "moe_gemm_kernels_bf16_fp8.cu",
        "moe_gemm_tma_warp_specialized_input.cu",
        "moe_gemm_mixed_utils.cu",
        "envUtils.cpp",
        "logger.cpp",
        "stringUtils.cpp",
        "tllmException.cpp",
        "memoryUtils.cu",
        "preQuantScaleKernel.cu",
        "cutlass_heuristic.cpp",
        "lora.cpp",
    }
)
STUBS_FILE = "vllm_h20_stubs.cpp"
# The runner instantiation file instantiates ~25 runner classes (~6 core-minutes); the
# block-scale path needs the one with bf16 activations and FP8 weights.
SELECT_FILE = "cutlass_fused_moe_instantiation.cu"
SELECT_ARGS = ("__nv_bfloat16", "__nv_fp8_e4m3")
_CLASS_LINE = re.compile(r"^template class \w+<([^;]*)>;[ \t]*$", re.M)
_LOCAL_INCLUDE = re.compile(r'^(\s*#\s*include\s*)"([^"]+)"', re.M)
# Functions in these namespaces may be stubbed; anything else left undefined must come from the
# libraries the module links with (CUDA runtime, NVRTC, C++ runtime, TVM FFI).
_STUBBABLE = ("12tensorrt_llm",)


class ReduceError(RuntimeError):
    pass


def module_name(base: str, variant: str, key: str) -> str:
    """`<FlashInfer's module name>_vllm_h20_bs_<fix|stock>_<key>`: FlashInfer's name keeps the
    H20 (prebuilt-D) and generic variants apart, the key the sources and patches."""
    return f"{base}_vllm_h20_bs_{variant}_{key[:8]}"


def reduction_key(base_key: str) -> str:
    return hashlib.sha256(f"{FORMAT}\0{base_key}".encode()).hexdigest()[:12]


def kept_sources(sources: Iterable[Path]) -> list[Path]:
    kept = [Path(s) for s in sources if Path(s).name in KEEP]
    missing = KEEP - {s.name for s in kept}
    if missing:
        raise ReduceError(
            "this FlashInfer's SM90 fused-MoE module has no "
            + ", ".join(sorted(missing))
            + "; the reduced block-scale module does not know this layout"
        )
    return kept


def select_instantiations(source: Path, first_args: Sequence[str]) -> str:
    """`source` with only the explicit class instantiations whose first template arguments are
    `first_args` left active (the others become comments; macro instantiations and the
    preprocessor lines stay), its quoted includes made absolute so it compiles from elsewhere."""
    text = source.read_text(encoding="utf-8")
    text = _LOCAL_INCLUDE.sub(
        lambda m: (
            f'{m.group(1)}"{source.parent / m.group(2)}"'
            if (source.parent / m.group(2)).is_file()
            else m.group(0)
        ),
        text,
    )
    kept = 0

    def keep_or_comment(m: re.Match) -> str:
        nonlocal kept
        args = [a.strip() for a in m.group(1).split(",")]
        if args[: len(first_args)] == list(first_args):
            kept += 1
            return m.group(0)
        return f"/* not in the reduced module: {m.group(0).strip()} */"  # may span lines

    text = _CLASS_LINE.sub(keep_or_comment, text)
    if not kept:
        raise ReduceError(
            f"{source.name} has no `template class ...<{', '.join(first_args)}...>` line; the "
            "reduced block-scale module does not know this layout"
        )
    return f"// Generated by vllm-h20 from {source}: the bf16 x FP8 runner only.\n" + text


def reduce_spec(spec: Any, variant: str, key: str, gen_dir: Path, base: str | None = None) -> Any:
    """FlashInfer's SM90 fused-MoE JitSpec (stock or moved onto the overlay) -> the reduced one,
    named after `base` (FlashInfer's own module name; default the spec's).

    Writes the cut-down instantiation file (and a placeholder stub file) into gen_dir;
    `write_stubs` fills the stubs once the other objects exist."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    kept = kept_sources(spec.sources)
    gen_dir.mkdir(parents=True, exist_ok=True)
    full = next(s for s in kept if s.name == SELECT_FILE)
    selected = gen_dir / f"vllm_h20_{full.name}"
    _write_if_different(selected, select_instantiations(full, SELECT_ARGS))
    stubs = gen_dir / STUBS_FILE
    if not stubs.exists():
        _write_if_different(stubs, "// filled by vllm-h20 once the other objects are built\n")
    return dataclasses.replace(
        spec,
        name=module_name(base or spec.name, variant, key),
        sources=[*(selected if s == full else s for s in kept), stubs],
    )


def _write_if_different(path: Path, text: str) -> None:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- symbols


def _nm(args: Sequence[str]) -> str:
    proc = subprocess.run(["nm", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ReduceError(f"nm {' '.join(args[-1:])}: {proc.stderr.strip()[:300]}")
    return proc.stdout


def symbols(objects: Sequence[Path]) -> tuple[set[str], set[str]]:
    """(defined, undefined) global symbols of a set of object files."""
    defined: set[str] = set()
    undefined: set[str] = set()
    for line in _nm(["-g", "--no-sort", *map(str, objects)]).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3:
            defined.add(parts[2])
    return defined, undefined - defined


def demangle(names: Sequence[str]) -> list[str]:
    if not names:
        return []
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    out = proc.stdout.splitlines()
    return out if proc.returncode == 0 and len(out) == len(names) else list(names)


def stub_source(missing: Sequence[str]) -> str:
    """C++ defining each missing function (by its mangled name) as one that throws."""
    names = sorted(missing)
    readable = demangle(names)
    lines = [
        "// Generated by vllm-h20: functions of FlashInfer's full SM90 fused-MoE module that the",
        "// reduced FP8 block-scale module leaves out. Each throws a TllmException naming itself.",
        '#include "tensorrt_llm/common/assert.h"',
        "",
        "namespace {",
        "[[noreturn]] void vllm_h20_left_out(char const* what) {",
        '  TLLM_THROW("%s is not in the vllm-h20 reduced FP8 block-scale fused-MoE module, which '
        "serves only cutlass_fused_moe(..., use_deepseek_fp8_block_scale=True); other calls go "
        "to FlashInfer's own module (set VLLM_H20_MOE_MODULE=full to patch all of it)\", what);",
        "}",
        "}  // namespace",
        "",
    ]
    for i, (name, text) in enumerate(zip(names, readable, strict=True)):
        what = text.replace("\\", "\\\\").replace('"', '\\"')
        lines += [
            f'extern "C" void vllm_h20_stub_{i}() __asm__("{name}");',
            f'void vllm_h20_stub_{i}() {{ vllm_h20_left_out("{what}"); }}',
        ]
    return "\n".join(lines) + "\n"


def stubbable(undefined: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split undefined symbols into (functions we stub, the rest). A C++ data symbol in our
    namespaces (vtable, typeinfo, guard) cannot be stubbed by a function: it goes to the rest."""
    stub, rest = [], []
    for name in sorted(undefined):
        ours = any(ns in name for ns in _STUBBABLE)
        data = name.startswith(("_ZTV", "_ZTI", "_ZTS", "_ZGV", "_ZTH", "_ZTW"))
        (stub if ours and not data else rest).append(name)
    return stub, rest


def write_stubs(objects: Sequence[Path], stubs: Path) -> list[str]:
    """Fill `stubs` for the undefined functions of the built objects; returns their names."""
    _defined, undefined = symbols(objects)
    stub, _rest = stubbable(undefined)
    _write_if_different(stubs, stub_source(stub))
    return stub


# --------------------------------------------------------------------------- build


def objects_of(spec: Any) -> list[Path]:
    """Every object of a reduced spec's ninja file but the stubs'."""
    by_source = object_map(spec.ninja_path)
    out = []
    for s in spec.sources:
        obj = by_source.get(str(s)) or by_source.get(str(Path(s).resolve()))
        if obj is None:
            raise ReduceError(f"{spec.ninja_path} has no build line for {s}")
        if Path(s).name != STUBS_FILE:
            out.append(Path(obj))
    return out


def prepare(spec: Any, run: Any) -> list[str]:
    """Write the ninja file, build every object but the stubs' (run(targets)), write the stubs.

    FlashInfer's own build_and_load() then compiles the stubs and links. Holds FlashInfer's
    lock for this module, so concurrent vLLM workers build it once."""
    from filelock import FileLock

    with FileLock(str(spec.lock_path), thread_local=False):
        spec.write_ninja()
        others = objects_of(spec)
        run([str(o) for o in others])
        return write_stubs(others, Path([s for s in spec.sources if s.name == STUBS_FILE][0]))


# --------------------------------------------------------------------------- link check


def _dynamic_symbols(path: Path, which: str) -> set[str]:
    out = set()
    for line in _nm(["-D", which, str(path)]).splitlines():
        parts = line.split()
        if not parts:
            continue
        kind, name = (parts[0], parts[1]) if len(parts) == 2 else (parts[1], parts[2])
        if which == "--undefined-only" and kind in ("w", "v"):
            continue  # weak: may stay unresolved
        out.add(name.split("@")[0])
    return out


def needed_libraries(library: Path) -> list[str]:
    proc = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ReduceError(f"readelf -d {library}: {proc.stderr.strip()[:300]}")
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", proc.stdout)


def _system_library_dirs() -> dict[str, Path]:
    proc = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    found: dict[str, Path] = {}
    for m in re.finditer(r"^\s*(\S+) \(([^)]*)\) => (\S+)$", proc.stdout, re.M):
        if "x86-64" in m.group(2) or "x86_64" in m.group(2) or "," not in m.group(2):
            found.setdefault(m.group(1), Path(m.group(3)))
    return found


def resolve_library(name: str, search: Sequence[Path], system: dict[str, Path]) -> Path | None:
    """A NEEDED entry -> a file that provides it: the search directories first (the CUDA
    toolkit's lib64 and its driver stubs, as the link line names them), then ldconfig's cache."""
    stem = name.split(".so")[0]
    for d in search:
        for cand in (d / name, d / f"{stem}.so"):
            if cand.is_file():
                return cand
    return system.get(name)


def unresolved_symbols(
    library: Path, search: Sequence[Path], extra_libraries: Sequence[Path] = ()
) -> tuple[list[str], list[str]]:
    """(symbols no linked library provides, NEEDED libraries not found) for a built module.

    `extra_libraries` are those loaded into the process before the module (FlashInfer's modules
    are loaded by TVM FFI, which provides the TVMFFI* symbols without being linked)."""
    undefined = _dynamic_symbols(library, "--undefined-only")
    system = _system_library_dirs()
    provided: set[str] = set()
    missing_libs = []
    for name in needed_libraries(library):
        path = resolve_library(name, search, system)
        if path is None:
            missing_libs.append(name)
            continue
        provided |= _dynamic_symbols(path, "--defined-only")
    for lib in extra_libraries:
        provided |= _dynamic_symbols(lib, "--defined-only")
    return sorted(undefined - provided), missing_libs


def link_search_dirs(ninja_file: Path) -> list[Path]:
    """The -L directories of a FlashInfer ninja file, with $cuda_home expanded."""
    text = Path(ninja_file).read_text()
    m = re.search(r"^cuda_home = (.+)$", text, re.M)
    cuda_home = m.group(1).strip() if m else ""
    return [Path(d.replace("$cuda_home", cuda_home)) for d in re.findall(r"-L(\S+)", text)]


def tvm_ffi_library() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("tvm_ffi")
    for base in spec.submodule_search_locations if spec else []:
        for hit in sorted(Path(base).rglob("libtvm_ffi.so")):
            return hit
    return None


def check_link(spec: Any) -> list[str]:
    """Problems with a built reduced module's link: undefined symbols that neither its NEEDED
    libraries (CUDA runtime and driver, NVRTC, C++ runtime) nor TVM FFI provide."""
    library = Path(spec.jit_library_path)
    if not library.is_file():
        return [f"{library} was not built"]
    extra = [p for p in [tvm_ffi_library()] if p is not None]
    if not extra:
        return ["TVM FFI (apache-tvm-ffi) is not installed: cannot check the TVMFFI symbols"]
    symbols_left, libs = unresolved_symbols(library, link_search_dirs(spec.ninja_path), extra)
    problems = [f"{library.name} needs {name}, which was not found" for name in libs]
    if symbols_left:
        shown = ", ".join(demangle(symbols_left[:5]))
        more = f" and {len(symbols_left) - 5} more" if len(symbols_left) > 5 else ""
        problems.append(f"{library.name} has {len(symbols_left)} undefined symbols: {shown}{more}")
    return problems
