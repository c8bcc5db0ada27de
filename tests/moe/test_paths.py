"""vllm_h20/moe/paths.py: every cache directory from one root."""

from __future__ import annotations

from vllm_h20.moe import paths


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_H20_CACHE_DIR", str(tmp_path / "c"))
    assert paths.cache_root() == tmp_path / "c"
    monkeypatch.delenv("VLLM_H20_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert paths.cache_root() == tmp_path / "x" / "vllm-h20"


def test_our_directories_all_live_under_the_root(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_H20_CACHE_DIR", str(tmp_path))
    ours = [
        paths.overlay_dir("0.7.4", "k" * 16),
        paths.reduced_dir("0.7.4", "fused_moe_90", "fix", "k" * 16),
        paths.link_shims_dir(),
        paths.precompile_dir("k" * 16),
        paths.check_dir(),
        paths.wheels_dir(),
    ]
    assert all(p.is_relative_to(tmp_path) for p in ours)
    assert len(set(ours)) == len(ours)
    assert paths.reduced_dir("0.7.4", "m", "fix", "abcdefabcdefXYZ") == (
        tmp_path / "flashinfer" / "0.7.4" / "m-reduced-fix-abcdefabcdef"
    )
    other = tmp_path / "elsewhere"
    assert paths.overlay_dir("0.7.4", "k", other).is_relative_to(other)


def test_other_tools_caches_follow_their_own_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "w"))
    assert paths.flashinfer_jit_dir("0.7.4") == tmp_path / "w" / ".cache" / "flashinfer" / "0.7.4"
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path / "dg"))
    assert paths.deepgemm_cache_dir() == tmp_path / "dg" / "cache"
    monkeypatch.delenv("TRTLLM_DG_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert paths.deepgemm_cache_dir() == tmp_path / "h" / ".tensorrt_llm" / "cache"
