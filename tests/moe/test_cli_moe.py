"""`vllm-h20 kernels` and `vllm-h20 patches` end to end (CPU; the compile runs in
test_flashinfer_wheels.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_h20.moe import export_pr

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_H20_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "vllm_h20.cli", *args], env=full, capture_output=True, text=True
    )


def test_kernels_status_says_which_module_serves_which_call(installed_fi, tmp_path):
    env = {"VLLM_H20_CACHE_DIR": str(tmp_path), "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "w")}
    r = cli("kernels", "status", "--json", **env)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["flashinfer"] == installed_fi.version and s["fix_state"] == "needs-patch"
    assert s["patches"] == [f"flashinfer/{p.name}" for p in
                            sorted((ROOT / "patches" / "flashinfer").glob("*.patch"))]  # fmt: skip
    assert s["routes"] == [
        "cutlass_fused_moe(use_deepseek_fp8_block_scale=True) -> the reduced fix module "
        "(patched sources, per-expert kernel choice)",
        "every other cutlass_fused_moe call -> FlashInfer's own SM90 fused-MoE module "
        "(built by FlashInfer on first use)",
    ]
    assert s["built"] == []
    r = cli("kernels", "status", VLLM_H20_MOE_DISPATCH="stock", **env)
    assert r.returncode == 1 and "VLLM_H20_MOE_DISPATCH=stock" in r.stdout
    assert "the reduced stock module (unpatched sources" in r.stdout
    r = cli("kernels", "status", "--json", VLLM_H20_MOE_MODULE="full", **env)
    assert r.returncode == 0 and json.loads(r.stdout)["routes"] == [
        "every cutlass_fused_moe call -> FlashInfer's whole module, patched"
    ]
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
    n = len(list((ROOT / "patches" / "flashinfer").glob("*.patch")))
    assert pr.startswith(f"# {export_pr.PR_TITLE}\n\n{n} commits, in order:")
    assert "Not measured yet" in pr
    issue = (tmp_path / "pr0" / "ISSUE.md").read_text()
    assert issue.startswith("# SM90 FP8 block-scale CUTLASS fused MoE chooses its DeepGEMM")
    assert "`expected_m_ = shape_m;`" in issue and "No kernel-level run was found" in issue
    assert "| 288 | regular | 5 | swap_ab |" in issue  # the rule on H20, from the reproducer
    shipped = ROOT / "patches" / "flashinfer" / "reproduce_expected_m.py"
    assert (tmp_path / "pr0" / "reproduce_expected_m.py").read_bytes() == shipped.read_bytes()
    assert "<measured" not in pr  # the placeholder in the commit message is replaced
    run = results / "moe_dispatch" / "hot-first-h200"
    (run / "repeats").mkdir(parents=True)
    (run / "README.md").write_text("| tokens | x |\n|---|---|\n| 288 | 1.1 |\n")
    (run / "kernel_h200.json").write_text("{}")
    (run / "repeats" / "README.md").write_text("| six runs | 1.0 |\n")
    (run / "repeats" / "1-v1.json.gz").write_bytes(b"")
    last = results / "moe_dispatch" / "last-tile-h100"  # the newer run, first in PR.md
    last.mkdir()
    (last / "README.md").write_text("| tokens | y |\n|---|---|\n| 128 | 1.2 |\n")
    (last / "kernel_h100.json").write_text("{}")
    (last / "kernel_h100.log").write_text("not evidence")
    (results / "moe_dispatch_h200.md").write_text("the previous series' table")  # not evidence
    (results / "unrelated.md").write_text("x")
    out = tmp_path / "pr1"
    r = cli("patches", "export", str(out), "--results", str(results))
    assert r.returncode == 0, r.stderr
    got = sorted(p.relative_to(out / "evidence").as_posix()
                 for p in (out / "evidence").rglob("*") if p.is_file())  # fmt: skip
    assert got == ["hot-first-h200/README.md", "hot-first-h200/kernel_h200.json",
                   "hot-first-h200/repeats/README.md", "last-tile-h100/README.md",
                   "last-tile-h100/kernel_h100.json"]  # fmt: skip
    pr = (out / "PR.md").read_text()
    assert "| 288 | 1.1 |" in pr and "| six runs | 1.0 |" in pr and "| 128 | 1.2 |" in pr
    titles = [line for line in pr.splitlines() if line.startswith("### ")]
    assert titles == ["### last-tile-h100/README", "### hot-first-h200/README",
                      "### hot-first-h200/repeats/README"]  # fmt: skip
    assert "previous series' table" not in pr
    variant = ROOT / "patches" / "flashinfer" / "v0.6.14"
    assert [p.read_bytes() for p in sorted((out / "v0.6.14").glob("*.patch"))] == [
        p.read_bytes() for p in sorted(variant.glob("*.patch"))
    ]
    shipped = sorted((ROOT / "patches" / "flashinfer").glob("*.patch"))
    assert [p.read_bytes() for p in sorted(out.glob("*.patch"))] == [
        p.read_bytes() for p in shipped
    ]
    # Only the shipped series and its release variants: candidate series are not the PR.
    assert sorted(d.name for d in out.iterdir() if d.is_dir()) == ["evidence", "v0.6.14"]
    assert "`candidates/`" not in (out / "PR.md").read_text()
    r = cli("patches", "export", str(out))
    assert r.returncode == 2 and "not empty" in r.stderr


def test_kernels_build_dry_run_prepares_the_reduced_modules(installed_fi, tmp_path):
    env = {
        "VLLM_H20_CACHE_DIR": str(tmp_path / "c"),
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "w"),
    }
    r = cli("kernels", "build", "--dry-run", "--dispatch", "both", "--variant", "generic",
            "--json", **env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    built = json.loads(r.stdout)
    assert [b["dispatch"] for b in built] == ["per_expert", "stock"]
    assert built[0]["module"].startswith("fused_moe_90_vllm_h20_bs_fix_")
    assert built[1]["module"].startswith("fused_moe_90_vllm_h20_bs_stock_")
    assert all(b["objects"] == 16 for b in built)
    # The fix compiles four sources that include patched files; the stock module none.
    assert sorted(Path(t).name for t in built[0]["plan"]["touched"]) == [
        "deepgemm_jit_setup.cu",
        "flashinfer_cutlass_fused_moe_binding.cu",
        "fp8_blockscale_gemm.cu",
        "vllm_h20_cutlass_fused_moe_instantiation.cu",
    ]
    assert built[1]["plan"]["touched"] == []
    ninja = sorted((tmp_path / "w").rglob("fused_moe_90_vllm_h20_bs_*/build.ninja"))
    assert len(ninja) == 2 and not list(ninja[0].parent.glob("*.o"))


def test_kernels_build_dry_run_of_the_full_module(installed_fi, tmp_path):
    env = {
        "VLLM_H20_CACHE_DIR": str(tmp_path / "c"),
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "w"),
    }
    r = cli("kernels", "build", "--dry-run", "--module", "full", "--variant", "generic", **env)
    assert r.returncode == 0, r.stderr
    assert "would build fused_moe_90_vllm_h20_" in r.stderr
    assert "4 of them from patched sources" in r.stderr
    assert str(tmp_path / "c" / "flashinfer" / installed_fi.version) in r.stderr
    r = cli("kernels", "build", "--dry-run", "--module", "full", "--dispatch", "stock", **env)
    assert r.returncode == 2 and "FlashInfer builds its own" in r.stderr


def test_export_reads_a_run_py_result_by_its_lead_version(tmp_path):
    """run.py's gzipped JSON keeps each version's speedup under `speedups` and names the version
    the bar judges in its spec: the export's numbers line is that version's."""
    import gzip

    run = tmp_path / "moe_dispatch" / "bar-five-families-h100"
    run.mkdir(parents=True)
    rows = [{"routing": "uniform", "tokens": t, "speedups": {"avg": 0.5, "fix": s}}
            for t, s in ((128, 1.04), (2048, 1.02), (4096, 0.97))]  # fmt: skip
    doc = {"spec": {"lead": "fix"}, "device": {"name": "NVIDIA H100 80GB HBM3"}, "ab": rows}
    (run / "moe_dispatch.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    (broken := tmp_path / "moe_dispatch" / "families-h100").mkdir()
    (broken / "moe_dispatch.json.gz").write_bytes(b"not gzip")  # skipped, not a traceback
    lines = export_pr._measured(export_pr.evidence_files(tmp_path))
    assert lines == ["- NVIDIA H100 80GB HBM3 (`bar-five-families-h100`): 2 of 3 routing x token "
                     "cases at or above 0.98x of the stock choice, worst 0.970x (uniform, 4096 "
                     "tokens); uniform routing at 128-2,048 tokens 1.02-1.04x."]  # fmt: skip
