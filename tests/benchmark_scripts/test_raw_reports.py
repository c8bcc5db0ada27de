"""benchmarks/raw_reports.py on a small git repository: `out` lists and untracks the raw
GuideLLM reports, `fetch` brings them back byte for byte from the manifest's commit."""

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import raw_reports as rr  # noqa: E402


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout  # fmt: skip


@pytest.fixture
def repo(tmp_path) -> Path:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@t")
    _git(tmp_path, "config", "user.name", "t")
    runs = tmp_path / "benchmarks/results/serve/round1/sweeps/decode/runs/fix"
    runs.mkdir(parents=True)
    (runs / "c1-r0.guidellm.json.gz").write_bytes(gzip.compress(b'{"benchmarks": [1]}'))
    (runs / "c1-r0.json").write_text("{}")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "runs")
    return tmp_path


def test_out_then_fetch_restores_every_report(repo, capsys):
    raw = repo / "benchmarks/results/serve/round1/sweeps/decode/runs/fix/c1-r0.guidellm.json.gz"
    before = raw.read_bytes()
    assert rr.main(["out"], repo) == 0
    _git(repo, "commit", "-qm", "raw reports out")
    assert "guidellm" not in _git(repo, "ls-files")
    assert "c1-r0.json" in _git(repo, "ls-files")  # the run records stay
    assert not raw.exists()
    assert rr.main(["fetch", "benchmarks/results/serve/round1"], repo) == 0
    assert raw.read_bytes() == before
    assert rr.main(["fetch"], repo) == 0 and "0 written, 1 already there" in capsys.readouterr().err
    # A later sweep's reports: a second section, under its own commit.
    new = raw.with_name("c2-r0.guidellm.json.gz")
    new.write_bytes(gzip.compress(b'{"benchmarks": [2]}', mtime=0))
    _git(repo, "add", str(new))
    _git(repo, "commit", "-qm", "round 2")
    assert rr.main(["out"], repo) == 0
    _git(repo, "commit", "-qm", "raw reports out again")
    assert rr.MANIFEST in _git(repo, "ls-files") and rr.main(["fetch"], repo) == 0
    assert new.read_bytes() == gzip.compress(b'{"benchmarks": [2]}', mtime=0)
    assert len({c for _, c in rr.read_manifest(repo).values()}) == 2


def test_a_manifest_that_does_not_match_its_commit_is_refused(repo, capsys):
    assert rr.main(["out"], repo) == 0
    m = repo / rr.MANIFEST
    m.write_text(m.read_text().replace(m.read_text().split("\n")[1][:8], "00000000"))
    assert rr.main(["fetch"], repo) == 1
    assert "holds other bytes than the manifest says" in capsys.readouterr().err
    m.write_text("# commit abc\nnot a line\n")
    assert rr.main(["fetch"], repo) == 1
    assert f"{rr.MANIFEST}:2: not '<sha256>  <path>'" in capsys.readouterr().err


def test_the_published_results_hold_no_raw_report_and_stay_under_40_mb():
    """Issue 4/4's budget for benchmarks/results/ in the tree; raw reports go through `out`."""
    listed = _git(ROOT, "ls-files", "-z", "--", rr.RESULTS).split("\0")
    files = [ROOT / p for p in listed if p and (ROOT / p).is_file()]
    assert not [f for f in files if f.name.endswith(".guidellm.json.gz")]
    assert sum(f.stat().st_size for f in files) < 40e6


def test_nothing_to_take_out_and_a_path_with_no_report_are_one_line_each(repo, capsys):
    raw = next(repo.rglob("*.guidellm.json.gz"))
    kept = raw.read_bytes()
    raw.write_bytes(b"edited")
    assert rr.main(["out"], repo) == 1  # a report that differs from HEAD is not listed
    assert "some raw reports differ from HEAD: commit them first" in capsys.readouterr().err
    assert not (repo / rr.MANIFEST).exists()
    raw.write_bytes(kept)
    assert rr.main(["fetch"], repo) == 1  # no manifest yet
    assert f"{rr.MANIFEST}: missing; run `python benchmarks/raw_reports.py out` first" in (
        capsys.readouterr().err)  # fmt: skip
    assert rr.main(["out"], repo) == 0
    _git(repo, "commit", "-qm", "raw reports out")
    assert rr.main(["out"], repo) == 1
    assert "nothing to take out" in capsys.readouterr().err
    assert rr.main(["fetch", "benchmarks/results/journey"], repo) == 1
    err = capsys.readouterr().err
    assert "no listed report under benchmarks/results/journey" in err and err.count("\n") == 1
