"""serve/steptimes.py: the step-time log wraps vLLM's real model runner and reads back safely."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_h20.serve import steptimes


def test_read_merges_processes_in_time_order_and_skips_a_cut_line(tmp_path):
    (tmp_path / "steps-1.jsonl").write_text(
        json.dumps({"t": 2.0, "tokens": 128}) + "\n" + '{"t": 3.0, "tok'
    )
    (tmp_path / "steps-2.jsonl").write_text(json.dumps({"t": 1.0, "tokens": 64}) + "\n")
    (tmp_path / "other.jsonl").write_text(json.dumps({"t": 0.0}) + "\n")
    assert [s["t"] for s in steptimes.read(tmp_path)] == [1.0, 2.0]
    assert steptimes.read(tmp_path / "missing") == []


@pytest.mark.vllm
def test_install_wraps_the_model_runner_of_the_installed_vllm(tmp_path):
    """The three methods exist under these names in vLLM's GPUModelRunner and are wrapped once;
    the plugin installs the log only when VLLM_H20_STEP_TIMES is set."""
    pytest.importorskip("vllm")
    code = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R
        before = {{n: getattr(R, n) for n in ("execute_model", "_model_forward", "sample_tokens")}}
        from vllm_h20 import plugin
        plugin.register()
        after = {{n: getattr(R, n) for n in before}}
        from vllm_h20.serve import steptimes
        print(json.dumps({{
            "wrapped": sorted(n for n in before if after[n] is not before[n]),
            "again": steptimes.install(Path({str(tmp_path)!r})),
            "log": str(R._vllm_h20_step_log.path.parent),
        }}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_H20_")}
    env.update(VLLM_H20_STEP_TIMES=str(tmp_path), VLLM_H20_MOE_DISPATCH="stock")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"wrapped": ["_model_forward", "execute_model", "sample_tokens"],
                   "again": False, "log": str(tmp_path)}  # fmt: skip


@pytest.mark.vllm
def test_a_log_folder_that_cannot_be_made_warns_and_serving_goes_on(tmp_path):
    pytest.importorskip("vllm")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_H20_")}
    env.update(VLLM_H20_STEP_TIMES=str(blocker / "steps"), VLLM_H20_MOE_DISPATCH="stock")
    code = "from vllm_h20 import plugin; plugin.register(); print('registered')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    out = r.stdout + r.stderr  # vLLM's logger writes to stdout once vLLM is imported
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "registered", out[-2000:]
    assert f"VLLM_H20_STEP_TIMES={blocker / 'steps'}: step times not logged" in out
    assert "Traceback" not in out
