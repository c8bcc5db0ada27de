"""patches/flashinfer/reproduce_expected_m.py, the reproducer an upstream issue carries: the stock
rule's choices as FlashInfer's sources state them, with FlashInfer and torch only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.benchmark_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "patches" / "flashinfer" / "reproduce_expected_m.py"
rep = load_script(SCRIPT, "reproduce_expected_m")


def test_the_stock_rule_takes_the_regular_kernel_for_five_rows_per_expert():
    """288 tokens, 384 experts, top-6: 5 rows per expert, yet expected_m = 288 picks the regular
    kernel on H20 (threshold 64) and on the 132-SM parts (threshold 32)."""
    args = rep.parse(["--dry-run"])
    for sms in (78, 132):
        row = next(r for r in rep.plan(args, sms) if r["tokens"] == 288)
        assert (row["stock_kernel"], row["rows_per_expert"], row["kernel_for_rows"]) == (
            "regular", 5, "swap_ab")  # fmt: skip
    h20 = {r["tokens"]: r["stock_kernel"] for r in rep.plan(args, 78)}
    assert h20[32] == "swap_ab" and h20[64] == "regular"
    other = {r["tokens"]: r["stock_kernel"] for r in rep.plan(args, 132)}
    assert other[16] == "swap_ab" and other[32] == "regular"


@given(st.integers(0, 1 << 16), st.integers(1, 16), st.integers(1, 512))
def test_rows_per_expert_is_the_ceiling_of_the_average(tokens, top_k, slots):
    got = rep.rows_per_expert(tokens, top_k, slots)
    assert got >= 1 and (got - 1) * slots < max(tokens * top_k, 1) <= max(got * slots, 1)


def test_the_script_runs_alone_and_refuses_bad_arguments_in_one_line():
    """No vllm-h20 import: it runs from any folder; bad input exits 2 with argparse's line, and
    without a GPU the timed run says so instead of a traceback."""
    run = [sys.executable, str(SCRIPT)]
    r = subprocess.run([*run, "--dry-run", "--sms", "78", "--tokens", "288"],
                       capture_output=True, text=True, cwd="/")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].split() == ["288", "regular", "5", "swap_ab"]
    r = subprocess.run([*run, "--experts", "100", "--ep-size", "8"], capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 2 and "must divide by --ep-size 8" in r.stderr
    r = subprocess.run([*run, "--tokens", "a,b"], capture_output=True, text=True)
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the timed run is the GPU machine's")
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 2 and "no CUDA GPU here" in r.stderr and "Traceback" not in r.stderr
