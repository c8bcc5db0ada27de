"""A patched copy of FlashInfer's sources in a directory we own, and the JIT spec built from it.

We never write into site-packages: the overlay mirrors FlashInfer's `csrc/` with symlinks,
holds the patched files (and every compiled source, see `materialize`) as real files, and the
JIT module built from it gets a distinct name so FlashInfer's stock cached module stays valid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from .._data import shipped_dir
from .flashinfer_src import FlashInferSource
from .patchfile import Patch, PatchError, apply_file, read_patch
from .paths import overlay_dir

OVERLAY_FORMAT = "2"
# The line the fix removes; its absence with a patch that does not apply means someone else
# fixed it (or rewrote the code), so we must not claim either state blindly.
BUG_FILE = (
    "csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/"
    "fp8_blockscale_gemm/fp8_blockscale_gemm.cu"
)
BUG_LINE = "expected_m_ = shape_m;"
# DeepGEMM compiles its kernels at run time from this header dir (the module is told where it is,
# see route.point_deepgemm); the overlay holds it as real files, so relative includes between its
# headers stay inside the overlay whatever the compiler makes of symlinks.
DEEPGEMM_DIR = "nv_internal/tensorrt_llm/deep_gemm"


class FixState(str, Enum):
    NEEDS_PATCH = "needs-patch"  # stock sources; our patches apply
    HAS_FIX = "has-fix"  # our patches are already in the sources (reverse-applies)
    FIXED_UPSTREAM = "fixed-upstream"  # patch does not apply, and the bug line is gone
    CONFLICT = "conflict"  # patch does not apply and the bug is still there


@dataclass(frozen=True)
class Assessment:
    state: FixState
    detail: str
    patched: dict[str, str]  # csrc-relative path -> patched text (NEEDS_PATCH only)


def series_files(version: str | None = None, project: str = "flashinfer") -> list[Path]:
    """The patch files of the series for a FlashInfer version, in order: `patches/<project>/`,
    each replaced by its namesake in `patches/<project>/v<version>/` where that release needs its
    own variant (same change, other context lines). Every file lives once: a variant folder
    holds only the patches that differ."""
    base = patches_dir() / project
    variant = base / f"v{version}" if version else None
    out = []
    for p in sorted(base.glob("*.patch")):
        own = variant / p.name if variant is not None else None
        out.append(own if own is not None and own.is_file() else p)
    if variant is not None and variant.is_dir():
        stray = sorted(q.name for q in variant.glob("*.patch") if not (base / q.name).is_file())
        if stray:
            raise PatchError(f"{variant}: {', '.join(stray)} replace no patch of {base}")
    return out


def shipped_patches(version: str | None = None, project: str = "flashinfer") -> list[Patch]:
    """The patches shipped with vllm-h20 for a FlashInfer version, in order."""
    out = [read_patch(p) for p in series_files(version, project)]
    if not out:
        raise PatchError(f"no {project} patches found in {patches_dir() / project}")
    return out


def series_name(version: str | None = None, project: str = "flashinfer") -> str:
    """How the log line names the series: the release's own variant folder under patches/
    where it has one (its other patches come from the series itself), else the series'."""
    base = patches_dir() / project
    variant = base / f"v{version}" if version else None
    folder = variant if variant is not None and any(variant.glob("*.patch")) else base
    return folder.relative_to(patches_dir()).as_posix()


def patches_dir() -> Path:
    return shipped_dir("patches", "patches")


def _source_diffs(patches: Sequence[Patch]):
    """(patch, file diff) for every file a patch changes under `csrc/`: the wheel ships only
    those (the FlashInfer test a patch adds lives in the repository, not in the wheel)."""
    for p in patches:
        for d in p.files:
            if d.path.startswith("csrc/"):
                yield p, d


def _read(root: Path, rel: str) -> str | None:
    path = root / rel
    return path.read_text(encoding="utf-8") if path.is_file() else None


def assess(src: FlashInferSource, patches: Sequence[Patch]) -> Assessment:
    """Whether FlashInfer's sources need our patches, already carry them, or neither."""
    texts: dict[str, str | None] = {}
    forward_error = None
    current = ""
    try:
        for p, d in _source_diffs(patches):
            current = p.name
            before = texts[d.path] if d.path in texts else _read(src.root, d.path)
            texts[d.path] = apply_file(d, before)
    except PatchError as e:
        forward_error = f"{current}: {e}"
    if forward_error is None:
        names = ", ".join(p.name for p in patches)
        patched = {k: v for k, v in texts.items() if v is not None}
        return Assessment(FixState.NEEDS_PATCH, f"patches apply cleanly: {names}", patched)
    try:
        texts = {}
        for _p, d in reversed(list(_source_diffs(patches))):
            before = texts[d.path] if d.path in texts else _read(src.root, d.path)
            texts[d.path] = apply_file(d, before, reverse=True)
        return Assessment(FixState.HAS_FIX, "the sources already contain the patches", {})
    except PatchError:
        pass
    bug = _read(src.root, BUG_FILE)
    if bug is not None and BUG_LINE not in bug:
        return Assessment(
            FixState.FIXED_UPSTREAM,
            f"the patches do not apply and `{BUG_LINE}` is gone from "
            f"{BUG_FILE.split('/')[-1]}: assuming FlashInfer fixed it itself",
            {},
        )
    return Assessment(FixState.CONFLICT, f"the patches do not apply ({forward_error})", {})


