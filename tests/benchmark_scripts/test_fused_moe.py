"""The CPU-side parts of the fused-MoE proof (benchmarks/fused_moe/): the staging, the GPU
script's shell syntax and help, and the published report being rendered from its own data."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "fused_moe"
RESULTS = ROOT / "benchmarks" / "results" / "moe_dispatch" / "estimated-row-classes-h200"


def test_gpu_script_parses_and_run_py_helps_without_a_gpu():
    r = subprocess.run(["bash", "-n", str(HERE / "h200.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, str(HERE / "run.py"), "--help"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "cutlass_fused_moe" in r.stdout and "--build-only" in r.stdout


def test_published_report_is_rendered_from_the_published_results(tmp_path):
    """benchmarks/results/moe_dispatch/estimated-row-classes-h200/fused_moe_h200.md: every
    number comes from the run's JSON, the clean build record and the test logs beside it (and
    the kernel-level JSON it compares with)."""
    pytest.importorskip("matplotlib")
    for f in [*RESULTS.glob("fused_moe_*"), RESULTS / "moe_dispatch_h200.json"]:
        if f.suffix != ".png":
            shutil.copy(f, tmp_path / f.name)
    cmd = [sys.executable, str(HERE / "report.py"), str(tmp_path / "fused_moe_h200.json")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fused_moe_h200.md").read_text() == (
        RESULTS / "fused_moe_h200.md"
    ).read_text()
    assert (tmp_path / "fused_moe_h200.png").stat().st_size > 10_000
    md = (RESULTS / "fused_moe_h200.md").read_text()
    assert (
        "44 of 44 cases pass" in md
        and "| per_expert | `test_fp8_blockscale_moe_expected_m.py` | 5 passed" in md
    )


def test_stage_exports_flashinfers_tests_and_the_patch_test(tmp_path):
    """stage.py's test export from a FlashInfer git checkout (a small local repository with the
    same layout stands in for FlashInfer's; the wheels part needs the network and is skipped)."""
    sys.path.insert(0, str(HERE))
    import stage

    repo = tmp_path / "flashinfer"
    for rel in stage.TESTS:
        f = repo / rel
        if rel.endswith(".py"):
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"# {rel}\n")
        else:
            f.mkdir(parents=True, exist_ok=True)
            (f / "__init__.py").write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    subprocess.run([*git, "tag", "v0.6.14"], check=True)
    out = tmp_path / "tests"
    added = stage.export_tests(repo, "v0.6.14", out, "0.6.14")
    assert added == ["tests/moe/test_fp8_blockscale_moe_expected_m.py"]
    text = (out / added[0]).read_text()
    # Added by 0001, changed by 0004 and 0006: the export applies the series in order.
    assert "def test_kernel_follows_rows_per_expert" in text
    assert "def test_skewed_routing_runs_both_classes_in_one_call" in text
    assert (out / "tests/moe/test_trtllm_cutlass_fused_moe.py").is_file()
    with pytest.raises(SystemExit, match="cannot export v9.9.9's tests"):
        stage.export_tests(repo, "v9.9.9", tmp_path / "other", "0.6.14")


def test_a_reference_that_misses_both_modules_alike_is_no_failure_of_the_fix():
    """zipf2 8 in bar-five-families-h100: fix and stock bit-identical, both 2.2e-2 from the fp32
    reference (tolerance 2e-2). That says nothing against the fix; a fix that leaves stock or the
    reference further than stock does still fails."""
    check = load_script(HERE / "run.py", "fused_moe_run").check
    assert check({"stock": 3e-3, "fix": 3e-3, "fix_again": 3e-3}, 0.0) == "ok"
    assert check({"stock": 2.2e-2, "fix": 2.2e-2, "fix_again": 2.2e-2}, 0.0) == "ok (reference)"
    assert check({"stock": 2.2e-2, "fix": 2.5e-2, "fix_again": 2.5e-2}, 5e-3) == "FAIL"
    assert check({"stock": 3e-3, "fix": 3e-3, "fix_again": 3e-3}, 2e-2) == "FAIL"
    assert check({"stock": 3e-3, "fix": float("inf"), "fix_again": 3e-3}, 0.0) == "FAIL"
    assert check({"stock": 3e-3, "fix": 3e-3, "fix_again": 3e-3}, float("nan")) == "FAIL"
