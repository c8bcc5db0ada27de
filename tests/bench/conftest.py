"""Real parts for the benchmark tests: GuideLLM's own mock server, a tokenizer built with
`tokenizers`, and a Prometheus exposition with vLLM's metric names served by
`prometheus_client`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("guidellm", reason="pip install -e '.[test,bench]'")
prometheus_client = pytest.importorskip("prometheus_client")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mock server exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"mock server did not start: {log.read_text()[-2000:]}")


class MockServer:
    """`guidellm mock-server` in a child process."""

    def __init__(self, tmp: Path, model: str, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"mock-{self.port}.log"
        cmd = [sys.executable, "-m", "guidellm", "mock-server", "--host", "127.0.0.1",
               "--port", str(self.port), "--model", model, *args]  # fmt: skip
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _wait(self.url + "/health", self.proc, self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def mock_servers(tmp_path_factory) -> Iterator[Callable[..., MockServer]]:
    """Start mock servers on demand; all are stopped at the end of the session."""
    tmp = tmp_path_factory.mktemp("mock")
    started: list[MockServer] = []

    def start(model: str = "tiny-model", *args: str, port: int | None = None) -> MockServer:
        s = MockServer(tmp, model, *args, port=port)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def mock_pair(mock_servers) -> tuple[MockServer, MockServer]:
    """Two deployments of one model: a slower baseline and a faster candidate."""
    base = mock_servers("tiny-model", "--ttft-ms", "40", "--itl-ms", "6", "--output-tokens", "4096")
    cand = mock_servers("tiny-model", "--ttft-ms", "20", "--itl-ms", "3", "--output-tokens", "4096")
    return base, cand


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level tokenizer (every byte one token): round-trips any text, builds in ms."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tokenizer")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"})
    )
    return d


class VllmMetrics:
    """vLLM's counter names in a real exposition; values grow at fixed rates with wall time,
    so the tokens/s a reader derives from two scrapes are known exactly."""

    def __init__(self, prompt_rate: float, generation_rate: float, engines: int = 2) -> None:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.core import CounterMetricFamily

        self.t0 = time.time()
        self.rates = {
            "vllm:prompt_tokens": prompt_rate,
            "vllm:generation_tokens": generation_rate,
            "vllm:prefix_cache_hits": 0.0,
            "vllm:prefix_cache_queries": prompt_rate,
        }
        outer = self

        class Collector:
            def collect(self):
                dt = time.time() - outer.t0
                for name, rate in outer.rates.items():
                    fam = CounterMetricFamily(name, name, labels=["model_name", "engine"])
                    for e in range(engines):  # vLLM exports one series per engine
                        fam.add_metric(["tiny-model", str(e)], rate * dt / engines)
                    yield fam

        self.registry = CollectorRegistry()
        self.registry.register(Collector())
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, "127.0.0.1", self.registry)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture
def vllm_metrics() -> Iterator[Callable[..., VllmMetrics]]:
    made: list[VllmMetrics] = []

    def make(prompt_rate: float = 1000.0, generation_rate: float = 500.0) -> VllmMetrics:
        m = VllmMetrics(prompt_rate, generation_rate)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


TINY_SPEC = """\
name: tiny
description: Two short tiers for tests.
request:
  format: /v1/completions
  prompt_tokens: 24
  output_tokens: 16
  temperature: 0.7
