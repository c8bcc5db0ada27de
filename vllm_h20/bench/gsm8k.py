"""`vllm-h20 bench gsm8k`: the paired quality check of two (or more) serving recipes.

The same seeded subset of GSM8K test goes to every target at temperature 0 with a fixed
output ceiling; items where any target hit the ceiling are excluded from the paired score,
answers are compared as exact numbers, and the exact McNemar test says whether the targets'
disagreements are more one-sided than chance.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from .._io import write_json_atomic
from .stats import mcnemar_exact
from .targets import Target, get_json

SOURCE_HINT = (
    "GSM8K test split as JSON lines with `question` and `answer` (`#### n`): "
    "grade_school_math/data/test.jsonl from github.com/openai/grade-school-math (MIT)"
)
PROMPT = (
    "Solve the following math problem step by step. End your response with a line of the "
    'form "#### N" where N is the final numerical answer.\n\n{question}'
)
PROMPT_VERSION = 1
MANIFEST = "gsm8k.json"


class GSM8KError(ValueError):
    """Unusable data or results directory; the message names the file and line."""


@dataclass(frozen=True)
class Item:
    index: int  # 0-based line in the data file
    question: str
    answer: str  # normalized number


_NUM = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def normalize(s: str) -> str | None:
    """GSM8K's scoring: drop commas, `$` and a trailing dot; compare as exact decimals."""
    t = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    d = d.normalize()
    return format(d, "f") if d != 0 else "0"


def extract(text: str) -> str | None:
    """The number after the last `####`; failing that, the last number in the text."""
    marked = re.findall(r"####\s*(\S+)", text)
    for cand in reversed(marked):
        m = _NUM.search(cand)
        if m and (v := normalize(m.group())) is not None:
            return v
    nums = _NUM.findall(text)
    return normalize(nums[-1]) if nums else None


