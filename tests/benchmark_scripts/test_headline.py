"""benchmarks/headline.py: README's headline table is what the results files say, and the README
stays a user's guide."""

from __future__ import annotations

import re
from pathlib import Path

from tests.benchmark_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
headline = load_script(ROOT / "benchmarks" / "headline.py", "headline")


def test_readme_table_is_rendered_from_the_results_files():
    """Every number of the table comes from a results file: README holds exactly what
    `headline.py` renders from benchmarks/results/ (rerun it with --write after a new run)."""
    text = (ROOT / "README.md").read_text()
    assert headline.block(text) == headline.render(), "python benchmarks/headline.py --write"
    for row in headline.ROWS:
        assert (headline.RESULTS / row.source).exists(), row.source
        assert (ROOT / row.link).is_file(), row.link


def test_every_number_in_the_table_moves_with_its_file(tmp_path):
    """A changed result changes the table: each row's number is recomputed, not stored."""
    import gzip
    import json
    import shutil

    run = Path("moe_dispatch") / "bar-five-families-h100"
    src = headline.RESULTS / run / "moe_dispatch.json.gz"
    (tmp_path / run).mkdir(parents=True)
    doc = json.loads(gzip.decompress(src.read_bytes()))
    doc["ab"][0]["speedups"]["fix"] = 0.5
    (tmp_path / run / src.name).write_bytes(gzip.compress(json.dumps(doc).encode()))
    row = next(r for r in headline.ROWS if r.source == str(run / src.name))
    assert "worst 0.500x (uniform, 1 tokens)" in row.cell(tmp_path / row.source)
    assert "299 of 300 cases >= 0.98x" in row.cell(tmp_path / row.source)
    shutil.rmtree(tmp_path / "moe_dispatch")


def test_readme_is_a_users_guide():
    """Under 12 KB, set-up first, and history in CHANGELOG.md rather than in the README."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) < 12 * 1024
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads[0] == "Set-up" and "Evidence" in heads
    assert not re.search(r"\bround \d\b|lease \d", text), "history belongs in CHANGELOG.md"
    assert (ROOT / "CHANGELOG.md").is_file()
