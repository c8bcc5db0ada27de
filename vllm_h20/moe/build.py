"""Build the patched SM90 fused-MoE JIT module (or just the objects our patch touches).

FlashInfer describes the module as a JitSpec and writes a ninja file for it; we take that spec
from the installed FlashInfer, move it onto our overlay (`overlay.patched_spec`) and run the
same ninja file, so the flags are FlashInfer's own. Imports FlashInfer (and so torch): CLI only,
never the plugin.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from .overlay import Overlay

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\]")


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BuildPlan:
    """What FlashInfer's ninja file for the patched module contains."""

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


def find_cuda_home() -> str | None:
    """CUDA_HOME, else the toolkit nvcc really lives in (`nvcc --dryrun` prints it as TOP:
    /usr/local/bin/nvcc is often a wrapper script, which fools FlashInfer's guess)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
    return str(Path(m.group(1).strip()).resolve()) if m else None  # TOP is <toolkit>/bin/..


def find_cublas_include(cuda_home: str | None) -> str | None:
    """Where cublas_v2.h is: the toolkit's include dir, else the nvidia-cublas wheel's."""
    if cuda_home:
        for d in (Path(cuda_home) / "include", Path(cuda_home) / "targets/x86_64-linux/include"):
            if (d / "cublas_v2.h").is_file():
                return None  # the toolkit has it; nvcc finds it on its own
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations if spec else []:
        for hit in sorted(Path(base).glob("*/include/cublas_v2.h")):
            return str(hit.parent)
    return None


_DRIVER_API = re.compile(r"\bCUDAAPI\s+(cu[A-Za-z0-9_]+)\s*\(")
_DRIVER_ALIAS = re.compile(r"^\s*#\s*define\s+(cu[A-Za-z0-9_]+)\s+(cu[A-Za-z0-9_]+)\b", re.M)


def driver_api_names(cuda_h: Path) -> list[str]:
    """Every CUDA driver API entry point cuda.h declares, under the names callers link to
    (`cuMemAlloc` is `#define`d to `cuMemAlloc_v2`: both are listed)."""
    text = cuda_h.read_text(encoding="utf-8", errors="replace")
    names = set(_DRIVER_API.findall(text))
    names |= {b for _a, b in _DRIVER_ALIAS.findall(text)}
    return sorted(names)


def _shim_dir(cache: Path) -> Path:
    d = cache / "link-shims"
    d.mkdir(parents=True, exist_ok=True)
    return d


def link_shims(cuda_home: str | None, cache: Path) -> Path | None:
    """A directory with what FlashInfer's link line (`-lcudart -lcuda -lnvrtc`) needs and this
    toolkit lacks, so a JIT module links on a machine without a GPU driver or a full toolkit:
    `libnvrtc.so`/`libcudart.so` pointing at the nvidia-* wheels' copies, and a link-time
    `libcuda.so` stub (what the toolkit's lib64/stubs holds: every driver API entry point of
    cuda.h, SONAME libcuda.so.1; the real driver is what loads at run time). None if nothing
    is missing."""
    if not cuda_home:
        return None
    lib64 = Path(cuda_home) / "lib64"
    made = False
    out = _shim_dir(cache)
    for name in ("nvrtc", "cudart"):
        if (lib64 / f"lib{name}.so").exists():
            continue
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
        for base in spec.submodule_search_locations if spec else []:
            hits = sorted(Path(base).glob(f"*/lib/lib{name}.so.[0-9]*"))
            if hits:
                link = out / f"lib{name}.so"
                if not link.is_symlink() or link.resolve() != hits[0].resolve():
                    link.unlink(missing_ok=True)
                    link.symlink_to(hits[0])
                made = True
                break
    has_driver = (lib64 / "stubs" / "libcuda.so").exists() or (lib64 / "libcuda.so").exists()
    cuda_h = Path(cuda_home) / "include" / "cuda.h"
    if not has_driver and cuda_h.is_file():
        stub = out / "libcuda.so"
        if not stub.exists():
            src = out / "libcuda_stub.c"
            src.write_text(
                "/* link-time stub of the CUDA driver API, made by vllm-h20 from cuda.h */\n"
                + "".join(f"void {n}(void) {{}}\n" for n in driver_api_names(cuda_h))
            )
            tmp = out / f".libcuda.so.tmp-{os.getpid()}"
            subprocess.run(
                ["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(src), "-o", str(tmp)],
                check=True, capture_output=True,
            )  # fmt: skip
            os.replace(tmp, stub)
        soname = out / "libcuda.so.1"  # for a loader on a machine with no driver (CPU tests)
        if not soname.is_symlink():
            soname.symlink_to("libcuda.so")
        made = True
    return out if made else None


def jit_env(
    workspace: Path | None = None, arch: str | None = None, cache: Path | None = None
) -> dict[str, str]:
    """Environment for building FlashInfer JIT modules on a machine that may have no GPU."""
    from .overlay import cache_root

    env = dict(os.environ)
    cuda_home = find_cuda_home()
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    shims = link_shims(cuda_home, cache or cache_root())
    if shims is not None:
        extra = env.get("FLASHINFER_EXTRA_LDFLAGS", "")
        if f"-L{shims}" not in extra:
            env["FLASHINFER_EXTRA_LDFLAGS"] = f"{extra} -L{shims}".strip()
    cublas = find_cublas_include(cuda_home)
    if cublas:  # nvcc and the host compiler (the module's .cpp files include cudaUtils.h)
        for var in ("FLASHINFER_EXTRA_CUDAFLAGS", "FLASHINFER_EXTRA_CFLAGS"):
            extra = env.get(var, "")
            if cublas not in extra:
                env[var] = f"{extra} -isystem {cublas}".strip()
    if arch:
        env["FLASHINFER_CUDA_ARCH_LIST"] = arch
    if workspace is not None:
        env["FLASHINFER_WORKSPACE_BASE"] = str(workspace)
    if cache is not None:
        env["VLLM_H20_CACHE_DIR"] = str(cache)
    return env


def include_closure(
    source: Path, include_dirs: Iterable[Path], _memo: dict[Path, list[str]] | None = None
) -> set[Path]:
    """Files that `source` includes with `#include "..."`, transitively, searched as the
    compiler does (the including file's directory, then the -I directories). The patched files
    are FlashInfer's own headers, always included this way; angle-bracket (system, CUTLASS)
    headers cannot reach them and are not followed."""
    dirs = [Path(d) for d in include_dirs]
    memo = {} if _memo is None else _memo
    seen: set[Path] = set()
    todo = [Path(os.path.normpath(source))]
    while todo:
        f = todo.pop()
        if f not in memo:
            try:
                memo[f] = _INCLUDE.findall(f.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                memo[f] = []
        for name in memo[f]:
            for d in [f.parent, *dirs]:
                cand = d / name
                if cand.is_file():
                    key = Path(os.path.normpath(cand))
                    if key not in seen:
                        seen.add(key)
                        todo.append(key)
                    break
    return seen


def touched_sources(
    sources: Iterable[Path], include_dirs: list[Path], overlay: Overlay
) -> list[Path]:
    """The translation units that compile a patched file (directly or through includes)."""
    patched = {Path(os.path.normpath(overlay.csrc_dir / f)) for f in overlay.patched_files}
    memo: dict[Path, list[str]] = {}
    out = []
    for s in sources:
        s = Path(s)
        if Path(os.path.normpath(s)) in patched or include_closure(s, include_dirs, memo) & patched:
            out.append(s)
    return out


def plan(variant: str = "auto", cache: Path | None = None) -> tuple[BuildPlan, Overlay]:
    """Write FlashInfer's ninja file for the patched SM90 fused-MoE module; return its plan.

    variant: auto (FlashInfer decides from the visible GPU), h20 (the 78-SM prebuilt-D
    variant, for building on a machine without the H20 attached), generic."""
    from flashinfer.jit import fused_moe as jit_fused_moe

    from . import dispatch
    from .overlay import overlay_for

    select_variant(variant)
    decision = dispatch.decide(env={dispatch.ENV: "per_expert", dispatch.MODULE_ENV: "full"})
    if not decision.overlay:
        raise BuildError(decision.message)
    stock_gen = jit_fused_moe.gen_cutlass_fused_moe_sm90_module
    gen = dispatch.patched_generator(stock_gen, decision, cache)
    spec = gen()
    spec.write_ninja()
    assert decision.src is not None
    overlay = overlay_for(decision.src, decision.patches, cache)
    from .reduced import object_map

    objects = object_map(Path(spec.ninja_path))
    includes = [Path(d) for d in spec.extra_include_dirs]
    touched = [str(Path(t).resolve()) for t in touched_sources(spec.sources, includes, overlay)]
    missing = [t for t in touched if t not in objects]
    if missing:
        raise BuildError(f"{spec.ninja_path} has no build line for {missing[0]}")
    return (
        BuildPlan(
            module=spec.name,
            build_dir=str(spec.build_dir),
            ninja_file=str(spec.ninja_path),
            library=str(spec.jit_library_path),
            objects=objects,
            touched=touched,
        ),
        overlay,
    )


def select_variant(variant: str) -> None:
    """Make FlashInfer's SM90 fused-MoE spec the H20 (78-SM prebuilt-D) or generic variant
    regardless of the visible GPU; "auto" leaves FlashInfer's own choice."""
    if variant == "auto":
        return
    from flashinfer.jit import fused_moe as jit_fused_moe

    hook = getattr(jit_fused_moe, "_should_enable_sm90_moe_prebuilt_d_descriptor", None)
    if hook is None and variant == "h20":
        raise BuildError("this FlashInfer has no H20 (prebuilt-D) fused-MoE variant")
    if hook is not None:
        jit_fused_moe._should_enable_sm90_moe_prebuilt_d_descriptor = lambda: variant == "h20"


@dataclass(frozen=True)
class NinjaFile:
    """A build directory and its ninja file: what `run_ninja` needs of a plan or a JitSpec."""

    build_dir: str
    ninja_file: str

    @classmethod
    def of(cls, spec) -> NinjaFile:
        return cls(str(spec.build_dir), str(spec.ninja_path))


def plan_in_subprocess(
    package_root: Path | None, env: Mapping[str, str], variant: str = "generic"
) -> BuildPlan:
    """`plan()` run by another FlashInfer (an unpacked wheel at package_root) in a child
    interpreter, so one CI job can check several FlashInfer versions."""
    env = dict(env)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(package_root), str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
        )
    code = (
        "import sys, os; from vllm_h20.moe import build; "
        f"p, _ = build.plan({variant!r}, os.environ.get('VLLM_H20_CACHE_DIR') and "
        "__import__('pathlib').Path(os.environ['VLLM_H20_CACHE_DIR'])); "
        "print('PLAN ' + p.to_json())"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("PLAN "):
            return BuildPlan.from_json(line[5:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise BuildError(f"could not build FlashInfer's JIT spec: {tail[0]}")


def ninja_binary() -> str:
    try:
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        found = shutil.which("ninja")
        if not found:
            raise BuildError("ninja is not installed (pip install ninja)") from None
        return found


def run_ninja(
    plan: BuildPlan | NinjaFile,
    targets: list[str] | None,
    jobs: int,
    env: Mapping[str, str],
    on_status: Callable[[int, int, str], None] | None = None,
    log: Path | None = None,
) -> None:
    """Run FlashInfer's ninja file (all of it, or the given object targets)."""
    cmd = [ninja_binary(), "-C", plan.build_dir, "-f", plan.ninja_file, "-j", str(jobs)]
    cmd += targets or []
    out = open(log, "w") if log else None  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(
            cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            if out:
                out.write(line)
            tail = (tail + [line.rstrip()])[-40:]
            m = _NINJA_STATUS.match(line)
            if m and on_status:
                on_status(int(m.group(1)), int(m.group(2)), line[m.end() :].strip())
        rc = proc.wait()
    finally:
        if out:
            out.close()
    if rc != 0:
        from .reduced import first_error

        where = f"; full log: {log}" if log else ""
        raise BuildError(f"ninja failed (exit {rc}): {first_error(tail)[:300]}{where}")


def headers_used(plan: BuildPlan, obj: str) -> list[str]:
    """The headers ninja recorded for an object it built (FlashInfer's rules use deps=gcc)."""
    proc = subprocess.run(
        [ninja_binary(), "-C", plan.build_dir, "-f", plan.ninja_file, "-t", "deps", obj],
        capture_output=True,
        text=True,
    )
    return [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith(" ")]


def wrong_headers(plan: BuildPlan, overlay: Overlay, stock_csrc: Path) -> list[str]:
    """How the built objects failed to use the patched sources, from ninja's dependency
    records: a touched object that read no patched file from the overlay, or that read the
    stock copy of one from FlashInfer's csrc (the include order let it escape)."""
    problems = []
    ours = {os.path.normpath(overlay.csrc_dir / rel) for rel in overlay.patched_files}
    for src in plan.touched:
        used = {os.path.normpath(h) for h in headers_used(plan, plan.objects[src])}
        used.add(os.path.normpath(src))
        if not used & ours:
            problems.append(f"{Path(src).name} read none of the patched files from {overlay.root}")
        for rel in overlay.patched_files:
            if os.path.normpath(stock_csrc / rel) in used:
                problems.append(f"{Path(src).name} compiled the stock {rel}")
    return problems


def unpack_wheel(wheel: Path, dest_root: Path) -> Path:
    """Unpack a flashinfer-python wheel once (cached by file name and size); returns the root
    that holds `flashinfer/` and its `.dist-info`."""
    import zipfile

    dest = dest_root / f"{wheel.name}-{wheel.stat().st_size}"
    if (dest / ".complete").is_file():
        return dest
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
    except zipfile.BadZipFile:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"{wheel}: not a wheel (bad zip file); download it again") from None
    (tmp / ".complete").write_text(wheel.name + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    return dest


def build_seconds(plan: BuildPlan) -> dict[str, float]:
    """Seconds ninja spent on each output (normalized absolute path), from its .ninja_log
    (latest entry wins; an output that was up to date keeps the time of the build that made
    it)."""
    log = Path(plan.build_dir) / ".ninja_log"
    out: dict[str, float] = {}
    if not log.is_file():
        return out
    for line in log.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 4 and fields[0].isdigit():
            target = fields[3]
            target = target if os.path.isabs(target) else str(Path(plan.build_dir) / target)
            out[os.path.normpath(target)] = (int(fields[1]) - int(fields[0])) / 1000
    return out
