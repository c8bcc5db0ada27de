"""benchmarks/moe_dispatch/series_commits.py `am`: the shipped series applied commit by commit
with git am to a release's sources as its wheel holds them (here: a wheel made of the installed
FlashInfer's files that the series touches), and the line it prints when one does not apply."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_h20.moe import overlay

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "moe_dispatch" / "series_commits.py"


def _wheel(tmp_path: Path, fi, break_one: bool = False) -> Path:
    """flashinfer_python-<version>-py3-none-any.whl holding flashinfer/data/<every file the
    series changes that exists before it>; break_one edits one of them so that 0002 fails."""
    touched = sorted({d.path for p in overlay.shipped_patches(fi.version) for d in p.files})
    whl = tmp_path / f"flashinfer_python-{fi.version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path in touched:
            src = fi.root / path
            if not src.is_file():  # a file the series creates (its test)
                continue
            text = src.read_text()
            if break_one and path.endswith("deep_gemm/scheduler.cuh"):
                text = text.replace("struct GroupedWithOffsetScheduler {", "struct Renamed {")
            z.writestr(f"flashinfer/data/{path}", text)
    return whl


def _am(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "am", *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_every_commit_applies_with_git_am_and_a_stale_source_is_one_line(tmp_path):
    import importlib.util

    from vllm_h20.moe import flashinfer_src

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("FlashInfer is not installed (CI installs it with vLLM 0.34.0)")
    fi = flashinfer_src.installed()
    n = len(overlay.series_files(fi.version))
    r = _am("--wheel", str(_wheel(tmp_path, fi)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"ok {fi.version} (")
    assert f": {n} commits applied (0001, " in r.stdout
    (tmp_path / "bad").mkdir()
    r = _am("--wheel", str(_wheel(tmp_path / "bad", fi, break_one=True)))
    assert r.returncode == 1
    (line,) = r.stdout.splitlines()
    assert line.startswith(f"FAIL {fi.version} (") and "git am: " in line


def test_a_tag_needs_the_clone_it_is_in():
    r = _am("--tag", "0.6.14")
    assert r.returncode == 2 and "--tag needs --tag-repo" in r.stderr


def test_a_bad_wheel_or_a_missing_tag_is_one_line(tmp_path):
    """A path that is not a FlashInfer wheel, a truncated one, and a clone without the tag: one
    line naming the file or clone and what to do, no traceback."""
    truncated = tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl"
    truncated.write_bytes(b"PK\x03\x04 cut short")
    empty = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(empty)], check=True)
    for args, want in (
        (["--wheel", str(tmp_path / "nothing.whl")], "not a flashinfer_python-<version>-*.whl"),
        (["--wheel", str(truncated)], "not a zip archive (a truncated download?)"),
        (["--tag", "0.6.14", "--tag-repo", str(empty)], "no tag v0.6.14 to check out"),
    ):
        r = _am(*args)
        assert r.returncode == 1, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("series_commits: ") and want in line
