"""The extension modules run.py and ep.py time: FlashInfer's SM90 FP8 block-scale grouped GEMM
(fp8_blockscale_gemm.cu) with a version's patch files applied, built as a torch extension,
loaded beside the others in one process, and the DeepGEMM kernels a run selects compiled
ahead in child processes, so that their run-time nvcc builds stay out of the timings.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import cases  # noqa: E402
import spec as specs  # noqa: E402

from vllm_h20.moe.build import find_cublas_include  # noqa: E402
from vllm_h20.moe.patchfile import apply_file, read_patch  # noqa: E402

# FlashInfer 0.7.2.post1's JIT flags for its SM90 fused-MoE module (from its build.ninja),
# minus include paths; fp8_blockscale_gemm.cu is one of that module's sources.
NVCC_FLAGS = [
    "-std=c++17", "--expt-relaxed-constexpr", "-static-global-template-stub=false",
    "-use_fast_math", "-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a",
    "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
    "-DFLASHINFER_ENABLE_FP8_E5M2", "-DFLASHINFER_ENABLE_FP8_E8M0", "-DFLASHINFER_ENABLE_FP4_E2M1",
    "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DCOMPILE_HOPPER_TMA_GEMMS",
    "-DCOMPILE_HOPPER_TMA_GROUPED_GEMMS", "-DENABLE_BF16", "-DENABLE_FP8",
    "-DENABLE_FP8_BLOCK_SCALE", "-DENABLE_FP4", "-DUSING_OSS_CUTLASS_MOE_GEMM",
    "-DCUTLASS_ENABLE_GDC_FOR_SM90=1", "-DCUTLASS_MIXED_GEMM_FP4_FP8_PREPROCESSED_SIGNS=1",
    # torch's extension builder disables the half/bf16 conversions FlashInfer relies on
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
]  # fmt: skip
KERNEL_CUH = (
    "tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm_kernel.cuh"
)
GEMM_CU = "tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu"
CALIB_PATCH = HERE / "calib.patch"


@dataclass(frozen=True)
class Build:
    """One extension module: FlashInfer's sources with `patches` (repository paths) applied;
    calib: also calib.patch and the switches in ext/deepgemm_setup.cu."""

    name: str
    patches: tuple[str, ...]
    calib: bool = False

    def patch_files(self) -> list[Path]:
        return [REPO / p for p in self.patches] + ([CALIB_PATCH] if self.calib else [])


def builds_of(spec: specs.Spec) -> dict[str, Build]:
    """Version name -> the module it runs: one per distinct (patches, calib), named for the
    first version that has it (an A/A copy shares its original's)."""
    first: dict[tuple, Build] = {}
    for v in spec.versions:
        name = f"{v.name}-calib" if v.calib else v.name
        first.setdefault((v.patches, v.calib), Build(name, v.patches, v.calib))
    return {v.name: first[(v.patches, v.calib)] for v in spec.versions}


def work_for(work: Path, builds: dict[str, Build], flashinfer: str) -> Path:
    """The builds and kernel caches of one state of the inputs, under `work`: DeepGEMM names a
    cached kernel by its template arguments only, so a work dir kept on the machine across a
    changed patch would time the patch as it was before (h200.sh keeps it between starts)."""
    digest = hashlib.sha256(flashinfer.encode())
    ext = sorted(f for f in (HERE / "ext").iterdir() if f.is_file())
    for b in sorted(set(builds.values()), key=lambda b: b.name):
        digest.update(f"\0{b.name}\0".encode())
        for f in [*b.patch_files(), *ext]:
            digest.update(f"\0{f.name}\0".encode() + f.read_bytes())
    return work / f"run-{digest.hexdigest()[:12]}"


def prepare_sources(data: Path, work: Path, b: Build) -> Path:
    """A private copy of csrc/nv_internal with the build's patches applied."""
    nv = work / b.name / "nv_internal"
    if nv.exists():
        return nv
    tmp = nv.with_name("nv_internal.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(data / "csrc" / "nv_internal", tmp)
    for patch in b.patch_files():
        for diff in read_patch(patch).files:
            if diff.path.startswith("csrc/nv_internal/"):
                f = tmp / diff.path[len("csrc/nv_internal/") :]
                f.write_text(apply_file(diff, f.read_text()))
    tmp.rename(nv)
    return nv


def deepgemm_dir(data: Path, work: Path, b: Build) -> str:
    """The include dir DeepGEMM's run-time compiles read: the build's own patched copy, or
    FlashInfer's for a build without patches."""
    if not b.patch_files():
        return str(data / "csrc" / "nv_internal" / "tensorrt_llm")
    return str(work / b.name / "nv_internal" / "tensorrt_llm")


def module_name(b: Build) -> str:
    return "vllm_h20_grouped_gemm_" + "".join(c if c.isalnum() else "_" for c in b.name)


def include_dirs(nv: Path, data: Path) -> list[Path]:
    """What fp8_blockscale_gemm.cu compiles against: a (patched) csrc/nv_internal copy `nv` and
    FlashInfer's data directory for the rest (CUTLASS, spdlog, its own headers)."""
    return [
        nv, nv / "include", nv / "tensorrt_llm/cutlass_extensions/include",
        nv / "tensorrt_llm/kernels/cutlass_kernels/include",
        nv / "tensorrt_llm/kernels/cutlass_kernels",
        data / "include", data / "csrc", data / "cutlass/include",
        data / "cutlass/tools/util/include", data / "spdlog/include",
    ]  # fmt: skip


def build_module(data: Path, work: Path, b: Build):
    import torch.utils.cpp_extension as ext

    nv = prepare_sources(data, work, b)
    build = work / b.name / "build"
    build.mkdir(parents=True, exist_ok=True)
    # Any series starts with 0001, which adds expected_m to getWorkspaceSize.
    defines = (["-DVLLM_H20_PATCHED"] if b.patches else []) + (["-DVLLM_H20_CALIB"] if b.calib
                                                               else [])  # fmt: skip
    includes = include_dirs(nv, data)
    # -isystem, after nvcc's own headers: a pip CUDA include dir may carry other crt/ headers
    cublas = find_cublas_include(ext.CUDA_HOME)  # None when the toolkit has cuBLAS
    system = ["-isystem", cublas] if cublas else []
    common = nv / "cpp/common"
    sources = [HERE / "ext/grouped_gemm.cpp", HERE / "ext/deepgemm_setup.cu", nv / GEMM_CU] + [
        common / f for f in ("logger.cpp", "stringUtils.cpp", "tllmException.cpp", "envUtils.cpp")
    ]
    return ext.load(
        name=module_name(b), sources=[str(s) for s in sources],
        extra_include_paths=[str(i) for i in includes],
        extra_cflags=["-O3", "-std=c++20", *defines, *system],
        extra_cuda_cflags=NVCC_FLAGS + defines + system,
        extra_ldflags=[f"-L{ext.CUDA_HOME}/lib64/stubs", "-lcuda", "-lnvrtc"],
        build_directory=str(build), verbose=False,
    )  # fmt: skip


class Module:
    """A built module. DeepGEMM's cache dir and JIT include list are statics of inline functions,
    which GCC makes process-wide (STB_GNU_UNIQUE): the modules of one process share them, the
    include list last set winning. So main() sets TRTLLM_DG_CACHE_DIR once, before any module
    loads, and sets the patched headers last (`shared_headers`): every build's kernels compile
    from them, those without a row class exactly as from FlashInfer's own."""

    def __init__(self, data: Path, work: Path, b: Build):
        import importlib.util

        import torch  # noqa: F401 - the extension links against torch's libraries

        name = module_name(b)
        so = work / b.name / "build" / f"{name}.so"
        loader = importlib.util.spec_from_file_location(name, so)
        self.mod = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(self.mod)
        self.build = b
        self.mod.set_include_dirs([deepgemm_dir(data, work, b)])

    def enter(self, force: int = 0, single: bool = False) -> None:
        if self.build.calib:
            self.mod.set_switches(force, single)


def shared_headers(data: Path, work: Path, builds: dict[str, Build]) -> str:
    """The build whose DeepGEMM headers every build's kernels compile from (Module): one that
    changes them, if any does; refused when two builds change them differently, as one process
    cannot compile each one's kernels from its own."""

    def digest(b: Build) -> str:
        d = Path(deepgemm_dir(data, work, b)) / "deep_gemm"
        return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(d.glob("*")))).hexdigest()

    own = digest(Build("stock", ()))
    changed = {name: h for name, b in builds.items() if (h := digest(b)) != own}
    if len(set(changed.values())) > 1:
        raise SystemExit(f"run.py: builds {', '.join(changed)} patch DeepGEMM's headers "
                         "differently; one run can time only one set of them (they share its "
                         "JIT include list and cache): time them in separate runs")  # fmt: skip
    return next(iter(changed), next(iter(builds)))


