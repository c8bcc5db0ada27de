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
def test_install_wraps_every_model_runner_of_the_installed_vllm(tmp_path):
    """Each GPU model runner the installed vLLM has (V1 up to 0.33, V2 from 0.34) has the
    methods under these names and is wrapped once; the plugin installs the log only when
    VLLM_H20_STEP_TIMES is set."""
    pytest.importorskip("vllm")
    code = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from vllm_h20.serve import steptimes
        runners = steptimes.runner_classes()
        names = ("execute_model", "_model_forward", "sample_tokens")
        before = {{m: {{n: getattr(R, n, None) for n in names}} for m, R in runners.items()}}
        from vllm_h20 import plugin
        plugin.register()
        print(json.dumps({{
            "wrapped": {{m: sorted(n for n in names if getattr(R, n, None) is not before[m][n])
                        for m, R in runners.items()}},
            "again": steptimes.install(Path({str(tmp_path)!r})),
            "logs": sorted({{str(R._vllm_h20_step_log.path.parent) for R in runners.values()}}),
        }}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_H20_")}
    env.update(VLLM_H20_STEP_TIMES=str(tmp_path), VLLM_H20_MOE_DISPATCH="stock")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    v1, v2 = steptimes.RUNNERS
    expect = {v1: ["_model_forward", "execute_model", "sample_tokens"],
              v2: ["execute_model", "sample_tokens"]}  # fmt: skip
    assert out["wrapped"] and all(out["wrapped"][m] == expect[m] for m in out["wrapped"])
    assert out["again"] is False and out["logs"] == [str(tmp_path)]
    from importlib.metadata import version

    if version("vllm") >= "0.34":  # Model Runner V1 is gone in 0.34
        assert list(out["wrapped"]) == [v2]


@pytest.mark.vllm
def test_a_vllm_without_a_known_runner_is_an_error_line(tmp_path):
    """A vLLM whose runners moved again cannot be produced here: an import hook hides both
    modules. The plugin logs one error naming the variable and what to do; serving goes on."""
    pytest.importorskip("vllm")
    code = textwrap.dedent("""
        import sys
        from importlib.abc import MetaPathFinder
        from vllm_h20.serve import steptimes

        class Hide(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name in steptimes.RUNNERS:
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, Hide())
        from vllm_h20 import plugin
        plugin.register()
        print("registered")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_H20_")}
    env.update(VLLM_H20_STEP_TIMES=str(tmp_path / "steps"), VLLM_H20_MOE_DISPATCH="stock")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "registered", out[-2000:]
    assert "step times cannot be logged with this vLLM" in out
    assert "unset VLLM_H20_STEP_TIMES" in out and "Traceback" not in out


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
