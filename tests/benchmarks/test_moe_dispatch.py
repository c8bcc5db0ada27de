"""The CPU-side parts of the kernel-level A/B (benchmarks/moe_dispatch/): the calibration
build's hooks still find their lines in the patched sources, the cases, and the published
report being rendered from its own data."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "moe_dispatch"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(HERE))

import cases  # noqa: E402

from tests.benchmarks import load_script  # noqa: E402


def _run_py():
    return load_script(HERE / "run.py", "moe_dispatch_run")


def test_calibration_hooks_apply_to_the_patched_sources(tmp_path):
    """run.py rewrites lines of the patched grouped_gemm_dispatch for its calibration build; a
    patch that moves them must fail here, not on the GPU machine."""
    import importlib.util

    from vllm_h20.moe import flashinfer_src

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("FlashInfer is not installed (CI installs it with vLLM 0.33.0)")
    installed_fi = flashinfer_src.installed()
    run = _run_py()
    data = tmp_path / "data"
    shutil.copytree(installed_fi.root / "csrc" / "nv_internal", data / "csrc" / "nv_internal",
                    symlinks=True)  # fmt: skip
    for variant in run.VARIANTS:
        nv = run.prepare_sources(data, tmp_path / "work", variant)
        text = (nv / run.KERNEL_CUH).read_text()
        assert ("plan_row_classes" in text) is (variant != "stock")
        assert ("vllm_h20_override_plan" in text) is (variant == "calib")
        assert run.deepgemm_dir(data, tmp_path / "work", variant).endswith("tensorrt_llm")


def test_eplb_routing_is_skewed_like_what_eplb_leaves():
    for tokens in (1024, 4096):
        counts = np.bincount(cases.route("eplb", tokens).ravel(), minlength=cases.SLOTS)
        assert 2.5 <= counts.max() / counts.mean() <= 5


def test_warm_jobs_cover_every_version_and_token_count():
    run = _run_py()
    jobs = run.warm_jobs(run.VERSIONS, cases.TOKENS)
    for v in run.VERSIONS:
        for t in cases.TOKENS:
            assert any(j[0] == v.variant and j[1] == v.rule and j[3] == t for j in jobs)


def test_published_report_is_rendered_from_the_published_json(tmp_path):
    """benchmarks/results/moe_dispatch_h200.md and the H20 model: every number from the JSON."""
    pytest.importorskip("matplotlib")
    for f in ("moe_dispatch_h200.json", "moe_dispatch_explore_h200.json"):
        shutil.copy(RESULTS / f, tmp_path / f)
    cmd = [sys.executable, str(HERE / "report.py"), str(tmp_path / "moe_dispatch_h200.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    for md in ("moe_dispatch_h200.md", "moe_dispatch_h20_model.md"):
        assert (tmp_path / md).read_text() == (RESULTS / md).read_text(), md
    md = (RESULTS / "moe_dispatch_h200.md").read_text()
    assert "every one of the 44 cases is at or above 0.98x stock" in md