def load_modules(data: Path, work: Path, builds: dict[str, Build],
                 shared: str | None = None) -> dict[str, Module]:  # fmt: skip
    """Every build's module, the one whose headers all compile from (`shared`, worked out by
    shared_headers when not given) last."""
    shared = shared or shared_headers(data, work, builds)
    mods = {name: Module(data, work, b) for name, b in builds.items() if name != shared}
    return mods | {shared: Module(data, work, builds[shared])}


def setup(work: Path, builds: dict[str, Build], flashinfer: Path, jobs: int) -> tuple[Path, Path]:
    """The work dir of this state of the inputs (work_for) and FlashInfer's unpacked sources;
    DeepGEMM's cache dir and compiler set before any module loads (see Module)."""
    from harness import unpack_flashinfer

    work = work_for(work, builds, flashinfer.name)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["TRTLLM_DG_CACHE_DIR"] = str(work / "deepgemm")
    os.environ.setdefault("TRTLLM_DG_NVCC_COMPILER", shutil.which("nvcc") or "nvcc")
    os.environ.setdefault("MAX_JOBS", str(jobs))
    return work, unpack_flashinfer(flashinfer, work)


def _build_in_child(args) -> tuple[str, float]:
    data, work, b = args
    t0 = time.time()
    build_module(Path(data), Path(work), b)
    return b.name, time.time() - t0