def overlay_key(src: FlashInferSource, patches: Sequence[Patch]) -> str:
    h = hashlib.sha256()
    for part in (OVERLAY_FORMAT, src.version, str(src.csrc_dir.resolve())):
        h.update(part.encode() + b"\0")
    for p in patches:
        for d in p.files:
            h.update(repr((d.path, d.hunks)).encode())
    return h.hexdigest()[:12]


def module_name(stock_name: str, key: str) -> str:
    """The patched module's name: distinct from the stock one, stable for one patch set."""
    return f"{stock_name}_vllm_h20_{key[:8]}"


@dataclass(frozen=True)
class Overlay:
    root: Path  # <cache>/flashinfer/<version>/overlay-<key>
    key: str
    stock_csrc: Path  # FlashInfer's csrc, resolved
    patched_files: tuple[str, ...]  # csrc-relative paths written as patched copies

    @property
    def csrc_dir(self) -> Path:
        return self.root / "csrc"

    @property
    def complete(self) -> bool:
        return (self.root / ".complete").is_file()

    def remap(self, path: Path | str) -> Path:
        """A path inside FlashInfer's csrc -> the same path inside the overlay."""
        p = Path(path)
        try:
            rel = p.resolve().relative_to(self.stock_csrc)
        except ValueError:
            return p
        return self.csrc_dir / rel


def overlay_for(src: FlashInferSource, patches: Sequence[Patch], root: Path | None = None):
    key = overlay_key(src, patches)
    base = overlay_dir(src.version, key, root)
    files = tuple(sorted({d.path[len("csrc/") :] for _p, d in _source_diffs(patches)}))
    return Overlay(root=base, key=key, stock_csrc=src.csrc_dir.resolve(), patched_files=files)


def build_overlay(src: FlashInferSource, assessment: Assessment, overlay: Overlay) -> Overlay:
    """Create the overlay tree once (atomically: built beside it, then renamed into place)."""
    if overlay.complete:
        return overlay
    if assessment.state is not FixState.NEEDS_PATCH:
        raise PatchError(f"nothing to overlay: {assessment.detail}")
    overlay.root.parent.mkdir(parents=True, exist_ok=True)
    tmp = overlay.root.with_name(f"{overlay.root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    csrc = tmp / "csrc"
    stock = overlay.stock_csrc
    for dirpath, dirnames, filenames in os.walk(stock):
        rel = Path(dirpath).relative_to(stock)
        (csrc / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            if rel.as_posix() == DEEPGEMM_DIR:
                shutil.copyfile(Path(dirpath) / name, csrc / rel / name)
            else:
                os.symlink(Path(dirpath) / name, csrc / rel / name)
        dirnames.sort()
    for rel_csrc, text in assessment.patched.items():
        target = tmp / rel_csrc
        if target.is_symlink() or target.exists():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    (tmp / "SOURCE").write_text(
        f"FlashInfer {src.version} {stock}\npatched: {', '.join(overlay.patched_files)}\n",
        encoding="utf-8",
    )
    (tmp / ".complete").write_text(overlay.key + "\n", encoding="utf-8")
    try:
        os.rename(tmp, overlay.root)
    except OSError:
        # Another process won the race (same key, same content) or a stale half-built
        # directory is in the way.
        shutil.rmtree(tmp, ignore_errors=True)
        if not overlay.complete:
            shutil.rmtree(overlay.root, ignore_errors=True)
            return build_overlay(src, assessment, overlay)
    return overlay


def materialize(paths: Iterable[Path]) -> None:
    """Turn overlay symlinks into real copies.

    FlashInfer's ninja writer resolves source paths, so a symlinked source would compile from
    site-packages and find the stock headers beside it. Atomic per file; safe to race."""
    for p in paths:
        if p.is_symlink():
            tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
            shutil.copyfile(p.resolve(), tmp)
            os.replace(tmp, p)


def patched_spec(spec: Any, overlay: Overlay) -> Any:
    """FlashInfer's JitSpecNvcc for the stock module -> the same build from the overlay.

    Sources and include directories under FlashInfer's csrc move into the overlay; the overlay's
    csrc root is appended to the include directories so csrc-relative includes resolve there
    before FlashInfer's own `-isystem .../csrc`. Everything else (flags, generated CUTLASS
    instantiations, link flags) is FlashInfer's."""
    stock = str(overlay.stock_csrc)
    ours = str(overlay.csrc_dir)

    def flag(f: str) -> str:
        return f.replace(stock, ours)

    sources = [overlay.remap(s) for s in spec.sources]
    includes = [overlay.remap(d) for d in (spec.extra_include_dirs or [])]
    if overlay.csrc_dir not in includes:
        includes.append(overlay.csrc_dir)
    changes: dict[str, Any] = {
        "name": module_name(spec.name, overlay.key),
        "sources": sources,
        "extra_include_dirs": includes,
        "extra_cflags": [flag(f) for f in spec.extra_cflags or []] or spec.extra_cflags,
        "extra_cuda_cflags": [flag(f) for f in spec.extra_cuda_cflags or []]
        or spec.extra_cuda_cflags,
    }
    by_source = getattr(spec, "extra_cuda_cflags_by_source", None)
    if by_source:
        changes["extra_cuda_cflags_by_source"] = {overlay.remap(k): v for k, v in by_source.items()}
    materialize(s for s in sources if str(s).startswith(ours))
    return dataclasses.replace(spec, **changes)
