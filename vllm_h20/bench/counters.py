"""Server-side token counters from vLLM's Prometheus `/metrics`, read over a time window.

Throughput is the change of vLLM's own counters between two scrapes inside GuideLLM's
measurement window, divided by the time between those scrapes: what the server processed,
independent of how the client counts tokens.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from itertools import pairwise

# Counter families vLLM (0.30-0.33) exports; the samples carry a `_total` suffix and one
# label set per engine, which we sum.
VLLM_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "preemptions": "vllm:num_preemptions",
}
REQUIRED = ("prompt_tokens", "generation_tokens")


class CountersError(RuntimeError):
    """The metrics endpoint cannot be read or is not a vLLM server's."""


@dataclass(frozen=True)
class Scrape:
    t: float
    values: dict[str, float]


def parse(text: str, source: str = "metrics") -> dict[str, float]:
    """Sum each vLLM counter over its label sets (engines) in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"{fam}_total": key for key, fam in VLLM_COUNTERS.items()}
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = wanted.get(s.name)
                if key is not None:
                    out[key] = out.get(key, 0.0) + float(s.value)
    except ValueError as e:
        raise CountersError(f"{source}: not a Prometheus exposition ({e})") from None
    missing = [VLLM_COUNTERS[k] + "_total" for k in REQUIRED if k not in out]
    if missing:
        raise CountersError(
            f"{source}: no {', '.join(missing)} counter; is it a vLLM server's /metrics?"
        )
    return out


def scrape(url: str, timeout: float = 5.0) -> Scrape:
    """One read, stamped with the midpoint of the request (time.time(), as GuideLLM uses)."""
    t0 = time.time()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise CountersError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CountersError(f"{url}: cannot connect ({reason})") from None
    t1 = time.time()
    return Scrape(t=(t0 + t1) / 2, values=parse(text, url))


def scrape_all(urls: tuple[str, ...] | list[str], timeout: float = 5.0) -> Scrape:
    """One read of every endpoint of a deployment (one per node), counters summed, stamped with
    the midpoint of the whole round. Any endpoint failing fails the round: a missing node would
    undercount."""
    if len(urls) == 1:
        return scrape(urls[0], timeout)
    parts = [scrape(u, timeout) for u in urls]
    total: dict[str, float] = {}
    for p in parts:
        for k, v in p.values.items():
            total[k] = total.get(k, 0.0) + v
    return Scrape(t=(parts[0].t + parts[-1].t) / 2, values=total)


@dataclass
class Recorder:
    """Scrapes every `interval` seconds in a thread while a GuideLLM run is going; `url` is one
    endpoint or several whose counters add up (a multi-node deployment)."""

    url: str | tuple[str, ...]
    interval: float = 0.5
    samples: list[Scrape] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Recorder:
        self._thread = threading.Thread(target=self._loop, name="vllm-h20-counters", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        urls = (self.url,) if isinstance(self.url, str) else self.url
        while True:
            try:
                self.samples.append(scrape_all(urls, timeout=min(5.0, 4 * self.interval)))
            except CountersError as e:
                if len(self.errors) < 20:
                    self.errors.append(str(e))
            if self._stop.wait(self.interval):
                return


@dataclass(frozen=True)
class Window:
    t0: float
    t1: float
    delta: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    def rate(self, key: str) -> float:
        return self.delta[key] / self.seconds


def window(samples: list[Scrape], start: float, end: float) -> Window:
    """Counter change between the first scrape at/after `start` and the last at/before `end`.

    Raises when fewer than two scrapes fall inside the window or a counter went backwards
    (the server restarted during the run)."""
    inside = [s for s in sorted(samples, key=lambda s: s.t) if start <= s.t <= end]
    if len(inside) < 2 or inside[-1].t <= inside[0].t:
        raise CountersError(
            f"fewer than two counter scrapes inside the {end - start:.1f} s window "
            f"({len(samples)} scrapes in all)"
        )
    a, b = inside[0], inside[-1]
    for prev, cur in pairwise(inside):
        for k, v in cur.values.items():
            if v < prev.values.get(k, 0.0):
                raise CountersError(
                    f"{VLLM_COUNTERS[k]}_total went backwards at t={cur.t:.1f}: "
                    "the server restarted during the run"
                )
    delta = {k: b.values[k] - a.values.get(k, 0.0) for k in b.values}
    return Window(t0=a.t, t1=b.t, delta=delta)
