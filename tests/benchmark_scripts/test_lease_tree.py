"""benchmarks/lease_tree.py on a real git repository: the published results leave what a device
call sends and come back with the index, the exclude file and every byte as they were."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lease_tree.py"
ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}  # fmt: skip


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, env=ENV, capture_output=True, text=True,
                          check=check)  # fmt: skip


def lease(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=repo, env=ENV,
                          capture_output=True, text=True)  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    (r / "benchmarks" / "results" / "run1").mkdir(parents=True)
    (r / "benchmarks" / "results" / "run1" / "kernel.json").write_bytes(b"x" * 300_000)
    (r / "benchmarks" / "results" / "README.md").write_text("# results\n")
    (r / "vllm_h20").mkdir()
    (r / "vllm_h20" / "cli.py").write_text("print('hi')\n")
    git(r, "init", "-q")
    (r / ".git" / "info").mkdir(exist_ok=True)
    (r / ".git" / "info" / "exclude").write_text("/.fi/\n")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "base")
    return r


def snapshot(repo: Path) -> dict[str, bytes]:
    return {str(p.relative_to(repo)): p.read_bytes()
            for d in ("benchmarks", "vllm_h20") for p in (repo / d).rglob("*")
            if p.is_file()}  # fmt: skip


def test_out_and_back_round_trip(repo: Path):
    before, exclude = snapshot(repo), (repo / ".git/info/exclude").read_text()
    big = lease(repo, "size")
    assert big.returncode == 0 and "0.3 MiB" in big.stdout, big.stdout

    out = lease(repo, "out")
    assert out.returncode == 0, out.stderr
    assert "2 files of benchmarks/results moved" in out.stdout
    assert not (repo / "benchmarks" / "results").exists()
    assert git(repo, "ls-files", "benchmarks").stdout == ""
    # nothing of the results travels: neither the index nor the folder aside
    assert git(repo, "ls-files", "--others", "--exclude-standard").stdout == ""
    small = lease(repo, "size")
    assert "(results out)" in small.stdout and "0.0 MiB" in small.stdout, small.stdout
    # a commit now would delete every result: the hook refuses it; one of other files goes in
    refused = git(repo, "commit", "-qm", "oops", check=False)
    assert refused.returncode != 0 and "lease_tree.py back" in refused.stderr
    (repo / "vllm_h20" / "cli.py").write_text("print('lease')\n")
    git(repo, "commit", "-qm", "meanwhile", "--", "vllm_h20/cli.py")
    assert git(repo, "ls-tree", "-r", "--name-only", "HEAD", "benchmarks").stdout.count("\n") == 2
    before["vllm_h20/cli.py"] = b"print('lease')\n"
    assert lease(repo, "out").returncode == 2  # already out

    back = lease(repo, "back")
    assert back.returncode == 0, back.stderr
    assert snapshot(repo) == before
    assert git(repo, "status", "--porcelain").stdout == ""
    assert (repo / ".git/info/exclude").read_text() == exclude
    assert not (repo / ".git/hooks/pre-commit").exists()
    again = lease(repo, "back")
    assert again.returncode == 2 and "not out" in again.stderr


def test_back_keeps_what_the_lease_wrote_and_never_overwrites(repo: Path):
    before = snapshot(repo)
    assert lease(repo, "out").returncode == 0
    new = repo / "benchmarks" / "results" / "run2" / "README.md"
    new.parent.mkdir(parents=True)
    new.write_text("rendered during the lease\n")
    clash = repo / "benchmarks" / "results" / "README.md"
    clash.write_text("also rendered\n")
    refused = lease(repo, "back")
    assert refused.returncode == 2 and "benchmarks/results/README.md" in refused.stderr
    assert clash.read_text() == "also rendered\n" and new.exists()  # nothing lost
    assert (repo / ".lease" / "results" / "README.md").read_text() == "# results\n"

    clash.unlink()
    back = lease(repo, "back")
    assert back.returncode == 0 and "kept 1 file" in back.stdout, back.stderr
    after = snapshot(repo)
    assert after.pop("benchmarks/results/run2/README.md") == b"rendered during the lease\n"
    assert after == before
    assert git(repo, "status", "--porcelain").stdout == "?? benchmarks/results/run2/\n"


def test_out_refuses_uncommitted_results_and_a_foreign_hook(repo: Path):
    (repo / "benchmarks" / "results" / "README.md").write_text("edited\n")
    dirty = lease(repo, "out")
    assert dirty.returncode == 2 and "uncommitted changes" in dirty.stderr
    assert (repo / "benchmarks" / "results" / "README.md").read_text() == "edited\n"
    git(repo, "checkout", "--", "benchmarks")

    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text("#!/bin/sh\nexit 0\n")
    foreign = lease(repo, "out")
    assert foreign.returncode == 2 and "someone else's pre-commit hook" in foreign.stderr
    assert git(repo, "status", "--porcelain").stdout == ""
    assert hook.read_text() == "#!/bin/sh\nexit 0\n"


def test_size_adds_carried_paths_and_says_when_a_call_would_not_fit(repo: Path):
    (repo / ".fi").mkdir()
    (repo / ".fi" / "src.tar.xz").write_bytes(b"\0" * (65 << 20))
    over = lease(repo, "size", ".fi")
    assert over.returncode == 1 and "over the device tool's limit" in over.stdout
    missing = lease(repo, "size", ".stage/piece-00")
    assert missing.returncode == 2 and ".stage/piece-00" in missing.stderr
