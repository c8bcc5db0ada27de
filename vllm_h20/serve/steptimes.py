"""Per-step GPU time of vLLM's model runner, for serving A/Bs (`VLLM_H20_STEP_TIMES=DIR`).

The wall time of a served batch mixes HTTP, scheduling and host jitter into the step time; a
CUDA event pair around the model forward times what the GPU did. Each process that runs a
model runner appends one JSON line per step to `DIR/steps-<pid>.jsonl`:

    {"t": 1733333333.123, "tokens": 128, "reqs": 128, "padded": 128,
     "forward_ms": 5.91, "gpu_ms": 6.02, "host_ms": 6.40}

`t` is the step's start (Unix time to the microsecond: step intervals are compared at the
1 % level, and 0.1 ms is 1 % of a 10 ms step), `tokens`/`reqs` what the scheduler gave the
step, `padded` the forward's token count (the CUDA-graph size), `forward_ms` the GPU time of
the forward, `gpu_ms` forward start to the end of sampling on the GPU, `host_ms` the host's
time in `execute_model` + `sample_tokens`. A thread reads the events once they have
completed, so the engine never waits on them. Off unless the variable is set; the plugin
imports this then only.

Both of vLLM's GPU model runners are wrapped where the installed vLLM has them: V1
(`v1/worker/gpu_model_runner.py`, the default up to 0.33; the forward is `_model_forward`) and
V2 (`v1/worker/gpu/model_runner.py`, the only one from 0.34; its forward runs inside
`execute_model`, so there `forward_ms` spans execute_model's GPU work: the input copies and
the forward). A vLLM with neither is an error, not a silent empty log.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

_POLL_S = 0.1
_ATTR = "_vllm_h20_step"  # per-runner state between execute_model, the forward and sampling


class StepLog:
    """Completed steps' events -> JSON lines, drained off the engine's thread."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"steps-{os.getpid()}.jsonl"
        self.pending: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None

    def add(self, record: dict, events: tuple) -> None:
        if self._thread is None:
            import torch

            device = torch.cuda.current_device()
            self._thread = threading.Thread(target=self._drain, args=(device,), daemon=True,
                                            name="vllm-h20-step-times")  # fmt: skip
            self._thread.start()
        self.pending.append((record, events))

    def _drain(self, device: int) -> None:
        import torch

        torch.cuda.set_device(device)
        with open(self.path, "a", buffering=1) as f:
            while True:
                while self.pending and self.pending[0][1][-1].query():
                    record, (start, forward_end, end) = self.pending.popleft()
                    record["forward_ms"] = round(start.elapsed_time(forward_end), 4)
                    record["gpu_ms"] = round(start.elapsed_time(end), 4)
                    f.write(json.dumps(record) + "\n")
                time.sleep(_POLL_S)


# vLLM's GPU model runners, by module: V1 (vLLM <= 0.33's default) and V2 (the only one in 0.34).
RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


class HookMissing(RuntimeError):
    """The installed vLLM has no model runner this module knows how to wrap."""


def runner_classes() -> dict[str, Any]:
    """{module: GPUModelRunner} of every runner the installed vLLM has; an import error inside
    an existing module propagates (it is a broken vLLM, not an absent runner)."""
    found = {}
    for name in RUNNERS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue
            raise
        found[name] = mod.GPUModelRunner
    if not found:
        import vllm

        raise HookMissing(
            f"vLLM {vllm.__version__} has neither {' nor '.join(RUNNERS)}: step times cannot be "
            "logged with this vLLM; unset VLLM_H20_STEP_TIMES"
        )
    return found


def _event() -> Any:
    import torch

    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _finish(log: StepLog, runner: Any) -> None:
    state = runner.__dict__.pop(_ATTR, None)
    if state is None or "events" not in state:  # no forward ran (an empty step)
        return
    record = state["record"]
    record["host_ms"] = round((time.perf_counter() - state["host_t0"]) * 1e3, 4)
    log.add(record, (*state["events"], _event()))


def _begin(runner: Any, scheduler_output: Any) -> dict:
    state = {
        "host_t0": time.perf_counter(),
        "record": {"t": round(time.time(), 6),
                   "tokens": int(scheduler_output.total_num_scheduled_tokens),
                   "reqs": len(scheduler_output.num_scheduled_tokens)},
    }  # fmt: skip
    runner.__dict__[_ATTR] = state
    return state


def _wrap_sample(Runner: Any, log: StepLog) -> None:
    """Both runners end a step in sample_tokens: its GPU work is the step's last."""
    sample = Runner.sample_tokens

    def sample_tokens(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        _finish(log, self)
        return out

    Runner.sample_tokens = sample_tokens


def _wrap_v1(Runner: Any, log: StepLog) -> None:
    import torch

    execute, forward = Runner.execute_model, Runner._model_forward

    def execute_model(self, scheduler_output, *args, **kwargs):
        _begin(self, scheduler_output)
        out = execute(self, scheduler_output, *args, **kwargs)
        if out is not None:  # no sample_tokens() follows this step
            _finish(log, self)
        return out

    def model_forward(self, *args, **kwargs):
        state = self.__dict__.get(_ATTR)
        # Outside a scheduled step (start-up's dummy runs, CUDA-graph capture): nothing to time.
        if state is None or torch.cuda.is_current_stream_capturing():
            return forward(self, *args, **kwargs)
        start = _event()
        out = forward(self, *args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["record"]["padded"] = int(ids.shape[0]) if ids is not None else None
        state["events"] = (start, _event())
        return out

    Runner.execute_model = execute_model
    Runner._model_forward = model_forward
    _wrap_sample(Runner, log)


def _wrap_v2(Runner: Any, log: StepLog) -> None:
    import torch

    execute = Runner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        # execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False, ...)
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        if dummy or torch.cuda.is_current_stream_capturing():
            return execute(self, scheduler_output, *args, **kwargs)
        state = _begin(self, scheduler_output)
        start = _event()
        out = execute(self, scheduler_output, *args, **kwargs)
        st = getattr(self, "execute_model_state", None)
        batch = getattr(st, "input_batch", None)
        padded = getattr(batch, "num_tokens_after_padding", None)
        state["record"]["padded"] = int(padded) if padded is not None else None
        state["events"] = (start, _event())
        if out is not None:  # no sample_tokens() follows this step (a non-last PP rank)
            _finish(log, self)
        return out

    Runner.execute_model = execute_model
    _wrap_sample(Runner, log)


def install(directory: Path) -> bool:
    """Wrap every GPU model runner of the installed vLLM to log each step; False when already
    installed in this process; HookMissing when vLLM has none this module knows."""
    runners = runner_classes()
    if all(getattr(R, "_vllm_h20_step_log", None) is not None for R in runners.values()):
        return False
    log = StepLog(directory)
    for name, Runner in runners.items():
        if getattr(Runner, "_vllm_h20_step_log", None) is not None:
            continue
        (_wrap_v1 if name == RUNNERS[0] else _wrap_v2)(Runner, log)
        Runner._vllm_h20_step_log = log
    return True


def read(directory: Path) -> list[dict]:
    """Every step logged under `directory` (all processes), oldest first; a line cut short by a
    running writer is skipped."""
    steps = []
    for f in sorted(Path(directory).glob("steps-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                steps.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(steps, key=lambda s: s["t"])
