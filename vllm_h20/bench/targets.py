"""Benchmark targets (`--target NAME=URL`), what they serve, and the tokenizer the client needs.

Both the sweep and the GSM8K check talk to OpenAI-compatible servers; the served model's id
comes from the server itself (`/v1/models`), so a result always records what was measured.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip


class TargetError(ValueError):
    """A target that cannot be used; the message names it and says what to do."""


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    # Prometheus endpoints whose counters add up to this target's: one per node of a multi-node
    # deployment (each node's engines export their own), else the server's own /metrics.
    metrics_urls: tuple[str, ...]

    def endpoint(self, path: str) -> str:
        return self.url + path


def parse_targets(values: tuple[str, ...], metrics: tuple[str, ...] = ()) -> list[Target]:
    """`NAME=URL` pairs; `metrics` (`NAME=URL`, repeatable) replaces a target's Prometheus URL:
    several for one name (one per node) are scraped together and their counters summed."""
    if not values:
        raise TargetError("no --target given; pass --target NAME=URL (e.g. fp8=http://h20-a:8000)")
    out: dict[str, Target] = {}
    for v in values:
        name, url = _pair(v, "--target")
        if name in out:
            raise TargetError(f"--target {v}: the name `{name}` is used twice")
        out[name] = Target(name, url, (url + "/metrics",))
    given: dict[str, list[str]] = {}
    for v in metrics:
        name, url = _pair(v, "--metrics-url")
        if name not in out:
            raise TargetError(f"--metrics-url {v}: no --target named `{name}`")
        if url in given.setdefault(name, []):
            raise TargetError(f"--metrics-url {v}: given twice (its counters would count twice)")
        given[name].append(url)
    return [Target(n, t.url, tuple(given.get(n, t.metrics_urls))) for n, t in out.items()]


def _pair(v: str, flag: str) -> tuple[str, str]:
    name, sep, url = v.partition("=")
    if not sep or not _NAME.match(name):
        raise TargetError(
            f"{flag} {v}: expected NAME=URL with NAME a word (e.g. fp8=http://host:8000)"
        )
    url = url.rstrip("/")
    if not re.match(r"^https?://[^/\s]+", url):
        raise TargetError(f"{flag} {v}: the URL must start with http:// or https://")
    if flag == "--target" and url.endswith("/v1"):
        url = url[: -len("/v1")]
    return name, url


def get_json(url: str, timeout: float = 5.0, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode("utf-8"))


@dataclass(frozen=True)
class Served:
    model: str
    root: str | None
    max_model_len: int | None


def served(t: Target, timeout: float = 5.0) -> Served:
    """The model a target serves, from its `/v1/models`; unreachable = TargetError."""
    url = t.endpoint("/v1/models")
    try:
        doc = get_json(url, timeout)
        first = doc["data"][0]
        return Served(first["id"], first.get("root"), first.get("max_model_len"))
    except urllib.error.HTTPError as e:
        raise TargetError(f"target {t.name}: {url} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TargetError(
            f"target {t.name}: cannot reach {url} ({reason}); is the server up?"
        ) from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise TargetError(
            f"target {t.name}: {url} is not an OpenAI-compatible model list"
        ) from None


def server_version(t: Target, timeout: float = 5.0) -> str | None:
    """vLLM's `/version` (recorded with the results); None where a server has none."""
    try:
        return str(get_json(t.endpoint("/version"), timeout)["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_tokenizer(flag: Path | None, roots: list[str | None]) -> Path:
    """`--tokenizer DIR`, else the served model's directory when it exists on this machine."""
    if flag is not None:
        if not _has_tokenizer(flag):
            raise TargetError(
                f"--tokenizer {flag}: no tokenizer.json or tokenizer_config.json there; pass "
                "the served model's directory (or a copy of its tokenizer files)"
            )
        return flag
    for r in roots:
        if r and _has_tokenizer(Path(r)):
            return Path(r)
    raise TargetError(
        "no tokenizer: the served model's directory is not on this machine; pass --tokenizer "
        "DIR (a directory with the served model's tokenizer.json / tokenizer_config.json)"
    )


def _has_tokenizer(d: Path) -> bool:
    return d.is_dir() and any((d / f).is_file() for f in TOKENIZER_FILES[:2])


def tokenizer_fingerprint(d: Path) -> str:
    """sha256 over the tokenizer files: results counted with another tokenizer do not mix."""
    h = hashlib.sha256()
    for f in TOKENIZER_FILES:
        p = d / f
        if p.is_file():
            h.update(f.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]
