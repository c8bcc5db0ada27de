"""A sweep spec: the benchmark method as data (benchmarks/sweeps/*.yaml), checked on load.

Every error names the file and the key, so a typo in a spec fails before a server is touched.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from .._data import resolve_shipped, shipped_dir


class SpecError(ValueError):
    """A sweep spec that cannot be run; the message names file and key."""


REQUEST_FORMATS = ("/v1/completions", "/v1/chat/completions")
THROUGHPUT = ("output", "input")
_TOP = {"name", "description", "request", "concurrency", "warmup_s", "measure_s", "runs",
        "throughput", "seed"}  # fmt: skip
_REQUEST = {"format", "prompt_tokens", "output_tokens", "temperature"}


@dataclass(frozen=True)
class RequestSpec:
    format: str
    prompt_tokens: int
    output_tokens: int
    temperature: float | None = None


@dataclass(frozen=True)
class SweepSpec:
    name: str
    request: RequestSpec
    concurrency: tuple[int, ...]
    warmup_s: float
    measure_s: float
    runs: int
    throughput: str
    seed: int
    description: str = ""
    path: str = ""
    sha256: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["concurrency"] = list(self.concurrency)
        return d

    def run_seed(self, concurrency: int, run: int) -> int:
        """Different prompts for every (tier, run), the same for every target."""
        return self.seed + 100_000 * run + concurrency

    @property
    def unit(self) -> str:
        return f"{self.throughput} tok/s"


def shipped_sweeps() -> Path:
    return shipped_dir("sweeps", "benchmarks/sweeps")


def resolve(spec: str | Path) -> Path:
    """A path, or the name of a shipped spec (`decode`, `prefill`)."""
    try:
        return resolve_shipped(spec, shipped_sweeps())
    except LookupError as e:
        raise SpecError(f"{spec}: no such sweep spec file or shipped spec (shipped: {e})") from None


def _unknown(where: str, keys: set[str], known: set[str]) -> None:
    for k in sorted(keys - known):
        near = difflib.get_close_matches(k, sorted(known), n=1)
        hint = f"; did you mean `{near[0]}`?" if near else f" (known: {', '.join(sorted(known))})"
        raise SpecError(f"{where}: unknown key `{k}`{hint}")


def _num(where: str, key: str, v: Any, kind: type, minimum: float) -> Any:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        ok = ok and float(v).is_integer()
    if not ok or v < minimum:
        what = "an integer" if kind is int else "a number"
        raise SpecError(f"{where}: `{key}` must be {what} >= {minimum}, got {v!r}")
    return kind(v)


def parse(doc: Any, where: str, sha256: str = "") -> SweepSpec:
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: a sweep spec is a mapping (name, request, concurrency, ...)")
    _unknown(where, set(doc), _TOP)
    for k in ("name", "request", "concurrency", "measure_s", "throughput"):
        if k not in doc:
            raise SpecError(f"{where}: missing key `{k}`")
    req = doc["request"]
    if not isinstance(req, dict):
        raise SpecError(f"{where}: `request` must be a mapping (format, prompt_tokens, ...)")
    _unknown(f"{where}: request", set(req), _REQUEST)
    fmt = req.get("format", "/v1/completions")
    if fmt not in REQUEST_FORMATS:
        raise SpecError(f"{where}: `request.format` must be one of {REQUEST_FORMATS}, got {fmt!r}")
    for k in ("prompt_tokens", "output_tokens"):
        if k not in req:
            raise SpecError(f"{where}: missing key `request.{k}`")
    temp = req.get("temperature")
    request = RequestSpec(
        format=fmt,
        prompt_tokens=_num(where, "request.prompt_tokens", req["prompt_tokens"], int, 1),
        output_tokens=_num(where, "request.output_tokens", req["output_tokens"], int, 1),
        temperature=None if temp is None else _num(where, "request.temperature", temp, float, 0),
    )
    tiers = doc["concurrency"]
    if not isinstance(tiers, list) or not tiers:
        raise SpecError(f"{where}: `concurrency` must be a non-empty list of stream counts")
    conc = tuple(_num(where, "concurrency", c, int, 1) for c in tiers)
    if len(set(conc)) != len(conc):
        raise SpecError(f"{where}: `concurrency` lists a tier twice: {list(conc)}")
    if max(conc) >= 100_000:
        raise SpecError(f"{where}: `concurrency` above 99,999 streams is not supported")
    if doc["throughput"] not in THROUGHPUT:
        raise SpecError(
            f"{where}: `throughput` must be `output` (generation tok/s) or `input` (prompt "
            f"tok/s), got {doc['throughput']!r}"
        )
    name = doc["name"]
    if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum():
        raise SpecError(f"{where}: `name` must be a word (letters, digits, - or _), got {name!r}")
    return SweepSpec(
        name=name,
        description=str(doc.get("description", "")).strip(),
        request=request,
        concurrency=conc,
        warmup_s=_num(where, "warmup_s", doc.get("warmup_s", 0), float, 0),
        measure_s=_num(where, "measure_s", doc["measure_s"], float, 1),
        runs=_num(where, "runs", doc.get("runs", 1), int, 1),
        throughput=doc["throughput"],
        seed=_num(where, "seed", doc.get("seed", 0), int, 0),
        path=where,
        sha256=sha256,
    )


def load(spec: str | Path) -> SweepSpec:
    path = resolve(spec)
    try:
        raw = path.read_bytes()
        doc = yaml.safe_load(raw)
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SpecError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    return parse(doc, str(path), hashlib.sha256(raw).hexdigest())


def fingerprint(spec: SweepSpec) -> str:
    """What must match for two runs to be comparable: the method, not the file's comments."""
    d = spec.as_dict()
    for k in ("path", "sha256", "description"):
        d.pop(k)
    return hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()[:16]
