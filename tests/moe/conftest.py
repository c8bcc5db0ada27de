"""FlashInfer source trees for the overlay and plugin tests.

`installed_fi` is the FlashInfer installed with vLLM (CI: 0.7.4, with vLLM 0.34.0); `fake_fi`
builds a small package tree holding only the files the patches touch, so tests can put it into any
state (stock, already patched, fixed differently, conflicting)."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable

import pytest

from vllm_h20.moe import flashinfer_src, overlay


@pytest.fixture(scope="session")
def installed_fi() -> flashinfer_src.FlashInferSource:
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("FlashInfer is not installed (CI installs it with vLLM 0.34.0)")
    return flashinfer_src.installed()


@pytest.fixture(scope="session")
def patches():
    return overlay.shipped_patches()


@pytest.fixture
def fake_fi(tmp_path, installed_fi, patches) -> Callable[..., flashinfer_src.FlashInferSource]:
    def make(state: str = "stock", version: str | None = None) -> flashinfer_src.FlashInferSource:
        version = version or installed_fi.version  # a release vllm-h20 supports
        root = tmp_path / f"fi-{state}"
        pkg = root / "flashinfer"
        for p in patches:
            for d in p.files:
                if d.path.startswith("csrc/"):
                    dst = pkg / "data" / d.path
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(installed_fi.root / d.path, dst)
        info = root / f"flashinfer_python-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Name: flashinfer-python\nVersion: {version}\n")
        src = flashinfer_src.from_package_dir(pkg)
        bug = src.root / overlay.BUG_FILE
        if state == "patched":
            for rel, text in overlay.assess(src, patches).patched.items():
                (src.root / rel).write_text(text)
        elif state == "fixed-upstream":
            # Someone else's fix: the bug line is gone and our hunk context no longer matches.
            bug.write_text(
                bug.read_text().replace(overlay.BUG_LINE, "expected_m_ = their_estimate();")
            )
        elif state == "conflict":
            # The code moved under our hunk, but the bug is still there.
            bug.write_text(bug.read_text().replace(overlay.BUG_LINE, overlay.BUG_LINE + " // x"))
        return src

    return make


@pytest.fixture
def jit_spec(installed_fi, monkeypatch, tmp_path):
    """FlashInfer's own spec for the SM90 fused-MoE module (no GPU needed with an arch list)."""
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "ws"))
    import importlib

    import flashinfer.jit.env as jit_env

    importlib.reload(jit_env)  # FlashInfer reads its workspace base at import
    from flashinfer.jit import fused_moe

    return fused_moe.gen_cutlass_fused_moe_sm90_module()
