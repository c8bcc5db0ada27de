"""The patched source overlay and the JIT spec built from it, against the real FlashInfer."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from vllm_h20.moe import overlay
from vllm_h20.moe.overlay import FixState
from vllm_h20.moe.patchfile import PatchError


def _built(src, patches, tmp_path):
    a = overlay.assess(src, patches)
    return a, overlay.build_overlay(src, a, overlay.overlay_for(src, patches, tmp_path))


@pytest.mark.parametrize(
    "state, expected",
    [
        ("stock", FixState.NEEDS_PATCH),
        ("patched", FixState.HAS_FIX),
        ("fixed-upstream", FixState.FIXED_UPSTREAM),
        ("conflict", FixState.CONFLICT),
    ],
)
def test_assess_tells_the_four_states_apart(fake_fi, patches, state, expected):
    a = overlay.assess(fake_fi(state), patches)
    assert a.state is expected, a.detail
    assert bool(a.patched) == (expected is FixState.NEEDS_PATCH)
    if expected is FixState.CONFLICT:
        assert "fp8_blockscale_gemm.cu: hunk 1" in a.detail


def test_installed_flashinfer_needs_the_patch(installed_fi, patches):
    # CI's FlashInfer (0.7.4 under vLLM 0.34.0; 0.7.2.post1 under 0.33.0) has the bug.
    assert overlay.assess(installed_fi, patches).state is FixState.NEEDS_PATCH


def test_overlay_mirrors_csrc_with_patched_real_files(installed_fi, patches, tmp_path):
    a, ov = _built(installed_fi, patches, tmp_path)
    assert ov.complete and ov.root.parent == tmp_path / "flashinfer" / installed_fi.version
    stock = installed_fi.csrc_dir
    for rel in ov.patched_files:
        f = ov.csrc_dir / rel
        assert not f.is_symlink()
        assert f.read_text() == a.patched[f"csrc/{rel}"] != (stock / rel).read_text()
    some = ov.csrc_dir / "fused_moe" / "cutlass_backend" / "deepgemm_jit_setup.cu"
    assert some.is_symlink() and some.resolve() == (stock / some.relative_to(ov.csrc_dir)).resolve()
    n_stock = sum(len(f) for _, _, f in os.walk(stock))
    n_ours = sum(len(f) for _, _, f in os.walk(ov.csrc_dir))
    assert n_ours == n_stock
    # Idempotent, and never touches site-packages.
    assert overlay.build_overlay(installed_fi, a, ov) == ov
    assert overlay.assess(installed_fi, patches).state is FixState.NEEDS_PATCH


def test_overlay_key_changes_with_patches_and_version(fake_fi, patches):
    a, b = fake_fi("stock", "1.0"), fake_fi("patched", "1.1")
    assert overlay.overlay_key(a, patches) != overlay.overlay_key(b, patches)
    assert overlay.overlay_key(a, patches) == overlay.overlay_key(a, patches)
    name = overlay.module_name("fused_moe_90", overlay.overlay_key(a, patches))
    assert re.fullmatch(r"fused_moe_90_vllm_h20_[0-9a-f]{8}", name)


def test_no_overlay_for_sources_that_do_not_need_it(fake_fi, patches, tmp_path):
    src = fake_fi("patched")
    a = overlay.assess(src, patches)
    with pytest.raises(PatchError, match="nothing to overlay"):
        overlay.build_overlay(src, a, overlay.overlay_for(src, patches, tmp_path))


def test_patched_spec_moves_the_build_onto_the_overlay(installed_fi, patches, jit_spec, tmp_path):
    a, ov = _built(installed_fi, patches, tmp_path)
    spec = overlay.patched_spec(jit_spec, ov)
    stock = str(installed_fi.csrc_dir.resolve())

    assert spec.name == f"{jit_spec.name}_vllm_h20_{ov.key[:8]}" != jit_spec.name
    assert len(spec.sources) == len(jit_spec.sources)
    for old, new in zip(jit_spec.sources, spec.sources, strict=True):
        if str(Path(old).resolve()).startswith(stock):
            assert new == ov.csrc_dir / Path(old).resolve().relative_to(stock)
            assert new.is_file() and not new.is_symlink()  # ninja resolves sources
        else:
            assert new == old  # generated CUTLASS instantiations stay FlashInfer's
    # Same include order, each stock directory replaced by its overlay twin, then the overlay's
    # csrc root (before FlashInfer's -isystem csrc, so csrc-relative includes stay ours).
    expected = [ov.remap(d) for d in jit_spec.extra_include_dirs] + [ov.csrc_dir]
    assert spec.extra_include_dirs == expected
    assert not any(str(d).startswith(stock) for d in spec.extra_include_dirs)
    assert spec.extra_cuda_cflags == jit_spec.extra_cuda_cflags  # no csrc paths in flags
    assert {s.name for s in spec.sources} >= {
        "fp8_blockscale_gemm.cu",
        "cutlass_fused_moe_instantiation.cu",
        "flashinfer_cutlass_fused_moe_binding.cu",
    }

    spec.write_ninja()
    ninja = Path(spec.ninja_path).read_text()
    assert Path(spec.ninja_path).parent.name == spec.name
    stock_refs = [ln.strip() for ln in ninja.splitlines() if stock in ln]
    assert stock_refs == [f"-isystem {stock} $"], stock_refs


def test_touched_sources_are_the_four_that_include_patched_files(
    installed_fi, patches, jit_spec, tmp_path
):
    from vllm_h20.moe import build

    a, ov = _built(installed_fi, patches, tmp_path)
    spec = overlay.patched_spec(jit_spec, ov)
    touched = build.touched_sources(spec.sources, list(spec.extra_include_dirs), ov)
    assert sorted(t.name for t in touched) == [
        "cutlass_fused_moe_instantiation.cu",
        "deepgemm_jit_setup.cu",  # DeepGEMM's compiler.cuh (row classes)
        "flashinfer_cutlass_fused_moe_binding.cu",
        "fp8_blockscale_gemm.cu",
    ]


def test_a_release_variant_replaces_only_the_patches_that_differ(tmp_path, monkeypatch):
    """patches/flashinfer/v<release>/ holds only the patches whose context differs for that
    release (0.6.14: 0001); the others come from the series itself, so every file lives once. A
    variant file that replaces no patch of the series is refused in one line."""
    base = overlay.patches_dir() / "flashinfer"
    names = [p.name for p in sorted(base.glob("*.patch"))]
    old = overlay.series_files("0.6.14")
    assert [p.name for p in old] == names
    assert old[0].parent.name == "v0.6.14" and all(p.parent == base for p in old[1:])
    assert overlay.series_files("0.7.4") == sorted(base.glob("*.patch"))
    assert overlay.series_name("0.6.14") == "flashinfer/v0.6.14"
    assert overlay.series_name("0.7.4") == "flashinfer"
    fake = tmp_path / "patches"
    shutil.copytree(overlay.patches_dir(), fake)
    (fake / "flashinfer" / "v0.6.14" / "0009-nothing.patch").write_text("x")
    monkeypatch.setattr(overlay, "patches_dir", lambda: fake)
    with pytest.raises(PatchError, match="0009-nothing.patch replace no patch of") as e:
        overlay.series_files("0.6.14")
    assert "\n" not in str(e.value)
