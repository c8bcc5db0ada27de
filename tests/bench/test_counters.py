"""The Prometheus counter reader against real expositions with vLLM's metric names."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest

from vllm_h20.bench import counters
from vllm_h20.bench.counters import CountersError, Scrape, window


def _exposition(**values: float) -> str:
    """vLLM's own way: prometheus_client Counters named like vLLM's, one series per engine."""
    reg = CollectorRegistry()
    for key, fam in counters.VLLM_COUNTERS.items():
        if key in values:
            c = Counter(fam, fam, ["model_name", "engine"], registry=reg)
            c.labels("m", "0").inc(values[key] * 0.25)
            c.labels("m", "1").inc(values[key] * 0.75)
    return generate_latest(reg).decode()


def test_parse_sums_engines_and_reads_vllm_names():
    text = _exposition(prompt_tokens=1000, generation_tokens=40, prefix_cache_hits=64)
    assert "vllm:prompt_tokens_total" in text and "vllm:generation_tokens_created" in text
    v = counters.parse(text)
    assert v == {"prompt_tokens": 1000.0, "generation_tokens": 40.0, "prefix_cache_hits": 64.0}


def test_parse_names_the_missing_counter():
    with pytest.raises(
        CountersError, match="no vllm:generation_tokens_total counter; is it a vLLM"
    ):
        counters.parse(_exposition(prompt_tokens=1), "http://x/metrics")
    with pytest.raises(CountersError, match="x/metrics: not a Prometheus exposition"):
        counters.parse("<html>not metrics</html>", "x/metrics")


def test_recorder_reads_a_live_exposition_at_its_rate(vllm_metrics):
    m = vllm_metrics(prompt_rate=2000.0, generation_rate=300.0)
    with counters.Recorder(m.url, interval=0.05) as rec:
        time.sleep(0.8)
    assert not rec.errors and len(rec.samples) >= 5
    s = rec.samples
    w = window(s, s[1].t, s[-1].t)
    # the exposition's value is rate x elapsed time, so two scrapes give the rate back
    assert w.rate("generation_tokens") == pytest.approx(300.0, rel=0.1)
    assert w.rate("prompt_tokens") == pytest.approx(2000.0, rel=0.1)


def test_scrape_of_a_closed_port():
    from tests.bench.conftest import free_port

    with pytest.raises(CountersError, match="cannot connect"):
        counters.scrape(f"http://127.0.0.1:{free_port()}/metrics", timeout=1)


def test_scrape_of_a_server_without_metrics(mock_pair):
    with pytest.raises(CountersError, match="HTTP 404"):
        counters.scrape(mock_pair[0].url + "/metrics")


@st.composite
def _series(draw):
    n = draw(st.integers(2, 30))
    ts = sorted(draw(st.lists(st.floats(0, 1000), min_size=n, max_size=n, unique=True)))
    incs = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n))
    vals, acc = [], 0
    for i in incs:
        acc += i
        vals.append(acc)
    return [
        Scrape(t, {"prompt_tokens": v, "generation_tokens": 2 * v})
        for t, v in zip(ts, vals, strict=True)
    ]


@given(_series(), st.floats(0, 1000), st.floats(0, 1000))
def test_window_uses_the_outermost_scrapes_inside(samples, x, y):
    start, end = min(x, y), max(x, y)
    inside = [s for s in samples if start <= s.t <= end]
    if len(inside) < 2:
        with pytest.raises(CountersError, match="fewer than two"):
            window(samples, start, end)
        return
    w = window(list(reversed(samples)), start, end)
    assert (w.t0, w.t1) == (inside[0].t, inside[-1].t)
    assert (
        w.delta["prompt_tokens"]
        == inside[-1].values["prompt_tokens"] - inside[0].values["prompt_tokens"]
    )
    assert w.delta["generation_tokens"] == 2 * w.delta["prompt_tokens"]


def test_window_refuses_a_counter_reset():
    s = [Scrape(0, {"prompt_tokens": 10, "generation_tokens": 10}),
         Scrape(1, {"prompt_tokens": 20, "generation_tokens": 3}),
         Scrape(2, {"prompt_tokens": 30, "generation_tokens": 9})]  # fmt: skip
    with pytest.raises(CountersError, match="vllm:generation_tokens_total went backwards"):
        window(s, 0, 2)


def test_scrape_all_sums_the_nodes_and_fails_with_any(vllm_metrics):
    from tests.bench.conftest import free_port

    a = vllm_metrics(prompt_rate=1000.0, generation_rate=100.0)
    b = vllm_metrics(prompt_rate=3000.0, generation_rate=300.0)
    one, both = counters.scrape(a.url), counters.scrape_all((a.url, b.url))
    assert both.values["generation_tokens"] > one.values["generation_tokens"]
    with counters.Recorder((a.url, b.url), interval=0.05) as rec:
        time.sleep(0.6)
    s = rec.samples
    assert window(s, s[1].t, s[-1].t).rate("generation_tokens") == pytest.approx(400.0, rel=0.1)
    with pytest.raises(CountersError, match="cannot connect"):
        counters.scrape_all((a.url, f"http://127.0.0.1:{free_port()}/metrics"), timeout=1)
