"""`vllm-h20 bench report` on a real sweep: tables, CSV/JSON, plots, refusals."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from tests.bench.conftest import RATES, cli, run_records
from vllm_h20.bench.stats import change_pct, summarize

pytestmark = pytest.mark.slow


def _per_run(out, target, conc):
    recs = [json.loads(p.read_text()) for p in run_records(out, f"{target}/c{conc}-r*.json")]
    return [r["throughput"] for r in sorted(recs, key=lambda r: r["run"])]


def test_report_table_csv_json_and_plots(finished_sweep, tmp_path):
    out = finished_sweep["out"]
    rep = tmp_path / "rep"
    res = cli("bench", "report", str(out), "--baseline", "a", "--out", str(rep))
    assert res.returncode == 0, res.stderr
    md = (rep / "report.md").read_text()
    assert "| Concurrency | a output tok/s | b output tok/s | b vs a |" in md
    for conc in (1, 2):
        a, b = summarize(_per_run(out, "a", conc)), summarize(_per_run(out, "b", conc))
        pct = f"{change_pct(a.mean, b.mean):+.1f}%".replace("-", "−")
        row = f"| {conc} | {a.mean:,.0f} ± {a.std:,.0f} | {b.mean:,.0f} ± {b.std:,.0f} | {pct} (CI "
        assert row in md and row in res.stdout
        # 60 % apart with a few % of noise: resolved, and the CI holds the change
        cell = next(ln for ln in md.splitlines() if ln.startswith(row)).split(" | ")[-1]
        assert "not resolved" not in cell
        lo, hi = (float(x.rstrip("%").replace("−", "-")) for x in cell[len(pct) + 5 :].rstrip(
            ") |").split(" to "))  # fmt: skip
        # the bounds are printed to 0.1 %; with the counters' tiny noise they can round onto
        # the change itself (60.004 % inside a printed 60.0 to 60.0)
        assert lo - 0.05 <= change_pct(a.mean, b.mean) <= hi + 0.05
        # the expositions grow at fixed rates: b is 60 % faster than a
        assert change_pct(a.mean, b.mean) == pytest.approx(
            100 * (RATES["b"] / RATES["a"] - 1), abs=15
        )
    assert "the servers' Prometheus token counters" in md and "## Notes" not in md
    assert "| Prompt tokens per request |" in md
    with open(rep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["target"], r["concurrency"]) for r in rows] == [
        ("a", "1"), ("a", "2"), ("b", "1"), ("b", "2")
    ]  # fmt: skip
    with open(rep / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 8 and {r["status"] for r in runs} == {"ok"}
    assert [
        float(r["output_tok_s"]) for r in runs if r["target"] == "a" and r["concurrency"] == "1"
    ] == _per_run(out, "a", 1)
    doc = json.loads((rep / "report.json").read_text())
    assert doc["baseline"] == "a" and doc["spec"]["name"] == "tiny" and not doc["failed_runs"]
    for png in ("throughput.png", "latency.png"):
        assert (rep / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_two_directories_and_baseline_order(finished_sweep, tmp_path):
    """Baseline and candidate swept separately (two nodes) report together."""
    out = finished_sweep["out"]
    da, db = tmp_path / "a", tmp_path / "b"
    for d, keep in ((da, "a"), (db, "b")):
        shutil.copytree(out, d)
        man = json.loads((d / "sweep.json").read_text())
        drop = "b" if keep == "a" else "a"
        del man["targets"][drop]
        (d / "sweep.json").write_text(json.dumps(man))
        shutil.rmtree(d / "runs" / drop)
    res = cli("bench", "report", str(db), str(da), "--baseline", "a")
    assert res.returncode == 0, res.stderr
    assert "| Concurrency | a output tok/s | b output tok/s | b vs a |" in res.stdout
    assert (db / "report" / "report.md").is_file()


def test_report_refuses_mixed_specs_unknown_baseline_and_non_sweeps(finished_sweep, tmp_path):
    out = finished_sweep["out"]
    other = tmp_path / "other"
    shutil.copytree(out, other)
    man = json.loads((other / "sweep.json").read_text())
    man["spec"]["fingerprint"] = "0" * 16
    man["targets"] = {"c": man["targets"]["a"]}
    (other / "sweep.json").write_text(json.dumps(man))
    for args, needle in (
        ((str(out), str(other)), "measured with another spec"),
        ((str(out), str(out)), "target a also in"),
        ((str(out), "--baseline", "zz"), "--baseline zz: no such target (have: a, b)"),
        ((str(tmp_path),), "not a `vllm-h20 bench sweep` directory"),
    ):
        res = cli("bench", "report", *args, "--out", str(tmp_path / "r"))
        assert res.returncode == 2 and needle in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_failed_runs_and_errors_are_reported(finished_sweep, tmp_path):
    d = tmp_path / "s"
    shutil.copytree(finished_sweep["out"], d)
    p = d / "runs/b/c2-r1.json"
    rec = json.loads(p.read_text())
    rec.update(status="error", error="target b: cannot reach http://x/v1/models")
    p.write_text(json.dumps(rec))
    res = cli("bench", "report", str(d), "--out", str(tmp_path / "r"))
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "r/report.md").read_text()
    assert "Failed run b c2 run 2: target b: cannot reach" in md
    assert "b: fewer than 2 finished runs at c2." in md
    assert "(1 run)" in md