concurrency: [1, 2]
warmup_s: 0.5
measure_s: 1.0
runs: 2
throughput: output
seed: 7
"""


@pytest.fixture
def tiny_spec(tmp_path) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY_SPEC)
    return p


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`vllm-h20 *args`; past `timeout` the test fails with what the command printed so far
    (a bare TimeoutExpired hid why CI's sweep of stop 54 ran 120 s)."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "vllm_h20.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"vllm-h20 {' '.join(args[:2])} ran past {timeout:.0f} s; its stderr:\n"
                    f"{(err or '')[-4000:]}")  # fmt: skip


RATES = {"a": 500.0, "b": 800.0}  # generation tok/s the two expositions report


def _run_sweep(mock_pair, tokenizer_dir, tmp: Path) -> dict:
    """A two-target sweep interrupted after its first run, then resumed to the end, in `tmp`."""
    spec = tmp / "tiny.yaml"
    spec.write_text(TINY_SPEC)
    out = tmp / "out"
    metrics = {n: VllmMetrics(prompt_rate=4 * r, generation_rate=r) for n, r in RATES.items()}
    base, cand = mock_pair
    # --stall-timeout: a 1.5 s run's GuideLLM took over 30 s to finish on a 2-core machine
    # loaded with the FlashInfer module builds (a cold CI run); only a real stall waits it out.
    args = ["bench", "sweep", str(spec), "--target", f"a={base.url}", "--target",
            f"b={cand.url}/v1/", "--tokenizer", str(tokenizer_dir), "--out", str(out),
            "--metrics-url", f"a={metrics['a'].url}", "--metrics-url", f"b={metrics['b'].url}",
            "--scrape-interval", "0.1", "--stall-timeout", "120"]  # fmt: skip
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "vllm_h20.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # A shell's background job (CI under nohup, `cmd &`) starts with SIGINT ignored,
            # and Python keeps an ignored SIGINT ignored: Ctrl-C must reach this sweep.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        first = out / "runs" / "a" / "c1-r0.json"
        deadline = time.time() + 240  # room for one stalled GuideLLM and its retry
        while not first.exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)  # inside the second run
        p.send_signal(signal.SIGINT)
        _, err1 = p.communicate(timeout=60)
        if not first.exists():
            pytest.fail(f"the sweep finished no run (exit {p.returncode}): {err1[-3000:]}")
        interrupted = {"rc": p.returncode, "stderr": err1, "first": first.read_text(),
                       "files": sorted(x.name for x in out.rglob("*.json"))}  # fmt: skip
        res = cli(*args, "--resume")
    finally:
        for m in metrics.values():
            m.stop()
    resumed = {"returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr}
    return {"out": str(out), "interrupted": interrupted, "resumed": resumed, "spec": str(spec),
            "args": args}  # fmt: skip


@pytest.fixture(scope="session")
def finished_sweep(request, tokenizer_dir, tmp_path_factory) -> dict:
    """`_run_sweep`'s result (~3 minutes of GuideLLM), made once per test session: under
    pytest-xdist the first worker that needs it runs it and the others read its result (a file
    lock in the session's shared temp folder), instead of each worker sweeping again."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        got = _run_sweep(request.getfixturevalue("mock_pair"), tokenizer_dir,
                         tmp_path_factory.mktemp("sweep"))  # fmt: skip
    else:
        from filelock import FileLock

        shared = tmp_path_factory.getbasetemp().parent / "finished-sweep"
        with FileLock(f"{shared}.lock"):
            done = shared / "result.json"
            if not done.exists():
                shared.mkdir(exist_ok=True)
                got = _run_sweep(request.getfixturevalue("mock_pair"), tokenizer_dir, shared)
                done.write_text(json.dumps(got))
            got = json.loads(done.read_text())
    res = got["resumed"]
    return {**got, "out": Path(got["out"]), "spec": Path(got["spec"]),
            "resumed": subprocess.CompletedProcess(got["args"], res["returncode"],
                                                   res["stdout"], res["stderr"])}  # fmt: skip


def run_records(out: Path, pattern: str = "*/c*-r*.json") -> list[Path]:
    """A sweep folder's run records (runs/<target>/c<N>-r<i>.json), sorted; not GuideLLM's own
    report of a run it did not finish (c<N>-r<i>.guidellm.json, which the glob also matches)."""
    from vllm_h20.bench.report import RUN_FILE

    return sorted(p for p in (out / "runs").glob(pattern) if RUN_FILE.match(p.name))
