"""`vllm-h20 kernels` and `vllm-h20 patches` end to end (CPU; the compile runs in
test_flashinfer_wheels.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_H20_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "vllm_h20.cli", *args], env=full, capture_output=True, text=True
    )


def test_kernels_status_reports_versions_fix_and_cache(installed_fi, tmp_path):
    r = cli("kernels", "status", "--json", VLLM_H20_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["flashinfer"] == installed_fi.version
    assert s["fix_state"] == "needs-patch" and s["overlay"].startswith(str(tmp_path))
    assert s["built"] == [] and s["module_prefix"].startswith("fused_moe_90*_vllm_h20_")
    r = cli("kernels", "status", VLLM_H20_CACHE_DIR=str(tmp_path), VLLM_H20_MOE_DISPATCH="stock")
    assert r.returncode == 1 and "VLLM_H20_MOE_DISPATCH=stock" in r.stdout
    r = cli("kernels", "status", VLLM_H20_MOE_DISPATCH="nope")
    assert r.returncode == 2 and r.stderr.startswith("error: VLLM_H20_MOE_DISPATCH='nope'")


def test_patches_check_exit_codes(installed_fi, fake_fi, tmp_path):
    r = cli("patches", "check", "--workdir", str(tmp_path / "w"))
    assert r.returncode == 0 and r.stdout.startswith(f"ok: FlashInfer {installed_fi.version}")
    fixed = fake_fi("patched")
    r = cli("patches", "check", "--flashinfer", str(fixed.package_dir), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "has-fix"
    bad = fake_fi("conflict")
    r = cli("patches", "check", "--flashinfer", str(bad.package_dir))
    assert r.returncode == 1 and "FAIL" in r.stdout and "hunk 1" in r.stdout
    r = cli("patches", "check", "--flashinfer", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such file or directory" in r.stderr
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    r = cli("patches", "check", "--flashinfer", str(junk), "--workdir", str(tmp_path / "w"))
    assert r.returncode == 2 and "not a wheel" in r.stderr


def test_patches_export_writes_patches_pr_text_and_evidence(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    r = cli("patches", "export", str(tmp_path / "pr0"), "--results", str(results))
    assert r.returncode == 0, r.stderr
    pr = (tmp_path / "pr0" / "PR.md").read_text()
    assert pr.startswith("# fused_moe: ") and "Not measured yet" in pr
    assert "<measured" not in pr  # the placeholder in the commit message is replaced
    (results / "moe_dispatch_h200.md").write_text("| tokens | x |\n|---|---|\n| 288 | 1.1 |\n")
    (results / "moe_dispatch_h200.json").write_text("{}")
    (results / "unrelated.md").write_text("x")
    out = tmp_path / "pr1"
    r = cli("patches", "export", str(out), "--results", str(results))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (out / "evidence").iterdir()) == [
        "moe_dispatch_h200.json",
        "moe_dispatch_h200.md",
    ]
    assert "| 288 | 1.1 |" in (out / "PR.md").read_text()
    shipped = sorted((ROOT / "patches" / "flashinfer").glob("*.patch"))
    assert [p.read_bytes() for p in sorted(out.glob("*.patch"))] == [
        p.read_bytes() for p in shipped
    ]
    r = cli("patches", "export", str(out))
    assert r.returncode == 2 and "not empty" in r.stderr


def test_kernels_build_dry_run_prepares_the_patched_module(installed_fi, tmp_path):
    env = {
        "VLLM_H20_CACHE_DIR": str(tmp_path / "c"),
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "w"),
    }
    r = cli("kernels", "build", "--dry-run", "--variant", "generic", **env)
    assert r.returncode == 0, r.stderr
    assert "would build fused_moe_90_vllm_h20_" in r.stderr
    assert "3 of them from patched sources" in r.stderr
    assert str(tmp_path / "c" / "flashinfer" / installed_fi.version) in r.stderr
    ninja = list((tmp_path / "w").rglob("fused_moe_90_vllm_h20_*/build.ninja"))
    assert len(ninja) == 1 and not list(ninja[0].parent.glob("*.o"))