def load(path: Path) -> list[Item]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise GSM8KError(f"{path}: no such file; pass --data with the {SOURCE_HINT}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GSM8KError(f"{path}: cannot read ({e})") from None
    items = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            q, a = doc["question"], doc["answer"]
        except (ValueError, KeyError, TypeError):
            raise GSM8KError(
                f"{path}:{i + 1}: not a JSON object with `question` and `answer`"
            ) from None
        _, sep, final = str(a).rpartition("####")
        ans = normalize(final) if sep else None
        if ans is None:
            raise GSM8KError(f"{path}:{i + 1}: the answer has no `#### <number>` line")
        items.append(Item(i, str(q), ans))
    if not items:
        raise GSM8KError(f"{path}: no questions")
    return items


def select(items: list[Item], limit: int | None, seed: int) -> list[Item]:
    """A fixed subset: the same seed and data give the same questions on every machine."""
    if limit is None or limit >= len(items):
        return list(items)
    picked = random.Random(seed).sample(range(len(items)), limit)
    return [items[i] for i in sorted(picked)]


@dataclass(frozen=True)
class Options:
    max_tokens: int = 2048
    request_format: str = "/v1/chat/completions"
    max_concurrency: int = 32
    timeout: float = 900.0
    retries: int = 2


def ask(t: Target, model: str, item: Item, o: Options) -> dict[str, Any]:
    """One question to one target; HTTP failures are retried, then recorded as errors."""
    prompt = PROMPT.format(question=item.question)
    body: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": o.max_tokens}
    if o.request_format == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    rec: dict[str, Any] = {"index": item.index, "answer": item.answer}
    err = ""
    for attempt in range(o.retries + 1):
        try:
            doc = get_json(t.endpoint(o.request_format), o.timeout, body)
            choice = doc["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            text = text or ""
            finish = choice.get("finish_reason")
            used = (doc.get("usage") or {}).get("completion_tokens")
            pred = extract(text)
            rec.update(
                text=text,
                finish_reason=finish,
                completion_tokens=used,
                truncated=finish == "length" or (used is not None and used >= o.max_tokens),
                predicted=pred,
                correct=pred == item.answer,
                error=None,
            )
            return rec
        except urllib.error.HTTPError as e:
            err = f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}"
        except (urllib.error.URLError, OSError) as e:
            err = f"cannot reach {t.url} ({getattr(e, 'reason', e)})"
        except (ValueError, KeyError, IndexError, TypeError) as e:
            err = f"unexpected response ({e})"
        if attempt < o.retries:
            time.sleep(1.0 + attempt)
    rec.update(error=err, truncated=False, correct=False, predicted=None)
    return rec


def read_results(path: Path) -> dict[int, dict[str, Any]]:
    """Finished answers of an earlier (possibly interrupted) run; errors are asked again."""
    out: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the last line of an interrupted run
        if isinstance(rec, dict) and rec.get("error") is None and "index" in rec:
            out[rec["index"]] = rec
    return out


def run_target(
    t: Target,
    model: str,
    items: list[Item],
    path: Path,
    o: Options,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Ask what `path` does not hold yet; every answer is appended as soon as it arrives."""
    have = read_results(path)
    todo = [it for it in items if it.index not in have]
    with open(path, "a", encoding="utf-8") as f, ThreadPoolExecutor(o.max_concurrency) as pool:
        futs = {pool.submit(ask, t, model, it, o) for it in todo}
        try:
            while futs:
                done, futs = wait(futs, return_when=FIRST_COMPLETED)
                for fu in done:
                    rec = fu.result()
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    if rec["error"] is None:
                        have[rec["index"]] = rec
                    if on_done:
                        on_done(rec)
        except BaseException:
            for fu in futs:
                fu.cancel()
            raise
    return have


def manifest(data: Path, items: list[Item], seed: int, limit: int | None, o: Options) -> dict:
    return {
        "data": {"path": str(data), "sha256": hashlib.sha256(data.read_bytes()).hexdigest()},
        "seed": seed,
        "limit": limit,
        "indices": [it.index for it in items],
        "max_tokens": o.max_tokens,
        "request_format": o.request_format,
        "prompt_version": PROMPT_VERSION,
        "prompt": PROMPT,
        "temperature": 0,
        "targets": {},
    }


def prepare(out: Path, new: dict[str, Any], models: dict[str, str], resume: bool) -> dict:
    mpath = out / MANIFEST
    if mpath.exists():
        if not resume:
            raise GSM8KError(f"{out}: holds an earlier GSM8K run; pass --resume or another --out")
        old = json.loads(mpath.read_text())
        for k in ("data", "indices", "max_tokens", "request_format", "prompt_version"):
            if old.get(k) != new.get(k):
                raise GSM8KError(f"{out}: earlier run used another `{k}`; choose another --out")
        for name, m in models.items():
            if name in old["targets"] and old["targets"][name] != m:
                raise GSM8KError(
                    f"{out}: target {name} served `{old['targets'][name]}` there, now `{m}`"
                )
        new = old
    elif out.exists() and any(out.iterdir()):
        raise GSM8KError(f"{out}: exists and is not a GSM8K results directory; choose another")
    new["targets"].update(models)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(mpath, new)
    return new


@dataclass
class Pair:
    a: str
    b: str
    n: int
    both: int
    only_a: int
    only_b: int
    neither: int

    @property
    def p_value(self) -> float:
        return mcnemar_exact(self.only_a, self.only_b)


def score(
    results: dict[str, dict[int, dict[str, Any]]], indices: list[int]
) -> tuple[list[int], list[int], dict[str, int]]:
    """Items every target answered without hitting the ceiling; the excluded ones."""
    kept, excluded = [], []
    for i in indices:
        recs = [r.get(i) for r in results.values()]
        if any(r is None for r in recs):
            continue
        (excluded if any(r["truncated"] for r in recs) else kept).append(i)
    right = {n: sum(1 for i in kept if r[i]["correct"]) for n, r in results.items()}
    return kept, excluded, right


def pair(results: dict[str, dict[int, dict[str, Any]]], a: str, b: str, kept: list[int]) -> Pair:
    ra, rb = results[a], results[b]
    ca = [ra[i]["correct"] for i in kept]
    cb = [rb[i]["correct"] for i in kept]
    return Pair(
        a=a,
        b=b,
        n=len(kept),
        both=sum(x and y for x, y in zip(ca, cb, strict=True)),
        only_a=sum(x and not y for x, y in zip(ca, cb, strict=True)),
        only_b=sum(y and not x for x, y in zip(ca, cb, strict=True)),
        neither=sum(not x and not y for x, y in zip(ca, cb, strict=True)),
    )


def markdown(man: dict, names: list[str], kept, excluded, right, pairs: list[Pair], missing) -> str:
    lines = [
        "# GSM8K paired check",
        "",
        f"{len(man['indices'])} questions from {man['data']['path']} (sha256 "
        f"{man['data']['sha256'][:12]}, seed {man['seed']}), temperature 0, "
        f"{man['max_tokens']}-token ceiling, {man['request_format']}, exact numeric match.",
        f"{len(excluded)} excluded because a target hit the ceiling; {len(kept)} scored.",
        "",
        "| Target | Model | Correct | Accuracy |",
        "|---|---|---|---|",
    ]
    for n in names:
        acc = f"{100 * right[n] / len(kept):.1f}%" if kept else "—"
        lines.append(f"| {n} | {man['targets'][n]} | {right[n]}/{len(kept)} | {acc} |")
    for p in pairs:
        lines += [
            "",
            f"## {p.a} vs {p.b}",
            "",
            f"| | {p.b} right | {p.b} wrong |",
            "|---|---|---|",
            f"| **{p.a} right** | {p.both} | {p.only_a} |",
            f"| **{p.a} wrong** | {p.only_b} | {p.neither} |",
            "",
            f"Exact McNemar (two-sided) on the {p.only_a + p.only_b} discordant pairs: "
            f"p = {p.p_value:.3g}. "
            + (
                "No significant difference at the 5 % level."
                if p.p_value >= 0.05
                else "The difference is significant at the 5 % level."
            ),
        ]
    if missing:
        lines += ["", "Unanswered (errors): " + ", ".join(f"{n}: {k}" for n, k in missing.items())]
    return "\n".join(lines) + "\n"
