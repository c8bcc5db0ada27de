"""What the DeepGEMM compile tests share (test_deepgemm_row_class, _fitted, _whole_expert): an
overlay of the installed FlashInfer with a patch series, a host program built against it (the
patched `generateKernel` writing kernel sources, or a plan cut out of the headers), and one
generated kernel compiled with DeepGEMM's own nvcc flags; and the H20 model whose plan ports
they check (also test_precompile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from vllm_h20.moe import overlay, precompile
from vllm_h20.moe.patchfile import read_patch


def bench_model() -> ModuleType:
    """benchmarks/moe_dispatch/model.py (a script beside its `cases` module, not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "moe_dispatch"))
    import model

    return model


def added_text(patch: Path, file_name: str) -> str:
    """What one patch file adds to the source file named `file_name` (its hunks' new side), for
    the tests that cut functions out of a patch and compile them alone."""
    (diff,) = [d for d in read_patch(patch).files if d.path.endswith("/" + file_name)]
    return "\n".join(line for h in diff.hunks for line in h.new)


def candidate_series(series: str, last: str, same_bytes: int | None = None) -> Path:
    """Check that a candidate folder holds whole series (a maintainer applies a folder with
    `git am`): on both FlashInfer lines patches named as the shipped ones, the first
    `same_bytes` of them (all by default) the shipped ones byte for byte, then `last`, the same on
    both lines. Returns the top-level `last`."""
    root = overlay.patches_dir() / "flashinfer"
    for line in ("", "v0.6.14"):
        shipped = sorted((root / line).glob("*.patch"))
        mine = sorted((root / series / line).glob("*.patch"))
        assert [p.name for p in mine] == [p.name for p in shipped] + [last]
        pairs = zip(mine[:same_bytes], shipped[:same_bytes], strict=False)
        assert all(a.read_bytes() == b.read_bytes() for a, b in pairs)
    assert (root / series / last).read_bytes() == (root / series / "v0.6.14" / last).read_bytes()
    return root / series / last


def series_patches(version: str, series: str):
    """The patches of one series under patches/flashinfer/ ("" the shipped one) for a FlashInfer
    version, as vllm-h20 picks them ($VLLM_H20_PATCH_SERIES)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(overlay.SERIES_ENV, series)
        return overlay.shipped_patches(version)


def nvcc() -> str:
    found = shutil.which("nvcc")
    if found is None:
        if os.environ.get("VLLM_H20_REQUIRE_NVCC"):
            pytest.fail("nvcc is not on PATH, and VLLM_H20_REQUIRE_NVCC is set (CI)")
        pytest.skip("nvcc is not on PATH")
    return found


def overlay_csrc(installed_fi, patches, work: Path) -> Path:
    """The csrc/ of an overlay of the installed FlashInfer with `patches` applied."""
    a = overlay.assess(installed_fi, patches)
    assert a.state is overlay.FixState.NEEDS_PATCH, a.detail
    ov = overlay.build_overlay(installed_fi, a, overlay.overlay_for(installed_fi, patches, work))
    return ov.csrc_dir


def build_host(src: Path, csrc: Path, installed_fi, exe: Path) -> None:
    """A host program against an overlay's headers (only their inline host code runs)."""
    flags, common = precompile._host_includes(csrc, installed_fi.root)
    cmd = [nvcc(), "-std=c++17", "--expt-relaxed-constexpr", *flags, str(src),
           *map(str, common), "-o", str(exe), "-Xlinker",
           "--unresolved-symbols=ignore-all"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def generate(gen: str, sources: dict[str, list[str]], csrc: Path, installed_fi, work: Path):
    """The kernel sources a generator program (`gen`, printing the source on stdout and "tag"
    plus the cache-name tag on stderr) writes for each argument list, and their tags."""
    (work / "gen.cu").write_text(gen)
    build_host(work / "gen.cu", csrc, installed_fi, work / "gen")
    out = {}
    for name, args in sources.items():
        r = subprocess.run([str(work / "gen"), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[name] = r.stdout
        out[name + "_tag"] = r.stderr.strip()[len("tag") :]
    return out


def compile_kernel(source: str, include: Path, tmp_path: Path, name: str, *extra: str):
    """DeepGEMM's own nvcc flags (compiler.cuh; vllm_h20.moe.precompile keeps the copy that
    `kernels precompile` uses) for one generated kernel, and `extra` ones."""
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    cmd = [nvcc(), str(src), "-o", str(tmp_path / f"{name}.cubin"), *precompile.NVCC_FLAGS,
           *extra, f"-I{include}"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
