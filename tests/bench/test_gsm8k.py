"""GSM8K: scoring, the seeded subset, exclusions, and the paired CLI against mock servers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.bench.conftest import cli, free_port
from vllm_h20.bench import gsm8k as g


@pytest.mark.parametrize(
    "text, want",
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### $1,234.50.", "1234.5"),
        ("#### 18.00", "18"),
        ("first #### 5 then corrected\n#### 6", "6"),
        ("The answer is -3.", "-3"),
        ("no number here", None),
        ("#### x but 12 apples and 15 pears", "15"),
        ("#### 0.0", "0"),
    ],
)
def test_extract(text, want):
    assert g.extract(text) == want


@given(st.integers(-(10**9), 10**9))
def test_normalize_round_trips_integers_in_gsm8k_notation(n):
    assert g.normalize(f"{n:,}") == str(n)
    assert g.normalize(f"${n}.") == str(n)
    assert g.extract(f"work...\n#### {n:,}") == str(n)


def _data(tmp_path, n=40):
    p = tmp_path / "test.jsonl"
    rows = [
        {"question": f"What is {i} + {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i:,}"}
        for i in range(n)
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_load_and_seeded_subset(tmp_path):
    items = g.load(_data(tmp_path))
    assert len(items) == 40 and items[7].answer == "14"
    a, b = g.select(items, 10, 0), g.select(items, 10, 0)
    assert a == b and len({it.index for it in a}) == 10
    assert [it.index for it in a] == sorted(it.index for it in a)
    assert g.select(items, 10, 1) != a
    assert g.select(items, 100, 0) == items


@pytest.mark.parametrize(
    "line, needle",
    [
        ("not json", "test.jsonl:2: not a JSON object"),
        ('{"question": "q"}', "test.jsonl:2: not a JSON object"),
        ('{"question": "q", "answer": "no"}', "test.jsonl:2: the answer has no `#### <number>`"),
    ],
)
def test_bad_data_names_file_and_line(tmp_path, line, needle):
    p = tmp_path / "test.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + line + "\n")
    with pytest.raises(g.GSM8KError, match=needle):
        g.load(p)


def test_score_excludes_items_any_target_truncated():
    def r(i, correct, truncated=False):
        return {"index": i, "correct": correct, "truncated": truncated}

    res = {
        "a": {0: r(0, True), 1: r(1, True), 2: r(2, False), 3: r(3, True, True), 4: r(4, False)},
        "b": {0: r(0, True), 1: r(1, False), 2: r(2, True), 3: r(3, True), 4: r(4, False)},
    }
    kept, excluded, right = g.score(res, [0, 1, 2, 3, 4])
    assert (kept, excluded, right) == ([0, 1, 2, 4], [3], {"a": 2, "b": 2})
    p = g.pair(res, "a", "b", kept)
    assert (p.n, p.both, p.only_a, p.only_b, p.neither) == (4, 1, 1, 1, 1)
    assert p.p_value == 1.0


@pytest.mark.slow
def test_gsm8k_cli_against_two_mock_servers(mock_servers, tmp_path):
    """Mock answers are random text: the check here is the plumbing, exclusions and
    resume; scoring is tested above."""
    a = mock_servers("tiny-model", "--ttft-ms", "1", "--itl-ms", "0", "--output-tokens", "24",
                     "--output-tokens-std", "12")  # fmt: skip
    b = mock_servers("tiny-model", "--ttft-ms", "1", "--itl-ms", "0", "--output-tokens", "8")
    data, out = _data(tmp_path), tmp_path / "out"
    args = ["bench", "gsm8k", "--target", f"base={a.url}", "--target", f"cand={b.url}",
            "--data", str(data), "--limit", "25", "--max-tokens", "24",
            "--out", str(out)]  # fmt: skip
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    recs = {n: [json.loads(x) for x in (out / f"{n}.jsonl").read_text().splitlines()]
            for n in ("base", "cand")}  # fmt: skip
    assert all(len(v) == 25 for v in recs.values())
    trunc = {r["index"] for v in recs.values() for r in v if r["truncated"]}
    assert trunc and all(r["completion_tokens"] >= 24 for r in recs["base"] if r["index"] in trunc)
    doc = json.loads((out / "result.json").read_text())
    assert sorted(doc["excluded"]) == sorted(trunc) and doc["scored"] == 25 - len(trunc)
    p = doc["pairs"][0]
    assert (p["a"], p["b"]) == ("base", "cand")
    assert p["both"] + p["only_a"] + p["only_b"] + p["neither"] == doc["scored"]
    md = (out / "gsm8k.md").read_text()
    assert "## base vs cand" in md and "Exact McNemar" in md and "| **base right** |" in md
    man = json.loads((out / "gsm8k.json").read_text())
    assert man["indices"] == [it.index for it in g.select(g.load(data), 25, 0)]

    again = cli(*args)
    assert again.returncode == 2 and "--resume" in again.stderr
    resumed = cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert len((out / "base.jsonl").read_text().splitlines()) == 25  # nothing asked twice


def test_gsm8k_without_data_or_server_is_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    res = cli("bench", "gsm8k", "--target", f"x={url}", "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "grade-school-math" in res.stderr and "--data" in res.stderr
    res = cli("bench", "gsm8k", "--target", f"x={url}", "--data", str(_data(tmp_path)),
              "--out", str(tmp_path / "o"))  # fmt: skip
    assert res.returncode == 2 and "target x: cannot reach" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "o").exists()
    res = cli("bench", "gsm8k", "--target", f"x={url}", "--data", str(tmp_path / "nope.jsonl"))
    assert res.returncode == 2 and "nope.jsonl: no such file" in res.stderr


def test_unknown_baseline_and_changed_settings_are_refused(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    res = cli("bench", "gsm8k", "--target", f"x={url}", "--data", str(_data(tmp_path)),
              "--baseline", "y", "--out", str(tmp_path / "o"))  # fmt: skip
    assert res.returncode == 2 and "--baseline y: no such --target (have: x)" in res.stderr
    data = _data(tmp_path)
    items = g.load(data)
    out = tmp_path / "out"
    g.prepare(out, g.manifest(data, g.select(items, 10, 0), 0, 10, g.Options()), {"x": "m"}, False)
    for new, models, needle in (
        (g.manifest(data, g.select(items, 10, 1), 1, 10, g.Options()), {"x": "m"}, "`indices`"),
        (g.manifest(data, g.select(items, 10, 0), 0, 10, g.Options(max_tokens=64)), {"x": "m"},
         "`max_tokens`"),
        (g.manifest(data, g.select(items, 10, 0), 0, 10, g.Options()), {"x": "other"},
         "target x served `m` there, now `other`"),
    ):  # fmt: skip
        with pytest.raises(g.GSM8KError, match=needle):
            g.prepare(out, new, models, resume=True)
