"""The toolchain layer: nvcc/CUDA discovery, link shims, include closures and every ninja
helper. It decides nothing (which module and which sources are `plan.py`'s and `dispatch.py`'s
business) and imports nothing of the package above `overlay`/`paths`, so anything may use it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .overlay import Overlay

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\]")


class BuildError(RuntimeError):
    pass


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
    out = paths.link_shims_dir(cache)
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
    env = dict(os.environ)
    cuda_home = find_cuda_home()
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    shims = link_shims(cuda_home, cache or paths.cache_root())
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


@dataclass(frozen=True)
class NinjaFile:
    """A build directory and its ninja file: what `run_ninja` needs of a plan or a JitSpec
    (plan.BuildPlan has both fields too)."""

    build_dir: str
    ninja_file: str

    @classmethod
    def of(cls, spec) -> NinjaFile:
        return cls(str(spec.build_dir), str(spec.ninja_path))


def object_map(ninja_file: Path) -> dict[str, str]:
    """source -> object, as FlashInfer's ninja file names them (the naming changed across
    FlashInfer versions, so it is read rather than recomputed)."""
    out = {}
    for line in Path(ninja_file).read_text().splitlines():
        m = re.match(r"^build (\S+\.o): \S*compile (\S+)", line)
        if m:
            out[m.group(2)] = m.group(1)
    return out


_ERROR = re.compile(r"(^|[\s:])(fatal )?error( [A-Z]*\d+)?:|#error", re.I)
_ERROR_LOOSE = re.compile(r"(^|[\s:])(fatal )?error( [A-Z]*\d+)?:|#error|^FAILED:|not found", re.I)


def first_error(output: str | Sequence[str]) -> str:
    """The first line of a compiler's or ninja's output that names an error (not a path that
    contains "error"), else its last line."""
    lines = output.strip().splitlines() if isinstance(output, str) else list(output)
    for pattern in (_ERROR, _ERROR_LOOSE):
        for ln in lines:
            if pattern.search(ln) and not ln.startswith("ninja: Entering"):
                return ln.strip()
    return (lines[-1] if lines else "(no output)").strip()


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
    plan: NinjaFile,
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
        where = f"; full log: {log}" if log else ""
        raise BuildError(f"ninja failed (exit {rc}): {first_error(tail)[:300]}{where}")


def headers_used(plan: NinjaFile, obj: str) -> list[str]:
    """The headers ninja recorded for an object it built (FlashInfer's rules use deps=gcc)."""
    proc = subprocess.run(
        [ninja_binary(), "-C", plan.build_dir, "-f", plan.ninja_file, "-t", "deps", obj],
        capture_output=True,
        text=True,
    )
    return [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith(" ")]


def wrong_headers(plan, overlay: Overlay, stock_csrc: Path) -> list[str]:
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


def build_seconds(plan: NinjaFile) -> dict[str, float]:
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