def build_all(data: Path, work: Path, builds: list[Build]) -> dict[str, float]:
    """Every build at once, one process each (nvcc-bound); build name -> seconds."""
    with cf.ProcessPoolExecutor(len(builds)) as pool:
        return dict(pool.map(_build_in_child, [(str(data), str(work), b) for b in builds]))


def _warm_child(args) -> list[tuple]:
    """Runs each job once on a small grouped GEMM (<= 4 rows per expert, contents zero) sized
    as the runner would be for its token count: DeepGEMM JIT-compiles what that selects."""
    data, work, fams, builds, jobs = args
    import torch

    mods = load_modules(Path(data), Path(work), builds)
    done = []
    for build, single, fname, si, num_rows, m, force in jobs:
        fam, mod = fams[fname], mods[build]
        s = fam.shapes[si]
        rows = min(4 * fam.local, num_rows * (fam.top_k if force == 0 else 1))
        counts = np.full(fam.local, rows // fam.local)
        counts[: rows % fam.local] += 1
        a = torch.zeros(rows, s.k, device="cuda").to(torch.bfloat16)
        w = torch.zeros(fam.local, s.n, s.k, dtype=torch.float8_e4m3fn, device="cuda")
        sc = torch.ones(fam.local, s.n // 128, s.k // 128, device="cuda")
        off = torch.tensor(cases.offsets(counts), device="cuda")
        gg = mod.mod.GroupedGemm(num_rows, s.n, s.k, fam.top_k if force == 0 else 1, fam.local, m)
        ws = torch.empty(max(gg.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
        out = torch.empty(rows, s.n, dtype=torch.bfloat16, device="cuda")
        t0 = time.time()
        mod.enter(force, single)
        gg.run(out, a, w, sc, off, ws)
        torch.cuda.synchronize()
        mod.enter(0, False)
        del a, w, sc, off, gg, ws, out
        torch.cuda.empty_cache()
        done.append((build, fname, si, num_rows, m, force, time.time() - t0))
    return done


def compile_kernels(data: Path, work: Path, families, builds, jobs, procs: int) -> list:
    """The warm jobs (build, single, family, shape index, tokens, expected_m, force) in up to 16
    spawned processes (they inherit VLLM_H20_NUM_SMS: a calib build plans for it)."""
    procs = min(procs, 16)
    chunks = [c for c in (jobs[i::procs] for i in range(procs)) if c]
    if not chunks:
        return []
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        fams = {f.name: f for f in families}
        parts = pool.map(_warm_child, [(str(data), str(work), fams, builds, c) for c in chunks])
        return [x for part in parts for x in part]
